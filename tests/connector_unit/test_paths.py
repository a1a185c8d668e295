"""The path checks the connector relies on for client-chosen and default file names.

Needs no vLLM: this directory's tests run where vLLM is not installed (unlike
``tests/connector``, whose conftest skips everything without vLLM).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hidden_state_reader import PathOutsideRootError
from hidden_state_reader.files.paths import resolve_inside
from hidden_state_reader.format import safe_component


def test_resolve_inside_accepts_nested_and_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", root / "link")
    assert resolve_inside(str(root), "a/b.safetensors") == str(root / "a" / "b.safetensors")
    assert resolve_inside(str(root), str(root / "c.safetensors")) == str(root / "c.safetensors")
    deep_ok = "d/" * 16 + "e.safetensors"
    assert resolve_inside(str(root), deep_ok) == str(root / deep_ok)
    for bad in [
        "d/" * 17 + "e.safetensors",  # the connector would create every level
        "m/" * 2100 + "m.safetensors",  # over PATH_MAX
        "../x.safetensors",
        "/etc/x.safetensors",
        "link/x.safetensors",
        "a\0.safetensors",
        "x.txt",
        "y" * 300 + ".safetensors",
        ".hidden.safetensors",
        "",
    ]:
        with pytest.raises(PathOutsideRootError):
            resolve_inside(str(root), bad)


def test_safe_component_keeps_ids_distinct_and_bounded() -> None:
    assert safe_component("cmpl-abc-0") == "cmpl-abc-0"
    a, b = safe_component("a/b"), safe_component("a_b")
    assert a != b and "/" not in a
    assert len(safe_component("x" * 500)) <= 120
    assert not safe_component("..").startswith(".")
