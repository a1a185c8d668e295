"""One role in a Mooncake Store test, run as its own process inside the test's namespace.

    python -m tools.store_role produce --master 127.0.0.1:50051 --count 20 ...
    python -m tools.store_role read --url mooncake://127.0.0.1:50051/hs --follow ...
    python -m tools.store_role tamper --master 127.0.0.1:50051
    python -m tools.store_role probe --master 127.0.0.1:50051

Each prints one JSON line on stdout when done (``produce --hold`` prints ``HOLDING`` and
waits to be killed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from samples import make_tensors  # noqa: E402

from hidden_state_reader.format import sample_metadata, write_sample  # noqa: E402
from hidden_state_reader.format.store_keys import CommitRecord, data_key  # noqa: E402
from hidden_state_reader.store.client import StoreClient, StoreSettings  # noqa: E402
from hidden_state_reader.store.publish import StorePublisher, publish_file  # noqa: E402

LAYERS, HIDDEN = 3, 16


def sample_index(name: str) -> int:
    """``p<slot>-<index>.safetensors`` -> a global index whose tensors are known."""
    slot, index = name.split(".")[0][1:].split("-")
    return int(slot) * 100_000 + int(index)


def staged(index: int, tokens: int, hidden: int) -> str:
    token_ids, hidden_states = make_tensors(index, tokens, LAYERS, hidden)
    path = os.path.join(tempfile.mkdtemp(dir="/dev/shm"), f"s{index}.safetensors")
    meta = sample_metadata(layer_ids=list(range(LAYERS)), request_id=f"req-{index}")
    write_sample(path, token_ids, hidden_states, metadata=meta, use_lock=False, checksum=True)
    return path


def settings(args: argparse.Namespace) -> StoreSettings:
    return StoreSettings(
        master=args.master, prefix=args.prefix, local_hostname="127.0.0.1",
        buffer_bytes=args.buffer,
    )  # fmt: skip


def produce(args: argparse.Namespace) -> None:
    publisher = StorePublisher(StoreClient(settings(args)), full_timeout=args.full_timeout)
    published, failed, waited = [], [], 0.0
    for i in range(args.count):
        name = f"p{publisher.slot}-{i}.safetensors"
        if args.fail_every and i % args.fail_every == args.fail_every - 1:
            publisher.fail(name, "injected failure")
            failed.append(name)
            continue
        path = staged(sample_index(name), args.tokens, args.hidden)
        started = time.monotonic()
        try:
            publish_file(publisher, name, path)
            published.append(name)
        except Exception as exc:
            publisher.fail(name, f"publish failed: {exc}")
            failed.append(name)
        waited = max(waited, time.monotonic() - started)
    if args.hold:
        # The next sample's put is in flight when the test kills this process.
        name = f"p{publisher.slot}-{args.count}.safetensors"
        path = staged(sample_index(name), args.hold_tokens, args.hidden)
        print(json.dumps({"holding": name, "published": published}), flush=True)
        while True:
            publish_file(publisher, name, path)
            name = f"{name}.again"
            path = staged(sample_index(name.split(".")[0] + ".x"), args.hold_tokens, args.hidden)
    result = {"slot": publisher.slot, "published": published, "failed": failed,
              "max_publish_s": waited}  # fmt: skip
    print(json.dumps(result), flush=True)


def read(args: argparse.Namespace) -> None:
    from hidden_state_reader import HiddenStateReader, SampleError

    kwargs = dict(follow=args.follow, idle_timeout=args.idle_timeout, claim=args.claim,
                  on_consumed="delete" if args.delete else "keep", on_error=args.on_error,
                  lock_timeout=args.lock_timeout)  # fmt: skip
    if args.names:
        kwargs["names"] = args.names.split(",")
    reader = HiddenStateReader(args.url, **kwargs)
    names, wrong, error = [], [], None
    try:
        for sample in reader:
            name = sample.path.rsplit("/", 1)[1]
            names.append(name)
            tokens, hidden = make_tensors(sample_index(name), sample.num_tokens, LAYERS,
                                          sample.hidden_states.shape[2])  # fmt: skip
            if not (sample.token_ids.equal(tokens) and sample.hidden_states.equal(hidden)):
                wrong.append(name)
            if args.slow:
                time.sleep(args.slow)  # a trainer step
    except SampleError as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    out = {"names": names, "wrong": wrong, "stats": reader.stats.as_dict(), "error": error}
    print(json.dumps(out), flush=True)


def tamper(args: argparse.Namespace) -> None:
    """Three bad samples, each with a commit record: truncated, bit-flipped, size lie."""
    client = StoreClient(settings(args))
    publisher = StorePublisher(client)
    good = Path(staged(7, 8, HIDDEN)).read_bytes()
    crc = json.loads(good[8 : 8 + int.from_bytes(good[:8], "little")])["__metadata__"]["crc32"]
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
    parser.add_argument("role", choices=["produce", "read", "tamper", "probe"])
    parser.add_argument("--master", default="127.0.0.1:50051")
    parser.add_argument("--prefix", default="hs")
    parser.add_argument("--buffer", type=int, default=64 << 20)
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--fail-every", type=int, default=0)
    parser.add_argument("--full-timeout", type=float, default=10.0)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--hold-tokens", type=int, default=8)
    parser.add_argument("--url", default="mooncake://127.0.0.1:50051/hs?hostname=127.0.0.1")
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--idle-timeout", type=float, default=None)
    parser.add_argument("--claim", action="store_true")
    parser.add_argument("--delete", action="store_true")
    parser.add_argument("--on-error", default="skip")
    parser.add_argument("--lock-timeout", type=float, default=5.0)
    parser.add_argument("--names", default="")
    parser.add_argument("--slow", type=float, default=0.0)
    args = parser.parse_args()
    {"produce": produce, "read": read, "tamper": tamper, "probe": probe}[args.role](args)


if __name__ == "__main__":
    main()
