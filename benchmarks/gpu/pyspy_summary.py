"""Where each thread's time went, from py-spy's raw output (``bench.py --pyspy``).

Usage: python benchmarks/gpu/pyspy_summary.py FILE [--top 25] [--match hidden_state]

For every thread (by process and thread name): its samples, then the functions with the
most samples on its stack (inclusive) and at its top (self). ``--match`` keeps only
functions whose frame text contains the string in the inclusive list.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_PROCESS = re.compile(r'process \d+:"([^"]*)"')
_THREAD = re.compile(r"thread \(\d+\): (.*)")


def parse(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks by thread ("process / thread" names), each with its sample count."""
    by_thread: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            at = stack.find("thread (")
            if at < 0:
                continue
            procs = _PROCESS.findall(stack[:at])  # command lines may hold ';'
            parts = stack[at:].split(";")
            thread = _THREAD.match(parts[0])
            name = f"{procs[-1][:40] if procs else '?'} / {thread.group(1) if thread else '?'}"
            by_thread[name].append((parts[1:], int(count)))
    return by_thread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("file")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--match", default="")
    parser.add_argument("--min-share", type=float, default=0.02)
    args = parser.parse_args()
    threads = parse(args.file)
    total = sum(c for stacks in threads.values() for _, c in stacks)
    for name, stacks in sorted(threads.items(), key=lambda kv: -sum(c for _, c in kv[1])):
        n = sum(c for _, c in stacks)
        if n < args.min_share * total:
            continue
        inclusive: Counter[str] = Counter()
        leaf: Counter[str] = Counter()
        for frames, count in stacks:
            for frame in set(frames):
                if args.match in frame:
                    inclusive[frame] += count
            if frames:
                leaf[frames[-1]] += count
        print(f"\n== {name}: {n} samples")
        print("  inclusive:")
        for frame, count in inclusive.most_common(args.top):
            print(f"    {100 * count / n:5.1f}%  {frame[:150]}")
        print("  self:")
        for frame, count in leaf.most_common(12):
            print(f"    {100 * count / n:5.1f}%  {frame[:150]}")


if __name__ == "__main__":
    main()
