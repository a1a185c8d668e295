"""What a demo run did: ``DemoSummary``, its table, ``summary.json`` and the loss curve."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from hidden_state_reader.files.atomic import write_atomic

log = logging.getLogger(__name__)

MB = 1e6


@dataclass
class DemoSummary:
    """The outcome of ``run_demo``.

    Attributes:
        ok: True when every prompt became exactly one trained-on sample and nothing was
            left behind.
        failures: Why ``ok`` is False (empty when it is True).
        interrupted: Stopped by Ctrl-C / SIGTERM.
        model: The served model directory.
        tiny_model: Whether it is the built-in tiny random Llama.
        layers: Captured layer ids.
        vocab_size: Vocabulary of the draft head.
        device: Where the draft head trained.
        out_dir: The output folder.
        hs_dir: Where the server wrote the hidden-state files.
        server_log: The server's log file.
        summary_json: This summary as JSON.
        loss_png: The loss-curve plot (None if it could not be drawn).
        prompts: Prompts sent.
        produced: Samples the server reported written.
        failed_requests: Requests that produced no sample.
        consumed: Samples the training loop received.
        unique_consumed: Distinct files among them.
        tokens_produced: Prompt tokens of the produced samples.
        tokens_consumed: Tokens of the consumed samples.
        bytes_written: Tensor bytes the server wrote (tokens x bytes per token).
        bytes_read: Tensor bytes the reader loaded.
        files_left: Files left in ``hs_dir`` at the end.
        reader_skipped: Samples the reader rejected (corrupt, incomplete, failed).
        server_start_s: Seconds until the server was healthy.
        produce_s: Seconds from the first request to the last response.
        stream_s: Seconds from the first request to the last sample consumed.
        wall_s: Seconds the whole run took.
        produce_tokens_per_s: Prompt tokens the server processed per second of
            ``produce_s``.
        samples_per_s: Consumed samples per second of ``stream_s`` (end to end).
        tokens_per_s: Consumed tokens per second of ``stream_s`` (end to end).
        write_mb_per_s: Written MB per second of ``produce_s``.
        read_mb_per_s: Read MB per second of ``stream_s``.
        optimizer_steps: Optimizer steps taken.
        initial_loss: Loss on the first batch, before any update.
        final_loss: Loss of the last three batches (weighted by their tokens), each
            computed before training on it.
        server_exit_code: The server's exit status after shutdown.
        batch_losses: ``[optimizer step, samples consumed, loss]`` of each batch, computed
            before training on it (step counts from 1).
        step_losses: Loss of every optimizer step.
        errors: First error messages seen (requests, trainer, server).
    """

    ok: bool = False
    failures: list[str] = field(default_factory=list)
    interrupted: bool = False
    model: str = ""
    tiny_model: bool = False
    layers: list[int] = field(default_factory=list)
    vocab_size: int = 0
    device: str = ""
    out_dir: str = ""
    hs_dir: str = ""
    server_log: str = ""
    summary_json: str = ""
    loss_png: str | None = None
    prompts: int = 0
    produced: int = 0
    failed_requests: int = 0
    consumed: int = 0
    unique_consumed: int = 0
    tokens_produced: int = 0
    tokens_consumed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    files_left: int = 0
    reader_skipped: int = 0
    server_start_s: float = 0.0
    produce_s: float = 0.0
    stream_s: float = 0.0
    wall_s: float = 0.0
    produce_tokens_per_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float = 0.0
    write_mb_per_s: float = 0.0
    read_mb_per_s: float = 0.0
    optimizer_steps: int = 0
    initial_loss: float | None = None
    final_loss: float | None = None
    server_exit_code: int | None = None
    batch_losses: list[tuple[int, int, float]] = field(default_factory=list)
    step_losses: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return asdict(self)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def format_table(s: DemoSummary) -> str:
    """The end-of-run summary as an aligned two-column table."""
    rows: list[tuple[str, str]] = [
        ("model", s.model + (" (tiny random Llama)" if s.tiny_model else "")),
        ("layers captured", ",".join(map(str, s.layers))),
        ("prompts sent", str(s.prompts)),
        (
            "samples produced",
            f"{s.produced}" + (f" ({s.failed_requests} failed)" if s.failed_requests else ""),
        ),
        ("samples consumed", str(s.consumed)),
        ("tokens", f"{s.tokens_produced} produced, {s.tokens_consumed} consumed"),
        ("MB written / read", f"{s.bytes_written / MB:.2f} / {s.bytes_read / MB:.2f}"),
        ("server start", f"{s.server_start_s:.1f} s"),
        (
            "producing (server)",
            f"{s.produce_s:.1f} s: {s.produce_tokens_per_s:.0f} tokens/s, "
            f"{s.write_mb_per_s:.2f} MB/s written",
        ),
        (
            "end to end (trained)",
            f"{s.stream_s:.1f} s: {s.samples_per_s:.1f} samples/s, {s.tokens_per_s:.0f} tokens/s, "
            f"{s.read_mb_per_s:.2f} MB/s read",
        ),
        ("optimizer steps", f"{s.optimizer_steps} on {s.device}"),
        ("initial loss", _loss(s.initial_loss)),
        ("final loss", _loss(s.final_loss)),
        ("files left on disk", str(s.files_left)),
        ("server exit code", "-" if s.server_exit_code is None else str(s.server_exit_code)),
        ("wall time", f"{s.wall_s:.1f} s"),
        ("loss curve", s.loss_png or "-"),
        ("summary", s.summary_json or "-"),
        ("result", "OK" if s.ok else "FAILED: " + "; ".join(s.failures)),
    ]
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 2 + max(len(v) for _, v in rows))
    lines = ["hidden-state demo summary", rule]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def write_json(s: DemoSummary, path: str) -> None:
    """Write the summary (atomically) to ``path``."""
    write_atomic(path, (json.dumps(s.to_dict(), indent=2) + "\n").encode())


def plot_loss(s: DemoSummary, path: str) -> bool:
    """Draw the loss curve to a PNG (matplotlib, Agg backend).

    Plots the loss of every optimizer step and, bold, the loss of each new batch before
    the head trained on it, against samples consumed.

    Returns:
        True if the file was written; False (with a warning) without matplotlib or data.
    """
    if not s.step_losses:
        log.info("no loss curve: no optimizer step was taken")
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("no loss curve: matplotlib is not installed (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        ax.plot(
            range(1, len(s.step_losses) + 1),
            s.step_losses,
            color="tab:blue",
            alpha=0.35,
            lw=1,
            label="every optimizer step",
        )
        ax.plot(
            [step for step, _, _ in s.batch_losses],
            [v for _, _, v in s.batch_losses],
            color="tab:blue",
            lw=2,
            marker=".",
            label="each new batch, before training on it",
        )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("next-token cross-entropy")
        name = os.path.basename(os.path.normpath(s.model)) or s.model
        ax.set_title(
            f"Draft head trained live on vLLM hidden states ({name}, {s.consumed} samples)"
        )
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return True
