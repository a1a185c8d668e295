"""A separate writer process for tests: ``python tests/tools/writer.py MODE ARGS``.

Modes:
  hold PATH            create PATH's lock (held), print "locked", wait for a line on
                       stdin, then write the sample, print the release time, exit
  vllm-partial PATH    like vLLM's connector: create the lock in place, lock it, write
                       half a file in place, print "partial", then wait to be killed
  partial PATH         take PATH's lock, write half the hidden states into the temporary
                       file, print the temporary file's path, then wait to be killed
  stream DIR COUNT     write COUNT small samples hs_0.. into DIR as fast as possible
  stream DIR COUNT go  the same, but first print "loaded" and wait for a line on stdin
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import SampleFileWriter

from samples import make_tensors, write_samples


def hold(path: str) -> None:
    lock = WriterLock.create(path)
    print("locked", flush=True)
    sys.stdin.readline()
    token_ids, hidden = make_tensors(7, tokens=6)
    writer = SampleFileWriter(
        path,
        token_ids=token_ids,
        hidden_shape=tuple(hidden.shape),
        hidden_dtype=hidden.dtype,
        lock=lock,
    )
    writer.write_hidden(hidden)
    before_release = time.time()
    writer.publish()  # renames the file into place, then releases the lock
    print(f"released {before_release:.6f}", flush=True)


def vllm_partial(path: str) -> None:
    from safetensors.torch import save

    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    token_ids, hidden = make_tensors(3, tokens=64, layers=2, hidden=32)
    blob = save({"hidden_states": hidden, "token_ids": token_ids})
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])
        f.flush()
    print("partial", flush=True)
    time.sleep(3600)  # until the test kills this process


def partial(path: str) -> None:
    token_ids, hidden = make_tensors(5, tokens=64, layers=2, hidden=32)
    writer = SampleFileWriter(
        path,
        token_ids=token_ids,
        hidden_shape=tuple(hidden.shape),
        hidden_dtype=hidden.dtype,
        lock=WriterLock.create(path),
    )
    writer.write_hidden(hidden[:32])
    print(writer.tmp_path, flush=True)
    time.sleep(3600)  # until the test kills this process


def stream(directory: str, count: int, wait_for_go: bool = False) -> None:
    if wait_for_go:
        print("loaded", flush=True)
        sys.stdin.readline()
    write_samples(directory, count, tokens=4, layers=1, hidden=8, dtype=torch.float32)
    print("done", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "hold":
        hold(sys.argv[2])
    elif mode == "vllm-partial":
        vllm_partial(sys.argv[2])
    elif mode == "partial":
        partial(sys.argv[2])
    elif mode == "stream":
        stream(sys.argv[2], int(sys.argv[3]), wait_for_go=sys.argv[4:] == ["go"])
    else:
        raise SystemExit(f"unknown mode {mode}")
