"""``python -m benchmarks --quick`` runs end to end and writes a complete report.

Speed is never asserted here: only that every benchmark ran and every section, table
and goal made it into the markdown and the JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS

from procs import TEST_ENGINE_ENV

REPO = Path(__file__).resolve().parents[1]
SECTIONS = (
    "## Machine",
    "## Goals",
    "## 1. Server overhead",
    "## 2. Write path alone",
    "## 3. Reader throughput",
    "## 4. Latency",
    "## 5. Scale",
    "## 6. DataLoader",
    "## 7. Completion order",
    "## 8. Lock release",
    "## 9. fp8 storage",
    "## 10. Mooncake Store vs files",
    "## 11. CLI start-up",
    "## 12. Directory watchers",
    "## 13. Loading a file",
    "## 14. Lock libraries",
    "## 15. Consume",
    "## GPU (NVIDIA H200)",
)


# The quick run starts several vLLM engines: ~1.5 min on an idle machine, much more on a
# loaded one. The first test's limit also covers the module fixture that runs it.
pytestmark = pytest.mark.timeout(1800)


def run_bench(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    # The quick run is a smoke test of the benchmarks' code (its figures are not reported),
    # so its engines get the one unpinned OpenMP thread of every engine the suite starts
    # (tests/conftest.py): with vLLM's own settings (a pinned, spinning OpenMP thread per
    # core) they fought the other test processes for both cores. `make bench` runs them
    # with vLLM's settings.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **TEST_ENGINE_ENV, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


WRITE_STAGES = (
    "write hidden states (os.write)",
    "gather out of the cache (engine thread)",
    "NaN/inf check (writer threads)",
    "CRC32 of the written bytes (writer threads)",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("bench")
    out = base / "out"
    proc = run_bench("--quick", "--out", str(out), "--scratch", str(base / "scratch"))
    return out, proc


@pytest.mark.vllm
def test_quick_run_succeeds_with_progress_on_stderr(quick_run) -> None:
    _out, proc = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[bench" in proc.stderr
    for name in BENCHMARKS:
        assert f"{name}: done in" in proc.stderr, name


@pytest.mark.vllm
def test_markdown_has_every_section_and_table(quick_run) -> None:
    out, _ = quick_run
    md = (out / "benchmarks.md").read_text()
    for section in SECTIONS:
        assert section in md, section
    assert "The benchmark failed" not in md
    # One markdown table per benchmark at least, plus machine and goals.
    assert md.count("|---|") >= len(BENCHMARKS) + 2
    for fact in ("CPU", "RAM", "kernel", "filesystem measured", "torch", "vllm", "safetensors"):
        assert fact in md, fact
    assert "benchmarks/gpu/NOTES.md" in md


@pytest.mark.vllm
def test_json_has_raw_numbers_and_goals(quick_run) -> None:
    out, _ = quick_run
    doc = json.loads((out / "benchmarks.json").read_text())
    assert doc["run"]["mode"] == "quick"
    assert set(doc["benchmarks"]) == set(BENCHMARKS)
    for name, res in doc["benchmarks"].items():
        assert "error" not in res, f"{name}: {res.get('error')}"
        assert res["seconds"] > 0
    goals = [g for res in doc["benchmarks"].values() for g in res["goals"]]
    metrics = " ".join(g["metric"] for g in goals)
    for word in ("null sink", "raw sequential write", "raw loop", "naive", "p50", "p99"):
        assert word in metrics, word
    for g in goals:
        assert isinstance(g["met"], bool)
        assert isinstance(g["value"], float)
    server = doc["benchmarks"]["server"]
    assert {"null", "ours"} <= set(server["summary"])
    assert server["ratios"]["ours/null"]["published"] > 0
    assert doc["benchmarks"]["latency"]["results"]["reader"]["samples"] > 0
    assert doc["benchmarks"]["scale"]["runs"]["as shipped"]["yielded"] > 0
    # The write profile's hooks reach the writer's code (each stage was timed).
    stages = doc["benchmarks"]["write"]["profile"]["thread_seconds"]
    assert all(stages.get(s, 0) > 0 for s in WRITE_STAGES), stages


@pytest.mark.vllm
def test_only_keeps_the_other_sections(tmp_path: Path, quick_run) -> None:
    out, _ = quick_run
    target = tmp_path / "out"
    target.mkdir()
    for name in ("benchmarks.json", "benchmarks.md"):
        (target / name).write_text((out / name).read_text())
    proc = run_bench(
        "--quick", "--only", "fp8", "--out", str(target), "--scratch", str(tmp_path / "s")
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((target / "benchmarks.json").read_text())
    assert set(doc["benchmarks"]) == set(BENCHMARKS)
    assert doc["run"]["benchmarks_run"] == ["fp8"]  # the quickest one
    md = (target / "benchmarks.md").read_text()
    for section in SECTIONS:
        assert section in md, section


def test_help_lists_benchmarks_and_examples() -> None:
    proc = run_bench("--help", timeout=60)
    assert proc.returncode == 0
    for word in ("--quick", "--only", "--out", "examples:", *BENCHMARKS):
        assert word in proc.stdout, word


def test_unknown_benchmark_is_refused() -> None:
    proc = run_bench("--only", "nope", timeout=60)
    assert proc.returncode != 0
    assert "unknown benchmark" in proc.stderr


def test_store_section_records_why_it_was_not_measured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where Mooncake is missing (faked: it is installed here) the section says so."""
    import importlib.util

    from benchmarks import store
    from benchmarks.common import Context

    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "mooncake" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    res = store.run(Context(quick=True, scratch=tmp_path, cache=tmp_path))
    assert "mooncake-transfer-engine" in res["skipped"] and res["goals"] == []
    assert "|---|" in store.render(res) and res["skipped"] in store.render(res)
    assert store.findings(res) == [f"Mooncake Store: not measured ({res['skipped']})"]


def test_store_engine_ratio_pairs_each_files_round_with_its_store_round() -> None:
    """The store/files ratio is the median of per-round pairs; the stages reach the table."""
    from benchmarks.store_engine import engine_finding, render_engines, summarise

    def round_(generate_s: float, published_s: float, put_ms: float) -> dict[str, object]:
        stage = {"gather_copy_ms": 4.0, "finish_ms": 1.0, "put_ms": put_ms, "after_put_ms": 0.0}
        return {"tokens": 8192, "requests": 16, "generate_s": generate_s,
                "published_s": published_s, "errors": [], "stages": [stage],
                "engine_cpu_s": 2.0, "others_cpu_share": 0.1}  # fmt: skip

    per = {
        "files": [round_(1.0, 1.0, 0.0), round_(1.0, 2.0, 0.0), round_(2.0, 2.0, 0.0)],
        "store": [round_(1.0, 1.25, 3.0), round_(2.0, 2.0, 5.0), round_(2.0, 2.5, 4.0)],
    }
    setup = {"rounds": 3, "prompts_per_round": 16, "prompt_tokens": 512}
    res = summarise(per, {"files": 1.0, "store": 1.0}, setup)
    # Pairs: 1/1.25, 2/2, 2/2.5 -> median 0.8 (the medians of the rates would give 1.0).
    assert res["ratio"]["published"] == pytest.approx(0.8)
    assert res["ratio"]["generate"] == pytest.approx(1.0)
    assert res["store"]["stages_p50_ms"]["put_ms"] == 4.0
    assert res["files"]["tail_ms"] == pytest.approx(0.0)
    text = render_engines(res)
    assert "0.800\u00d7 until published" in text and "|---|" in text
    assert "0.800\u00d7" in engine_finding(res) and "4.0 ms" in engine_finding(res)


def test_the_raw_loop_hands_its_consumer_what_the_reader_hands_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Section 3 compares reading: both loops' consumers touch the same bytes in the same
    # pieces (token ids, then hidden states, per file), whatever the files' lengths.
    from benchmarks import reader

    touched: list[int] = []
    touch = reader.touch
    monkeypatch.setattr(reader, "touch", lambda t: touched.append(t.nbytes) or touch(t))
    nbytes = reader.make_dataset(tmp_path, [16, 300, 16], 4, 256)
    assert reader.pass_raw(tmp_path) == 3
    raw, touched[:] = list(touched), []
    assert reader.pass_reader(tmp_path) == 3
    assert raw == touched and sum(raw) == nbytes and len(raw) == 6


@pytest.mark.vllm
def test_consume_quick_section_measures_every_kind_it_can(quick_run) -> None:
    # The consume section of the quick run.
    out, proc = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads((out / "benchmarks.json").read_text())
    res = doc["benchmarks"]["consume"]
    assert "error" not in res, res.get("error")
    assert {"bf16", "fp8"} <= set(res["kinds"])
    for kind, row in res["kinds"].items():
        assert row["consumed"] == row["produced"] > 0 and row["duplicates"] == 0, kind
        assert row["gb_s_per_reader_busy"] > 0 and row["raw_gb_s"] > 0, kind
        assert row["yield_latency_p99_ms"] >= row["yield_latency_p50_ms"] > 0, kind
    metrics = " ".join(g["metric"] for g in res["goals"])
    assert "fp8 files / bf16 files" in metrics
    md = (out / "benchmarks.md").read_text()
    assert "## 15. Consume" in md and "yield p50 / p99 ms" in md


@pytest.mark.vllm
def test_claims_section_delivers_exactly_once_with_a_reader_killed(quick_run) -> None:
    # The claims section of the quick run (1 and 4 readers, then one of 4 killed).
    out, proc = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "benchmarks.json").read_text())["benchmarks"]["claims"]
    assert "error" not in res, res.get("error")
    assert [r["readers"] for r in res["rows"]] == [1, 4]
    for row in [*res["rows"], res["kill"]]:
        assert row["consumed"] == row["produced"] > 0 and row["unknown"] == 0, row
    assert all(r["duplicates"] == 0 for r in res["rows"])
    assert res["kill"]["duplicates"] <= 1  # at most the sample the killed reader held
    assert "CPU ms per sample (all readers)" in (out / "benchmarks.md").read_text()
