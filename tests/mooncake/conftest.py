"""Fixtures of the Mooncake Store tests (``store_cluster``)."""

from store_cluster import cluster

__all__ = ["cluster"]
