"""``hidden-state tiny-model``: build the tiny random Llama to try things without a hub.

Also runnable as ``python -m hidden_state_connector.apps.cli.tiny_model``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hidden_state_connector.apps.tiny_archs import ARCHITECTURES
from hidden_state_reader.apps.cli.toolkit import CliError, HelpFormatter, add_command, positive_int

DESCRIPTION = """\
Build a tiny model with random weights and a byte-level tokenizer (with a chat
template) into OUT_DIR, locally, in a few seconds: no download, no hub account. A Llama
by default; --arch picks another architecture, with the same tokenizer. vLLM (CPU or
CUDA) and Hugging Face load it like any local model folder, so `hidden-state serve`,
`extract` and `demo --model` run on it at once. Its hidden states
are meaningless: it is for trying the pipeline, not for training a drafter.

OUT_DIR must be new, empty, or a tiny model built before (rebuilt only if the options
differ). Needs transformers and tokenizers (pip install "hidden-state-connector[demo]").
"""

EXAMPLES = """\
hidden-state tiny-model ./tiny-llama                          # 4 layers, hidden 128, bf16
hidden-state tiny-model ./tiny-llama-fp32 --dtype float32 --layers 6
hidden-state tiny-model ./tiny-qwen3 --arch qwen3                 # or qwen3_moe, gpt_oss
hidden-state serve ./tiny-llama --out /tmp/hs --layers 1,2,4  # then serve it ...
hidden-state extract ./tiny-llama --input prompts.jsonl --out /tmp/hs   # ... or extract
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options."""
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write the model into")
    parser.add_argument(
        "--layers", type=positive_int, default=4, metavar="N", help="decoder layers"
    )
    parser.add_argument("--hidden", type=positive_int, default=128, metavar="N", help="width")
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=2,
        metavar="N",
        help="attention heads (the head size, hidden / heads, must be one vLLM's CPU attention "
        "takes: 32, 64, 80, ...)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument(
        "--arch",
        choices=tuple(ARCHITECTURES),
        default="llama",
        help="architecture (every one gets the same byte-level tokenizer); forward capture, "
        "serve's default, captures each of them (the extract engine, --capture extract, "
        "refuses gemma3 and deepseek_v2 with MLA)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")


def register(subparsers: Any) -> None:
    """Add the ``tiny-model`` subcommand."""
    parser = add_command(
        subparsers,
        "tiny-model",
        summary="build a tiny random Llama (no download) to try serve/extract/demo on",
        description=DESCRIPTION,
        examples=EXAMPLES,
        handler=run,
    )
    add_arguments(parser)


def _check(args: argparse.Namespace) -> Path:
    """The output folder, once the options and the folder are known to be usable."""
    from hidden_state_connector.apps.tiny_model import CPU_HEAD_SIZES, RECIPE_FILE

    if args.hidden % args.heads or args.hidden // args.heads not in CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, CPU_HEAD_SIZES))
        raise CliError(
            f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden / args.heads:g}: "
            f"the head size must be one of {sizes} (what vLLM's CPU attention takes); "
            f"e.g. --hidden 128 --heads 2"
        )
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise CliError(f"{out} exists and is not a folder: choose a new folder for the model")
    if out.is_dir() and any(out.iterdir()) and not (out / RECIPE_FILE).exists():
        raise CliError(
            f"{out} is not empty and holds no tiny model ({RECIPE_FILE} missing): choose a "
            "new or empty folder (nothing was written)"
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Build (or reuse) the model; print where it is and what to run next.

    Returns:
        0 once the folder holds the model; 2 for unusable options or a folder in use.
    """
    out = _check(args)
    title = "Llama" if args.arch == "llama" else args.arch
    try:
        from hidden_state_connector.apps.tiny_model import RECIPE_FILE, build_tiny_model

        before = (out / RECIPE_FILE).read_text() if (out / RECIPE_FILE).exists() else None
        started = time.monotonic()
        if before is None:
            print(f"building a tiny random {title} in {out} ...", file=sys.stderr, flush=True)
        path = build_tiny_model(
            out,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            dtype=args.dtype,
            seed=args.seed,
            arch=args.arch,
        )
    except ImportError as exc:
        raise CliError(
            f"building the model needs transformers and tokenizers ({exc}): "
            'pip install "hidden-state-connector[demo]"'
        ) from None
    reused = before is not None and (path / RECIPE_FILE).read_text() == before
    what = "already there" if reused else f"built in {time.monotonic() - started:.1f} s"
    layers = ",".join(str(n) for n in sorted({1, max(1, args.layers // 2), args.layers}))
    print(
        f"{os.fspath(path)}: tiny random {title}, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, {args.dtype} ({what})\n"
        + next_step(f"hidden-state serve {os.fspath(path)} --out /tmp/hs --layers {layers}")
    )
    return 0


def next_step(serve: str) -> str:
    """What to run next: ``serve`` (its forward capture takes every architecture built here)."""
    return f"next: {serve}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hidden_state_connector.apps.cli.tiny_model OUT_DIR [options]``."""
    parser = argparse.ArgumentParser(
        prog="hidden-state tiny-model",
        description=DESCRIPTION,
        epilog="examples:\n" + "\n".join("  " + line for line in EXAMPLES.strip().splitlines()),
        formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except CliError as exc:
        print(f"hidden-state tiny-model: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
