"""The GPU correctness sweep: every published row right, nothing answered and silently missing.

    bash benchmarks/gpu/run.sh verify            # the sweep, one device call (< 9 minutes)
    python benchmarks/gpu/verify.py --configs pc=on,graphs=off,storage=bf16,sleep=on
    python benchmarks/gpu/verify.py one --config pc=off,graphs=on,storage=fp8 --requests 128

Each configuration starts its own engine (a child process) with a tiny random model
(Llama unless ``arch=`` names another family; bf16 unless ``dtype=float32``; built
locally), chunked prefill (``max_num_batched_tokens=512``, prompts of 17-1,500 tokens,
some sharing a prefix with an earlier prompt and some repeating the one before, so the
prefix cache hits, in the same step too), and the
connector with small host buffers (copies still in flight when a batch returns). Per
round one batch: half the requests store their generated tokens
(``include_output_tokens``), half only the prompt; ``max_tokens`` 1-64; greedy and sampled
decoding (sampled drafts get rejected, greedy ones on a random model are often accepted).
With ``sleep=on`` every round is followed by ``llm.sleep()`` / ``llm.wake_up()``.
With ``spec=ngram`` or ``spec=eagle3`` (forward capture only, async scheduling off) the
engine speculates beside the capture (ngram prompt lookup; a tiny echo EAGLE-3 drafter,
``apps.tiny_drafter``), a quarter of the prompts repeat a motif so drafts get accepted,
and each sample's drafted/accepted counts are checked (``accepted <= drafted``) and summed.
With ``long=N`` prompts are about N tokens (the model's position limit raised to fit) and
``arena=SIZE`` sets ``capture_buffer_bytes``: back-pressure on the host arena. An
``arena=`` engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the
scheduler's admission waits can be read; its row says ``"engine": "in-process"``. Float32
engines run Triton's float32 dots in IEEE precision (``TRITON_F32_DEFAULT=ieee``): TF32
rounding in the fused MoE picks other experts than HF float32 at a tiny router's near-ties.

Then every answered request is accounted for: published (read back, CRC checked, token
ids equal to the prompt plus the generated tokens that were fed back, every row of every
captured layer within tolerance of HF transformers' float32 hidden states), a client
error (``hidden_states_error`` in the response), or missing. A missing sample whose lock
records a failure is visible to the operator (``hidden-state verify``); one without is a
silent failure. One JSON line per configuration (``kind: "gpu_verify"``) after ``RESULT ``,
appended to ``--jsonl``. Exit status 1 when any row is wrong or any sample silently missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LAYERS = [1, 2, 4]  # the tiny model has 4 layers; 4 is the last one, before the final norm
# Generated tokens need synchronous scheduling (engine/output_tokens.py): four engines
# with it, and one with vLLM's default (async), where those requests must be refused.
SWEEP = [
    "pc=on,graphs=off,storage=bf16,sleep=on,async=off",
    "pc=off,graphs=off,storage=fp8,sleep=off,async=off",
    "pc=on,graphs=on,storage=fp8,sleep=off,async=off",
    "pc=off,graphs=on,storage=bf16,sleep=on,async=off",
    "pc=on,graphs=off,storage=bf16,sleep=off",
]
# A row is wrong beyond these relative errors (per token, per layer) against HF float32:
# bf16 engine arithmetic, plus fp8's rounding (2**-4 per element) when stored as fp8.
ROW_TOL = {"bf16": 0.06, "fp8": 0.12, "fp32": 0.01}
SPEC_METHODS = ("", "ngram", "eagle3")


@dataclass(frozen=True)
class Config:
    """One engine configuration of the sweep."""

    prefix_caching: bool
    graphs: bool
    storage: str  # "bf16" (the model's dtype) or "fp8"
    sleep: bool
    async_scheduling: bool | None = None  # None: vLLM's default
    capture: str = "extract"  # or "forward" (no speculative config)
    arch: str = "llama"  # tiny-model --arch (MoE and MLA families: forward capture only)
    dtype: str = "bfloat16"  # the engine's (float32: the families' values, crisply)
    spec: str = ""  # forward capture beside a drafter: "ngram" or "eagle3"
    long: int = 0  # prompts of about this many tokens (back-pressure on the arena), 0: 17-1,500
    arena: str = ""  # capture_buffer_bytes (forward capture), "": the default

    @classmethod
    def parse(cls, text: str) -> Config:
        """``pc=on,graphs=off,storage=bf16,sleep=on[,async=off,capture=,arch=,dtype=]``."""
        fields = dict(part.split("=", 1) for part in text.split(",") if part)
        flag = {"on": True, "off": False}
        known = {"pc", "graphs", "storage", "sleep", "async", "capture", "arch", "dtype", "spec"}
        known |= {"long", "arena"}
        if fields.get("spec", "") not in SPEC_METHODS:
            raise SystemExit(f"bad --config {text!r}: spec is one of {SPEC_METHODS}")
        if set(fields) - known or fields.get("storage", "bf16") not in ROW_TOL:
            raise SystemExit(f"bad --config {text!r}: keys pc, graphs, storage(bf16|fp8), sleep")
        return cls(
            prefix_caching=flag[fields.get("pc", "on")],
            graphs=flag[fields.get("graphs", "off")],
            storage=fields.get("storage", "bf16"),
            sleep=flag[fields.get("sleep", "off")],
            async_scheduling=flag[fields["async"]] if "async" in fields else None,
            capture=fields.get("capture", "extract"),
            arch=fields.get("arch", "llama"),
            dtype=fields.get("dtype", "bfloat16"),
            spec=fields.get("spec", ""),
            long=_count(fields.get("long", "0"), text),
            arena=fields.get("arena", ""),
        )

    @property
    def row_tolerance(self) -> float:
        """Relative error per row beyond which a row is wrong (``ROW_TOL``)."""
        return ROW_TOL["fp32"] if self.dtype == "float32" else ROW_TOL[self.storage]


def _count(value: str, text: str) -> int:
    """A config's integer field, or exit naming the config."""
    if not value.isdigit():
        raise SystemExit(f"bad --config {text!r}: long is a token count (e.g. long=32768)")
    return int(value)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python benchmarks/gpu/verify.py --jsonl /tmp/out/results.jsonl",
    )
    parser.add_argument("mode", nargs="?", default="sweep", choices=["sweep", "one"])
    parser.add_argument("--configs", default=";".join(SWEEP), help="';'-separated configs")
    parser.add_argument("--config", default=SWEEP[0], help="the configuration (mode one)")
    parser.add_argument("--requests", type=int, default=128, help="requests per configuration")
    parser.add_argument("--rounds", type=int, default=2, help="batches per configuration")
    parser.add_argument("--parallel", type=int, default=5, help="engines at once (sweep)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per configuration")
    parser.add_argument("--work", default="/tmp/hs-verify", help="where the tiny model is built")
    parser.add_argument("--jsonl", default="", help="append the RESULT lines here")
    parser.add_argument(
        "--gpu-memory", type=float, default=0.15, help="GPU memory share per engine"
    )
    parser.add_argument("--label", default="", help="recorded in each row (e.g. the code's state)")
    parser.add_argument(
        "--connector-module",
        default="hidden_state_connector.connector",
        help="module holding HiddenStateConnector (a subclass of it, for diagnostics)",
    )
    return parser.parse_args()


def make_engine(model_dir: Path, out: str, cfg: Config, module: str, gpu_memory: float) -> Any:
    """The tiny bf16 model with the configuration's switches and small prefill chunks."""
    import torch
    from vllm import LLM

    from hidden_state_connector.apps.server import kv_transfer_config, speculative_config

    settings: dict[str, Any] = {
        "chunk_bytes": 65536,  # small chunks and buffers: copies outlive generate()
        "host_buffer_bytes": 1 << 20,
        "checksum": True,
        "stats_interval": 0,
    }
    if cfg.storage == "fp8":
        settings["storage_dtype"] = "fp8_e4m3"
    extra: dict[str, Any] = {}
    if torch.cuda.is_available():
        # A fixed KV cache: engines started side by side on one GPU would otherwise see
        # each other's memory as used and find none left for their caches.
        mla = cfg.arch.startswith("deepseek")
        extra.update(
            attention_backend="TRITON_MLA" if mla else "TRITON_ATTN",
            gpu_memory_utilization=gpu_memory,
            kv_cache_memory_bytes=2 << 30,
        )
    else:  # a smoke run of this script on vLLM's CPU build
        extra.update(kv_cache_memory_bytes=1 << 30)
    if cfg.async_scheduling is not None:
        extra["async_scheduling"] = cfg.async_scheduling
    if cfg.capture == "forward":
        settings.update(capture="forward", layer_ids=LAYERS)
        if cfg.arena:
            settings["capture_buffer_bytes"] = cfg.arena
        if cfg.spec:
            extra["speculative_config"] = drafter_config(cfg.spec, model_dir)
    else:
        extra["speculative_config"] = speculative_config(LAYERS)
    return LLM(
        model=str(model_dir),
        dtype=cfg.dtype,
        max_model_len=max(4096, cfg.long + 128),
        enforce_eager=not cfg.graphs,
        skip_tokenizer_init=True,
        enable_prefix_caching=cfg.prefix_caching,
        max_num_batched_tokens=512,
        enable_sleep_mode=cfg.sleep,
        seed=0,
        kv_transfer_config={
            **kv_transfer_config(out, settings),
            "kv_connector_module_path": module,
        },
        **extra,
    )


def drafter_config(method: str, model_dir: Path) -> dict[str, Any]:
    """vLLM's ``speculative_config`` of ``spec=ngram`` or ``spec=eagle3`` (a tiny echo drafter)."""
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    from hidden_state_connector.apps.tiny_drafter import build_tiny_eagle3

    drafter = build_tiny_eagle3(model_dir.parent / f"{model_dir.name}-eagle3", model_dir, echo=True)
    return {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 2}


def make_requests(
    round_no: int, count: int, earlier: list[list[int]], repeat: bool = False, long: int = 0
) -> tuple[list, list]:
    """Prompts (a quarter extend an earlier prompt's prefix) and their sampling params.

    Odd indices store their generated tokens; every third request samples (temperature 1).
    With ``repeat`` (speculation), a quarter of the prompts repeat a short motif instead.
    With ``long``, prompts are ``long`` minus 0-63 tokens (back-pressure on the arena).
    """
    import torch
    from vllm import SamplingParams

    gen = torch.Generator().manual_seed(1000 + round_no)
    prompts, params = [], []
    for i in range(count):
        n = int(torch.randint(17, 1500, (1,), generator=gen))
        if long:
            n = long - int(torch.randint(0, 64, (1,), generator=gen))
        prompt = torch.randint(0, 250, (n,), generator=gen).tolist()
        if repeat and i % 4 == 1:  # a motif repeated: ngram drafts match
            motif = prompt[: int(torch.randint(2, 9, (1,), generator=gen))]
            prompt = (motif * (n // len(motif) + 1))[:n]
        if earlier and i % 4 == 3:  # reuse 64-400 tokens of an earlier prompt: a cache hit
            base = earlier[int(torch.randint(0, len(earlier), (1,), generator=gen))]
            keep = min(len(base), int(torch.randint(64, 400, (1,), generator=gen)))
            prompt = base[:keep] + prompt[: max(1, n - keep)]
        elif prompts and i % 8 == 5:  # the previous prompt again (GRPO's samples of one)
            prompt = list(prompts[-1])
        prompts.append(prompt)
        transfer: dict[str, Any] = {"metadata": {"round": str(round_no), "index": str(i)}}
        if i % 2 == 1:
            transfer["include_output_tokens"] = True
        sampled = i % 3 == 2
        params.append(
            SamplingParams(
                max_tokens=int(torch.randint(1, 65, (1,), generator=gen)),
                temperature=1.0 if sampled else 0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": transfer},
            )
        )
        earlier.append(prompt)
    return prompts, params


def run_config(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Start the engine, run the rounds, account for every answered request."""
    import torch

    from hidden_state_connector.apps.tiny_model import build_tiny_model
    from hidden_state_connector.engine import compat

    model_dir = build_tiny_model(
        Path(args.work) / f"tiny-{cfg.arch}-{cfg.dtype}", arch=cfg.arch, dtype=cfg.dtype
    )
    if cfg.long:
        model_dir = with_positions(model_dir, cfg.long + 128)
    out = tempfile.mkdtemp(prefix="hs-verify-", dir="/tmp")
    started = time.monotonic()
    llm = make_engine(model_dir, out, cfg, args.connector_module, args.gpu_memory)
    start_s = time.monotonic() - started
    outs: list[Any] = []
    earlier: list[list[int]] = []
    per_round = max(1, args.requests // args.rounds)
    notes: list[str] = []
    for round_no in range(args.rounds):
        prompts, params = make_requests(
            round_no, per_round, earlier, repeat=bool(cfg.spec), long=cfg.long
        )
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs += batch
        if cfg.sleep:
            try:
                llm.sleep(level=1)  # right after generate(): copies may be in flight
                llm.wake_up()
            except RuntimeError as exc:
                notes.append(f"round {round_no}: sleep/wake raised {exc}")
    gen_s = time.monotonic() - started - start_s
    waits = admission_waits(llm)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    account = account_for(outs, out, model_dir, cfg.row_tolerance, bool(cfg.spec))
    account["cached_tokens"] = sum(int(o.num_cached_tokens or 0) for o in outs)
    account["requests_with_cache_hits"] = sum(1 for o in outs if o.num_cached_tokens)
    account["admission_waits"] = waits if in_process() else None
    # Odd indices of each round asked for their generated tokens (make_requests).
    account["with_generated_tokens"] = sum(
        1
        for i, o in enumerate(outs)
        if (i % per_round) % 2 == 1 and len(o.outputs[0].token_ids) > 1
    )
    return {
        "date": time.strftime("%Y-%m-%d"),
        "kind": "gpu_verify",
        "label": args.label,
        "vllm": compat.vllm_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "prefix_caching": cfg.prefix_caching,
        "graphs": cfg.graphs,
        "storage_dtype": "fp8_e4m3" if cfg.storage == "fp8" else "bfloat16",
        "sleep": cfg.sleep,
        "async_scheduling": cfg.async_scheduling,
        "capture": cfg.capture,
        "arch": cfg.arch,
        "dtype": cfg.dtype,
        "spec": cfg.spec or None,
        "max_num_batched_tokens": 512,
        "long": cfg.long,
        "engine": "in-process" if in_process() else "multiprocess",
        "capture_buffer_bytes": cfg.arena or None,
        "row_tolerance": cfg.row_tolerance,
        **account,
        "notes": notes,
        "engine_start_s": round(start_s, 1),
        "generate_s": round(gen_s, 1),
    }


def with_positions(model_dir: Path, positions: int) -> Path:
    """A copy of the tiny model that takes ``positions`` tokens (RoPE: only the limit moves)."""
    import shutil

    longer = model_dir.parent / f"{model_dir.name}-{positions}"
    if not longer.exists():  # built aside, then renamed: engines started at once see it whole
        building = Path(tempfile.mkdtemp(prefix=f".{longer.name}-", dir=model_dir.parent))
        shutil.copytree(model_dir, building, dirs_exist_ok=True)
        config = json.loads((building / "config.json").read_text())
        config["max_position_embeddings"] = positions
        (building / "config.json").write_text(json.dumps(config, indent=2))
        try:
            os.rename(building, longer)
        except OSError:  # another engine's copy got there first
            shutil.rmtree(building, ignore_errors=True)
    return longer


def in_process() -> bool:
    """Whether vLLM runs its engine core in this process (its scheduler can be read)."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def admission_waits(llm: Any) -> int:
    """Times forward-capture requests waited for arena room so far (in-process engines)."""
    if not in_process():
        return 0
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    rows = getattr(connector._scheduler, "rows", None)
    admission = getattr(rows, "admission", None)
    return int(getattr(admission, "waits", 0))


def account_for(
    outs: list[Any], out: str, model_dir: Path, row_tol: float, speculating: bool = False
) -> dict[str, Any]:
    """Published, client errors, missing (visible or silent), wrong rows vs HF."""
    from hidden_state_reader import HiddenStateReader
    from hidden_state_reader.files.locks import read_status

    params = [o.kv_transfer_params or {} for o in outs]
    errors = [p.get("hidden_states_error") for p in params]
    paths = [p.get("hidden_states_path", "") for p in params]
    names = [os.path.basename(p) for p in paths if p]
    read = HiddenStateReader(
        out, names=names, on_error="skip", verify_checksum=True, lock_timeout=120
    )
    by_name = {os.path.basename(s.path): s for s in read}
    published, missing_visible, silent, client_errors = [], [], [], 0
    for o, path, error in zip(outs, paths, errors, strict=True):
        name = os.path.basename(path)
        if error:
            client_errors += 1
        elif name in by_name:
            published.append((o, by_name[name]))
        elif read_status(path + ".lock").failed:
            missing_visible.append(f"{name}: {read_status(path + '.lock').reason}")
        else:
            silent.append(name)
    wrong, worst, rows_checked, details = compare_rows(model_dir, published, row_tol)
    counts = acceptance(published, speculating)
    wrong += counts.pop("bad_counts")
    stored_generated = sum(1 for o, s in published if len(s.token_ids) > len(o.prompt_token_ids))
    return {
        "answered": len(outs),
        "published": len(published),
        "published_with_generated_tokens": stored_generated,
        "client_errors": client_errors,
        "client_error_examples": sorted({e for e in errors if e})[:5],
        "missing": len(missing_visible) + len(silent),
        "missing_visible": missing_visible[:10],
        "silent": len(silent),
        "silent_examples": silent[:10],
        "wrong": wrong,
        "rows_checked": rows_checked,
        "worst_row_rel_err": worst,
        "wrong_examples": details[:10],
        **counts,
    }


def acceptance(published: list[tuple[Any, Any]], speculating: bool) -> dict[str, Any]:
    """Summed drafted/accepted counts; ``bad_counts``: samples whose counts are wrong.

    With speculation every sample that stores generated tokens carries them (one that
    asked for them but generated one token may carry zeros); without, none does.
    """
    from hidden_state_reader.format import sample_acceptance

    drafted = accepted = with_counts = bad = 0
    for o, s in published:
        counts = sample_acceptance(s.metadata)
        stores_output = len(s.token_ids) > len(o.prompt_token_ids)
        if counts is None:
            bad += int(speculating and stores_output)
            continue
        with_counts += 1
        if not speculating or counts.accepted > counts.drafted:
            bad += 1
        drafted, accepted = drafted + counts.drafted, accepted + counts.accepted
    return {
        "samples_with_spec_counts": with_counts,
        "spec_drafted": drafted,
        "spec_accepted": accepted,
        "bad_counts": bad,
    }


def compare_rows(
    model_dir: Path, published: list[tuple[Any, Any]], row_tol: float
) -> tuple[int, float, int, list[str]]:
    """Each published sample's tokens and every row of every layer against HF float32."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    last: dict[str, torch.Tensor] = {}
    hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("x", o[0] if isinstance(o, tuple) else o)
    )
    wrong, worst, rows, details = 0, 0.0, 0, []
    for o, s in published:
        generated = list(o.outputs[0].token_ids)
        stores_output = len(s.token_ids) > len(o.prompt_token_ids)
        expect = list(o.prompt_token_ids) + (generated[:-1] if stores_output else [])
        got_ids = s.token_ids.tolist()
        if got_ids != expect:
            wrong += 1
            details.append(
                f"{os.path.basename(s.path)}: {len(got_ids)} token ids, want {len(expect)}"
            )
            continue
        with torch.no_grad():
            ref = hf(s.token_ids[None].to(device), output_hidden_states=True)
        bad: list[str] = []
        for pos, lid in enumerate(s.layer_ids or []):
            exp = last["x"][0] if lid == len(hf.model.layers) else ref.hidden_states[lid][0]
            got = s.hidden_states[:, pos].float().to(device)
            err = (got - exp).norm(dim=-1) / exp.norm(dim=-1).clamp_min(1e-6)
            rows += int(err.numel())
            worst = max(worst, float(err.max()))
            for t in torch.nonzero(err > row_tol).flatten().tolist()[:3]:
                zero = bool((got[t] == 0).all())
                bad.append(
                    f"token {t} (prompt {len(o.prompt_token_ids)}) layer {lid}: "
                    f"{float(err[t]):.3f}{' zero' if zero else ''}"
                )
        if bad:
            wrong += 1
            details.append(f"{os.path.basename(s.path)}: " + "; ".join(bad[:4]))
    return wrong, worst, rows, details


def sweep(args: argparse.Namespace) -> int:
    """Each configuration in a child process, ``--parallel`` at a time; RESULT lines out."""
    configs = [c for c in args.configs.split(";") if c]
    failed = False
    running: list[tuple[str, subprocess.Popen[str], float]] = []
    pending = list(configs)
    while pending or running:
        while pending and len(running) < args.parallel:
            cfg = pending.pop(0)
            cmd = [
                sys.executable,
                __file__,
                "one",
                "--config",
                cfg,
                "--requests",
                str(args.requests),
                "--rounds",
                str(args.rounds),
                "--work",
                args.work,
                "--connector-module",
                args.connector_module,
                "--label",
                args.label,
                "--gpu-memory",
                str(args.gpu_memory),
            ]
            child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            running.append((cfg, child, time.monotonic()))
        cfg, child, t0 = running.pop(0)
        try:
            stdout, _ = child.communicate(timeout=max(1.0, args.timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, _ = child.communicate()
            print(f"config {cfg}: timed out after {args.timeout:.0f} s", flush=True)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if child.returncode != 0 or not lines:
            failed = True
        for line in lines:
            print(line, flush=True)
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(line[7:] + "\n")
        if not lines:
            print(f"config {cfg}: no result (exit {child.returncode})", flush=True)
    return 1 if failed else 0


def main() -> int:
    args = parse_args()
    if args.mode == "sweep":
        return sweep(args)
    # The engine core starts after this process used torch on the CPU (the tiny model):
    # spawn it rather than fork (a forked engine core once hung in an OpenMP barrier).
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    cfg = Config.parse(args.config)
    if cfg.dtype == "float32":  # Triton's float32 dots in IEEE precision, not TF32 (the
        # fused MoE's TF32 rounding picks other experts than HF at router near-ties)
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    if cfg.arena:  # in-process: the scheduler's admission counts its waits
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run_config(cfg, args)
    print("RESULT " + json.dumps(result), flush=True)
    bad = (
        result["wrong"]
        or result["silent"]
        or result["published"] + result["client_errors"] + (result["missing"]) != result["answered"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
