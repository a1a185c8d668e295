"""vLLM plugin entry point: registers ``HiddenStateConnector`` with vLLM's connector factory.

Declared under ``vllm.general_plugins``, which vLLM loads in every process it starts.
Registration is by module path and class name, so vLLM imports the connector lazily.
"""

from __future__ import annotations

from hidden_state_connector import CONNECTOR_MODULE, CONNECTOR_NAME
from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


def register() -> None:
    """Make ``kv_connector: "HiddenStateConnector"`` resolvable; watch for forward capture.

    Idempotent. Forward capture must hook a model while vLLM builds it (``engine.forward.
    install``); the watch costs one check per registered module list and touches nothing
    unless the engine's connector is this one with ``capture: "forward"``.
    """
    from hidden_state_connector.engine.forward.install import watch_model_construction

    watch_model_construction()
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM absent or reorganised: kv_connector_module_path still works
        log.debug("vLLM connector factory not importable; %s not registered", CONNECTOR_NAME)
        return
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
