"""A yielded sample whose file is then rewritten in place: ``rewrite_after_read.py DIR``.

Writes a 6 MiB sample the way vLLM's connector does with an in-place writer (lock
``O_TRUNC`` + ``LOCK_EX``, bytes written straight into the final name), reads it with
``HiddenStateReader`` and keeps the sample, then a second writer reuses the name (a
re-run into the same directory, a client reusing a custom path) and rewrites the file in
place, shorter. Finally the kept sample is used. Prints ``sum S`` and exits 0 if the
sample still holds what was yielded, exits 3 if its values changed; a reader that maps
files dies with SIGBUS here (exit status -7 / 135).
"""

from __future__ import annotations

import fcntl
import os
import sys

import torch
from safetensors.torch import save

from hidden_state_reader import HiddenStateReader


def write_in_place(path: str, tokens: int, value: float) -> None:
    tensors = {
        "hidden_states": torch.full((tokens, 3, 1024), value),
        "token_ids": torch.arange(tokens),
    }
    lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    blob = save(tensors)
    out = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(out, blob)
    finally:
        os.close(out)
        os.close(lock)


def main() -> None:
    path = os.path.join(sys.argv[1], "reused.safetensors")
    write_in_place(path, 512, 1.0)
    sample = next(iter(HiddenStateReader(sys.argv[1])))
    expected = 512 * 3 * 1024
    write_in_place(path, 4, 0.0)
    total = float(sample.hidden_states.sum())
    print(f"sum {total}", flush=True)
    sys.exit(0 if total == expected else 3)


if __name__ == "__main__":
    main()
