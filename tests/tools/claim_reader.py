"""A claim-mode reader process for tests: prints every sample name it consumes.

Usage: claim_reader.py DIR [--hold-first] [--idle S] [--delete] [--ready] [--max N]
                         [--steal S] [--work-ms M]
With --ready it prints "ready" once the reader exists and starts reading at the next line
on stdin, so a test can start all readers and the writer together (imports take seconds
on a loaded machine, longer than the idle timeout).
With --hold-first it prints "holding NAME" after the first sample and then waits
forever without consuming it (so a test can kill it while it holds a claim).
With --max N it stops after N samples and closes the reader (it leaves the group);
--steal sets ``claim_steal_after``; --work-ms spends that long on each sample.
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
parser.add_argument("--max", type=int, default=None)
parser.add_argument("--steal", type=float, default=2.0)
parser.add_argument("--work-ms", type=float, default=0.0)
args = parser.parse_args()

reader = HiddenStateReader(
    args.dir,
    follow=True,
    claim=True,
    idle_timeout=args.idle,
    rescan_interval=args.rescan,
    on_consumed="delete" if args.delete else "keep",
    max_samples=args.max,
    claim_steal_after=args.steal,
)
if args.ready:
    print("ready", flush=True)
    sys.stdin.readline()
for sample in reader:
    name = os.path.basename(sample.path)
    if args.hold_first:
        print(f"holding {name}", flush=True)
        time.sleep(3600)  # keep the claim until the test kills this process
    if args.work_ms:
        time.sleep(args.work_ms / 1000)  # a training step: the claim is held meanwhile
    print(name, flush=True)
reader.close()
print(f"stats {reader.stats.as_dict()}", file=sys.stderr, flush=True)
