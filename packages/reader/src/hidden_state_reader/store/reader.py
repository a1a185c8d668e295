"""``StoreReader``: what ``HiddenStateReader("mooncake://...")`` returns.

The same iteration contract as the file reader, over the store protocol of
``format.store_keys``: samples announced by commit records (or pulled by name), claimed
first-put-wins for exactly-once delivery within a consumer group, size- and
CRC32-checked, deleted after use if asked. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence

import torch

from hidden_state_reader.errors import (
    FailedSampleError,
    IncompleteSampleError,
    LockTimeoutError,
    SampleError,
    WaitCancelledError,
)
from hidden_state_reader.format.flockwait import CancelToken
from hidden_state_reader.format.store_keys import CommitRecord, data_key, failed_key
from hidden_state_reader.options import OnConsumed, OnError
from hidden_state_reader.read.stats import ReaderStats
from hidden_state_reader.reader import HiddenStateReader
from hidden_state_reader.sample.load import LoadOptions
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.sample.states import GRACE
from hidden_state_reader.store.claims import StoreClaims
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.follow import CommitLog
from hidden_state_reader.store.load import load_bytes
from hidden_state_reader.store.url import parse_store_url, store_url

log = logging.getLogger("hidden_state_reader.reader")

_POLL_MIN = 0.002
# (name, ok, record): ok False means the producer recorded a failure instead.
Entry = tuple[str, bool, "CommitRecord | None"]


class StoreReader(HiddenStateReader):
    """Iterate over samples in a Mooncake Store; the arguments are ``HiddenStateReader``'s.

    ``path`` is a ``mooncake://HOST:PORT/PREFIX`` URL (``store.url``). Without ``names``
    the reader follows every producer's commit log (``follow=True`` keeps polling, like
    ``tail -f``); with ``names`` it pulls exactly those samples, in the order they become
    complete, each waited for up to ``lock_timeout`` seconds. ``claim=True`` gives each
    sample to one reader of ``claim_group``; a following reader takes over the claim of a
    reader that stopped renewing it for the URL's ``lease`` seconds (``store.claims``), so
    a sample whose reader died is delivered again. ``on_consumed="delete"`` removes it
    after use. Not available: ``on_consumed="move"``, ``done_dir``, ``watch`` (no files).

    Raises:
        ValueError: A bad URL or an option the store does not support.
        StoreError: The store cannot be joined (names the master).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        follow: bool = False,
        idle_timeout: float | None = None,
        max_samples: int | None = None,
        claim: bool = False,
        claim_group: str = "default",
        on_consumed: OnConsumed = "keep",
        done_dir: str | os.PathLike[str] | None = None,
        on_error: OnError = "skip",
        lock_timeout: float | None = 600.0,
        names: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        pin_memory: bool = False,
        verify_checksum: bool = False,
        mmap: bool = True,
        raw_fp8: bool = False,
        device: str | torch.device | None = None,
        watch: str = "auto",
        rescan_interval: float = 30.0,
        poll_interval: float = 1.0,
        orphan_grace: float = GRACE,
    ) -> None:
        self.root = os.fspath(path)
        settings = parse_store_url(self.root)
        _check_store_options(follow=follow, names=names, on_consumed=on_consumed,
                             on_error=on_error, done_dir=done_dir, watch=watch)  # fmt: skip
        self.follow = follow
        self.idle_timeout = idle_timeout
        self.max_samples = max_samples
        self.on_consumed = on_consumed
        self.on_error = on_error
        self.lock_timeout = lock_timeout
        self.orphan_grace = orphan_grace
        self._names = list(names) if names is not None else None
        self._poll_max = max(_POLL_MIN, min(poll_interval, 0.1))
        self._load = LoadOptions(
            layers, layer_ids, dtype, pin_memory, verify_checksum, mmap, raw_fp8=raw_fp8,
            device=device,
        )
        self._cancel = CancelToken()
        self._closed = False
        self.stats = ReaderStats()
        self.address = store_url(settings)
        self.client = StoreClient(settings, where=self.address)
        self.prefix = settings.prefix
        token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        self._leases = (
            StoreClaims(self.client, claim_group, token, settings.claim_lease) if claim else None
        )

    def close(self) -> None:
        """Stop iterating (safe from another thread, or twice); leaves the store."""
        if not self._closed:
            self._closed = True
            self._cancel.cancel()

    @property
    def pending(self) -> list[str]:
        """Always empty: the store shows a sample only once it is complete."""
        return []

    def where(self, name: str) -> str:
        """The address of sample ``name`` (``Sample.path`` and error messages)."""
        return f"{self.address}/{name}"

    def __iter__(self) -> Iterator[Sample]:
        if self._closed or self.max_samples == 0:
            return
        yielded = 0
        try:
            for name, ok, record in self._entries():
                sample = self._take(name, ok, record)
                if sample is None:
                    continue
                yielded += 1
                try:
                    yield sample
                finally:
                    self._settle(name)
                if self.max_samples is not None and yielded >= self.max_samples:
                    return
        except WaitCancelledError:
            return
        finally:
            if self._leases is not None:
                self._leases.stop()

    # -- where entries come from --------------------------------------------------

    def _entries(self) -> Iterator[Entry]:
        return self._pulled() if self._names is not None else self._logged()

    def _logged(self) -> Iterator[Entry]:
        cursor = CommitLog(self.client, hole_grace=self.orphan_grace)
        last_news, delay = time.monotonic(), _POLL_MIN
        while not self._closed:
            records = cursor.poll()
            for _key, record in records:
                yield record.name, record.ok, record
            for entry in self._leases.takeovers() if self._leases is not None else ():
                self.stats.reclaimed += 1
                yield entry  # type: ignore[misc]
            if records:
                last_news, delay = time.monotonic(), _POLL_MIN
                continue
            idle = time.monotonic() - last_news
            stop = not self.follow or (self.idle_timeout is not None and idle >= self.idle_timeout)
            # Before stopping, wait until every claim seen held is done or proven alive.
            if stop and (self._leases is None or self._leases.settled()):
                return
            self._cancel.sleep(delay)
            delay = min(delay * 2, self._poll_max)

    def _pulled(self) -> Iterator[Entry]:
        assert self._names is not None
        pending, started, delay = list(self._names), time.monotonic(), _POLL_MIN
        while pending and not self._closed:
            keys = [data_key(self.prefix, n) for n in pending]
            found = self.client.exists(keys + [failed_key(self.prefix, n) for n in pending])
            failed = found[len(keys) :]
            ready = [(n, found[i]) for i, n in enumerate(pending) if found[i] or failed[i]]
            pending = [n for n in pending if n not in {r for r, _ in ready}]
            for name, ok in ready:
                yield name, ok, None
            if ready:
                delay = _POLL_MIN
                continue
            if self.lock_timeout is not None and time.monotonic() - started >= self.lock_timeout:
                for name in pending:
                    self._timed_out(name)
                return
            self._cancel.sleep(delay)
            delay = min(delay * 2, self._poll_max)

    # -- one entry ------------------------------------------------------------------

    def _take(self, name: str, ok: bool, record: CommitRecord | None) -> Sample | None:
        if self._leases is None:
            return self._fetch(name, ok, record)
        if not self._leases.claim(name, (name, ok, record)):
            self.stats.claimed_elsewhere += 1
            return None
        sample = None
        try:
            sample = self._fetch(name, ok, record)
            return sample
        finally:
            if sample is None:  # failed, vanished or bad: consumed all the same
                self._leases.finish(name)

    def _fetch(self, name: str, ok: bool, record: CommitRecord | None) -> Sample | None:
        where = self.where(name)
        if not ok:
            raw = self.client.get(failed_key(self.prefix, name)) or b"{}"
            reason = str(json.loads(raw).get("reason", "no reason recorded"))
            self._bad(FailedSampleError(where, f"the writer gave up: {reason}"), "failed")
            return None
        data = self.client.get_object(data_key(self.prefix, name))
        if data is None:
            self.stats.vanished += 1  # consumed and deleted by another reader
            return None
        try:
            sample = load_bytes(where, data, record, self._load)
        except SampleError as exc:
            counter = "incomplete" if isinstance(exc, IncompleteSampleError) else "corrupt"
            self._bad(exc, counter)
            return None
        if sample.num_tokens == 0:
            self.stats.empty += 1
            return None
        self.stats.yielded += 1
        self.stats.bytes += sample.nbytes
        self.stats.tokens += sample.num_tokens
        return sample

    def _bad(self, error: SampleError, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        if self.on_error == "raise":
            raise error
        log.warning("skipping %s", error)

    def _timed_out(self, name: str) -> None:
        self.stats.lock_timeouts += 1
        error = LockTimeoutError(
            self.where(name),
            f"neither the sample nor a failure record appeared within {self.lock_timeout:g} s "
            "(the request has not finished, or its producer died before publishing it)",
        )
        if self.on_error == "raise":
            raise error
        log.warning("%s", error)

    def _settle(self, name: str) -> None:
        # Done first: a crash in between leaves data behind, never a second delivery.
        if self._leases is not None:
            self._leases.finish(name)
        if self.on_consumed == "delete":
            self.client.remove(data_key(self.prefix, name))


def _check_store_options(
    *, follow: bool, names: Sequence[str] | None, on_consumed: str, on_error: str,
    done_dir: object, watch: str,
) -> None:  # fmt: skip
    if on_consumed not in ("keep", "delete"):
        raise ValueError(f"on_consumed: a store reader can 'keep' or 'delete', not {on_consumed!r}")
    if done_dir is not None or watch != "auto":
        raise ValueError("done_dir and watch apply to directories, not to a mooncake:// store")
    if on_error not in ("skip", "raise"):
        raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
    if follow and names is not None:
        raise ValueError("names= lists a fixed set of samples; it cannot be followed")
