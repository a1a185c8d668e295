"""Claim-mode follow readers that log each delivery, forked from a warm process.

``claim_worker.py serve DIR [options]`` imports torch and the reader once, then forks a
reader per command (a fresh Python costs seconds when eight start at once; a fork
costs milliseconds, so readers can be killed and replaced at will). Commands on stdin:

``spawn INDEX OUTFILE``  fork a reader writing its log to OUTFILE; prints ``pid INDEX PID``
``reap PID``             wait for that reader (killed or finished); prints ``exit PID STATUS``
``quit``                 exit

``claim_worker.py read DIR [options]`` runs one reader in this process, logging to stdout.

Each reader prints, one line each, flushed at once (timestamps are ``time.monotonic()``,
system-wide on Linux, so lines of different processes can be ordered):

``got T NAME OK``
    the reader yielded NAME at time T; OK is 1 if its content matched its name.
``done T NAME``
    the reader has marked NAME consumed: the reader marks a sample done when the next
    one is requested, so this line is printed when the next sample arrives (or when the
    iteration ends). A reader killed after marking its last sample done, but before
    printing this line, leaves that sample done without a ``done`` line.
``stats {...}``
    at the end (idle timeout reached).

Options: ``--idle S`` (idle timeout, default 5), ``--rescan S`` (default 1), ``--work-ms
M`` (time spent "training" on each sample, holding its claim; default 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hidden_state_reader import HiddenStateReader

from tools.relkit import matches_pattern


def consume(args: argparse.Namespace, out: int) -> None:
    def say(line: str) -> None:
        os.write(out, (line + "\n").encode())

    reader = HiddenStateReader(
        args.dir, follow=True, claim=True, idle_timeout=args.idle, rescan_interval=args.rescan
    )
    previous = None
    for sample in reader:
        now = time.monotonic()
        if previous is not None:
            say(f"done {now:.6f} {previous}")
        previous = os.path.basename(sample.path)
        say(f"got {now:.6f} {previous} {int(matches_pattern(sample))}")
        if args.work_ms:
            time.sleep(args.work_ms / 1000)  # a training step: the claim is held meanwhile
    if previous is not None:
        say(f"done {time.monotonic():.6f} {previous}")
    say("stats " + json.dumps(reader.stats.as_dict()))


def serve(args: argparse.Namespace) -> None:
    matches_pattern  # noqa: B018 - imported before forking, like everything else
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "spawn":
            index, outfile = rest
            pid = os.fork()
            if pid == 0:
                code = 0
                out = os.open(outfile, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(out, 2)  # warnings of this reader go to its log as well
                try:
                    consume(args, out)
                except BaseException as exc:
                    # where it came from, on one line (the test prints the line it fails on)
                    where = " <- ".join(
                        f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                        for f in reversed(traceback.extract_tb(exc.__traceback__))
                    )
                    os.write(out, f"error {exc!r} at {where}\n".encode())
                    code = 1
                os._exit(code)
            print(f"pid {index} {pid}", flush=True)
        elif cmd == "reap":
            pid = int(rest[0])
            _, status = os.waitpid(pid, 0)
            print(f"exit {pid} {status}", flush=True)
        elif cmd == "quit":
            return


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["serve", "read"])
    parser.add_argument("dir")
    parser.add_argument("--idle", type=float, default=5.0)
    parser.add_argument("--rescan", type=float, default=1.0)
    parser.add_argument("--work-ms", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # no intra-op thread pool to inherit across fork()
    if args.mode == "serve":
        print("ready", flush=True)
        serve(args)
    else:
        consume(args, sys.stdout.fileno())


if __name__ == "__main__":
    main()
