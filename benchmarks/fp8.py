"""fp8 storage (``storage_dtype="fp8_e4m3"``): bytes, error and speed against bf16.

Real states: a tiny random Llama (HF transformers, bf16) runs a prompt and its hidden
states of four layers are captured. On them: file bytes of bf16 vs fp8, and the error of
the default read (dequantized to bf16) per layer, for our per-token-per-layer scales and
for speculators' per-token scales (``hs_connectors`` 0.9.0). Speed, on a larger sample
made by tiling those states: writer GB/s (quantize + ``write_sample``) and reader GB/s
(``load_sample``: dequantize on the CPU, or raw fp8), warm page cache, in bf16 bytes per
second, runs interleaved. On CUDA, quantize and dequantize are timed on the GPU too.
The vLLM server ratio (fp8 vs bf16 storage) is not measured here.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Context, bench_model, fmt, gb, goal, log, median, table

NAME = "fp8"
TITLE = "9. fp8 storage: bytes, error, write and read speed"
QUICK_MODEL = {"num_layers": 4, "hidden_size": 128, "num_heads": 2, "dtype": "bfloat16"}
FULL_MODEL = {"num_layers": 8, "hidden_size": 512, "num_heads": 8, "dtype": "bfloat16"}
BOUND = 2**-4  # documented per-element relative bound (docs/format.md)
PROMPTS = Path(__file__).resolve().parents[1] / (
    "packages/connector/src/hidden_state_connector/data/prompts.jsonl"
)


def _captured(ctx: Context) -> tuple[Any, dict[str, Any]]:
    """``[tokens, 4, hidden]`` bf16 states of the tiny model, and what they are."""
    import torch
    from transformers import AutoModelForCausalLM

    spec = ctx.pick(QUICK_MODEL, FULL_MODEL)
    model = AutoModelForCausalLM.from_pretrained(bench_model(ctx, spec), dtype=torch.bfloat16)
    text = " ".join(json.loads(line)["text"] for line in PROMPTS.read_text().splitlines())
    tokens = ctx.pick(256, 1024)
    ids = torch.tensor(list(text.encode()[:tokens]))
    n = spec["num_layers"]
    layers = [n // 4, n // 2, 3 * n // 4, n]
    with torch.no_grad():
        out = model.eval()(ids[None], output_hidden_states=True)
    states = torch.stack([out.hidden_states[i][0] for i in layers], dim=1)
    return states, {"model": spec, "layers": layers, "tokens": int(ids.numel())}


def _per_token(x: Any) -> tuple[Any, Any]:
    """speculators' ``hs_connectors.fp8_utils.quantize_tensor_to_fp8``: one scale a token."""
    import torch

    fp32 = x.float()
    scale = (fp32.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
    return (fp32 / scale).to(torch.float8_e4m3fn), scale


def _errors(states: Any, layers: list[int]) -> list[dict[str, Any]]:
    """Per layer: relative (Frobenius) error and the worst element's share of the bound."""
    import torch

    from hidden_state_reader.kernels.fp8 import dequantize, quantize

    x = states.float()
    rows = []
    for name, (q, s) in (
        ("per token+layer (ours)", quantize(states)),
        ("per token", _per_token(states)),
    ):
        got = dequantize(q, s, torch.bfloat16).float()
        rel = ((got - x).norm(dim=(0, 2)) / x.norm(dim=(0, 2))).tolist()
        share = ((got - x).abs() / (BOUND * x.abs() + 2**-10 * s + 2**-8 * got.abs())).amax(
            dim=(0, 2)
        )
        cos = torch.nn.functional.cosine_similarity(got, x, dim=-1).mean(dim=0).tolist()
        for i, layer in enumerate(layers):
            rows.append(
                {
                    "scales": name,
                    "layer": layer,
                    "rel_error": rel[i],
                    "bound_share": float(share[i]),
                    "cosine": cos[i],
                }
            )
    return rows


def _interleaved(work: Path, big: Any, reps: int) -> dict[str, list[float]]:
    """Seconds per write and read, bf16 and fp8 alternating."""
    import torch

    from hidden_state_reader import LoadOptions, load_sample
    from hidden_state_reader.files.publish import write_sample

    tokens = torch.arange(big.shape[0])
    times: dict[str, list[float]] = {}

    def timed(key: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        fn(*args, **kwargs)
        times.setdefault(key, []).append(time.perf_counter() - start)

    for rep in range(reps):
        for storage in ("model", "fp8_e4m3"):
            path = work / f"{storage}-{rep}.safetensors"
            timed(f"write {storage}", write_sample, path, tokens, big, storage=storage)
            load_sample(path)  # warm the page cache: reads are measured from memory
            timed(f"read {storage}", load_sample, path)
            if storage == "fp8_e4m3":
                timed("read fp8_e4m3 raw", load_sample, path, LoadOptions(raw_fp8=True))
            os.unlink(path)
    return times


KERNEL_SHAPE = (1024, 4, 4096)
"""An 8B-shaped sample (1024 tokens, 4 layers, hidden 4096) for the kernels alone: rows as
long as real models' (the captured tiny model's are 512: its tables weigh more)."""


def _kernels(reps: int) -> dict[str, Any]:
    """GB/s (of output: bf16 or fp16 bytes) of each CPU dequantization on its own, into one
    reused output per dtype (bf16 models, and fp16 ones: most quantized models in vLLM).

    An 8B-shaped random sample (``KERNEL_SHAPE``); interleaved, median of ``reps`` rounds;
    also the kernel ``dequantize`` picks here.
    """
    import torch

    from hidden_state_reader.kernels import fp8_cpu
    from hidden_state_reader.kernels.fp8 import quantize

    gen = torch.Generator().manual_seed(0)
    big = torch.randn(KERNEL_SHAPE, generator=gen).to(torch.bfloat16)
    q, scales = quantize(big)
    outs = {
        name: torch.empty(big.shape, dtype=dtype)
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16))
    }
    impls: dict[str, Callable[..., Any]] = {"torch passes": fp8_cpu.torch_passes_into}
    for level in fp8_cpu.native_levels():  # each level this CPU runs (LEVELS)
        impls[f"native, {fp8_cpu.LEVELS[level]}"] = functools.partial(
            fp8_cpu.native_into, level=level
        )
    runs = [
        (f"{impl} \u2192 {dtype}", impls[impl], out)
        for impl in impls
        for dtype, out in outs.items()
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(reps):
        for name, fn, out in runs:
            start = time.perf_counter()
            fn(q, scales, out)
            times[name].append(time.perf_counter() - start)
    gbps = {name: gb(big.numel() * 2 / median(t)) for name, t in times.items()}
    return {"gbps": gbps, "default": fp8_cpu.kernel()}


def _gpu(big: Any, reps: int) -> dict[str, float] | None:
    """GB/s (bf16 bytes) of quantize and dequantize on the GPU, when there is one."""
    import torch

    from hidden_state_reader.kernels.fp8 import dequantize, quantize

    if not torch.cuda.is_available():
        return None
    x = big.cuda()
    q, scales = quantize(x)
    out: dict[str, float] = {}
    for key, fn in (
        ("quantize", lambda: quantize(x)),
        ("dequantize", lambda: dequantize(q, scales)),
    ):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        out[key] = gb(x.numel() * 2 * reps / (time.perf_counter() - start))
    return out


def _layout_bytes(tokens: int, layers: int, hidden: int) -> dict[str, int]:
    """File bytes of a sample of this shape (no metadata), bf16 vs fp8, from the layout."""
    import torch

    from hidden_state_reader.format import encode_header
    from hidden_state_reader.format.fp8 import SCALES

    ids = {"token_ids": (torch.int64, (tokens,))}
    bf16 = {**ids, "hidden_states": (torch.bfloat16, (tokens, layers, hidden))}
    fp8 = {
        **ids,
        "hidden_states": (torch.float8_e4m3fn, (tokens, layers, hidden)),
        SCALES: (torch.float32, (tokens, layers, 1)),
    }
    return {
        "model": encode_header(bf16).file_size,
        "fp8_e4m3": encode_header(fp8, trailing=[SCALES]).file_size,
    }


def run(ctx: Context) -> dict[str, Any]:
    import torch

    from hidden_state_reader.files.publish import write_sample

    work = ctx.workdir(NAME)
    states, setup = _captured(ctx)
    log(f"fp8: captured {tuple(states.shape)} states of layers {setup['layers']}")
    sizes = {}
    for storage in ("model", "fp8_e4m3"):
        path = write_sample(
            work / f"{storage}.safetensors", torch.arange(len(states)), states, storage=storage
        )
        sizes[storage] = os.path.getsize(path)
    big_sizes = _layout_bytes(8192, 4, 4096)
    errors = _errors(states, setup["layers"])
    target = ctx.pick(32, 256) * 2**20  # bf16 bytes of the timed sample
    big = states.repeat(max(1, target // (states.numel() * 2)), 1, 1)
    times = _interleaved(work, big, ctx.pick(2, 3))
    nbytes = big.numel() * 2
    speed = {key: gb(nbytes / median(t)) for key, t in times.items()}
    log("fp8: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in speed.items()))
    ours = [r["rel_error"] for r in errors if r["scales"].endswith("(ours)")]
    setup.update(timed_bytes=nbytes, threads=torch.get_num_threads())
    return {
        "setup": setup,
        "sizes": sizes,
        "sizes_8b": big_sizes,
        "errors": errors,
        "gbps": speed,
        "kernels": _kernels(ctx.pick(3, 7)),
        "gpu_gbps": _gpu(big, ctx.pick(3, 10)),
        "goals": [
            goal(
                "fp8 / bf16 file bytes, 8B-shaped sample (8192 tokens, 4 layers, hidden 4096)",
                big_sizes["fp8_e4m3"] / big_sizes["model"],
                0.51,
                higher_is_better=False,
            ),
            goal(
                "fp8 worst per-layer relative error vs bf16",
                max(ours),
                BOUND,
                higher_is_better=False,
                unit="",
            ),
        ],
    }


def render(res: dict[str, Any]) -> str:
    s, sizes, big = res["setup"], res["sizes"], res["sizes_8b"]
    m = s["model"]
    out = [
        f"Tiny random Llama (hidden {m['hidden_size']}, {m['num_layers']} layers, bf16, HF "
        f"transformers), {s['tokens']} prompt tokens, layers {s['layers']}.",
        "",
        table(
            ["storage", "file bytes (this sample)", "vs bf16", "8B-shaped sample", "vs bf16"],
            [[k, v, v / sizes["model"], big[k], big[k] / big["model"]] for k, v in sizes.items()],
        ),
        "",
        "8B-shaped: 8192 tokens, 4 layers, hidden 4096, computed from the format's layout "
        "(scales cost 4 bytes per token and layer, so small hidden sizes save less).",
        "",
        "Error of the default read (dequantized to bf16) against the bf16 states; bound "
        "share = worst element's error / its documented bound (docs/format.md, incl. bf16 "
        "rounding):",
        "",
        table(
            ["scales", "layer", "relative error", "bound share", "mean cosine"],
            [
                [r["scales"], r["layer"], r["rel_error"], r["bound_share"], r["cosine"]]
                for r in res["errors"]
            ],
        ),
        "",
        f"Speed on a {fmt(s['timed_bytes'] / 2**20)} MiB (bf16) sample, warm page cache, "
        f"{s['threads']} torch threads, GB/s of bf16 bytes (median):",
        "",
        table(["operation", "GB/s"], [[k, v] for k, v in res["gbps"].items()]),
    ]
    kernels = res.get("kernels")
    if kernels:
        out += [
            "",
            f"Dequantization alone, an 8B-shaped sample ({' x '.join(map(str, KERNEL_SHAPE))}, "
            "random), into one reused output per dtype (no page faults), one thread, GB/s of "
            "output (median), at each level of the native kernel this CPU runs; reads use "
            f"**{kernels['default']}** here:",
            "",
            table(["CPU dequantization", "GB/s"], [[k, v] for k, v in kernels["gbps"].items()]),
        ]
    if res.get("gpu_gbps"):
        out += ["", table(["on the GPU", "GB/s"], [[k, v] for k, v in res["gpu_gbps"].items()])]
    else:
        out += ["", "No GPU here: quantize/dequantize on CUDA not measured."]
    return "\n".join(out)


def findings(res: dict[str, Any]) -> list[str]:
    sizes, speed = res["sizes"], res["gbps"]
    ours = max(r["rel_error"] for r in res["errors"] if r["scales"].endswith("(ours)"))
    theirs = max(r["rel_error"] for r in res["errors"] if not r["scales"].endswith("(ours)"))
    return [
        f"fp8 storage: {sizes['fp8_e4m3'] / sizes['model']:.1%} of the bf16 bytes, worst "
        f"per-layer relative error {ours:.2%} (per-token scales: {theirs:.2%}); CPU write "
        f"{speed['write fp8_e4m3']:.2f} vs {speed['write model']:.2f} GB/s, read (dequantize) "
        f"{speed['read fp8_e4m3']:.2f} vs {speed['read model']:.2f} GB/s"
        + _kernel_finding(res.get("kernels"))
    ]


def _kernel_finding(kernels: dict[str, Any] | None) -> str:
    if not kernels:
        return ""
    parts = ", ".join(f"{name} {v:.1f}" for name, v in kernels["gbps"].items())
    return f"; dequantization alone (GB/s of output): {parts} (reads use {kernels['default']})"
