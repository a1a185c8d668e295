"""``benchmarks/gpu/summary.py``: sustained runs get their no-extraction figure, and the
GPU section renders every results file (the H200 scripts themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def load_summary() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "benchmarks/gpu/summary.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(producer: str, tok_s: float, **extra: Any) -> dict[str, Any]:
    return {"kind": "sustain", "producer": producer, "tok_s": tok_s, **extra}


def test_each_run_is_paired_with_the_nearest_no_extraction_run() -> None:
    summary = load_summary()
    rows = [
        run("none", 100.0),
        run("ours", 97.0),
        run("ours", 95.0),
        {"kind": "throughput", "tok_s": 1.0},  # not a sustained run: left alone
        run("ours", 90.0),  # next call, run before its own baseline
        run("none", 92.0),
        run("ours", 91.0),
    ]
    paired = summary.pair_with_none(rows)
    assert [r.get("tok_s_none") for r in paired] == [None, 100.0, 100.0, None, 92.0, None, 92.0]
    assert rows[1].get("tok_s_none") is None  # the input is not changed


def test_a_figure_already_recorded_is_kept_and_none_missing_leaves_it_unset() -> None:
    summary = load_summary()
    assert (
        summary.pair_with_none([run("none", 100.0), run("ours", 97.0, tok_s_none=99.0)])[1][
            "tok_s_none"
        ]
        == 99.0
    )
    assert "tok_s_none" not in summary.pair_with_none([run("ours", 97.0)])[0]


def test_every_sustained_run_on_record_has_its_baseline() -> None:
    """The issue's fields: every sustained run in the results files compares itself."""
    for path in sorted((ROOT / "benchmarks/gpu/results").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "sustain" and row["producer"] != "none":
                assert row["tok_s_none"] > 0, (path.name, row)


TRAIN_FEED_FIELDS = (
    "feed", "mode", "storage_dtype", "workers", "tok_s", "tok_s_synthetic",
    "ratio_vs_synthetic", "data_wait_frac", "loader_gb_s", "host_cpu_s_per_gb",
)  # fmt: skip


def test_every_train_feed_row_has_the_issues_fields_and_is_rendered() -> None:
    summary = load_summary()
    dates, _ = summary.load()
    rows = [r for date in dates.values() for r in date if r.get("kind") == "train_feed"]
    assert rows
    for row in rows:
        missing = [f for f in TRAIN_FEED_FIELDS if f not in row]
        assert not missing, (row["row"], missing)
        assert row["feed"] in (
            "hidden_state_loader",
            "safetensors",
            "synthetic",
            "synthetic_varlen",
        )
        if not row["alone"] and row["tok_s_synthetic"]:
            assert abs(row["ratio_vs_synthetic"] - row["tok_s"] / row["tok_s_synthetic"]) < 1e-3
    table = summary.render(rows, "2026-12-04")
    assert table.count("| train_feed-") == len(rows)


def test_train_feed_lists_its_rows_without_a_gpu() -> None:
    import subprocess
    import sys

    script = ROOT / "benchmarks/gpu/train_feed.py"
    out = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert {"synthetic", "hsl_bf16_static", "hsl_fp8_follow", "safetensors_bf16"} <= set(
        out.stdout.split()
    )
    help_text = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert "example:" in help_text.stdout
