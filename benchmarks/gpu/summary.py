"""Write ``benchmarks/gpu_summary.md`` (the GPU section of docs/benchmarks.md) from results.

    python benchmarks/gpu/summary.py            # reads benchmarks/gpu/results/*.jsonl

Every RESULT line of every H200 run is kept in ``benchmarks/gpu/results/DATE.jsonl``; this
turns each date's lines into tables (newest date first), followed by that date's
hand-written findings (``findings-DATE.md``), so the docs never hold a number that is not
in a results file. ``python -m benchmarks`` then appends the summary to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE.parent / "gpu_summary.md"
NOTES = """\
Machine: one NVIDIA H200 (143,771 MiB), driver 580.159.04; vLLM 0.26.0 (the trimmed kit,
Triton attention, V1 model runner), torch 2.11.0+cu130, Python 3.12. Throughput rows:
Llama-3.1-8B shape with dummy bf16 weights, 256 prompts \u00d7 1024 tokens, `max_tokens=1`,
layers [2, 16, 29, 32], local disk (`/tmp`), one engine per row (multiprocess, except the
32k rows: in-process, for the device-memory figure). Validation rows: tiny 4-layer Llama
with random weights, in-process engine, layers [0, 1, 2, 4], chunked prefill (256-token
batches, prompts of 1 to 2,000 tokens), prefix caching (a shared 96-token prefix),
`include_output_tokens`, 64 KiB chunks and a 1 MiB host budget, CRC32 checked by the
reader; layer 0 is reported apart (vLLM's fused add-RMSNorm updates it in place on CUDA in
eager mode)."""


def _f(value: Any, digits: int = 1) -> str:
    if value is None:
        return "\u2013"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def render_all(dates: dict[str, list[dict[str, Any]]], findings: dict[str, str]) -> str:
    """The GPU section: the common notes, then every date's tables and findings, newest first."""
    out = ["## GPU (NVIDIA H200): from `benchmarks/gpu/results/DATE.jsonl`", ""]
    out += ["How each plan is run and what every session found: `benchmarks/gpu/NOTES.md`.", ""]
    out += [NOTES, ""]
    for date in sorted(dates, reverse=True):
        out += [render(dates[date], date), findings.get(date, "")]
    return "\n".join(out)


def render(rows: list[dict[str, Any]], date: str) -> str:
    """The markdown tables of one date's result lines."""
    out = [f"### {date}: `benchmarks/gpu/results/{date}.jsonl`", ""]
    val = [r for r in rows if r.get("kind") == "validate"]
    if val:
        out += [
            "| validation | samples | worst rel. error (layers ≥ 1) | tolerance | layer 0 "
            "rel. error | failures |",
            "|---|---|---|---|---|---|",
        ]
        for r in val:
            mode = "CUDA graphs" if r["graphs"] else "eager"
            if r.get("storage_dtype", "model") != "model":
                mode += f", stored as {r['storage_dtype']}"
            out.append(
                f"| {r['dtype']}, {mode} | {r['samples']} | {r['worst_rel_err']:.1e} | "
                f"{r['tolerance']:.0e} | {r['layer0_rel_err']:.2g} | {len(r['failures'])} |"
            )
        out.append("")
    thr = [r for r in rows if r.get("kind") in ("none", "example", "ours", "null")]
    decode = [r for r in thr if r.get("max_tokens", 1) > 1]
    thr = [r for r in thr if r.get("max_tokens", 1) == 1]
    short = [r for r in thr if r.get("prompt_len") == 1024]
    if short:
        out += [
            "| run | kind | mode | prefill tok/s | GB/s | lock release after return p50 / p99 ms |",
            "|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(short, 1):
            p50, p99 = r.get("release_after_return_p50_ms"), r.get("release_after_return_p99_ms")
            rel = "\u2013" if r["kind"] == "none" else f"{_f(p50)} / {_f(p99)}"
            mode = "graphs" if r["graphs"] else "eager"
            storage = (r.get("connector") or {}).get("storage_dtype")
            kind = r["kind"] + (f" ({storage} storage)" if storage else "")
            out.append(
                f"| {i} | {kind} | {mode} | {_f(r['tok_s'], 0)} | "
                f"{_f(r.get('write_gb_s'), 2)} | {rel} |"
            )
        out.append("")
    out += _long_table([r for r in thr if r.get("prompt_len", 0) > 1024])
    out += _decode_table(decode)
    out += _sustain_table([r for r in rows if r.get("kind") == "sustain"])
    out += _train_feed_table([r for r in rows if r.get("kind") == "train_feed"])
    out += _verify_table([r for r in rows if r.get("kind") == "gpu_verify"])
    return "\n".join(out)


def _long_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = [
        "| 32k-token requests | engine | prefill tok/s | peak extra device MiB (torch, above "
        "idle) | peak extra device MiB (nvidia-smi, above the engine's reservation) | "
        "pinned host MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['kind']} | {r.get('engine', '')} | {_f(r['tok_s'], 0)} | "
            f"{_f(r.get('peak_extra_device_mb'), 0)} | {_f(r.get('peak_extra_device_mb_smi'), 0)} "
            f"| {_f(r.get('pinned_pool_mb'), 0)} |"
        )
    return [*out, ""]


NULL_SINK = "null sink (extraction, nothing copied or written)"


def runs_of(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Consecutive rows grouped into runs: a run ends where a kind comes again.

    A plan runs each kind once per call (``bench.py throughput --kinds ...``), so rows of
    one run share a machine and compare with each other, not with another call's.
    """
    runs: list[list[dict[str, Any]]] = []
    for row in rows:
        if not runs or row["kind"] in {r["kind"] for r in runs[-1]}:
            runs.append([])
        runs[-1].append(row)
    return runs


def _decode_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = [
        "| run | decode-heavy (prompt tokens, generated) | kind | prompt tok/s | generated "
        "tok/s | vs none (same run) | vs null sink (same run) |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, run in enumerate(runs_of(rows), 1):
        base = {r["kind"]: r["tok_s"] for r in run}
        for r in run:
            kind = NULL_SINK if r["kind"] == "null" else r["kind"]
            vs = [r["tok_s"] / base[k] if k in base else None for k in ("none", "null")]
            out.append(
                f"| {i} | {r['prompt_len']}, {r['max_tokens']} | {kind} | {_f(r['tok_s'], 0)} | "
                f"{_f(r.get('out_tok_s'), 0)} | {_f(vs[0], 3)} | {_f(vs[1], 3)} |"
            )
    return [*out, ""]


def pair_with_none(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with ``tok_s_none`` set on every sustained run that lacks it.

    A sustained run with extraction is compared with the no-extraction run (``producer:
    "none"``) nearest to it in the list, the earlier on a tie: plans put one in each
    call, before or after the runs it is for, so the nearest is the same call's.
    """
    nones = [i for i, r in enumerate(rows) if _is_sustain(r) and r.get("producer") == "none"]
    out = []
    for i, row in enumerate(rows):
        wants = _is_sustain(row) and row.get("producer") != "none" and "tok_s_none" not in row
        if wants and nones:
            nearest = min(nones, key=lambda j: (abs(j - i), j))
            row = {**row, "tok_s_none": rows[nearest]["tok_s"]}
        out.append(row)
    return out


def _is_sustain(row: dict[str, Any]) -> bool:
    return row.get("kind") == "sustain"


def _sustain_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    out = [
        "| sustained run | readers | reader device (fp8 on the CPU by) | produced (samples, GB "
        "on disk) | consumed exactly once | max backlog (files) | yield p50 / p99 ms | tok/s "
        "(median batch) | vs none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("producer") == "none":
            dash = "\u2013"
            cells = " | ".join([dash] * 6)
            out.append(f"| no extraction | {cells} | {_f(r['tok_s'], 0)} | 1.000 |")
            continue
        none = r.get("tok_s_none")
        ratio = r["tok_s"] / none if none else None
        device = r["reader_device"]
        if r["storage_dtype"] != "model" and device == "cpu":
            device += f" ({r.get('fp8_cpu_kernel', 'torch passes')})"
        out.append(
            f"| {r['storage_dtype']} storage | {r['readers']} | {device} | "
            f"{r['produced']}, {r['produced_bytes'] / 1e9:,.1f} | "
            f"{r['consumed']} ({'yes' if r['exactly_once'] else 'NO'}) | "
            f"{r['max_backlog_files']} | {_f(r['yield_latency_p50_ms'])} / "
            f"{_f(r['yield_latency_p99_ms'])} | {_f(r['tok_s'], 0)} | {_f(ratio, 3)} |"
        )
    return [*out, ""]


def _train_feed_table(rows: list[dict[str, Any]]) -> list[str]:
    """``train_feed.py`` rows: the trainer's tok/s per feed, and each feed alone."""
    if not rows:
        return []
    out = [
        "| call | row | feed (design) | storage | mode | workers | trainer tok/s | vs "
        "synthetic | vs synthetic, same shapes | data wait | loader GB/s (bf16-eq.) | host "
        "CPU-s per GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        feed = r["path"] + (f" ({r['device_design']})" if r.get("device_design") else "")
        tok_s = _f(r["tok_s"], 0) + (" (alone)" if r.get("alone") else "")
        out.append(
            f"| {r.get('call', '')} | {r['row']} | {feed} | {r['storage_dtype']} | {r['mode']} | "
            f"{r['workers']} | {tok_s} | {_f(r.get('ratio_vs_synthetic'), 3)} | "
            f"{_f(r.get('ratio_vs_synthetic_varlen'), 3)} | {_f(r['data_wait_frac'], 3)} | "
            f"{_f(r['loader_gb_s'])} | {_f(r.get('host_cpu_s_per_gb'), 3)} |"
        )
    return [*out, ""]


def _verify_table(rows: list[dict[str, Any]]) -> list[str]:
    """``verify.py`` rows: every answered request accounted for, every row against HF."""
    if not rows:
        return []
    out = [
        "| code | GPU | capture | prefix caching | graphs | storage | sleep | async scheduling | "
        "answered | published (with generated tokens) | refused | wrong | missing (silent) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sync = {None: "vLLM default (on)", True: "on", False: "off"}[r.get("async_scheduling")]
        out.append(
            f"| {r.get('label', '')} | {r['gpu']} | {r.get('capture', 'extract')} | "
            f"{r['prefix_caching']} | {r['graphs']} | "
            f"{r['storage_dtype']} | {r.get('sleep')} | {sync} | {r['answered']} | "
            f"{r['published']} ({r.get('published_with_generated_tokens', '?')}) | "
            f"{r['client_errors']} | {r['wrong']} | {r['missing']} ({r['silent']}) |"
        )
    return [*out, ""]


def load() -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    """Every date's result lines and hand-written findings."""
    dates = {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(RESULTS.glob("*.jsonl"))
    }
    findings = {p.stem.removeprefix("findings-"): p.read_text() for p in HERE.glob("findings-*.md")}
    return dates, findings


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0] if __doc__ else None,
        epilog="example: python benchmarks/gpu/summary.py && python -m benchmarks --only write",
    ).parse_args(argv)
    dates, findings = load()
    if not dates:
        print(f"no results in {RESULTS}", file=sys.stderr)
        return 1
    OUT.write_text(render_all(dates, findings))
    print(f"wrote {OUT} from {sum(map(len, dates.values()))} results of {len(dates)} dates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
