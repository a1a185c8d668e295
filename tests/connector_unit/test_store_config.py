"""Start-up validation of the store keys, and store URLs: errors name what to fix."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_fakes import finished_request, new_request, scheduler_output

from hidden_state_connector.client import Completion
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import MEDIA, CapturePlan, scheduler_side
from hidden_state_connector.engine.sinks.mooncake import transfer_params
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_reader.store.url import parse_store_url


def test_mooncake_keys_are_parsed() -> None:
    config = ConnectorConfig.from_extra_config({
        "storage_backend": "mooncake", "mooncake_master": "10.0.0.5:50051",
        "mooncake_segment_bytes": 0, "mooncake_buffer_bytes": "64MiB",
        "mooncake_full_timeout": "5",
    })  # fmt: skip
    assert config.mooncake_segment_bytes == 0 and config.mooncake_buffer_bytes == 64 << 20
    assert config.mooncake_full_timeout == 5.0
    params = transfer_params(config, "/data", "/data/req-1.x.safetensors")
    assert params == {
        "hidden_states_key": "req-1.x.safetensors",
        "hidden_states_url": "mooncake://10.0.0.5:50051/hs/req-1.x.safetensors",
    }
    files = ConnectorConfig(shared_storage_path="/data")
    assert MEDIA[files.storage_backend].index(files, "/data").client_params("/data/a") is None


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"storage_backend": "redis"}, "storage_backend"),
        ({"storage_backend": "mooncake"}, "mooncake_master"),
        ({"storage_backend": "mooncake", "mooncake_master": "nohost"}, "mooncake_master"),
        ({"storage_backend": "mooncake", "mooncake_master": "h:1", "mooncake_prefix": "/x"},
         "mooncake_prefix"),
        ({"storage_backend": "mooncake", "mooncake_master": "h:1", "mooncake_protocol": "udp"},
         "mooncake_protocol"),
        ({"storage_backend": "mooncake", "mooncake_master": "h:1", "mooncake_full_timeout": -1},
         "mooncake_full_timeout"),
        ({"mooncake_buffer_bytes": "lots"}, "mooncake_buffer_bytes"),
    ],
)  # fmt: skip
def test_bad_store_keys_name_the_key(extra: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra_config(extra)


def test_store_urls() -> None:
    s = parse_store_url("mooncake://10.0.0.5:50051/run-7?hostname=10.0.0.9&buffer=1GiB&segment=2GB")
    assert (s.master, s.prefix, s.local_hostname) == ("10.0.0.5:50051", "run-7", "10.0.0.9")
    assert s.buffer_bytes == 1 << 30 and s.segment_bytes == 2 * 10**9
    assert s.claim_lease == 30.0
    assert parse_store_url("mooncake://h:1/hs?lease=2.5").claim_lease == 2.5
    for bad, why in [("mooncake://host/hs", "HOST:PORT"), ("mooncake://h:1/", "prefix"),
                     ("mooncake://h:1/hs?colour=red", "unknown option"),
                     ("mooncake://h:1/hs?buffer=big", "buffer"),
                     ("mooncake://h:1/hs?lease=0", "lease must be positive"),
                     ("mooncake://h:1/hs?lease=soon", "lease must be positive")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_store_url(bad)


def test_store_readers_check_the_reader_options() -> None:
    """A store URL reads through the same options: an unknown or bad one, or one that
    applies to directories only, fails before the store is joined."""
    from hidden_state_reader import HiddenStateReader

    url = "mooncake://127.0.0.1:1/hs"
    with pytest.raises(TypeError):
        HiddenStateReader(url, colour="blue")
    with pytest.raises(ValueError, match="on_error"):
        HiddenStateReader(url, on_error="ignore")
    for directory_only in ({"on_consumed": "move"}, {"done_dir": "/tmp"}, {"watch": "poll"}):
        with pytest.raises(ValueError, match=r"on_consumed|done_dir"):
            HiddenStateReader(url, **directory_only)


def test_dataset_follows_stores_only() -> None:
    from hidden_state_reader import HiddenStateDataset

    with pytest.raises(ValueError, match=r"mooncake://h:1/hs: .*use follow=True"):
        HiddenStateDataset("mooncake://h:1/hs")
    with pytest.raises(ValueError, match="unknown option"):
        HiddenStateDataset("mooncake://h:1/hs?colour=red", follow=True)


def test_a_store_response_names_the_key_and_no_local_file(tmp_path: Path) -> None:
    """With the store backend nothing is written under shared_storage_path: the response
    carries the sample's key and URL, and no ``hidden_states_path``."""
    config = ConnectorConfig.from_extra_config({
        "storage_backend": "mooncake", "mooncake_master": "10.0.0.5:50051",
        "shared_storage_path": str(tmp_path), "instance_id": "unit",
        "allow_custom_save_path": True,
    })  # fmt: skip
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=f"unit-{uuid.uuid4().hex}"),
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
    )
    side = scheduler_side(config, vllm_config, CapturePlan(1, 4), WriteStats(0))
    try:
        prompt, blocks = list(range(10, 16)), [3, 1]
        # A local file where the name's folder would be: the name is still a fine key.
        (tmp_path / "run1").write_text("not a folder")
        chosen = {"hidden_states_path": "run1/chosen.safetensors"}
        requests = (
            new_request("req-s", prompt, blocks),
            new_request("req-c", prompt, [2, 0], chosen),
        )
        side.build_metadata(scheduler_output(new=requests, scheduled={"req-s": 6, "req-c": 6}))
        _, params = side.request_finished(finished_request("req-s", prompt, [7]), blocks)
        _, named = side.request_finished(finished_request("req-c", prompt, [7]), [2, 0])
    finally:
        side.shutdown()
    assert params == {
        "hidden_states_key": "req-s.unit.safetensors",
        "hidden_states_url": "mooncake://10.0.0.5:50051/hs/req-s.unit.safetensors",
    }
    assert Completion(0, None, params=params).sample == params["hidden_states_url"]
    # A client-chosen name is a store key: no local folder is looked at or made.
    assert named == {
        "hidden_states_key": "run1/chosen.safetensors",
        "hidden_states_url": "mooncake://10.0.0.5:50051/hs/run1/chosen.safetensors",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["run1"]
