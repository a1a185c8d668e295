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
from hidden_state_reader.format.fp8 import STORAGE_DTYPES

EXAMPLES = """\
hidden-state serve meta-llama/Llama-3.1-8B-Instruct --out /data/hs   # a Hugging Face hub id
hidden-state serve ./my-model --out /data/hs --layers 2,16,29 --include-last \\
    --vllm-args --max-model-len 8192
hidden-state serve ./my-model --out /data/hs --dry-run     # print the vllm command only
hidden-state serve ./my-model --out /data/hs --storage-dtype fp8_e4m3  # half the disk of bf16
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


def _layers_in_config(doc: dict[str, Any]) -> int | None:
    """``num_hidden_layers`` of a ``config.json``, or of its ``text_config`` (multimodal)."""
    text_config = doc.get("text_config") or {}
    value = doc.get("num_hidden_layers") or text_config.get("num_hidden_layers")
    return int(value) if value else None


def hub_config_path(model: str) -> str:
    """The local path of a Hugging Face hub model's ``config.json``.

    Looks in the Hugging Face cache first (``HF_HOME`` / ``HF_HUB_CACHE``, as vLLM
    does), then, unless ``HF_HUB_OFFLINE`` is set, downloads just that one small file.

    Args:
        model: A hub id such as ``meta-llama/Llama-3.1-8B-Instruct``.

    Returns:
        The path of the cached ``config.json``.

    Raises:
        CliError: ``model`` is not a valid hub id, or its config is neither cached nor
            downloadable (offline, no network, gated, unknown id).
    """
    hint = "pass --layers (e.g. --layers 2,16,29) or a local model directory"
    try:
        # Imported here: huggingface_hub comes with vLLM and costs start-up time.
        from huggingface_hub import (
            constants,
            get_hf_file_metadata,
            hf_hub_download,
            hf_hub_url,
            try_to_load_from_cache,
        )
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise CliError(
            f"{model}: not a local directory, and huggingface_hub is not installed to "
            f"look it up on the Hugging Face hub; {hint}"
        ) from None
    try:
        cached = try_to_load_from_cache(model, "config.json")
    except HFValidationError:
        raise CliError(f"{model}: no such model directory (nor a Hugging Face model id)") from None
    if isinstance(cached, str):
        return cached
    if constants.HF_HUB_OFFLINE:
        raise CliError(
            f"{model}: config.json is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and HF_HUB_OFFLINE is set; {hint}"
        )
    try:
        # One HEAD without retries first: hf_hub_download retries a dead network for
        # ~25 s with a warning per attempt; this fails at once with the real reason.
        get_hf_file_metadata(hf_hub_url(model, "config.json"), timeout=10)
        return str(hf_hub_download(model, "config.json"))
    except Exception as exc:  # network, auth (gated models), unknown id: all the same advice
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CliError(
            f"{model}: cannot get config.json from the Hugging Face hub ({reason}); {hint}"
        ) from None


def num_hidden_layers(model: str) -> int | None:
    """``num_hidden_layers`` of a model directory or Hugging Face hub id (None if unknown).

    A local directory's ``config.json`` is read directly; anything else is taken as a
    hub id and resolved through the Hugging Face cache (see ``hub_config_path``).

    Raises:
        CliError: A hub id whose config cannot be found, or an unreadable config.
    """
    if os.path.isdir(model):
        config = Path(model) / "config.json"
        if not config.is_file():
            return None
    else:
        config = Path(hub_config_path(model))
    try:
        doc: dict[str, Any] = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"{model}: cannot read {config}: {exc}; pass --layers") from None
    return _layers_in_config(doc) if isinstance(doc, dict) else None


def resolve_layers(model: str, layers: list[int] | None, include_last: bool) -> list[int]:
    """The layers to capture: explicit, or EAGLE-3's low/middle/high default.

    Args:
        model: A model directory or Hugging Face hub id.
        layers: Explicit layer ids (``--layers``), or None for EAGLE-3's default.
        include_last: Also capture the last layer (``num_hidden_layers``, pre-norm).

    Returns:
        The sorted layer ids.

    Raises:
        CliError: The default cannot be computed (no config found and no --layers), or
            a layer id is out of range.
    """
    # Explicit layers need no config for a hub id (nothing to look up, nothing to download).
    need_config = layers is None or include_last or os.path.isdir(model)
    n = num_hidden_layers(model) if need_config else None
    if layers is None:
        if n is None:
            raise CliError(f"{model}: no num_hidden_layers in config.json; pass --layers")
        layers = default_layer_ids(n)
    if include_last:
        if n is None:
            raise CliError(f"{model}: --include-last needs num_hidden_layers in config.json")
        layers = sorted(set(layers) | {n})
    if n is not None and any(x > n for x in layers):
        raise CliError(f"--layers: layer ids must be <= {n} (num_hidden_layers), got {layers}")
    return layers


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


def run(args: argparse.Namespace) -> int:
    """Print the equivalent vLLM command, then replace this process with the server.

    With ``--dry-run`` only the command is printed (on stdout) and nothing is created.
    """
    layers = resolve_layers(args.model, args.layers, args.include_last)
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
