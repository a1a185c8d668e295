"""``hidden-state serve``: start ``vllm serve`` configured to write hidden states."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hidden_state_connector.layers import parse_layers, resolve_layers
from hidden_state_connector.server import ServeOptions, server_argv
from hidden_state_reader.cli.toolkit import CliError, add_command
from hidden_state_reader.format.fp8 import STORAGE_DTYPES

EXAMPLES = """\
hidden-state serve meta-llama/Llama-3.1-8B-Instruct --out /data/hs   # a Hugging Face hub id
hidden-state serve ./my-model --out /data/hs --layers 2,16,29 --include-last \\
    --vllm-args --max-model-len 8192
hidden-state serve ./my-model --out /data/hs --dry-run     # print the vllm command only
hidden-state serve ./my-model --out /data/hs --storage-dtype fp8_e4m3  # half the disk of bf16
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, output and layer options shared by serve and demo."""
    parser.add_argument(
        "model",
        help="model directory, or Hugging Face hub id such as meta-llama/Llama-3.1-8B-Instruct "
        "(its config.json is read from the HF cache, or downloaded unless HF_HUB_OFFLINE=1)",
    )
    parser.add_argument("--out", required=True, help="directory the hidden-state files go to")
    parser.add_argument("--layers", type=parse_layers, help="layer ids to capture, e.g. 2,16,29")
    parser.add_argument(
        "--include-last", action="store_true", help="also capture the last layer (pre-norm)"
    )


def add_storage_argument(parser: argparse.ArgumentParser) -> None:
    """``--storage-dtype`` and ``--no-checksum``: how files are stored (serve and extract)."""
    parser.add_argument(
        "--storage-dtype",
        choices=STORAGE_DTYPES,
        help="how hidden states are stored: model (the model's dtype, default) or fp8_e4m3 "
        "(float8 with per-token, per-layer scales: about half the bytes of bf16; readers "
        "dequantize); sets storage_dtype in the connector config",
    )
    parser.add_argument(
        "--no-checksum",
        dest="checksum",
        action="store_false",
        help="record no CRC32 in the files (default: each file carries one, computed as it "
        "is written, so `hidden-state verify --checksums` can detect a changed byte); sets "
        "checksum: false in the connector config",
    )


def with_storage(
    connector: dict[str, Any], storage_dtype: str | None, *, checksum: bool = True
) -> dict[str, Any]:
    """The connector config with ``--storage-dtype`` / ``--no-checksum`` applied.

    Both win over the JSON; without them the JSON (or the connector's default) stands.
    """
    out = dict(connector)
    if storage_dtype is not None:
        out["storage_dtype"] = storage_dtype
    if not checksum:
        out["checksum"] = False
    return out


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
    add_storage_argument(parser)
    parser.add_argument(
        "--connector-config",
        type=json.loads,
        default={},
        help="extra kv_connector_extra_config as JSON, e.g. '{\"fsync\": true}'",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the vllm command on stdout and exit; creates nothing (not even --out)",
    )
    parser.add_argument(
        "--vllm-args",
        nargs=argparse.REMAINDER,
        default=[],
        metavar="ARG",
        help="everything after this goes to vllm serve unchanged (put it last)",
    )


def refuse_uncapturable(model: str, command: str) -> None:
    """Stop before vLLM starts when it cannot capture this model's hidden states.

    Raises:
        CliError: The model uses MLA or lacks vLLM's aux-hidden-state interface (the
            message names the architecture and the families that work).
    """
    from hidden_state_connector.engine.architecture import (
        UnsupportedArchitectureError,
        check_model_before_start,
    )

    try:
        check_model_before_start(model, command)
    except UnsupportedArchitectureError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Print the equivalent vLLM command, then replace this process with the server.

    With ``--dry-run`` only the command is printed (on stdout) and nothing is created.
    """
    layers = resolve_layers(args.model, args.layers, args.include_last)
    refuse_uncapturable(args.model, "hidden-state serve")
    options = ServeOptions(
        model=args.model,
        out_dir=os.path.abspath(args.out),
        layer_ids=layers,
        port=args.port,
        connector=with_storage(args.connector_config, args.storage_dtype, checksum=args.checksum),
        vllm_args=list(args.vllm_args),
    )
    if args.dry_run:
        print(options.shell_command(), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    print("Equivalent vLLM command:\n  " + options.shell_command(), file=sys.stderr, flush=True)
    argv = server_argv(options)
    os.execvp(argv[0], argv)
    return 0  # not reached
