"""The write path: from vLLM's paged hidden-state cache to a published sample file.

``target`` pins a request's directory and creates its lock; ``job`` is one sample's
state; ``pipeline`` (``WritePipeline``) pumps cache chunks through ``gather`` into host
slabs from ``buffers`` and hands them to writer threads, each writing one file with
``sample_file`` (create, write chunks, publish by rename, release the lock, or abort),
which refuses rows vLLM never stored with ``row_guard``; ``trace`` times the stages.
Where a finished file goes (a directory, or a Mooncake Store) is the medium's
(``engine.sinks``). Nothing is imported here.
"""
