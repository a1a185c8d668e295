"""The store protocol with real processes: master, segment host, producers, readers."""

from __future__ import annotations

import json
from collections import Counter

from conftest import URL, StoreCluster


def test_round_trip_follow_and_pull(cluster: StoreCluster) -> None:
    produced = cluster.role("produce", "--count", "6", "--fail-every", "3")
    assert len(produced["published"]) == 4 and len(produced["failed"]) == 2
    snapshot = cluster.role("read")
    assert snapshot["names"] == produced["published"]  # commit order
    assert snapshot["wrong"] == [] and snapshot["stats"]["failed"] == 2
    pulled = cluster.role("read", "--names", ",".join(reversed(produced["published"])))
    assert sorted(pulled["names"]) == sorted(produced["published"])
    assert pulled["wrong"] == []
