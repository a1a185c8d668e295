"""The training side: dataset, loader, sharding, collation, the device feed.

``dataset`` is a torch ``IterableDataset``, ``loader`` a DataLoader whose resume is exact,
``sharding`` the ranks and the static order, ``collate`` pads or packs a batch, and
``device_feed`` builds batches in threads for ``HiddenStateLoader(..., device=...)`` in
three stages: ``host_build``, ``to_device``, ``device_finishing``.
"""
