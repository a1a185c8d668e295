"""What the connector records about a capture in every file (``engine/capture.py``).

vLLM's model config is stood in for by plain objects with the attributes of vLLM 0.32's
``ModelConfig`` that the connector reads (``model``, ``revision``, ``hf_config``,
``hf_text_config``, ``get_total_num_hidden_layers()``); the real engine's values are
checked by tests/connector/test_offline.py and test_extract.py. The metadata goes
through the real writer and is read back through the header's typed accessors.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hidden_state_connector.engine.capture import describe_capture
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import Meta

SHA = "0123456789abcdef0123456789abcdef01234567"


class ResolvedRevision(str):
    """huggingface_hub's ``ResolvedRevision``: the revision asked for, plus its hash."""

    resolved: str


def model_config(**fields: Any) -> SimpleNamespace:
    layers = fields.pop("layers", 4)
    config = SimpleNamespace(
        model=fields.pop("model", "/models/tiny"),
        revision=fields.pop("revision", None),
        hf_config=SimpleNamespace(num_hidden_layers=layers, **fields.pop("hf", {})),
        hf_text_config=SimpleNamespace(num_hidden_layers=layers),
        **fields,
    )
    return config


def describe(config: SimpleNamespace, layer_ids: list[int]) -> Any:
    return describe_capture(
        SimpleNamespace(model_config=config),
        layer_ids,
        connector_version="9.9",
        vllm_version="0.32.0",
    )


def test_every_sample_records_model_layers_revision_dtype_and_vllm(tmp_path: Path) -> None:
    config = model_config(get_total_num_hidden_layers=lambda: 4, hf={"_commit_hash": SHA})
    capture = describe(config, [1, 2, 4])
    meta = capture.metadata(request_id="req-1", num_prompt_tokens=3)
    path = write_sample(
        tmp_path / "a.safetensors", torch.arange(5), torch.randn(5, 3, 8), metadata=meta
    )
    header = read_header(path)
    assert (header.layer_ids, header.num_hidden_layers, header.captures_last_layer) == (
        [1, 2, 4],
        4,
        True,
    )
    assert (header.model, header.model_revision, header.vllm_version) == (
        "/models/tiny",
        SHA,
        "0.32.0",
    )
    assert header.model_dtype == "F32"  # recorded by the writer from the hidden states
    assert header.metadata[Meta.PRODUCER] == "hidden-state-connector/9.9 vllm/0.32.0"
    assert header.metadata[Meta.REQUEST_ID] == "req-1"
    assert len(header.metadata[Meta.CRC32]) == 8  # the writer's default


def test_layer_count_falls_back_to_the_text_config() -> None:
    # A model config without get_total_num_hidden_layers (older vLLM) or whose getter fails.
    assert describe(model_config(layers=6), [2, 6]).num_hidden_layers == 6

    def broken() -> int:
        raise NotImplementedError

    config = model_config(layers=6, get_total_num_hidden_layers=broken)
    assert describe(config, [6]).num_hidden_layers == 6
    capture = describe(model_config(layers=None), [2, 9])
    assert capture.num_hidden_layers is None  # unknown: nothing recorded, nothing refused
    assert Meta.NUM_HIDDEN_LAYERS not in capture.metadata(request_id="r", num_prompt_tokens=1)


def test_revision_prefers_the_resolved_commit_hash(tmp_path: Path) -> None:
    resolved = ResolvedRevision("main")
    resolved.resolved = SHA
    assert describe(model_config(revision=resolved), [4]).model_revision == SHA
    other = "fedcba9876543210fedcba9876543210fedcba98"
    config = model_config(revision="v1.0", hf={"_commit_hash": other})
    assert describe(config, [4]).model_revision == other
    assert describe(model_config(revision="v1.0"), [4]).model_revision == "v1.0"
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    assert describe(model_config(model=str(snapshot)), [4]).model_revision == SHA
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert describe(model_config(model=str(plain)), [4]).model_revision is None


def test_layer_ids_the_model_does_not_have_refuse_to_start() -> None:
    with pytest.raises(ValueError, match=r"the model has 4 layers.*0 \(embeddings\) to 4"):
        describe(model_config(layers=4), [2, 5])


def test_checksum_is_on_by_default() -> None:
    assert ConnectorConfig.from_extra_config({"shared_storage_path": "/tmp"}).checksum
    config = ConnectorConfig.from_extra_config({"shared_storage_path": "/tmp", "checksum": False})
    assert not config.checksum
