"""A fork server of writers to be SIGKILLed: ``python tests/tools/kill_writer.py DIR``.

Starting Python with torch costs about a second; forking a warm process costs a few
milliseconds, so hundreds of kills fit in a minute. Commands, one per line on stdin:

``go MODE GEN COUNT SEED``
    fork a writer child that writes up to COUNT samples into DIR, one after the other,
    then exits; prints ``pid PID``. The child prints ``done NAME`` right after each
    sample is complete (for MODE ``atomic``: published by rename and unlocked; for
    ``inplace``: written and unlocked).
``reap PID``
    wait for that child (the test has killed it, or it finished) and print
    ``exit PID STATUS``.
``quit``
    exit.

MODE ``atomic`` alternates ``write_sample`` (one write) and ``SampleFileWriter`` with
the hidden states streamed in 256 KiB chunks (what the connector does). The other two
modes follow vLLM's ``ExampleHiddenStatesConnector``: ``open(NAME.lock, O_CREAT |
O_TRUNC)``, ``flock(LOCK_EX)``, write the file, close the lock. MODE ``vllm`` writes
with ``safetensors.torch.save_file`` exactly as vLLM does (safetensors >= 0.8 writes a
hidden ``.tmpXXXXXX`` file and renames it); MODE ``inplace`` writes the serialized bytes
straight into the final name in 1 MiB pieces (any writer without a temp file), so a
kill leaves a partial final file.

Sizes are random per sample: 65% small (1-16 tokens x 3 x 16, under 2 KB) and 35%
multi-MB (128-512 tokens x 3 x 1024 float32, 1.5-6 MB). Names encode the content
(``relkit.sample_name``) so a reader can check every byte.
"""

from __future__ import annotations

import fcntl
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors.torch import save, save_file

from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.files.publish import SampleFileWriter, write_sample

from tools.relkit import _pattern, pattern_tensors, sample_name

CHUNK = 256 * 1024
INPLACE_PIECE = 1024 * 1024


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # one write(2): lines of parent and child never mix


def choose(rng: random.Random, prefix: str) -> str:
    if rng.random() < 0.65:
        return sample_name(prefix, rng.randint(1, 16), 3, 16, rng.choice(["bf16", "f32"]))
    return sample_name(prefix, rng.randint(128, 512), 3, 1024, "f32")


def write_atomic(path: str, index: int) -> None:
    token_ids, hidden = pattern_tensors(os.path.basename(path))
    if index % 2 == 0:
        write_sample(path, token_ids, hidden, checksum=True)
        return
    lock = WriterLock.create(path)
    writer = SampleFileWriter(
        path,
        token_ids=token_ids,
        hidden_shape=(hidden.shape[0], hidden.shape[1], hidden.shape[2]),
        hidden_dtype=hidden.dtype,
        lock=lock,
        checksum=True,
        record_nonfinite=True,
    )
    raw = hidden.reshape(-1).view(torch.uint8)
    for start in range(0, raw.numel(), CHUNK):
        writer.write_hidden(raw[start : start + CHUNK])
    writer.publish()


def write_vllm_style(path: str, in_place: bool) -> None:
    token_ids, hidden = pattern_tensors(os.path.basename(path))
    tensors = {"hidden_states": hidden.contiguous(), "token_ids": token_ids}
    fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if not in_place:
            save_file(tensors, path)
            return
        blob = memoryview(save(tensors))
        out = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            for start in range(0, len(blob), INPLACE_PIECE):
                os.write(out, blob[start : start + INPLACE_PIECE])
        finally:
            os.close(out)
    finally:
        os.close(fd)


def child(directory: str, mode: str, gen: int, count: int, seed: int) -> None:
    rng = random.Random(seed)
    for i in range(count):
        name = choose(rng, f"{mode}-g{gen:05d}-{i:02d}")
        path = os.path.join(directory, name)
        if mode == "atomic":
            write_atomic(path, i)
        else:
            write_vllm_style(path, in_place=mode == "inplace")
        say(f"done {name}")


def main() -> None:
    directory = sys.argv[1]
    torch.set_num_threads(1)  # no intra-op thread pool to inherit across fork()
    _pattern()  # built once here, shared copy-on-write by every child
    say("ready")
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "go":
            mode, gen, count, seed = args[0], int(args[1]), int(args[2]), int(args[3])
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    child(directory, mode, gen, count, seed)
                except BaseException as exc:
                    say(f"error {exc!r}")
                    code = 1
                os._exit(code)
            say(f"pid {pid}")
        elif cmd == "reap":
            pid = int(args[0])
            _, status = os.waitpid(pid, 0)
            say(f"exit {pid} {status}")
        elif cmd == "quit":
            return


if __name__ == "__main__":
    main()
