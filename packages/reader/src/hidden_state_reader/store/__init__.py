"""Samples in a Mooncake Store instead of a shared directory (``docs/scale-out.md``).

Nothing here imports the ``mooncake`` package until a store is actually opened, so
importing these modules costs nothing where the store is not used.
"""
