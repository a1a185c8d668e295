"""``tools/uv_flags.py``: ``make install`` hands pip's configuration to uv."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "uv_flags.py"


def run_tool(tmp_path: Path, config: str, **env: str) -> str:
    """The tool's output with a pip config file holding ``config`` and these ``PIP_*``.

    pip still reads the machine's own config files; the test file is read last (it wins
    over them, as ``PIP_CONFIG_FILE`` does in pip) and the variables win over every file.
    """
    (tmp_path / "pip.conf").write_text(config)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update(PIP_CONFIG_FILE=str(tmp_path / "pip.conf"), **env)
    return subprocess.run([sys.executable, str(TOOL)], env=clean, capture_output=True,
                          text=True, check=True, timeout=60).stdout  # fmt: skip


def test_settings_map_to_uv_flags() -> None:
    spec = importlib.util.spec_from_file_location("uv_flags", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    got = tool.uv_flags({
        "index-url": "https://mirror.example/simple",
        "extra-index-url": "file:///a/simple file:///b/simple",
        "find-links": "/srv/wheels", "constraint": "/etc/caps.txt", "timeout": "60",
    })  # fmt: skip
    assert " ".join(got) == (
        "--index-url https://mirror.example/simple "
        "--extra-index-url file:///a/simple --extra-index-url file:///b/simple "
        "--find-links /srv/wheels --constraint /etc/caps.txt "
        "--index-strategy unsafe-best-match"  # several indexes merged, as pip does
    )
    assert tool.uv_flags({}) == []
    assert tool.uv_flags({"no-index": "true", "cert": "/etc/ssl/corp.pem"}) == [
        "--no-index", "--native-tls",
    ]  # fmt: skip


def test_pips_files_and_variables_are_read(tmp_path: Path) -> None:
    from_file = run_tool(tmp_path, "[global]\nfind-links = /from/file\nconstraint = /c.txt\n")
    assert "--find-links /from/file" in from_file and "--constraint /c.txt" in from_file
    # A PIP_* variable wins over the file, as in pip.
    from_env = run_tool(tmp_path, "[global]\nfind-links = /from/file\n", PIP_FIND_LINKS="/env")
    assert "--find-links /env" in from_env and "/from/file" not in from_env


def test_help_shows_an_example() -> None:
    out = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True,
                         check=True, timeout=60).stdout  # fmt: skip
    assert "example: python tools/uv_flags.py" in out
