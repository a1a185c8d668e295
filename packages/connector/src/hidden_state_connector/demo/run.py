"""``run_demo``: a live ``vllm serve`` streaming hidden states into a training loop.

One call builds (or reuses) a model, starts ``vllm serve`` with the connector, sends
prompts through the OpenAI API from a producer thread, and trains an EAGLE-style draft
head on the hidden states in a consumer thread *while they are being written*: a
follow-mode, claiming ``HiddenStateReader`` (through ``HiddenStateDataset`` and a torch
``DataLoader``) picks each file up as soon as the server publishes it and deletes it
after use. At the end it checks that every prompt became exactly one trained-on sample
and that nothing was left on disk, stops the server cleanly, and writes
``summary.json`` and a loss-curve PNG.

Example::

    from hidden_state_connector.demo.run import DemoOptions, run_demo

    summary = run_demo(DemoOptions(num_prompts=100, out="out/demo"))
    assert summary.ok, summary.failures
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch

from hidden_state_connector.demo.producer import Producer
from hidden_state_connector.demo.progress import ProgressLine, Snapshot
from hidden_state_connector.demo.prompts import load_prompts
from hidden_state_connector.demo.report import DemoSummary, plot_loss, write_json
from hidden_state_connector.demo.trainer import Trainer, TrainerConfig
from hidden_state_connector.server import ServeOptions, VllmServer

DEFAULT_OUT = os.path.join("out", "demo")
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "hidden-state", "demo")
DEFAULT_NUM_PROMPTS = 300
TINY_MODEL_NAME = "tiny-llama-bf16"
TINY_LAYERS = [1, 2, 4]
"""Layers captured from the 4-layer tiny model: low, middle and the last (pre-norm)."""
SERVED_MODEL_NAME = "hidden-state-demo"
CPU_VLLM_ARGS = [
    "--max-num-batched-tokens", "256",
    "--kv-cache-memory-bytes", str(512 * 1024**2),
    "--enforce-eager",
]  # fmt: skip
"""What vLLM's CPU build needs to start quickly and fit in a small machine."""
EXIT_INTERRUPTED = 130


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_config(model: str) -> dict[str, Any]:
    """A local model's ``config.json``, with a nested ``text_config`` merged in.

    Raises:
        DemoError: There is no readable ``config.json``.
    """
    path = Path(model) / "config.json"
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DemoError(f"{model}: not a Hugging Face model directory ({exc})") from None
    text = doc.get("text_config")
    return {**doc, **text} if isinstance(text, dict) else doc


def _itemsize(config: dict[str, Any]) -> int:
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in name else 2


def count_files(root: str) -> int:
    """Regular files below ``root`` (0 if it does not exist)."""
    return sum(len(files) for _, _, files in os.walk(root))


class _Interrupts:
    """SIGINT/SIGTERM: the first stops cleanly, a second exits at once.

    While ``raising`` is set (model build, server start-up) the first signal raises
    ``KeyboardInterrupt`` so that blocking set-up code unwinds through its clean-up.
    """

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.count = 0
        self.raising = True
        self.server: VllmServer | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals can only be handled in the main thread; the caller's job
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)

    @staticmethod
    def say(text: str) -> None:
        # Straight to fd 2: the interrupted code may be inside a write to sys.stderr, and
        # a buffered stream refuses re-entrant writes.
        with contextlib.suppress(OSError, ValueError):
            prefix = "\n" if sys.stderr.isatty() else ""  # off the in-place progress line
            os.write(sys.stderr.fileno(), (prefix + text + "\n").encode())

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count > 1:
            self.say("hidden-state demo: second interrupt, exiting now")
            if self.server is not None:
                self.server.kill()
            sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)
        self.stop.set()
        self.say("hidden-state demo: interrupted, stopping cleanly (Ctrl-C again to quit at once)")
        if self.raising:
            raise KeyboardInterrupt


def run_demo(options: DemoOptions | None = None, *, stream: TextIO | None = None) -> DemoSummary:
    """Run the whole demo: server, producer, training loop, checks, report.

    Args:
        options: What to run (defaults: tiny model, 300 bundled prompts, ``out/demo``).
        stream: Where progress goes (default ``sys.stderr``).

    Returns:
        The summary; ``summary.ok`` is False with ``summary.failures`` saying why when
        anything went wrong (server start, lost or duplicated samples, files left,
        errors, interruption). Also written to ``<out>/summary.json``.

    Raises:
        DemoError: The options are unusable (nothing was started).
    """
    return _Demo(options or DemoOptions(), stream or sys.stderr).run()


class _Demo:
    def __init__(self, options: DemoOptions, stream: TextIO) -> None:
        self.o = options
        self.stream = stream
        self.started = time.monotonic()
        self.stop = threading.Event()
        self.progress = ProgressLine(stream, options.progress_interval)
        self.summary = DemoSummary()
        self.out_dir = os.path.abspath(os.path.expanduser(options.out))
        self.hs_dir = os.path.join(self.out_dir, "hs")
        self.producer: Producer | None = None
        self.trainer: Trainer | None = None
        self.estimate = 0.0

    def say(self, text: str) -> None:
        if self.o.progress:
            self.progress.message(text)

    # -- set-up ------------------------------------------------------------------------

    def _check_options(self) -> None:
        o = self.o
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

    def _model(self) -> tuple[str, bool]:
        if self.o.model is not None:
            return os.path.abspath(self.o.model), False
        from hidden_state_connector.demo.tiny_model import build_tiny_model

        directory = Path(os.path.expanduser(self.o.cache_dir)) / TINY_MODEL_NAME
        self.say(f"tiny bf16 Llama: {directory}")
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one tiny shard: no progress bar
        try:
            return os.fspath(build_tiny_model(directory, dtype="bfloat16")), True
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    def _layers(self, model: str, tiny: bool) -> list[int]:
        from hidden_state_connector.cli.serve import resolve_layers

        layers = self.o.layers if self.o.layers is not None else (TINY_LAYERS if tiny else None)
        try:
            return resolve_layers(model, layers, False)
        except SystemExit as exc:
            raise DemoError(str(exc.code)) from None

    def _serve_options(self, model: str, layers: list[int]) -> ServeOptions:
        o = self.o
        args = ["--max-model-len", str(o.max_model_len), "--served-model-name", SERVED_MODEL_NAME]
        if torch.cuda.is_available():
            if not any(a.startswith("--gpu-memory-utilization") for a in o.vllm_args):
                args += ["--gpu-memory-utilization", "0.8"]  # leave room for the trainer
        else:
            args += CPU_VLLM_ARGS
        return ServeOptions(
            model=model,
            out_dir=self.hs_dir,
            layer_ids=layers,
            port=o.port if o.port is not None else free_port(),
            connector={"stats_interval": 10},
            vllm_args=args + list(o.vllm_args),
        )

    def _fresh_hs_dir(self) -> None:
        if os.path.isdir(self.hs_dir):
            left = count_files(self.hs_dir)
            if left:
                self.say(f"removing {left} files left in {self.hs_dir} by an earlier run")
            shutil.rmtree(self.hs_dir)
        os.makedirs(self.hs_dir)

    # -- the run -----------------------------------------------------------------------

    def run(self) -> DemoSummary:
        o, s = self.o, self.summary
        self._check_options()
        try:
            prompts = load_prompts(o.prompts, o.num_prompts)
        except (OSError, ValueError) as exc:
            raise DemoError(f"cannot load prompts: {exc}") from None
        os.makedirs(self.out_dir, exist_ok=True)
        s.out_dir, s.hs_dir, s.prompts = self.out_dir, self.hs_dir, len(prompts)
        s.server_log = os.path.join(self.out_dir, "server.log")
        s.summary_json = os.path.join(self.out_dir, "summary.json")
        s.device = o.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if s.device == "cpu":
            # Leave the cores to the server: the draft head is small (this sets torch's
            # thread count for the whole process).
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 4))
        interrupts = _Interrupts(self.stop)
        try:
            with interrupts.installed():
                self._run(prompts, interrupts)
        except DemoError:
            raise  # raised before anything was started
        except Exception as exc:
            s.failures.append(f"{type(exc).__name__}: {exc}")
            s.errors.append(traceback.format_exc())
            self.say(f"hidden-state demo: error:\n{traceback.format_exc()}")
        s.interrupted = s.interrupted or interrupts.count > 0
        self._finish()
        return s

    def _run(self, prompts: list[str], interrupts: _Interrupts) -> None:
        o, s = self.o, self.summary
        server: VllmServer | None = None
        try:
            model, tiny = self._model()
            config = model_config(model)
            layers = self._layers(model, tiny)
            s.model, s.tiny_model, s.layers = model, tiny, layers
            s.vocab_size = int(config.get("vocab_size") or 0)
            if s.vocab_size < 1:
                raise DemoError(f"{model}: config.json has no vocab_size")
            serve = self._serve_options(model, layers)
            self._fresh_hs_dir()
            env = {
                "VLLM_NO_USAGE_STATS": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                **o.server_env,
            }
            server = VllmServer(serve, log_file=s.server_log, env=env)
            interrupts.server = server
            self.say("equivalent command:\n  " + serve.shell_command())
            self.say(f"starting vllm serve on port {serve.port} (log: {s.server_log})")
            t = time.monotonic()
            try:
                server.start(timeout=o.server_timeout)
            except RuntimeError as exc:
                s.failures.append("server failed to start")
                s.errors.append(str(exc))
                self.say(f"hidden-state demo: {exc}")
                return
            s.server_start_s = time.monotonic() - t
            self.say(f"server ready after {s.server_start_s:.1f}s")
            interrupts.raising = False
            self._stream(server, prompts, config)
        except KeyboardInterrupt:
            s.interrupted = True
        finally:
            interrupts.raising = False
            if server is not None:
                self.say("stopping the server")
                s.server_exit_code = server.stop()

    def _stream(self, server: VllmServer, prompts: list[str], config: dict[str, Any]) -> None:
        o, s = self.o, self.summary
        producer = Producer(
            server.url, SERVED_MODEL_NAME, prompts, concurrency=o.concurrency, stop=self.stop
        )
        trainer: Trainer

        def keep_going() -> bool:
            if self.stop.is_set():
                return False
            if not producer.done.is_set():
                return True
            if trainer.consumed >= producer.produced:
                return False
            last = max(trainer.last_sample_at or 0.0, producer.finished_at or 0.0)
            return time.monotonic() - last < o.drain_timeout

        trainer = Trainer(
            self.hs_dir,
            s.vocab_size,
            TrainerConfig(
                batch_size=o.batch_size,
                steps_per_batch=o.steps_per_batch,
                lr=o.lr,
                device=s.device,
                seed=o.seed,
                on_consumed="keep" if o.keep_files else "delete",
            ),
            keep_going=keep_going,
            stop=self.stop,
        )
        hidden = int(config.get("hidden_size") or 0)
        estimate = len(s.layers) * hidden * _itemsize(config) + 8
        self.say(
            f"sending {len(prompts)} prompts ({o.concurrency} in flight) while the draft head "
            f"trains on what arrives"
        )
        self.trainer, self.producer, self.estimate = trainer, producer, estimate
        if o.progress:
            self.progress.update(self._snapshot())  # the zero baseline of the rates
        trainer.start()
        producer.start()
        server_died = False
        while not trainer.done.wait(0.25):
            if o.progress:
                self.progress.update(self._snapshot())
            if not server_died and server.process is not None and server.process.poll() is not None:
                server_died = True
                s.failures.append(f"server exited unexpectedly ({server.process.returncode})")
                s.errors.append(server.tail())
                self.stop.set()
        self.stop.set()  # the trainer is done: nothing more to send
        producer.join()
        if o.progress:
            self.progress.update(self._snapshot(), force=True)
            self.progress.finish()

    def _snapshot(self) -> Snapshot:
        p, t = self.producer, self.trainer
        assert p is not None and t is not None
        per_token = t.bytes_per_token or self.estimate
        return Snapshot(
            time=time.monotonic(),
            produced=p.produced,
            failed=p.failed,
            consumed=t.consumed,
            tokens_produced=p.tokens,
            tokens_consumed=t.tokens,
            bytes_per_token=per_token,
            bytes_read=t.bytes,
            loss=t.recent_loss(),
            total=len(p.prompts),
        )

    # -- the end -----------------------------------------------------------------------

    def _finish(self) -> None:
        o, s = self.o, self.summary
        producer, trainer = self.producer, self.trainer
        if producer is not None and trainer is not None:
            self._collect(producer, trainer)
        if os.path.isdir(self.hs_dir):
            s.files_left = count_files(self.hs_dir)
        if s.interrupted:
            s.failures.insert(0, "interrupted")
        if producer is not None and trainer is not None and not s.interrupted:
            self._check(producer, trainer)
        if s.files_left and not o.keep_files and not s.interrupted:
            s.failures.append(f"{s.files_left} files left in {self.hs_dir}")
        s.ok = not s.failures
        s.wall_s = time.monotonic() - self.started
        png = os.path.join(self.out_dir, "loss.png")
        with contextlib.suppress(OSError):
            os.unlink(png)
        if os.path.isdir(self.out_dir):
            s.loss_png = png if plot_loss(s, png) else None
            write_json(s, s.summary_json)

    def _collect(self, producer: Producer, trainer: Trainer) -> None:
        s = self.summary
        s.produced, s.failed_requests, s.tokens_produced = (
            producer.produced,
            producer.failed,
            producer.tokens,
        )
        s.consumed, s.tokens_consumed, s.bytes_read = (
            trainer.consumed,
            trainer.tokens,
            trainer.bytes,
        )
        s.unique_consumed = len({os.path.basename(p) for p in trainer.paths})
        s.bytes_written = round(producer.tokens * (trainer.bytes_per_token or self.estimate))
        s.reader_skipped = trainer.reader_stats.skipped
        s.optimizer_steps = trainer.steps
        s.step_losses = list(trainer.step_losses)
        s.batch_losses = list(trainer.batch_losses)
        if s.batch_losses:
            s.initial_loss = s.batch_losses[0][2]
            s.final_loss = trainer.recent_loss()
        if producer.started_at is not None:
            now = time.monotonic()
            s.produce_s = max((producer.finished_at or now) - producer.started_at, 1e-9)
            s.produce_tokens_per_s = s.tokens_produced / s.produce_s
            s.write_mb_per_s = s.bytes_written / 1e6 / s.produce_s
            end = trainer.last_sample_at or producer.finished_at or now
            s.stream_s = max(end - producer.started_at, 1e-9)
            s.samples_per_s = s.consumed / s.stream_s
            s.tokens_per_s = s.tokens_consumed / s.stream_s
            s.read_mb_per_s = s.bytes_read / 1e6 / s.stream_s
        s.errors += producer.errors
        for what, exc in (("producer", producer.error), ("trainer", trainer.error)):
            if exc is not None:
                s.failures.append(f"{what} failed: {type(exc).__name__}: {exc}")

    def _check(self, producer: Producer, trainer: Trainer) -> None:
        s = self.summary
        if s.failed_requests:
            s.failures.append(f"{s.failed_requests} requests produced no sample")
        if s.produced != s.prompts - s.failed_requests:
            s.failures.append(f"{s.prompts - s.produced - s.failed_requests} prompts never sent")
        if s.produced != s.consumed:
            s.failures.append(f"produced {s.produced} != consumed {s.consumed}")
        if s.unique_consumed != s.consumed:
            s.failures.append(f"{s.consumed - s.unique_consumed} samples consumed twice")
        produced = {os.path.basename(p) for p in producer.paths}
        consumed = {os.path.basename(p) for p in trainer.paths}
        if produced - consumed:
            s.failures.append(f"{len(produced - consumed)} samples lost (produced, never consumed)")
        if consumed - produced:
            s.failures.append(f"{len(consumed - produced)} samples consumed that were not produced")
        if s.reader_skipped:
            s.failures.append(f"{s.reader_skipped} samples rejected by the reader")
