"""Read a storage directory once, in a process of its own, and report as JSON.

``read_dir.py DIR [options]`` runs ``HiddenStateReader(DIR)`` (snapshot mode) and prints
the report. ``read_dir.py serve`` is a warm fork server for the same job (a new Python
with torch costs seconds; a fork costs milliseconds): each line ``run OUTFILE DIR
[options]`` on stdin forks a child that does the job and writes its report to OUTFILE
(one line, one write); the server prints ``pid PID``. Children are reaped
automatically. A test bounds each run with a timeout and kills the child if it hangs (a
reader that blocks forever is a finding, not a stuck test suite).

The report::

    {"yielded": [names], "stats": {...}, "warnings": [messages],
     "error": null | {"type": name, "sample_error": bool, "message": text}}

or, with ``--verify``: ``{"rc": exit status, "output": what it printed}``.

Options:
  --on-error skip|raise   the reader's on_error (default skip)
  --as-nobody             drop to uid/gid 65534 first (needs root); file modes then apply
  --verify                run ``hidden-state verify DIR --grace 0 --json`` instead
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import sys
from contextlib import redirect_stdout
from typing import Any

# Import everything first: the interpreter itself may live where uid 65534 cannot read.
from hidden_state_reader import HiddenStateReader, SampleError
from hidden_state_reader.apps.cli.main import main as cli_main


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--on-error", default="skip")
    parser.add_argument("--as-nobody", action="store_true")
    parser.add_argument("--verify", action="store_true")
    return parser.parse_args(argv)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())


def job(args: argparse.Namespace) -> dict[str, Any]:
    if args.as_nobody:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    if args.verify:
        out = io.StringIO()
        with redirect_stdout(out):
            rc = cli_main(["verify", args.dir, "--grace", "0", "--json"])
        return {"rc": rc, "output": out.getvalue()}
    collect = Collect()
    logger = logging.getLogger("hidden_state_reader")
    logger.addHandler(collect)
    logger.setLevel(logging.WARNING)
    yielded: list[str] = []
    error = None
    reader = HiddenStateReader(args.dir, on_error=args.on_error, lock_timeout=5)
    try:
        for sample in reader:
            yielded.append(os.path.basename(sample.path))
    except BaseException as exc:
        error = {
            "type": type(exc).__name__,
            "sample_error": isinstance(exc, SampleError),
            "message": str(exc),
        }
    return {
        "yielded": yielded,
        "stats": reader.stats.as_dict(),
        "warnings": collect.messages,
        "error": error,
    }


def serve() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd != "run":
            return
        outfile, argv = rest[0], rest[1:]
        pid = os.fork()
        if pid == 0:
            code = 0
            # Opened before the job may drop privileges; written in one write(2).
            out = os.open(outfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                report = job(parse(argv))
            except BaseException as exc:
                report = {"crash": repr(exc)}
                code = 1
            os.write(out, json.dumps(report).encode() + b"\n")
            os._exit(code)
        print(f"pid {pid}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve()
    else:
        json.dump(job(parse(sys.argv[1:])), sys.stdout)
        print(flush=True)
