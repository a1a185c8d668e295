"""One role in a Mooncake Store test, run as its own process inside the test's namespace.

    python -m tools.store_role produce --files DIR [--fail NAME,...] [--hold BIG_FILE]
    python -m tools.store_role produce --files DIR --force   # put and announce, unchecked
    python -m tools.store_role read --files DIR [--follow --claim --delete --names ...]
    python -m tools.store_role read --files DIR --claim --hold-first   # then killed
    python -m tools.store_role read --files DIR --stop-after 3 [--again]   # breaks out
    python -m tools.store_role dataset --files DIR --workers 2   # HiddenStateDataset
    python -m tools.store_role tamper --files DIR
    python -m tools.store_role probe

The test writes the sample files (with the product's writer); producers publish them,
readers check each sample they get against its file. Producers import no torch, so they
start in a fraction of a second. Each role prints one JSON line on stdout when done
(``produce --hold`` prints its line first, then waits in a put to be killed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.store_keys import CommitRecord, data_key
from hidden_state_reader.store.client import StoreClient, StoreSettings
from hidden_state_reader.store.publish import StorePublisher, parse_sample_header, publish_file


def settings(args: argparse.Namespace) -> StoreSettings:
    return StoreSettings(
        master=args.master, prefix=args.prefix, local_hostname="127.0.0.1",
        buffer_bytes=args.buffer,
    )  # fmt: skip


def publish_copy(publisher: StorePublisher, path: Path, name: str = "") -> None:
    """Publish a copy of ``path`` as ``name`` (publish_file removes what it published)."""
    staged = os.path.join(tempfile.mkdtemp(), path.name)
    shutil.copyfile(path, staged)
    publish_file(publisher, name or path.name, staged)


def produce(args: argparse.Namespace) -> None:
    publisher = StorePublisher(StoreClient(settings(args)), full_timeout=args.full_timeout)
    fail = set(filter(None, args.fail.split(",")))
    published, failed, waited = [], [], 0.0
    for path in sorted(Path(args.files).glob("*.safetensors")):
        if path.name in fail:
            publisher.fail(path.name, "injected failure")
            failed.append(path.name)
            continue
        started = time.monotonic()
        try:
            if args.force:  # a retry that checked before its key was consumed
                data = path.read_bytes()
                header = parse_sample_header(path.name, data)
                publisher.client.put(data_key(args.prefix, path.name), data)
                publisher._commit(CommitRecord(path.name, True, len(data),
                                               header.metadata[Meta.CRC32]))  # fmt: skip
            else:
                publish_copy(publisher, path)
            published.append(path.name)
        except Exception as exc:
            publisher.fail(path.name, f"publish failed: {exc}")
            failed.append(path.name)
        waited = max(waited, time.monotonic() - started)
    stored = publisher.client.exists([data_key(args.prefix, n) for n in published])
    result = {"slot": publisher.slot, "published": published, "failed": failed,
              "stored": [n for n, there in zip(published, stored, strict=True) if there],
              "max_publish_s": round(waited, 3)}  # fmt: skip
    print(json.dumps(result), flush=True)
    for i in range(1_000_000) if args.hold else ():  # killed while a put is in flight
        publish_copy(publisher, Path(args.hold), f"held-{i}.safetensors")


def read(args: argparse.Namespace) -> None:
    if args.each:  # one reader per name, in this process: each name's own outcome
        names = args.names.split(",")
        for name in names:
            args.names = name
            read_once(args)
    else:
        read_once(args)


def read_once(args: argparse.Namespace) -> None:
    from hidden_state_reader import HiddenStateReader, SampleError, load_sample

    kwargs = dict(follow=args.follow, idle_timeout=args.idle_timeout, claim=args.claim,
                  claim_group=args.group,
                  on_consumed="delete" if args.delete else "keep", on_error=args.on_error,
                  lock_timeout=args.lock_timeout, max_samples=args.max_samples,
                  consumed_key_retention=args.retention)  # fmt: skip
    if args.names:
        kwargs["names"] = args.names.split(",")
    reader = HiddenStateReader(args.url, **kwargs)
    names, wrong, error = [], [], None
    kept = []  # every sample, checked again at the end: no later read may overwrite one

    def check(name: str, sample: Any) -> None:
        held = name.startswith("held-")  # copies of --hold's file
        expected = load_sample(Path(args.hold) if held else Path(args.files) / name)
        if not (sample.token_ids.equal(expected.token_ids)
                and sample.hidden_states.equal(expected.hidden_states)):  # fmt: skip
            wrong.append(name)

    try:
        for sample in reader:
            name = sample.path.rsplit("/", 1)[1]
            names.append(name)
            check(name, sample)
            if not name.startswith("held-"):
                kept.append((name, sample))
            if args.announce or args.hold_first:
                print(json.dumps({"got": name}), flush=True)
            if args.hold_first:  # dies in its first training step: the test kills it
                time.sleep(3600)
            if args.slow:
                time.sleep(args.slow)  # stands for a training step
            if args.stop_after and len(names) == args.stop_after:
                reader.commit()  # trained on: recorded (a bare break would give it back)
                break  # the caller stops early: what was read ahead goes back to the group
        if args.again:  # the same reader, iterated again
            for sample in reader:
                name = sample.path.rsplit("/", 1)[1]
                names.append(name)
                check(name, sample)
                kept.append((name, sample))
    except SampleError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    reader.close()
    for name, sample in kept:
        check(name, sample)
    pool = getattr(reader._backend, "client", None)
    pool = pool and pool.receive_pool
    out = {"names": names, "wrong": sorted(set(wrong)), "stats": reader.stats.as_dict(),
           "error": error, "pool_misses": pool.misses if pool else 0}  # fmt: skip
    print(json.dumps(out), flush=True)


def dataset(args: argparse.Namespace) -> None:
    """Follow the store through ``HiddenStateDataset`` and a DataLoader with workers."""
    from torch.utils.data import DataLoader

    from hidden_state_reader import HiddenStateDataset, load_sample

    data = HiddenStateDataset(args.url, follow=True, idle_timeout=args.idle_timeout)
    names, wrong = [], []
    loader = DataLoader(data, batch_size=None, num_workers=args.workers,
                        collate_fn=lambda s: (s.path.rsplit("/", 1)[1], s))  # fmt: skip
    for name, sample in loader:
        names.append(name)
        expected = load_sample(Path(args.files) / name)
        if not sample.hidden_states.equal(expected.hidden_states):
            wrong.append(name)
    print(json.dumps({"names": names, "wrong": wrong}), flush=True)


def tamper(args: argparse.Namespace) -> None:
    """Bad objects, each announced by a commit record: truncated, bit-flipped, size lie."""
    client = StoreClient(settings(args))
    publisher = StorePublisher(client)
    good = (Path(args.files) / args.source).read_bytes()
    header = json.loads(good[8 : 8 + int.from_bytes(good[:8], "little")])
    crc = header["__metadata__"]["crc32"]
    flipped = bytearray(good)
    flipped[-3] ^= 0x40
    cases = {
        "truncated.safetensors": (good[:-64], len(good)),
        "flipped.safetensors": (bytes(flipped), len(good)),
        "sizelie.safetensors": (good, len(good) + 8),
    }
    for name, (data, size) in cases.items():
        client.put(data_key(args.prefix, name), data)
        publisher._commit(CommitRecord(name, True, size, crc))
    print(json.dumps({"names": sorted(cases)}), flush=True)


def probe(args: argparse.Namespace) -> None:
    """Wait until the store accepts a put (the master is up and a segment is mounted)."""
    client = StoreClient(settings(args))
    client.put("probe/ready", b"ready", full_timeout=args.full_timeout)
    client.remove("probe/ready")
    print(json.dumps({"ready": True}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["produce", "read", "tamper", "probe", "dataset"])
    parser.add_argument("--master", default="127.0.0.1:50051")
    parser.add_argument("--prefix", default="hs")
    parser.add_argument("--buffer", type=int, default=64 << 20)
    parser.add_argument("--files", default="")
    parser.add_argument("--fail", default="")
    parser.add_argument("--full-timeout", type=float, default=10.0)
    parser.add_argument("--hold", default="")
    parser.add_argument("--source", default="")
    parser.add_argument("--url", default="mooncake://127.0.0.1:50051/hs?hostname=127.0.0.1")
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--idle-timeout", type=float, default=None)
    parser.add_argument("--claim", action="store_true")
    parser.add_argument("--group", default="default")
    parser.add_argument("--delete", action="store_true")
    parser.add_argument("--on-error", default="skip")
    parser.add_argument("--lock-timeout", type=float, default=5.0)
    parser.add_argument("--names", default="")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--each", action="store_true")
    parser.add_argument("--hold-first", action="store_true")
    parser.add_argument("--announce", action="store_true")
    parser.add_argument("--max-samples", type=int, default=None)
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--again", action="store_true")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--retention", type=float, default=7 * 24 * 3600.0)
    args = parser.parse_args()
    roles = {"produce": produce, "read": read, "tamper": tamper, "probe": probe,
             "dataset": dataset}  # fmt: skip
    roles[args.role](args)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
