"""Start and stop a ``vllm serve`` process configured for hidden-state extraction.

One place builds the command line (used by ``hidden-state serve``, the demo, the
benchmarks and the tests), so the speculative and kv-transfer configs are always right.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hidden_state_connector import CONNECTOR_NAME
from hidden_state_connector.engine.output_tokens import NO_ASYNC_FLAG
from hidden_state_connector.vllm_release import installed_vllm

CPU_KV_CACHE_BYTES = 512 * 1024**2
"""KV cache given to vLLM's CPU build when the user sizes none (serve, extract, demo)."""
KV_CACHE_SIZE_SETTINGS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
"""vLLM settings that size the CPU build's KV cache (as flags: with dashes)."""


def cpu_kv_cache_bytes(
    user_settings: Iterable[str], env: Mapping[str, str] | None = None
) -> int | None:
    """The KV-cache size to give vLLM's CPU build, or None where the user sized it.

    Without a size, vLLM's CPU build reserves ``gpu_memory_utilization`` (0.92) of the
    host's RAM and exits with a memory error about a minute after launch when less is free;
    ``CPU_KV_CACHE_BYTES`` fits any machine that fits the model.

    Args:
        user_settings: The user's vLLM flags (``--kv-cache-memory-bytes``, ``=value``
            forms too) or engine-argument names (``kv_cache_memory_bytes``).
        env: The server's environment (default ``os.environ``): ``VLLM_CPU_KVCACHE_SPACE``
            sizes the cache too.
    """
    given = {s.split("=", 1)[0].lstrip("-").replace("-", "_") for s in user_settings}
    if given & set(KV_CACHE_SIZE_SETTINGS):
        return None
    if (os.environ if env is None else env).get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    return CPU_KV_CACHE_BYTES


def cpu_kv_cache_args(vllm_args: Sequence[str], env: Mapping[str, str] | None = None) -> list[str]:
    """``--kv-cache-memory-bytes`` for vLLM's CPU build (``cpu_kv_cache_bytes``), or []."""
    size = cpu_kv_cache_bytes(vllm_args, env)
    return [] if size is None else ["--kv-cache-memory-bytes", f"{size // 2**20}M"]


def scheduling_args(connector: Mapping[str, Any], vllm_args: Sequence[str]) -> list[str]:
    """``--no-async-scheduling`` when every request stores its generated tokens, or [].

    The connector refuses ``include_output_tokens`` under async scheduling (its rows
    come out wrong: ``engine/output_tokens.py``); a user's own choice of the flag stands.
    """
    chosen = {arg.split("=", 1)[0] for arg in vllm_args}
    if not connector.get("include_output_tokens") or chosen & {
        "--async-scheduling",
        NO_ASYNC_FLAG,
    }:
        return []
    return [NO_ASYNC_FLAG]


def speculative_config(layer_ids: Sequence[int]) -> dict[str, Any]:
    """The ``speculative_config`` that makes vLLM capture these layers."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


CAPTURES = ("forward", "extract")  # engine.config's CAPTURE_* (not imported: CLI start-up)
"""The capture engines the launchers offer (``--capture``); the first is the default."""


def capture_settings(
    capture: str, layer_ids: Sequence[int]
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The ``speculative_config`` (None: none) and connector keys of a capture engine.

    Forward capture takes no speculative method (a drafter may be added); the extract
    engine is vLLM's ``extract_hidden_states`` speculative method.
    """
    if capture == "extract":
        return speculative_config(layer_ids), {"capture": "extract"}
    return None, {"capture": "forward", "layer_ids": list(layer_ids)}


def kv_transfer_config(
    out_dir: str | os.PathLike[str] | None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ``kv_transfer_config`` that routes captured states to ``HiddenStateConnector``.

    ``out_dir`` None leaves ``shared_storage_path`` out (the store backend writes none).
    """
    storage = {} if out_dir is None else {"shared_storage_path": os.fspath(out_dir)}
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {**storage, **(extra or {})},
    }


@dataclass
class ServeOptions:
    """What ``vllm serve`` needs to write hidden states.

    Attributes:
        model: Model path or name.
        out_dir: Storage directory for the samples (None with the store backend).
        layer_ids: Layers to capture.
        port: HTTP port on 127.0.0.1.
        connector: Extra ``kv_connector_extra_config`` keys.
        capture: The capture engine, ``"forward"`` (default) or ``"extract"``.
        vllm_args: Further ``vllm serve`` arguments, passed through.
        shutdown_timeout: vLLM's ``--shutdown-timeout``: seconds a stopping server keeps
            stepping. vLLM's default (0) aborts at once, so a request answered just
            before Ctrl-C never gets its save order to the writer and its sample ends
            ``failed``; a drain lets it be written. ``None`` leaves vLLM's default.
    """

    model: str
    out_dir: str | None
    layer_ids: Sequence[int]
    port: int = 8000
    connector: dict[str, Any] = field(default_factory=dict)
    vllm_args: list[str] = field(default_factory=list)
    shutdown_timeout: int | None = 30
    capture: str = CAPTURES[0]

    def command(self) -> list[str]:
        """The ``vllm serve`` command line."""
        spec, keys = capture_settings(self.capture, self.layer_ids)
        return [
            "vllm",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *([] if spec is None else ["--speculative-config", json.dumps(spec)]),
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(self.out_dir, {**keys, **self.connector})),
            *(
                ["--shutdown-timeout", str(self.shutdown_timeout)]
                if self.shutdown_timeout is not None
                else []
            ),
            *scheduling_args(self.connector, self.vllm_args),
            *self.vllm_args,
        ]

    def launch_command(self) -> list[str]:
        """The command that starts this server with the vLLM installed here.

        ``vllm serve MODEL ...`` (``command``), except under vLLM's CPU build: it installs
        as ``vllm-cpu``, whose ``vllm`` command fails looking up the version of a ``vllm``
        distribution (``PackageNotFoundError``), so there this interpreter runs vLLM's API
        server module instead, with the same arguments and ``--model MODEL`` for the
        positional model. Without vLLM here it is the plain command, for another machine.
        """
        plain = self.command()
        if vllm_distribution() != "vllm-cpu":
            return plain
        api_server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        return [*api_server, "--model", self.model, *plain[3:]]

    def shell_command(self) -> str:
        """``launch_command``, quoted for a shell (what ``hidden-state serve`` prints)."""
        return shlex.join(self.launch_command())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for ``ServeOptions.port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_distribution() -> str | None:
    """The name vLLM is installed under: ``vllm``, ``vllm-cpu`` (the CPU build), or None."""
    found = installed_vllm()
    return None if found is None else found[0]


def server_argv(options: ServeOptions) -> list[str]:
    """The command that really starts the server from this interpreter.

    ``options.launch_command()`` (what ``hidden-state serve`` prints), with ``vllm``
    taken from this interpreter's environment when it is there, so that the server runs
    the vLLM this Python has whatever ``PATH`` says.
    """
    argv = options.launch_command()
    candidate = Path(sys.executable).with_name("vllm")
    if argv[0] == "vllm" and candidate.exists():
        return [str(candidate), *argv[1:]]
    return argv


class VllmServer:
    """A ``vllm serve`` subprocess; a context manager that always stops it.

    Args:
        options: What to serve.
        log_file: Where the server's output goes (a file keeps pipes from filling up).
        env: Extra environment variables.
        preexec_fn: Run in the child before exec (e.g. to set resource limits).
    """

    def __init__(
        self,
        options: ServeOptions,
        *,
        log_file: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        preexec_fn: Any = None,
    ) -> None:
        self.options = options
        self.log_path = Path(log_file)
        self._env = {**os.environ, **(env or {})}
        self._preexec_fn = preexec_fn
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """Base URL of the OpenAI-compatible API."""
        return f"http://127.0.0.1:{self.options.port}"

    def start(self, timeout: float = 300.0) -> VllmServer:
        """Start the server and wait until ``/health`` answers.

        Raises:
            RuntimeError: The server exited or did not become healthy in time; the
                message holds the end of its log.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            server_argv(self.options),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            preexec_fn=self._preexec_fn,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.process.returncode}:\n{self.tail()}"
                )
            if self.healthy():
                return self
            time.sleep(0.5)  # waiting for an external server: nothing to block on
        self.stop()
        raise RuntimeError(f"vllm serve not healthy after {timeout:.0f}s:\n{self.tail()}")

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether ``/health`` answers 200 within ``timeout`` seconds."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the server: SIGINT to the server, then SIGTERM and SIGKILL to its group.

        The first SIGINT goes to the server process only, as a service manager's stop
        does: vLLM then drains (``--shutdown-timeout``) and stops its own workers, so
        every answered request is written. A terminal's Ctrl-C instead reaches every
        process of the group, and vLLM's worker processes exit on it at once.

        Returns:
            The exit code, or None if it was never started.
        """
        proc = self.process
        if proc is None:
            return None
        steps = (
            (lambda: os.kill(proc.pid, signal.SIGINT), timeout),
            (lambda: os.killpg(proc.pid, signal.SIGTERM), 10.0),
            (lambda: os.killpg(proc.pid, signal.SIGKILL), 10.0),
        )
        for send, wait in steps:
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                send()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
        # Workers the server left behind (it was killed) must not outlive it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole server process group at once (fault injection)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
