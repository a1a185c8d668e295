"""Compatibility alias: the ``vllm serve`` launcher lives in ``hidden_state_connector.apps.server``.

Kept so the documented ``from hidden_state_connector.server import VllmServer`` keeps
working; it re-exports only (an application module, like everything under ``apps``).
"""

from hidden_state_connector.apps.server import (
    CPU_KV_CACHE_BYTES,
    ServeOptions,
    VllmServer,
    cpu_kv_cache_args,
    cpu_kv_cache_bytes,
    free_port,
    kv_transfer_config,
    server_argv,
    speculative_config,
)

__all__ = [
    "CPU_KV_CACHE_BYTES",
    "ServeOptions",
    "VllmServer",
    "cpu_kv_cache_args",
    "cpu_kv_cache_bytes",
    "free_port",
    "kv_transfer_config",
    "server_argv",
    "speculative_config",
]
