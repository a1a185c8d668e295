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
    thr = [r for r in rows if r.get("kind") in ("none", "example", "ours")]
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
    long_rows = [r for r in thr if r.get("prompt_len", 0) > 1024]
    if long_rows:
        out += [
            "| 32k-token requests | prefill tok/s | peak extra device MiB (torch, above "
            "idle) | pinned host MiB |",
            "|---|---|---|---|",
        ]
        for r in long_rows:
            out.append(
                f"| {r['kind']} | {_f(r['tok_s'], 0)} | {_f(r.get('peak_extra_device_mb'), 0)} "
                f"| {_f(r.get('pinned_pool_mb'), 0)} |"
            )
        out.append("")
    return "\n".join(out)


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
