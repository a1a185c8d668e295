"""Two processes, no shared filesystem: a producer puts samples into a Mooncake Store,
a trainer follows the store and consumes each sample once.

What it shows:

* the trainer is plain ``HiddenStateReader`` on a ``mooncake://HOST:PORT/PREFIX`` URL:
  ``follow=True`` reads every producer's commit log as samples arrive, ``claim=True``
  gives each sample to one reader of the group, ``on_consumed="delete"`` frees its store
  memory after use;
* the producer stands in for vLLM with ``storage_backend="mooncake"``: it publishes
  through the same ``StorePublisher`` the connector uses (data key, then commit record).

Run it (needs a master and a segment host; see docs/scale-out.md)::

    hidden-state store-master &
    hidden-state store-host --size 1GB &
    python examples/store_two_process.py --master 127.0.0.1:50051

Prints one JSON line: the samples consumed and the reader's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata
from hidden_state_reader.store.client import StoreClient, StoreSettings
from hidden_state_reader.store.publish import StorePublisher, publish_file


def produce(master: str, prefix: str, count: int) -> None:
    settings = StoreSettings(master=master, prefix=prefix, local_hostname="127.0.0.1")
    publisher = StorePublisher(StoreClient(settings))
    staging = tempfile.mkdtemp()
    for i in range(count):
        path = os.path.join(staging, f"sample-{i}.safetensors")
        hidden = torch.full((16, 2, 32), float(i)).bfloat16()
        write_sample(
            path,
            torch.arange(16),
            hidden,
            use_lock=False,
            checksum=True,
            metadata=sample_metadata(layer_ids=[1, 2], request_id=f"req-{i}"),
        )
        publish_file(publisher, os.path.basename(path), path)  # data, then commit record


def train(master: str, prefix: str, count: int) -> dict:
    url = f"mooncake://{master}/{prefix}?hostname=127.0.0.1"
    # Stop once `count` samples are consumed. The trainer may start well before the
    # producer's first sample (its start-up, a busy machine): the idle timeout only guards
    # against a producer that died, so make it longer than the producer needs to start.
    reader = HiddenStateReader(
        url, follow=True, max_samples=count, idle_timeout=60, claim=True, on_consumed="delete"
    )
    seen = []
    for _token_ids, hidden_states in reader:
        seen.append(int(hidden_states[0, 0, 0]))  # a real loop would take a step here
    return {"consumed": sorted(seen), "stats": reader.stats.as_dict()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Producer and trainer through a Mooncake Store (docs/scale-out.md).",
        epilog="example:\n  python examples/store_two_process.py --master 127.0.0.1:50051",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--master", default="127.0.0.1:50051")
    parser.add_argument("--prefix", default="example")
    parser.add_argument("--count", type=int, default=20)
    parser.add_argument("--produce", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce:
        return produce(args.master, args.prefix, args.count)
    producer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--produce",
            "--master",
            args.master,
            "--prefix",
            args.prefix,
            "--count",
            str(args.count),
        ]
    )
    result = train(args.master, args.prefix, args.count)
    result["producer_exit"] = producer.wait()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
