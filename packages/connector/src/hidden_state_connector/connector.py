"""Stable import path of the vLLM-facing class: ``hidden_state_connector.connector``.

Users configure ``kv_connector_module_path="hidden_state_connector.connector"`` and the
plugin registers this path (``CONNECTOR_MODULE``), so it stays importable although the
class now lives in ``hidden_state_connector.engine.connector``. This module only
re-exports it; importing it imports vLLM.
"""

from hidden_state_connector.engine.connector import HiddenStateConnector, refuse_sleep_mode

__all__ = ["HiddenStateConnector", "refuse_sleep_mode"]
