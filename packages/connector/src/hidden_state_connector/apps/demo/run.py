"""``run_demo``: a live ``vllm serve`` streaming hidden states into a training loop.

One call builds (or reuses) a model, starts ``vllm serve`` with the connector, sends
prompts through the OpenAI API from a producer thread, and trains an EAGLE-style draft
head on the hidden states in a consumer thread *while they are being written*: a
follow-mode, claiming ``HiddenStateReader`` (through ``HiddenStateDataset`` and a torch
``DataLoader``) picks each file up as soon as the server publishes it and deletes it
after use. At the end it checks that every prompt became exactly one trained-on sample
and that nothing was left on disk, stops the server cleanly, and writes
``summary.json`` and a loss-curve PNG.

This module runs it; the pieces live beside it: ``options`` (``DemoOptions``,
``DemoError``), ``serving`` (model, layers, server options), ``interrupts`` (Ctrl-C),
``producer``, ``trainer``, ``progress``, ``outcome`` (the end-of-run checks) and
``report`` (``DemoSummary``, its table, JSON and plot).

Example::

    from hidden_state_connector.apps.demo.options import DemoOptions
    from hidden_state_connector.apps.demo.run import run_demo

    summary = run_demo(DemoOptions(num_prompts=100, out="out/demo"))
    assert summary.ok, summary.failures
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
import traceback
from typing import Any, TextIO

import torch

from hidden_state_connector.apps.demo.interrupts import Interrupts
from hidden_state_connector.apps.demo.options import (
    SERVED_MODEL_NAME,
    DemoError,
    DemoOptions,
    check_options,
)
from hidden_state_connector.apps.demo.outcome import check, collect, count_files
from hidden_state_connector.apps.demo.producer import Producer
from hidden_state_connector.apps.demo.progress import Snapshot, SnapshotLine
from hidden_state_connector.apps.demo.report import DemoSummary, plot_loss, write_json
from hidden_state_connector.apps.demo.serving import (
    capture_layers,
    estimate_bytes_per_token,
    model_config,
    prepare_model,
    serve_options,
    server_env,
)
from hidden_state_connector.apps.demo.trainer import Trainer, TrainerConfig
from hidden_state_connector.apps.prompts import load_prompts
from hidden_state_connector.apps.server import VllmServer

__all__ = ["run_demo"]


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
        self.progress = SnapshotLine(stream, options.progress_interval)
        self.summary = DemoSummary()
        self.out_dir = os.path.abspath(os.path.expanduser(options.out))
        self.hs_dir = os.path.join(self.out_dir, "hs")
        self.producer: Producer | None = None
        self.trainer: Trainer | None = None
        self.estimate = 0.0

    def say(self, text: str) -> None:
        if self.o.progress:
            self.progress.message(text)

    def _fresh_hs_dir(self) -> None:
        if os.path.isdir(self.hs_dir):
            left = count_files(self.hs_dir)
            if left:
                self.say(f"removing {left} files left in {self.hs_dir} by an earlier run")
            shutil.rmtree(self.hs_dir)
        os.makedirs(self.hs_dir)

    def run(self) -> DemoSummary:
        o, s = self.o, self.summary
        check_options(o)
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
        interrupts = Interrupts(self.stop)
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

    def _run(self, prompts: list[str], interrupts: Interrupts) -> None:
        o, s = self.o, self.summary
        server: VllmServer | None = None
        try:
            model, tiny = prepare_model(o, self.say)
            config = model_config(model)
            layers = capture_layers(o, model, tiny)
            s.model, s.tiny_model, s.layers = model, tiny, layers
            s.vocab_size = int(config.get("vocab_size") or 0)
            if s.vocab_size < 1:
                raise DemoError(f"{model}: config.json has no vocab_size")
            serve = serve_options(o, model, layers, self.hs_dir)
            self._fresh_hs_dir()
            server = VllmServer(serve, log_file=s.server_log, env=server_env(o))
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
        estimate = estimate_bytes_per_token(config, len(s.layers))
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

    def _finish(self) -> None:
        o, s = self.o, self.summary
        producer, trainer = self.producer, self.trainer
        if producer is not None and trainer is not None:
            collect(s, producer, trainer, self.estimate)
        if os.path.isdir(self.hs_dir):
            s.files_left = count_files(self.hs_dir)
        if s.interrupted:
            s.failures.insert(0, "interrupted")
        if producer is not None and trainer is not None and not s.interrupted:
            check(s, producer, trainer)
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
