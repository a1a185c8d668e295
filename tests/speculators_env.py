"""speculators 0.9.0's own code for the interop tests, as ``make install`` puts it.

``make install`` installs speculators, hs-connectors and the packages of Hugging Face
``datasets`` that the venv lacks into ``.venv-spec/`` (``--no-deps``: speculators'
declared dependencies would replace the CPU torch with a CUDA build; see the Makefile and
docs/training.md, "How do I install speculators without replacing my torch?", which
gives users the same list: ``spec_packages()``).
``use_speculators()`` appends that folder to ``sys.path`` (after the venv, so it never
shadows a package the venv has) and ``env()`` gives a subprocess the same view.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC_DIR = ROOT / ".venv-spec"
NEEDED = ("speculators", "hs_connectors", "datasets", "pyarrow")


def use_speculators() -> None:
    """Make speculators, hs_connectors and datasets importable here, or fail saying how."""
    if SPEC_DIR.is_dir() and str(SPEC_DIR) not in sys.path:
        sys.path.append(str(SPEC_DIR))
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not importable: run `make install` (it installs "
            f"speculators 0.9.0 into {SPEC_DIR}, see the Makefile's SPEC_PKGS)"
        )


def env() -> dict[str, str]:
    """``os.environ`` with ``.venv-spec`` at the end of ``PYTHONPATH``."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*parts, str(SPEC_DIR)])}


def spec_packages() -> list[str]:
    """The Makefile's ``SPEC_PKGS``: what goes into ``.venv-spec``, pinned."""
    text = (ROOT / "Makefile").read_text()
    found = re.search(r"^SPEC_PKGS := ((?:.*\\\n)*.*)$", text, re.MULTILINE)
    assert found, "Makefile: no SPEC_PKGS line"
    return found.group(1).replace("\\\n", " ").split()
