"""What ``run_demo`` is asked to do: ``DemoOptions``, their defaults and ``DemoError``.

The ``hidden-state demo`` command takes its defaults from here. Nothing here imports
torch or vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

DEFAULT_OUT = os.path.join("out", "demo")
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "hidden-state", "demo")
DEFAULT_NUM_PROMPTS = 300
TINY_MODEL_NAME = "tiny-llama-bf16"
TINY_LAYERS = [1, 2, 4]
"""Layers captured from the 4-layer tiny model: low, middle and the last (pre-norm)."""
SERVED_MODEL_NAME = "hidden-state-demo"
CPU_VLLM_ARGS = [
    "--max-num-batched-tokens", "256",
    "--enforce-eager",
]  # fmt: skip
"""What vLLM's CPU build needs to start quickly (its KV cache: ``cpu_kv_cache_args``)."""


class DemoError(Exception):
    """The demo cannot run with these options (bad model directory, prompts, layers)."""


@dataclass
class DemoOptions:
    """What ``run_demo`` does.

    Attributes:
        model: A local Hugging Face model directory; None builds (or reuses) the tiny
            random bf16 Llama under ``cache_dir`` (no downloads).
        layers: Layer ids to capture; default ``[1, 2, 4]`` for the tiny model, else
            EAGLE-3's low/middle/high choice from the model's ``config.json``.
        prompts: JSONL file with one ``{"text": ...}`` per line; None: the bundled set.
        num_prompts: How many prompts to send (the file is repeated if shorter); None
            sends each prompt of the file once.
        out: Output folder: ``hs/`` (the hidden-state files, emptied at the start),
            ``server.log``, ``summary.json``, ``loss.png``.
        keep_files: Keep the consumed files instead of deleting them.
        port: Server port; None picks a free one.
        concurrency: Requests in flight at most.
        batch_size: Samples per training batch.
        steps_per_batch: Optimizer steps on each batch.
        lr: Adam learning rate of the draft head.
        cache_dir: Where the tiny model is built once and reused.
        device: Torch device of the draft head; None: ``cuda`` if available, else ``cpu``.
        max_model_len: ``--max-model-len`` of the server.
        server_timeout: Seconds to wait for the server to become healthy.
        drain_timeout: After the last response, how long to wait for samples that have
            not arrived before declaring them lost.
        progress: Print progress on ``stream``.
        progress_interval: Seconds between progress lines (at least 1).
        seed: Seed of the draft head.
        vllm_args: Further ``vllm serve`` arguments, passed through.
        server_env: Extra environment variables for the server.
        capture: The capture engine, ``"forward"`` (default) or ``"extract"``.
    """

    model: str | None = None
    layers: list[int] | None = None
    prompts: str | None = None
    num_prompts: int | None = DEFAULT_NUM_PROMPTS
    out: str = DEFAULT_OUT
    keep_files: bool = False
    port: int | None = None
    concurrency: int = 8
    batch_size: int = 8
    steps_per_batch: int = 4
    lr: float = 1e-2
    cache_dir: str = DEFAULT_CACHE_DIR
    device: str | None = None
    max_model_len: int = 2048
    server_timeout: float = 600.0
    drain_timeout: float = 120.0
    progress: bool = True
    progress_interval: float = 1.0
    seed: int = 0
    vllm_args: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)
    capture: str = "forward"


def check_options(o: DemoOptions) -> None:
    """Refuse options the demo cannot run with (before anything is started).

    Raises:
        DemoError: Naming the option.
    """
    for name in ("concurrency", "batch_size", "steps_per_batch", "max_model_len"):
        if getattr(o, name) < 1:
            raise DemoError(f"{name} must be at least 1, got {getattr(o, name)}")
    if o.num_prompts is not None and o.num_prompts < 1:
        raise DemoError(f"num_prompts must be at least 1, got {o.num_prompts}")
    if o.lr <= 0:
        raise DemoError(f"lr must be positive, got {o.lr}")
    if o.model is not None and not os.path.isdir(o.model):
        raise DemoError(
            f"--model {o.model!r} is not a local directory (the demo downloads nothing; "
            "pass a Hugging Face model directory)"
        )
