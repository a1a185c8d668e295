"""The code that runs inside vLLM's processes (like vLLM's own ``kv_connector/v1/nixl/``).

* ``connector``: ``HiddenStateConnector``, the facade vLLM instantiates once per role.
* ``scheduler_side`` / ``worker_side``: the two halves behind it.
* ``metadata``: what the scheduler half tells the worker half each step.
* ``local_handoff`` / ``order_channel``: finish-time orders between steps (same process
  / local socket).
* ``sample_target``: a scheduled request's pinned directory and lock.
* ``save_job`` / ``writer`` / ``sample_write``: one sample's state, the write pipeline
  (slabs, writer threads, back-pressure, shutdown), and one writer thread's file.
* ``gather``: copies chunks of the paged hidden-state cache into host slabs.
* ``buffers``: the bounded pool of host slabs.
* ``layout``: how the hidden-state cache view is indexed (pure types).
* ``config``, ``stats``, ``metrics``, ``trace``, ``storage_check``: settings, counters
  (``metrics`` is vLLM's stats type), stage timings, start-up checks of the storage.
* ``compat``: everything that differs between vLLM releases.

Only ``connector`` and ``metrics`` need vLLM to be importable. ``compat`` imports vLLM
inside its functions only, and ``metadata`` is plain dataclasses (``connector`` registers
its class with vLLM's empty ``KVConnectorMetadata`` ABC), so every other module imports,
and can be unit-tested, without vLLM and without loading an installed one. Nothing is
imported here.
"""
