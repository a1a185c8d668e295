"""The processes of the consume benchmark (``benchmarks.consume``): producer and readers.

    python -m benchmarks.consume_roles produce DIR OUT SAMPLES RATE STAGED...
    python -m benchmarks.consume_roles produce-store URL OUT SAMPLES RATE STAGED...
    python -m benchmarks.consume_roles read SOURCE OUT IDLE [DEVICE]

The producer prints ``ready`` once connected, waits for a line on stdin, then publishes
``SAMPLES`` samples at ``RATE`` per second the way the connector does, without its GPU
work: for files, it creates the sample's lock (held), links a pre-written file to the
sample's name (the file appears complete, as after the connector's rename) and releases
the lock; for the store, it puts a pre-written file and its commit record
(``publish_file``). Each publication's wall-clock time is recorded.

A reader follows with the default options of a consumer group (``follow=True,
claim=True, on_consumed="delete"``, and ``device`` where given), prints ``ready`` once
it is built, and touches every byte of every sample it gets (on a GPU: a reduction).
It records, per sample, when it asked for it, when it got it and when it was done, and
the CPU time its process had spent by then since its first request (all threads:
loading, dequantizing, touching, watching, claiming, deleting; waiting costs none).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _paced(count: int, rate: float) -> Any:
    """Say ``ready``, wait for ``go`` on stdin, then yield 0..count-1 at ``rate`` per second.

    The i-th comes no earlier than i / rate seconds after the first.
    """
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    for i in range(count):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        yield i


def produce_files(argv: list[str]) -> None:
    from hidden_state_reader.files.locks import WriterLock

    directory, out, staged = Path(argv[0]), argv[1], argv[4:]
    count, rate = int(argv[2]), float(argv[3])
    published = []
    for i in _paced(count, rate):
        final = str(directory / f"hs_{i}.safetensors")
        lock = WriterLock.create(final)
        os.link(staged[i % len(staged)], final)  # appears complete, as after a rename
        published.append([os.path.basename(final), time.time()])
        lock.release()
    Path(out).write_text(json.dumps({"published": published}))


def produce_store(argv: list[str]) -> None:
    from hidden_state_reader.store.client import StoreClient
    from hidden_state_reader.store.publish import StorePublisher, publish_file
    from hidden_state_reader.store.url import parse_store_url

    url, out, count, rate, staged = argv[0], argv[1], int(argv[2]), float(argv[3]), argv[4:]
    publisher = StorePublisher(StoreClient(parse_store_url(url)))
    published = []
    for i in _paced(count, rate):
        name = f"hs_{i}.safetensors"
        link = f"{out}.{i}.staged"
        os.link(staged[i % len(staged)], link)
        publish_file(publisher, name, link)  # removes the link
        published.append([name, time.time()])
    Path(out).write_text(json.dumps({"published": published}))


def touch(tensor: Any) -> None:
    """Read every byte: numpy's sum on the CPU, a reduction (and a sync) on a device."""
    if tensor.device.type == "cpu":
        from benchmarks.reader import touch as touch_cpu

        touch_cpu(tensor)
    else:
        float(tensor.float().sum())


def read(argv: list[str]) -> None:
    from hidden_state_reader import HiddenStateReader

    source, out, idle = argv[0], argv[1], float(argv[2])
    device = argv[3] if len(argv) > 3 and argv[3] else None
    reader = HiddenStateReader(source, follow=True, claim=True, on_consumed="delete",
                               idle_timeout=idle, device=device)  # fmt: skip
    print("ready", flush=True)
    records = []
    asked = time.time()
    cpu_start = _cpu_seconds()
    for sample in reader:
        got = time.time()
        touch(sample.token_ids)
        touch(sample.hidden_states)
        done = time.time()
        name = os.path.basename(sample.path)
        records.append([name, asked, got, done, sample.nbytes, _cpu_seconds() - cpu_start])
        asked = done
    Path(out).write_text(json.dumps({"records": records, "stats": reader.stats.as_dict()}))


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


ROLES = {"produce": produce_files, "produce-store": produce_store, "read": read}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ROLES:
        raise SystemExit(__doc__)
    ROLES[sys.argv[1]](sys.argv[2:])
