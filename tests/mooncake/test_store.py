"""The store protocol with real processes: a master, a segment host, producers, readers.

Each test uses its own key prefix in the module's store (``conftest.StoreCluster``),
except the full-store test, which needs a store of its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from store_cluster import (
    BIN,
    StoreCluster,
    finish,
    finish_all,
    needs_store,
    url,
    write_store_samples,
)

pytestmark = needs_store


def test_many_readers_get_every_sample_exactly_once(cluster: StoreCluster, tmp_path: Path) -> None:
    a = write_store_samples(tmp_path / "a", [f"a-{i:02d}" for i in range(30)])
    b = write_store_samples(tmp_path / "b", [f"b-{i:02d}" for i in range(30)])
    read = ["read", "--url", url("many"), "--files", str(tmp_path / "all"), "--follow",
            "--claim", "--idle-timeout", "3", "--slow", "0.01"]  # fmt: skip
    (tmp_path / "all").mkdir()
    for path in a + b:
        (tmp_path / "all" / path.name).symlink_to(path)
    readers = [cluster.start(*read) for _ in range(3)]
    failures = {"a": "a-07.safetensors,a-21.safetensors", "b": "b-13.safetensors"}
    producers = [
        cluster.start("produce", "--prefix", "many", "--files", str(tmp_path / d), "--fail", f)
        for d, f in failures.items()
    ]
    produced = [finish(p) for p in producers]
    results = [finish(r) for r in readers]
    published = sorted(n for p in produced for n in p["published"])
    assert len(published) == 57 and sorted(p["slot"] for p in produced) == [0, 1]
    counts = Counter(n for r in results for n in r["names"])
    assert sorted(counts) == published, "every published sample is delivered"
    assert max(counts.values()) == 1, "and to exactly one reader"
    assert all(r["wrong"] == [] and r["error"] is None for r in results)
    # Failures are claimed like samples: each is reported by one reader.
    assert sum(r["stats"]["failed"] for r in results) == 3


def test_a_killed_readers_claim_is_taken_over_after_its_lease(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    files = str(tmp_path / "files")
    names = [f"c-{i:02d}.safetensors" for i in range(10)]
    write_store_samples(tmp_path / "files", [n.split(".")[0] for n in names])
    read = ["read", "--url", url("takeover") + "&lease=1.5", "--files", files, "--claim"]
    follow = [*read, "--follow", "--idle-timeout", "2", "--announce"]
    # The holder dies in its first step; the slow reader's every step outlasts the lease
    # twice over, but it renews, so what it holds must not be taken over.
    holder = cluster.start(*read, "--follow", "--hold-first")
    slow = cluster.start(*follow, "--slow", "3")
    assert len(cluster.role("produce", "--prefix", "takeover", "--files", files)["published"]) == 10
    assert holder.stdout is not None and slow.stdout is not None
    held = json.loads(holder.stdout.readline())["got"]
    assert "got" in json.loads(slow.stdout.readline())  # in its first step
    fast = cluster.start(*follow)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    results = [finish(slow), finish(fast)]
    counts = Counter(n for r in results for n in r["names"])
    assert sorted(counts) == names, "every sample, the dead reader's included"
    assert max(counts.values()) == 1, "and nothing a live reader held twice"
    assert results[0]["names"], "the slow reader held samples past the lease"
    # Taken over: the sample it died in, and the one it had claimed and read ahead (if
    # it owned another), never more (``store.read_ahead``).
    assert 1 <= sum(r["stats"]["reclaimed"] for r in results) <= 2
    assert any(held in r["names"] and r["stats"]["reclaimed"] for r in results)
    assert all(r["wrong"] == [] and r["error"] is None for r in results)
    # Consumed is consumed: the group gets nothing again; another group gets all.
    assert cluster.role(*read)["names"] == []
    other = cluster.role("read", "--url", url("takeover"), "--files", files, "--claim",
                         "--group", "other")  # fmt: skip
    assert sorted(other["names"]) == names


def test_a_reader_that_stops_early_gives_back_what_it_read_ahead(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    files = str(tmp_path / "files")
    names = [f"e-{i:02d}.safetensors" for i in range(8)]
    write_store_samples(tmp_path / "files", [n.split(".")[0] for n in names])
    assert len(cluster.role("produce", "--prefix", "early", "--files", files)["published"]) == 8
    read = ["read", "--url", url("early") + "&lease=1.5", "--files", files, "--claim",
            "--follow", "--idle-timeout", "2", "--delete"]  # fmt: skip
    # max_samples: the reader claims no sample beyond the last it yields.
    limited = cluster.role(*read, "--max-samples", "2")
    # Breaking out of the loop: the sample read ahead meanwhile is given back.
    stopped = cluster.role(*read, "--stop-after", "2", "--slow", "0.2")
    # The same, then the same reader iterated again: it must not count its own given-back
    # claim as won (another reader may have taken it over); it takes it over itself.
    again = cluster.role(*read, "--stop-after", "1", "--slow", "0.2", "--again")
    rest = cluster.role(*read)
    assert len(limited["names"]) == len(stopped["names"]) == 2
    counts = Counter(n for r in (limited, stopped, again, rest) for n in r["names"])
    assert sorted(counts) == names and max(counts.values()) == 1, "each once, none lost"
    assert limited["stats"]["reclaimed"] == stopped["stats"]["reclaimed"] == 0
    assert again["stats"]["reclaimed"] + rest["stats"]["reclaimed"] <= 2, "the ones read ahead"
    assert all(r["wrong"] == [] and r["error"] is None for r in (limited, stopped, again, rest))


def test_a_name_published_again_is_delivered_once(cluster: StoreCluster, tmp_path: Path) -> None:
    # A retried request with the same idempotency key publishes the same name again.
    files = str(tmp_path / "files")
    write_store_samples(tmp_path / "files", [f"retry-{i}" for i in range(4)])
    first = cluster.role("produce", "--prefix", "retry", "--files", files)["published"]
    again = cluster.role("produce", "--prefix", "retry", "--files", files)["published"]
    assert len(first) == 4 and again == first
    got = cluster.role("read", "--url", url("retry"), "--files", files)
    assert sorted(got["names"]) == sorted(first) and got["wrong"] == [] and got["error"] is None


def _clean(cluster: StoreCluster, prefix: str, *args: str) -> dict:
    """``hidden-state clean URL --json`` in the store's namespace."""
    argv = [str(BIN / "hidden-state"), "clean", url(prefix), "--json", *args]
    proc = cluster.net.popen(argv, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out)


def test_a_consumed_key_is_remembered_in_the_store(cluster: StoreCluster, tmp_path: Path) -> None:
    files = str(tmp_path / "files")
    paths = write_store_samples(tmp_path / "files", [f"key-{i}" for i in range(3)], keyed=True)
    names = sorted(p.name for p in paths)
    produce = ["produce", "--prefix", "consumed", "--files", files]
    read = ["read", "--url", url("consumed"), "--files", files, "--delete"]
    assert cluster.role(*produce)["stored"] == names
    first = cluster.role(*read)
    assert sorted(first["names"]) == names and first["wrong"] == []
    # A retry of each key after the reader deleted it: nothing is stored or announced.
    assert cluster.role(*produce)["stored"] == []
    assert cluster.role(*read)["names"] == []
    # A copy stored anyway (a retry that checked before the key was consumed) is
    # removed unread by the deleting reader.
    assert cluster.role(*produce, "--force")["stored"] == names
    assert cluster.role(*read)["names"] == []
    assert cluster.role(*produce)["stored"] == [], "the copies were removed"
    # clean: the records are live (nothing to expire) until told to forget them.
    assert _clean(cluster, "consumed")["files"] == []
    forgotten = _clean(cluster, "consumed", "--consumed-keys-older-than", "0")["files"]
    assert sorted(f["path"] for f in forgotten) == [f"consumed/consumed/{n}" for n in names]
    assert {f["outcome"] for f in forgotten} == {"removed"}
    # Forgotten: a retry is written again. Consumed with a retention that is over by
    # the time the next producer starts: written again too. (Read by name from here on:
    # the logs announce each name again with every copy.)
    pull = [*read, "--names", ",".join(names)]
    assert cluster.role(*produce)["stored"] == names
    assert sorted(cluster.role(*pull, "--retention", "0.001")["names"]) == names
    assert cluster.role(*produce)["stored"] == names
    again = cluster.role(*pull)
    assert sorted(again["names"]) == names and again["wrong"] == []
    # Consumed again: the expired records were replaced by live ones.
    assert _clean(cluster, "consumed")["files"] == []


def test_samples_kept_by_the_caller_are_never_overwritten(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    # A receive arena of four ranges; the reader keeps all 12 samples (and checks each
    # again at the end), so 8 of them are read into fresh memory instead.
    files = str(tmp_path / "files")
    write_store_samples(tmp_path / "files", [f"k-{i:02d}" for i in range(12)])
    assert len(cluster.role("produce", "--prefix", "kept", "--files", files)["published"]) == 12
    got = cluster.role("read", "--url", url("kept") + "&buffer=16KiB", "--files", files)
    assert len(got["names"]) == 12 and got["wrong"] == [] and got["error"] is None
    assert got["pool_misses"] >= 8


def test_dataset_follows_a_store_with_loader_workers(cluster: StoreCluster, tmp_path: Path) -> None:
    files = str(tmp_path / "files")
    names = [f"d-{i:02d}.safetensors" for i in range(12)]
    write_store_samples(tmp_path / "files", [n.split(".")[0] for n in names])
    loader = cluster.start("dataset", "--url", url("dataset"), "--files", files,
                           "--workers", "2", "--idle-timeout", "3")  # fmt: skip
    assert len(cluster.role("produce", "--prefix", "dataset", "--files", files)["published"]) == 12
    got = finish(loader)
    assert sorted(got["names"]) == names, "each sample once across the two workers"
    assert got["wrong"] == []


def test_killed_producer_loses_nothing_it_published(cluster: StoreCluster, tmp_path: Path) -> None:
    write_store_samples(tmp_path / "files", [f"s-{i}" for i in range(4)])
    big = write_store_samples(tmp_path / "big", ["big"], tokens=2048, layers=3, hidden=2048)[0]
    producer = cluster.start("produce", "--prefix", "kill", "--files", str(tmp_path / "files"),
                             "--hold", str(big), "--buffer", str(128 << 20))  # fmt: skip
    assert producer.stdout is not None
    first = producer.stdout.readline()  # printed once its four samples are published
    assert '"published"' in first
    producer.send_signal(signal.SIGKILL)  # mid-way through putting copies of the 24 MB sample
    producer.wait()
    # A new producer (a restarted server) takes a new slot; the segment host kept it all.
    later = write_store_samples(tmp_path / "later", [f"t-{i}" for i in range(3)])
    restarted = cluster.role("produce", "--prefix", "kill", "--files", str(tmp_path / "later"))
    assert restarted["slot"] == 1
    for path in later:
        (tmp_path / "files" / path.name).symlink_to(path)
    got = cluster.role("read", "--url", url("kill") + "&buffer=128MiB", "--files",
                       str(tmp_path / "files"), "--hold", str(big))  # fmt: skip
    small = [n for n in got["names"] if not n.startswith("held-")]
    assert small == [f"s-{i}.safetensors" for i in range(4)] + [p.name for p in later]
    held = [n for n in got["names"] if n.startswith("held-")]
    assert held == [f"held-{i}.safetensors" for i in range(len(held))], "committed in order"
    assert got["wrong"] == [] and got["stats"]["corrupt"] == got["stats"]["incomplete"] == 0


def test_missing_corrupt_and_truncated_samples_are_named(
    cluster: StoreCluster, tmp_path: Path
) -> None:
    files = tmp_path / "files"
    write_store_samples(files, ["good"])
    cluster.role("tamper", "--prefix", "bad", "--files", str(files), "--source", "good.safetensors")
    skipping = cluster.start("read", "--url", url("bad"), "--files", str(files))
    pulling = cluster.start("read", "--url", url("bad"), "--files", str(files), "--each",
                            "--names", "never.safetensors,flipped.safetensors",
                            "--lock-timeout", "1", "--on-error", "raise")  # fmt: skip
    skipped, (timed_out, mismatch) = finish(skipping), finish_all(pulling)
    assert skipped["names"] == []
    # Truncated, and shorter than its commit record says: both incomplete.
    assert skipped["stats"]["incomplete"] == 2
    assert skipped["stats"]["corrupt"] == 1  # a flipped bit: CRC32
    assert timed_out["error"]["type"] == "LockTimeoutError"
    assert "mooncake://127.0.0.1:50051/bad/never.safetensors" in timed_out["error"]["message"]
    assert mismatch["error"]["type"] == "CorruptSampleError"
    assert "CRC32 mismatch" in mismatch["error"]["message"]
    assert "bad/flipped.safetensors" in mismatch["error"]["message"]


@pytest.fixture()
def small_store(tmp_path: Path) -> StoreCluster:
    store = StoreCluster(tmp_path / "logs", segment="40MB")
    yield store
    store.close()


def test_full_store_refuses_then_applies_back_pressure(
    small_store: StoreCluster, tmp_path: Path
) -> None:
    # 12 samples of 8 MB into a 40 MB segment.
    names = [f"f-{i:02d}" for i in range(12)]
    write_store_samples(tmp_path / "files", names, tokens=1024, layers=2, hidden=2048)
    files = str(tmp_path / "files")
    # Nobody consumes: puts wait briefly, then the samples fail with a recorded reason.
    refused = small_store.role("produce", "--prefix", "full", "--files", files,
                               "--full-timeout", "0.3")  # fmt: skip
    assert 3 <= len(refused["published"]) < 12 and refused["failed"]
    # Nothing was evicted: every published sample is intact; each refusal is recorded.
    first = small_store.role("read", "--url", url("full"), "--files", files, "--delete")
    assert first["names"] == refused["published"] and first["wrong"] == []
    assert first["stats"]["failed"] == len(refused["failed"])
    # With a consumer that deletes what it used, a waiting producer gets through.
    reader = small_store.start("read", "--url", url("wait"), "--files", files, "--follow",
                               "--delete", "--idle-timeout", "8", "--slow", "0.2")  # fmt: skip
    waited = small_store.role("produce", "--prefix", "wait", "--files", files,
                              "--full-timeout", "60")  # fmt: skip
    consumed = finish(reader)
    assert waited["failed"] == [] and len(waited["published"]) == 12
    assert waited["max_publish_s"] > 0.1, "some put had to wait for room"
    assert consumed["names"] == waited["published"] and consumed["wrong"] == []
