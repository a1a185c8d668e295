"""``kv_connector_extra_config`` (``engine/config.py``): values, sizes, bad keys."""

from __future__ import annotations

import pytest

from hidden_state_connector.engine.config import ConnectorConfig, parse_size


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
