"""The parts of ``HiddenStateConnector`` that run inside vLLM's processes.

Like vLLM's own ``kv_connector/v1/offloading/`` behind ``offloading_connector.py``: the
facade vLLM instantiates is ``hidden_state_connector.connector``; behind it:

* ``engines``: the factory, the one reader of ``capture`` and ``storage_backend``; it
  builds ``scheduler_side`` / ``worker_side``, the two halves (one class each: names
  files, orders saves, keeps block tables / locks files, turns orders into save jobs),
  with the parts ``seam`` defines: a capture engine's (``extract/``, ``forward/``) and a
  medium's (``sinks/``). ``metadata``: what the scheduler half tells the worker half.
* ``handoff/``: finish-time save orders that cannot wait for the next step's metadata.
* ``write/``: the write path, from rows on the host or in the cache to a published file
  (``target``, ``job``, ``pipeline``, ``gather``, ``buffers``, ``sample_file``, ``trace``).
* Settings and checks: ``config`` (``kv_connector_extra_config``), ``store_config`` (its
  ``mooncake_*`` keys), ``storage_check``, ``loss_mask_param``, ``sample_params``,
  ``stats`` / ``metrics``, ``layout``, ``compat`` (everything that differs between vLLM
  releases) and ``architecture`` (which models the installed vLLM can capture).

Only the facade and ``metrics`` need vLLM to be importable, so every module here can be
unit-tested without vLLM. Nothing is imported here.
"""
