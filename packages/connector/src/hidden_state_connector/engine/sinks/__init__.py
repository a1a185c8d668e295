"""Storage media behind the ``Sink`` / ``SinkIndex`` seam (``engine.seam``).

One module per medium, each with a worker half (``Sink``: pins a sample, says where the
writer writes it) and a scheduler half (``SinkIndex``: what is written already, what a
client learns): ``files`` (``storage_backend="files"``, a shared directory) and
``mooncake`` (``storage_backend="mooncake"``, a Mooncake Store; docs/scale-out.md). The
factory (``engine.engines``) picks one. Nothing is imported here.
"""
