"""A claim-mode reader process for tests: prints every sample name it consumes.

Usage: claim_reader.py DIR [--hold-first] [--idle S] [--delete] [--ready]
With --ready it prints "ready" once the reader exists and starts reading at the next line
on stdin, so a test can start all readers and the writer together (imports take seconds
on a loaded machine, longer than the idle timeout).
With --hold-first it prints "holding NAME" after the first sample and then waits
forever without consuming it (so a test can kill it while it holds a claim).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from hidden_state_reader import HiddenStateReader

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--hold-first", action="store_true")
parser.add_argument("--idle", type=float, default=3.0)
parser.add_argument("--delete", action="store_true")
parser.add_argument("--rescan", type=float, default=1.0)
parser.add_argument("--ready", action="store_true")
args = parser.parse_args()

reader = HiddenStateReader(
    args.dir,
    follow=True,
    claim=True,
    idle_timeout=args.idle,
    rescan_interval=args.rescan,
    on_consumed="delete" if args.delete else "keep",
)
if args.ready:
    print("ready", flush=True)
    sys.stdin.readline()
for sample in reader:
    name = os.path.basename(sample.path)
    if args.hold_first:
        print(f"holding {name}", flush=True)
        time.sleep(3600)  # keep the claim until the test kills this process
    print(name, flush=True)
print(f"stats {reader.stats.as_dict()}", file=sys.stderr, flush=True)
