r"""A production vLLM KV-connector plugin that writes ``extract_hidden_states`` output.

After ``pip install hidden-state-connector`` vLLM finds the connector by name::

    vllm serve MODEL \\
      --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                             "draft_model_config": {"hf_config":
                                 {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}}}' \\
      --kv-transfer-config '{"kv_connector": "HiddenStateConnector", "kv_role": "kv_producer",
                             "kv_connector_extra_config": {"shared_storage_path": "/data/hs"}}'

The vLLM-facing class lives in ``hidden_state_connector.connector`` (``CONNECTOR_MODULE``,
the path users give as ``kv_connector_module_path``); the parts behind it that run inside
vLLM in ``hidden_state_connector.engine``; ``layers`` and ``client`` beside them; the
applications (command line, extract, demo, launcher, tiny models) in ``apps``. None is
imported here, so this package can be imported without vLLM.
"""

__version__ = "0.1.0"
CONNECTOR_NAME = "HiddenStateConnector"
CONNECTOR_MODULE = "hidden_state_connector.connector"
