"""``hidden-state serve``: start ``vllm serve`` configured to write hidden states."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hidden_state_connector.server import ServeOptions, default_layer_ids, server_argv
from hidden_state_reader.cli.common import CliError, add_command

EXAMPLES = """\
hidden-state serve meta-llama/Llama-3.1-8B-Instruct --out /data/hs
hidden-state serve ./my-model --out /data/hs --layers 2,16,29 --include-last \\
    --vllm-args --max-model-len 8192
hidden-state serve ./my-model --out /data/hs --dry-run     # print the vllm command only
"""


def parse_layers(text: str) -> list[int]:
    """``"2,16,29"`` -> ``[2, 16, 29]``."""
    try:
        layers = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers takes integers like 2,16,29, got {text!r}"
        ) from None
    if not layers or any(x < 0 for x in layers):
        raise argparse.ArgumentTypeError(f"--layers needs non-negative layer ids, got {text!r}")
    return layers


def num_hidden_layers(model: str) -> int | None:
    """Read ``num_hidden_layers`` from a local model's ``config.json`` (None if unknown)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    doc: dict[str, Any] = json.loads(config.read_text())
    text_config = doc.get("text_config") or {}
    value = doc.get("num_hidden_layers") or text_config.get("num_hidden_layers")
    return int(value) if value else None


def resolve_layers(model: str, layers: list[int] | None, include_last: bool) -> list[int]:
    """The layers to capture: explicit, or EAGLE-3's low/middle/high default.

    Raises:
        CliError: The default cannot be computed (remote model without --layers), or a
            layer id is out of range.
    """
    n = num_hidden_layers(model)
    if layers is None:
        if n is None:
            raise CliError(f"{model}: no num_hidden_layers in config.json; pass --layers")
        layers = default_layer_ids(n)
    if include_last:
        if n is None:
            raise CliError(f"{model}: --include-last needs a local model directory")
        layers = sorted(set(layers) | {n})
    if n is not None and any(x > n for x in layers):
        raise SystemExit(
            f"hidden-state: layer ids must be <= {n} (num_hidden_layers), got {layers}"
        )
    return layers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, output and layer options shared by serve and demo."""
    parser.add_argument("model", help="model directory or Hugging Face name")
    parser.add_argument("--out", required=True, help="directory the hidden-state files go to")
    parser.add_argument("--layers", type=parse_layers, help="layer ids to capture, e.g. 2,16,29")
    parser.add_argument(
        "--include-last", action="store_true", help="also capture the last layer (pre-norm)"
    )


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand."""
    parser = add_command(
        subparsers,
        "serve",
        summary="start vllm serve writing hidden states to a directory",
        description=(
            "Start an OpenAI-compatible vLLM server whose requests also write the hidden\n"
            "states of the chosen layers to DIR (one safetensors file per request).\n"
            "Prints the equivalent plain vLLM command. Arguments after --vllm-args go to vLLM."
        ),
        examples=EXAMPLES,
        handler=run,
    )
    add_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument(
        "--connector-config",
        type=json.loads,
        default={},
        help="extra kv_connector_extra_config as JSON, e.g. '{\"fsync\": true}'",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command and exit")
    parser.add_argument(
        "--vllm-args",
        nargs=argparse.REMAINDER,
        default=[],
        metavar="ARG",
        help="everything after this goes to vllm serve unchanged (put it last)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the equivalent vLLM command, then replace this process with the server."""
    layers = resolve_layers(args.model, args.layers, args.include_last)
    extra = list(args.vllm_args)
    os.makedirs(args.out, exist_ok=True)
    options = ServeOptions(
        model=args.model,
        out_dir=os.path.abspath(args.out),
        layer_ids=layers,
        port=args.port,
        connector=args.connector_config,
        vllm_args=extra,
    )
    print("Equivalent vLLM command:\n  " + options.shell_command(), file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    argv = server_argv(options)
    os.execvp(argv[0], argv)
    return 0  # not reached
