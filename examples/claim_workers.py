"""Several independent trainer processes share one directory, each sample read exactly once.

What it shows:

* ``HiddenStateDataset(follow=True)`` claims every sample it reads (``claim=True`` is the
  default in follow mode): a claim file under ``<dir>/.claims/<group>/`` taken
  atomically, so among all processes following the directory, on this host or on
  others sharing the filesystem, exactly one gets each sample. No coordinator, no
  process group, no ranks: start as many consumers as you like, whenever you like.
  While it follows, each consumer is a member of its group (``.claims/.members/``): every
  sample has one owner among the members, who claims it, so the others do not race for
  it (docs/scale-out.md);
* ``claim_group``: consumers in different groups do not see each other's claims, so
  each group gets every sample once (e.g. a training job and an evaluation job);
* this script plays both sides: it starts ``--workers`` consumer processes per group
  (itself with ``--worker``), writes ``--num-samples`` samples with ``write_sample``
  while they start and run, and checks that each group read every sample exactly once.

A reader that dies while holding a claim leaves its lock released; another reader takes
the sample over when it looks again (after ``rescan_interval`` seconds).

Run it::

    python examples/claim_workers.py                          # 3 workers, 60 samples
    python examples/claim_workers.py --workers 4 --groups 2 --num-samples 200
    # one consumer by hand, next to a server writing /data/hs:
    python examples/claim_workers.py --worker 0 --dir /data/hs --idle-timeout 30
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch

from hidden_state_reader import HiddenStateDataset, HiddenStateLoader, pad_collate, write_sample


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Several consumer processes following one directory with claims: every "
        "sample is read by exactly one of them (per claim group).",
        epilog="example:\n  python examples/claim_workers.py --workers 3 --groups 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dir", help="the shared directory (default: a new temp directory)")
    parser.add_argument("--workers", type=int, default=3, help="consumers per group (default 3)")
    parser.add_argument("--groups", type=int, default=1, help="claim groups (default 1)")
    parser.add_argument("--num-samples", type=int, default=60, help="samples to write")
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=3.0,
        help="a consumer stops after this many seconds without new samples",
    )
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.05,
        help="seconds each consumer spends per batch (its 'training step')",
    )
    parser.add_argument("--worker", type=int, metavar="ID", help="run as one consumer")
    parser.add_argument("--claim-group", default="default", help="with --worker")
    return parser.parse_args(argv)


def consume(args: argparse.Namespace) -> int:
    """One consumer: what each trainer process would run."""
    torch.set_num_threads(1)
    dataset = HiddenStateDataset(
        args.dir,
        follow=True,  # claim=True by default in follow mode
        claim_group=args.claim_group,
        idle_timeout=args.idle_timeout,
        rescan_interval=2.0,  # how soon a claim left by a dead consumer is taken over
    )
    loader = HiddenStateLoader(dataset, batch_size=4, collate_fn=pad_collate)
    names: list[str] = []
    tokens = 0
    for batch in loader:
        names += [os.path.basename(p) for p in batch["paths"]]
        tokens += int(batch["lengths"].sum())
        time.sleep(args.step_time)  # stands in for the training step on this batch
    print(
        json.dumps(
            {
                "worker": args.worker,
                "group": args.claim_group,
                "names": names,
                "tokens": tokens,
                "stats": dataset.stats.as_dict(),
            }
        )
    )
    return 0


def start_consumers(
    args: argparse.Namespace, directory: str, groups: list[str]
) -> list[subprocess.Popen[str]]:
    """Start ``args.workers`` consumer processes (this script with --worker) per group."""
    procs = []
    for group in groups:
        for worker in range(args.workers):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                str(worker),
                "--dir",
                directory,
                "--claim-group",
                group,
                "--idle-timeout",
                str(args.idle_timeout),
                "--step-time",
                str(args.step_time),
            ]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    return procs


def produce(directory: str, num_samples: int) -> None:
    """The producer: here a loop of write_sample; in real life a vLLM server.

    Each file is published atomically under a lock, so a consumer never sees half of one.
    """
    generator = torch.Generator().manual_seed(0)
    for i in range(num_samples):
        tokens = 4 + i % 13
        token_ids = torch.randint(0, 1000, (tokens,), generator=generator)
        hidden = torch.randn(tokens, 2, 64, generator=generator).bfloat16()
        write_sample(os.path.join(directory, f"hs_{i}.safetensors"), token_ids, hidden)
        time.sleep(0.05)  # a server produces samples over time, not all at once


def collect(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Wait for every consumer and return the JSON summary each printed last."""
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            sys.exit(f"a consumer failed with exit status {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def check_exactly_once(results: list[dict[str, Any]], groups: list[str], num_samples: int) -> bool:
    """Print, per group, whether its consumers read each sample exactly once."""
    expected = {f"hs_{i}.safetensors" for i in range(num_samples)}
    ok = True
    for group in groups:
        mine = [r for r in results if r["group"] == group]
        counts = Counter(n for r in mine for n in r["names"])
        per_worker = [len(r["names"]) for r in mine]
        twice = sum(1 for c in counts.values() if c > 1)
        missing = len(expected - set(counts))
        good = twice == 0 and missing == 0
        ok = ok and good
        print(
            f"group {group}: samples per consumer {per_worker}, total {sum(per_worker)}; "
            f"read twice {twice}, never read {missing}: "
            f"{'each sample exactly once, OK' if good else 'FAILED'}"
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        if not args.dir:
            sys.exit("--worker needs --dir")
        return consume(args)

    directory = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="hs-claims-"))
    os.makedirs(directory, exist_ok=True)
    groups = ["default"] + [f"group{g}" for g in range(1, args.groups)]
    procs = start_consumers(args, directory, groups)
    # No waiting for the consumers: like trainers next to a live server, they may start
    # before, during or after the writing, and read what is already there when they do.
    print(
        f"started {len(procs)} consumers ({args.workers} per group, groups {groups}) "
        f"on {directory}",
        flush=True,
    )

    produce(directory, args.num_samples)
    print(f"wrote {args.num_samples} samples", flush=True)

    results = collect(procs)
    ok = check_exactly_once(results, groups, args.num_samples)
    if not args.dir:
        shutil.rmtree(directory)  # the temporary directory: samples and claims
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
