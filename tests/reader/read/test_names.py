"""``HiddenStateReader(root, names=[...])``: a name that is not there is named, not skipped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from hidden_state_reader import HiddenStateReader

from samples import write_samples


def test_names_not_in_the_directory_are_named_in_a_warning(
    hs_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_samples(hs_dir, 1)
    # What a client of the store backend used to be sent: a path under shared_storage_path
    # where nothing is ever written.
    wanted = ["hs_0.safetensors", "req-1.engine.safetensors"]
    with caplog.at_level(logging.WARNING):
        reader = HiddenStateReader(hs_dir, names=wanted)
        got = [Path(s.path).name for s in reader]
    assert got == ["hs_0.safetensors"]
    [warning] = [r.getMessage() for r in caplog.records if "names asked for" in r.getMessage()]
    assert f"1 of the 2 names asked for are not in {hs_dir}" in warning
    assert "req-1.engine.safetensors" in warning and "hs_0" not in warning
    assert "Mooncake Store" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(list(HiddenStateReader(hs_dir, names=["hs_0.safetensors"]))) == 1
    assert "names asked for" not in caplog.text
