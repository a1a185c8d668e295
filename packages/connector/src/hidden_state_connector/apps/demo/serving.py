"""What the demo serves: the model, its layers, and the server's options.

The model is a local directory or the tiny random Llama built once; its ``config.json``
gives the vocabulary and an estimate of the bytes per token; the ``vllm serve`` options
suit a CPU-only machine or leave GPU memory to the trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hidden_state_connector.apps.demo.options import (
    CPU_VLLM_ARGS,
    SERVED_MODEL_NAME,
    TINY_LAYERS,
    TINY_MODEL_NAME,
    DemoError,
    DemoOptions,
)
from hidden_state_connector.apps.server import ServeOptions, cpu_kv_cache_args, free_port
from hidden_state_connector.model_config import ModelConfigError, read_model_config


def model_config(model: str) -> dict[str, Any]:
    """A local model's ``config.json``, with a nested ``text_config`` merged in.

    Raises:
        DemoError: There is no readable ``config.json``.
    """
    try:
        doc = read_model_config(model, hub="off")
    except ModelConfigError as exc:
        raise DemoError(f"{exc} (the demo serves a Hugging Face model directory)") from None
    text = doc.get("text_config")
    return {**doc, **text} if isinstance(text, dict) else doc


def estimate_bytes_per_token(config: dict[str, Any], num_layers: int) -> int:
    """Bytes the server writes per token (hidden states and token id), from the config."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    itemsize = 4 if "32" in name else 2
    hidden = int(config.get("hidden_size") or 0)
    return num_layers * hidden * itemsize + 8


def prepare_model(options: DemoOptions, say: Callable[[str], None]) -> tuple[str, bool]:
    """The model directory to serve and whether it is the tiny one (built if needed)."""
    if options.model is not None:
        return os.path.abspath(options.model), False
    from hidden_state_connector.apps.tiny_model import build_tiny_model

    directory = Path(os.path.expanduser(options.cache_dir)) / TINY_MODEL_NAME
    say(f"tiny bf16 Llama: {directory}")
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one tiny shard: no progress bar
    try:
        return os.fspath(build_tiny_model(directory, dtype="bfloat16")), True
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def capture_layers(options: DemoOptions, model: str, tiny: bool) -> list[int]:
    """The layers to capture (``TINY_LAYERS`` for the tiny model, else EAGLE-3's default).

    Raises:
        DemoError: A layer id is out of range.
    """
    from hidden_state_connector.layers import resolve_layers
    from hidden_state_reader.apps.cli.toolkit import CliError

    layers = options.layers if options.layers is not None else (TINY_LAYERS if tiny else None)
    try:
        return resolve_layers(model, layers, False)
    except CliError as exc:
        raise DemoError(str(exc)) from None


def serve_options(options: DemoOptions, model: str, layers: list[int], hs_dir: str) -> ServeOptions:
    """The server's options: CPU-friendly vLLM settings, or GPU room left for training."""
    args = [
        "--max-model-len", str(options.max_model_len),
        "--served-model-name", SERVED_MODEL_NAME,
    ]  # fmt: skip
    if torch.cuda.is_available():
        if not any(a.startswith("--gpu-memory-utilization") for a in options.vllm_args):
            args += ["--gpu-memory-utilization", "0.8"]  # leave room for the trainer
    else:
        args += CPU_VLLM_ARGS + cpu_kv_cache_args(
            options.vllm_args, {**os.environ, **options.server_env}
        )
    return ServeOptions(
        capture=options.capture,
        model=model,
        out_dir=hs_dir,
        layer_ids=layers,
        port=options.port if options.port is not None else free_port(),
        connector={"stats_interval": 10},
        vllm_args=args + list(options.vllm_args),
    )


def server_env(options: DemoOptions) -> dict[str, str]:
    """The server's extra environment: offline, quiet, plus ``options.server_env``."""
    return {
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **options.server_env,
    }
