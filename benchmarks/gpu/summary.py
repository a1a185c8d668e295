"""Write ``benchmarks/gpu_summary.md`` (the GPU section of docs/benchmarks.md) from results.

    python benchmarks/gpu/summary.py            # reads benchmarks/gpu/results/*.jsonl

Every RESULT line of every H200 run is kept in ``benchmarks/gpu/results/DATE.jsonl``; this
turns the newest date's lines into tables, so the docs never hold a number that is not in
a results file. ``python -m benchmarks`` then appends the summary to docs/benchmarks.md.
"""

from __future__ import annotations

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


def render(rows: list[dict[str, Any]], date: str) -> str:
    """The markdown summary of one date's result lines."""
    out = [f"## GPU (NVIDIA H200), {date}: from `benchmarks/gpu/results/{date}.jsonl`", ""]
    out += ["How each plan is run and what every session found: `benchmarks/gpu/NOTES.md`.", ""]
    out += [NOTES, ""]
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


def _decode_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    none = [r["tok_s"] for r in rows if r["kind"] == "none"]
    out = [
        "| decode-heavy (prompt tokens, generated) | kind | prompt tok/s | generated tok/s | "
        "vs none |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["tok_s"] / none[0] if none else None
        kind = NULL_SINK if r["kind"] == "null" else r["kind"]
        out.append(
            f"| {r['prompt_len']}, {r['max_tokens']} | {kind} | {_f(r['tok_s'], 0)} | "
            f"{_f(r.get('out_tok_s'), 0)} | {_f(ratio, 3)} |"
        )
    return [*out, ""]


def _sustain_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    none = [r["tok_s"] for r in rows if r.get("producer") == "none"]
    out = [
        "| sustained run | readers | reader device | produced (samples, GB on disk) | consumed "
        "exactly once | max backlog (files) | yield p50 / p99 ms | tok/s (median batch) | vs "
        "none |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("producer") == "none":
            dash = "\u2013"
            cells = " | ".join([dash] * 6)
            out.append(f"| no extraction | {cells} | {_f(r['tok_s'], 0)} | 1.000 |")
            continue
        ratio = r["tok_s"] / none[0] if none else None
        out.append(
            f"| {r['storage_dtype']} storage | {r['readers']} | {r['reader_device']} | "
            f"{r['produced']}, {r['produced_bytes'] / 1e9:,.1f} | "
            f"{r['consumed']} ({'yes' if r['exactly_once'] else 'NO'}) | "
            f"{r['max_backlog_files']} | {_f(r['yield_latency_p50_ms'])} / "
            f"{_f(r['yield_latency_p99_ms'])} | {_f(r['tok_s'], 0)} | {_f(ratio, 3)} |"
        )
    return [*out, ""]


def main() -> int:
    files = sorted(RESULTS.glob("*.jsonl"))
    if not files:
        print(f"no results in {RESULTS}", file=sys.stderr)
        return 1
    newest = files[-1]
    rows = [json.loads(line) for line in newest.read_text().splitlines() if line.strip()]
    OUT.write_text(render(rows, newest.stem) + "\n" + (HERE / "findings.md").read_text())
    print(f"wrote {OUT} from {len(rows)} results in {newest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
