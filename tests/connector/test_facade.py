"""The facade (``connector.py``), the plugin and ``compat`` against the installed vLLM.

Registration with vLLM's connector factory, the cache layout vLLM really writes, sleep
mode accepted (refused by the CPU build itself), and the installed release inside the
supported range.
"""

from __future__ import annotations

import pytest
import torch

from hidden_state_connector.engine import compat


def test_plugin_registers_with_vllm_and_module_path_also_works() -> None:
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from hidden_state_connector.connector import HiddenStateConnector
    from hidden_state_connector.plugin import register

    register()
    register()  # idempotent
    by_name = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="HiddenStateConnector", kv_role="kv_producer")
    )
    by_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(
            kv_connector="HiddenStateConnector",
            kv_connector_module_path="hidden_state_connector.connector",
            kv_role="kv_producer",
        )
    )
    assert by_name is HiddenStateConnector and by_path is HiddenStateConnector


@pytest.mark.parametrize("block_size,layers", [(16, 3), (16, 16), (32, 4)])
def test_layout_probe_finds_the_token_axis_of_this_vllm(block_size: int, layers: int) -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.models.extract_hidden_states import basic_cache

    # Build a cache the way the installed vLLM writes it, and check the probe agrees.
    probe_shape = (
        (4, block_size, layers, 8)
        if compat._parse(compat.vllm_version()) < (0, 27, 0)
        else (4, layers, block_size, 8)
    )
    cache = torch.zeros(probe_shape)
    layout = compat.probe_layout(cache, block_size, layers)
    values = torch.randn(block_size * 2, layers, 8)
    slots = torch.arange(block_size, block_size * 3)  # blocks 1 and 2
    basic_cache(values, cache, slots)
    view = layout.blocks_tokens_layers(cache)  # [blocks, block_size, layers, hidden]
    assert torch.equal(view[1:3].reshape(-1, layers, 8), values)


def test_sleep_mode_is_accepted_and_the_cpu_build_refuses_it_itself() -> None:
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.platforms import current_platform

    from hidden_state_connector.connector import HiddenStateConnector

    config = KVTransferConfig(kv_connector="HiddenStateConnector", kv_role="kv_producer")
    # vLLM >= 0.33 asks the class (VllmConfig._verify_kv_transfer_compat); 0.32's base
    # class has no such method, ours answers anyway.
    assert HiddenStateConnector.supports_sleep_mode(config) is True
    assert HiddenStateConnector.supports_sleep_mode() is True
    if current_platform.is_sleep_mode_available():
        return  # a GPU build: benchmarks/gpu/sleep_check.py runs sleep there
    # The CPU build refuses enable_sleep_mode while building the model config, before
    # any connector exists: sleep cannot be run here, only the ordering with fakes.
    with pytest.raises(ValueError, match="Sleep mode is not supported on current platform"):
        ModelConfig(model="unused", enable_sleep_mode=True, skip_tokenizer_init=True)


def test_this_vllm_is_in_the_range_and_was_run() -> None:
    pytest.importorskip("vllm")
    found = compat.check_vllm_version()
    assert compat.MIN_VLLM <= compat._parse(found) < compat.MAX_VLLM_EXCLUSIVE
