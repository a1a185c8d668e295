"""Write small pattern samples at a steady rate: ``stream_writer.py DIR PREFIX COUNT RATE``.

It prints ``loaded`` once imports are done and starts writing at the next line on stdin,
so a test can start readers and writers together (imports take seconds under load).
Names are ``PREFIX-NNNNNN-t{tokens}-l1-h8-f32.safetensors`` (content checkable with
``relkit.matches_pattern``), written atomically with ``write_sample``, RATE per second
(0: as fast as possible). Prints ``done COUNT`` at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hidden_state_reader.files.publish import write_sample

from tools.relkit import pattern_tensors, sample_name


def main() -> None:
    directory, prefix, count, rate = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    torch.set_num_threads(1)
    print("loaded", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    for i in range(count):
        if rate > 0:
            due = start + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing: the writer keeps writing while readers run
        name = sample_name(f"{prefix}-{i:06d}", 1 + i % 8, 1, 8, "f32")
        token_ids, hidden = pattern_tensors(name)
        write_sample(os.path.join(directory, name), token_ids, hidden)
    print(f"done {count}", flush=True)


if __name__ == "__main__":
    main()
