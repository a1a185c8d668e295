"""``hidden-state export --format speculators`` runs in the environment ``make install``
builds: its ``datasets`` comes with the reader's ``speculators`` extra, not from the
interop tests' ``.venv-spec`` folder (which this test keeps off the path)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from samples import write_samples


def test_export_needs_nothing_the_install_does_not_bring(tmp_path: Path) -> None:
    src, dst = tmp_path / "hs", tmp_path / "exported"
    src.mkdir()
    write_samples(src, 3, tokens=[5, 7, 9], layer_ids=[1, 2, 4])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cli = Path(sys.executable).with_name("hidden-state")
    proc = subprocess.run(
        [str(cli), "export", "--format", "speculators", str(src), str(dst)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "exported 3 samples" in proc.stdout + proc.stderr
