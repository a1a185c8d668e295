"""The training side: dataset, loader, sharding, collation.

``dataset`` is a torch ``IterableDataset``, ``loader`` a DataLoader whose resume is exact,
``sharding`` the ranks and the static order, ``collate`` pads or packs a batch.
"""
