"""The parts of ``HiddenStateConnector`` that run inside vLLM's processes.

Like vLLM's own ``kv_connector/v1/offloading/`` behind ``offloading_connector.py``: the
facade vLLM instantiates is ``hidden_state_connector.connector``; behind it:

* ``scheduler_side`` / ``worker_side``: the two halves (names files and orders saves /
  locks files and turns orders into save jobs), and ``metadata``, what the scheduler half
  tells the worker half each step.
* ``handoff/``: finish-time save orders that cannot wait for the next step's metadata
  (``same_process``, ``socket_channel``).
* ``write/``: the write path, from the paged cache to a published file: ``target`` (a
  request's pinned directory and lock), ``job`` (one sample's state), ``pipeline`` (slabs,
  writer threads, back-pressure, shutdown), ``gather`` (cache chunks into host slabs),
  ``buffers`` (the bounded slab pool), ``sample_file`` (one writer thread's file),
  ``store_backend`` (``storage_backend="mooncake"``), ``trace`` (stage timings).
* Settings and checks: ``config`` (``kv_connector_extra_config``), ``store_config`` (its
  ``mooncake_*`` keys), ``storage_check`` (start-up checks of the storage),
  ``loss_mask_param`` (a request's loss mask), ``stats`` / ``metrics`` (counters; vLLM's
  stats type), ``layout`` (how the cache view is indexed), ``compat`` (everything that
  differs between vLLM releases) and ``architecture`` (which models the installed vLLM
  can capture).

Only the facade and ``metrics`` need vLLM to be importable, so every module here can be
unit-tested without vLLM. Nothing is imported here.
"""
