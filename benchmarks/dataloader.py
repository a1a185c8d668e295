"""DataLoader: ``HiddenStateDataset`` + ``HiddenStateLoader``, workers, pinning, pad vs pack.

One epoch per configuration over the same files (page cache warm), batch size 8; the
consumer touches every byte of each batch's ``hidden_states``. For reference, the plain
``HiddenStateReader`` loop over the same files (no DataLoader, no collation).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import Context, fmt, log, median, rotate, spread, table
from benchmarks.reader import make_dataset, pass_reader, touch

NAME = "dataloader"
TITLE = "6. DataLoader (samples/s by workers, pinning, padding vs packing)"
BATCH = 8


def _epoch(root: Any, workers: int, pin: bool, collate: str) -> dict[str, Any]:
    from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, pack_collate, pad_collate

    dataset = HiddenStateDataset(root)
    loader = HiddenStateLoader(
        dataset,
        batch_size=BATCH,
        num_workers=workers,
        pin_memory=pin,
        collate_fn=pad_collate if collate == "pad" else pack_collate,
    )
    samples = tokens = slots = 0
    first = None
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator
        for batch in loader:
            if first is None:
                first = time.perf_counter() - t0
            touch(batch["hidden_states"])
            lengths = batch["lengths"]
            samples += int(lengths.numel())
            tokens += int(lengths.sum())
            slots += int(batch["hidden_states"].shape[0] * batch["hidden_states"].shape[1])
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "first_batch_s": first,
        "samples": samples,
        "tokens": tokens,
        "token_slots": slots,
    }


def _profile(root: Any, collate: str, top: int = 8) -> list[dict[str, Any]]:
    """cProfile of one ``num_workers=0`` epoch: the functions with the most own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _epoch(root, 0, False, collate)
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [
        {
            "function": f"{func}",
            "where": f"{file.rsplit('/', 1)[-1]}:{line}",
            "calls": calls,
            "tottime_s": tottime,
        }
        for (file, line, func), (_cc, calls, tottime, _cum, _callers) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:top]


def _measure(
    work: Path, configs: list[tuple[int, bool, str]], rounds: int, count: int
) -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """Time every loader config per round (rotated), plus a reader pass per round.

    Returns the epochs per config key and the reader-loop pass times.
    """
    per: dict[str, list[dict[str, Any]]] = {}
    reader_times: list[float] = []
    for r in range(rounds):
        t = time.perf_counter()
        pass_reader(work)
        reader_times.append(time.perf_counter() - t)
        for workers, pin, collate in rotate(configs, r):
            key = f"workers={workers} pin_memory={pin} {collate}"
            res = _epoch(work, workers, pin, collate)
            if res["samples"] != count:
                raise RuntimeError(f"{key}: {res['samples']} of {count} samples")
            per.setdefault(key, []).append(res)
            log(
                f"dataloader: round {r + 1}/{rounds} {key:32s} "
                f"{res['samples'] / res['seconds']:7.1f} samples/s"
            )
    return per, reader_times


def _summarise(
    per: dict[str, list[dict[str, Any]]], nbytes: int, reader_sps: float
) -> dict[str, dict[str, Any]]:
    """Medians (and spread of samples/s) of each config's epochs."""
    summary = {}
    for key, rows in per.items():
        sps = [r["samples"] / r["seconds"] for r in rows]
        summary[key] = {
            "samples_s": spread(sps),
            "tokens_s": median([r["tokens"] / r["seconds"] for r in rows]),
            "gb_s": median([nbytes / r["seconds"] / 1e9 for r in rows]),
            "first_batch_s": median([r["first_batch_s"] for r in rows]),
            "padding_fraction": 1 - median([r["tokens"] / r["token_slots"] for r in rows]),
            "vs_reader_loop": median(sps) / reader_sps,
        }
    return summary


def run(ctx: Context) -> dict[str, Any]:
    import random

    import torch

    work = ctx.workdir("dataloader")
    rng = random.Random(0)
    count = ctx.pick(32, 384)
    lengths = [rng.randint(64, 1024) for _ in range(count)]
    layers, hidden = 4, 1024
    log(f"dataloader: writing {count} samples")
    nbytes = make_dataset(work, lengths, layers, hidden)
    pass_reader(work)  # warm the page cache
    configs = [
        (0, False, "pad"),
        (0, False, "pack"),
        (1, False, "pad"),
        (1, False, "pack"),
        (2, False, "pad"),
        (2, False, "pack"),
        (2, True, "pad"),
    ]
    rounds = ctx.pick(1, 2)
    per, reader_times = _measure(work, configs, rounds, count)
    reader_sps = count / median(reader_times)
    profiles = {collate: _profile(work, collate) for collate in ("pad", "pack")}
    summary = _summarise(per, nbytes, reader_sps)
    return {
        "setup": {
            "samples": count,
            "token_lengths": [min(lengths), max(lengths)],
            "layers": layers,
            "hidden": hidden,
            "tensor_bytes": nbytes,
            "batch_size": BATCH,
            "rounds": rounds,
            "accelerator": torch.cuda.is_available(),
        },
        "reader_loop_samples_s": reader_sps,
        "profiles_workers0": profiles,
        "summary": summary,
        "goals": [],
    }


def findings(res: dict[str, Any]) -> list[str]:
    """Data-driven conclusions for the report's findings list."""
    summary = res["summary"]
    best = max(summary.items(), key=lambda kv: kv[1]["samples_s"]["median"])
    pad0 = summary.get("workers=0 pin_memory=False pad")
    pack0 = summary.get("workers=0 pin_memory=False pack")
    text = (
        f"**DataLoader**: best {best[0]} at {best[1]['samples_s']['median']:.0f} samples/s "
        f"({best[1]['gb_s']:.2f} GB/s); the plain reader loop over the same files does "
        f"{res['reader_loop_samples_s']:.0f} samples/s."
    )
    if pad0 and pack0:
        text += (
            f" Packing vs padding (no workers): {pack0['samples_s']['median']:.0f} vs "
            f"{pad0['samples_s']['median']:.0f} samples/s; padding fills "
            f"{pad0['padding_fraction']:.0%} of the padded batch with zeros."
        )
    prof = res.get("profiles_workers0", {}).get("pad") or []
    if prof:
        top = ", ".join(
            f"`{p['function']}` ({p['where']}) {p['tottime_s']:.2f} s" for p in prof[:3]
        )
        text += f" Where a no-worker epoch goes (pad): {top}."
    return [text]


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    pin_note = (
        ""
        if s["accelerator"]
        else " No accelerator here, so `pin_memory=True` is ignored by the DataLoader (it "
        "warns); the row shows only the cost of asking for it."
    )
    out = [
        f"{s['samples']} samples of {s['token_lengths'][0]}\u2013{s['token_lengths'][1]} "
        f"tokens (uniform) \u00d7 {s['layers']} layers \u00d7 {s['hidden']} hidden (bf16, "
        f"{s['tensor_bytes'] / 1e9:.2f} GB), batch size {s['batch_size']}, page cache warm, "
        f"one epoch per row and round, {s['rounds']} round(s) interleaved; medians. Worker "
        "processes are forked per epoch, so their start-up is included." + pin_note,
        "",
        table(
            [
                "configuration",
                "samples/s (min\u2013max)",
                "tokens/s",
                "GB/s",
                "first batch s",
                "padding share",
                "vs plain reader loop",
            ],
            [
                [
                    key,
                    f"{fmt(v['samples_s']['median'])} "
                    f"({fmt(v['samples_s']['min'])}\u2013{fmt(v['samples_s']['max'])})",
                    v["tokens_s"],
                    v["gb_s"],
                    v["first_batch_s"],
                    v["padding_fraction"],
                    v["vs_reader_loop"],
                ]
                for key, v in res["summary"].items()
            ],
        ),
        "",
        f"Plain `HiddenStateReader` loop over the same files: "
        f"{fmt(res['reader_loop_samples_s'])} samples/s.",
    ]
    for collate, prof in res.get("profiles_workers0", {}).items():
        out += [
            "",
            f"cProfile of one `num_workers=0` epoch with `{collate}_collate` (own time):",
            "",
            table(
                ["function", "where", "calls", "own s"],
                [[p["function"], p["where"], p["calls"], p["tottime_s"]] for p in prof],
            ),
        ]
    return "\n".join(out)
