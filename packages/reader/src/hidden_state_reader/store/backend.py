"""The store backend: samples in a Mooncake Store (what ``mooncake://`` paths read).

``StoreBackend`` implements the reader's ``Backend`` protocol (``read.backend``) over
the store protocol of ``format.store_keys``: samples are discovered by following every
producer's commit log (``follow.CommitLog``), or pulled by name; claimed first-put-wins
for delivery to one reader of a consumer group (``claims``); transferred straight into
the memory that becomes the sample's and size- and CRC32-checked (``fetch``, ``pool``),
one sample ahead of the caller in a thread of their own (``read_ahead``); then loaded
through the file format's own loader in the caller's thread (``load``) and judged by the
one sample-state rule. The reader's iteration, error policy and options are the same as
for a directory. See ``docs/scale-out.md``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Iterator, Sequence

from hidden_state_reader.errors import (
    LockTimeoutError,
    WaitCancelledError,
)
from hidden_state_reader.files.flockwait import CancelToken
from hidden_state_reader.files.identity import unique_token
from hidden_state_reader.format.store_keys import data_key, failed_key
from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.read.backend import Outcome, OutcomeKind
from hidden_state_reader.read.claim_lifecycle import Ending, HeldClaim, settle
from hidden_state_reader.store.claims import StoreClaims
from hidden_state_reader.store.client import StoreClient
from hidden_state_reader.store.fetch import Fetched, fetch, load
from hidden_state_reader.store.follow import CommitLog
from hidden_state_reader.store.key_memory import KeyMemory
from hidden_state_reader.store.membership import StoreMembership
from hidden_state_reader.store.read_ahead import ReadAhead, Room
from hidden_state_reader.store.turns import Entry, GroupTurns
from hidden_state_reader.store.url import parse_store_url, store_url

_POLL_MIN = 0.002
# While records keep coming (one within _STREAMING s), the log is polled at least every
# _POLL_STREAMING s: the sample's discovery is part of its latency. What idle polling
# costs: docs/scale-out.md, "Finding new samples".
_POLL_STREAMING = 0.01
_STREAMING = 1.0
_READ_AHEAD = 1  # samples claimed and read ahead of the one the caller is using


class StoreBackend:
    """Samples of one store prefix, ``mooncake://HOST:PORT/PREFIX`` (``store.url``).

    Without ``names`` the backend follows every producer's commit log (``follow=True``
    keeps polling, like ``tail -f``); with ``names`` it pulls exactly those samples, in
    the order they become complete, each waited for up to ``lock_timeout`` seconds.
    ``claim=True`` gives each sample to one reader of ``claim_group``; a following
    reader takes over the claim of a reader that stopped renewing it for the URL's
    ``lease`` seconds (``store.claims``), so a sample whose reader died is delivered
    again. ``on_consumed="delete"`` removes it after use, recording a keyed sample's key
    first (``store.key_memory``). Not available:
    ``on_consumed="move"``, ``done_dir``, ``watch`` (there are no files).

    Args:
        url: The store URL.
        options: The reader's options.
        cancel: Cancelled by the reader's ``close``; interrupts a wait in progress.

    Raises:
        ValueError: A bad URL or an option the store does not support.
        StoreError: The store cannot be joined (names the master).
    """

    def __init__(self, url: str, options: ReaderOptions, cancel: CancelToken) -> None:
        settings = parse_store_url(url)
        _check_store_options(options)
        self.options = options
        self._cancel = cancel
        self._poll_max = max(_POLL_MIN, min(options.poll_interval, 0.1))
        self.where = store_url(settings)
        self.client = StoreClient(settings, where=self.where)
        self.prefix = settings.prefix
        token = unique_token()
        self._leases = None
        if options.claim:
            self._leases = StoreClaims(
                self.client,
                options.claim_group,
                token,
                settings.claim_lease,
                takes_over=options.names is None,
            )
        # A follower of a group is a member of it while it follows: its samples are
        # routed by the group's turns (``store.turns``).
        self._turns: GroupTurns | None = None
        if options.claim and options.follow and options.names is None:
            group = options.claim_group
            membership = StoreMembership(self.client, group, token, settings.claim_lease)
            self._turns = GroupTurns(self.client, self.prefix, group, membership,
                                     options.claim_steal_after)  # fmt: skip
        self._keys = KeyMemory.of(self.client, options)  # a deleting reader's consumed keys
        # Passes in progress: their cancel tokens and read-aheads (``close`` stops both).
        self._passes: dict[CancelToken, ReadAhead[Outcome | Fetched] | None] = {}

    def address(self, name: str) -> str:
        """The address of sample ``name`` (``Sample.path`` and error messages)."""
        return f"{self.where}/{name}"

    # -- the Backend protocol ---------------------------------------------------------

    def outcomes(self, names: Sequence[str] | None = None) -> Generator[Outcome, None, None]:
        """Decided samples: from the commit logs, or the names asked for.

        A pass over more than one sample runs in a read-ahead thread
        (``store.read_ahead``): the next sample is claimed, transferred and checked
        while the caller uses this one. Membership ends with the pass, in the caller's
        thread; claims keep their leases until each is settled (``consumed``).
        """
        token = CancelToken()  # this pass's waits: ended by ``close`` or by the caller
        single = names is not None and len(names) == 1  # ``in_order``: nothing to overlap
        here = self._decisions(names, token, _no_wait) if single else None
        ahead: ReadAhead[Outcome | Fetched] | None = None
        decisions: Iterable[Outcome | Fetched]
        if here is not None:
            decisions = here
        else:
            decisions = ahead = ReadAhead(lambda room: self._decisions(names, token, room),
                                          holds_sample=_holds_sample, samples=_READ_AHEAD,
                                          interrupt=token.cancel)  # fmt: skip
        self._passes[token] = ahead
        if self._cancel.cancelled:
            self.close()
        try:
            for decision in decisions:
                if token.cancelled:  # closed: hand out nothing more, give it back
                    settle(decision.claim, Ending.RETURNED)
                    break
                yield load(decision, self.options) if isinstance(decision, Fetched) else decision
        finally:
            if here is not None:
                here.close()
            if ahead is not None:
                for decision in ahead.close():  # decided, never handed out: give them back
                    settle(decision.claim, Ending.RETURNED)
            self._passes.pop(token, None)
            if self._leases is not None:
                self._leases.stop_when_released()
            if self._turns is not None:
                self._turns.leave()

    def _decisions(
        self, names: Sequence[str] | None, token: CancelToken, room: Room
    ) -> Generator[Outcome | Fetched, None, None]:
        """One pass: each entry claimed (when asked to) and fetched, in order.

        ``room()`` is called before each claim: reading ahead waits there until the
        caller has taken the sample read before. Stops after ``max_samples`` samples
        fetched (on a pass over the whole store), so that reading ahead claims no sample
        the caller will not take.
        """
        limit = self.options.max_samples if names is None else None
        names = self.options.names if names is None else names
        entries = self._pulled(names, token) if names is not None else self._logged(token)
        fetched = 0
        try:
            for entry in entries:
                if isinstance(entry, Outcome):
                    yield entry
                    continue
                room()
                decision = self._decide(entry)
                keys = self._keys
                if keys is not None and isinstance(decision, Fetched) and keys.drops(decision):
                    continue  # a copy of a key consumed already: removed unread
                yield decision
                fetched += isinstance(decision, Fetched)
                if limit is not None and fetched >= limit:
                    return
        except WaitCancelledError:
            return

    def pending(self) -> list[str]:
        """Always empty: the store shows a sample only once it is complete."""
        return []

    def watch_counters(self) -> None:
        """None: a store has no directory watch."""
        return None

    def set_aside(self, name: str, reason: str) -> bool:
        """Nothing to move aside: a bad object stays where it is."""
        return False

    def forget(self, name: str) -> None:
        """Nothing to forget: the commit log hands out each record once."""

    def consumed(self, name: str, claim: HeldClaim | None) -> None:
        """Settle the claim, then delete the sample if asked (``on_consumed="delete"``).

        Done first: a crash in between leaves data behind, never a second delivery. A
        keyed sample whose key cannot be recorded is kept (``KeyMemory.before_delete``).
        """
        settle(claim, Ending.CONSUMED)
        keys = self._keys  # set only when deleting
        if self.options.on_consumed == "delete" and (keys is None or keys.before_delete(name)):
            self.client.remove(data_key(self.prefix, name))

    def receipt(self, name: str, claim: HeldClaim | None) -> None:
        """None: only this process's store client can settle a claim of this reader."""
        return None

    def released(self, name: str, claim: HeldClaim | None) -> None:
        """Nothing to do: with no receipts, no other process ever settles a sample here."""

    def close(self) -> None:
        """End every pass in progress: its waits and its read-ahead (safe from any thread)."""
        for token, ahead in list(self._passes.items()):
            token.cancel()
            if ahead is not None:
                ahead.stop()

    # -- where entries come from ------------------------------------------------------

    def _logged(self, token: CancelToken) -> Iterator[Entry | Outcome]:
        cursor = CommitLog(self.client, hole_grace=self.options.orphan_grace)
        last_news, delay = time.monotonic(), _POLL_MIN
        idle_timeout = self.options.idle_timeout
        while not token.cancelled:
            turns = self._turns
            if turns is not None:
                turns.keep_membership()
            records = cursor.poll()
            for _key, record in records:
                entry = Entry(record.name, record.ok, record)
                routed = entry if turns is None else turns.route(entry)
                if routed is not None:
                    yield routed
            if turns is not None:
                yield from turns.due()
            for taken in self._leases.takeovers() if self._leases is not None else ():
                assert isinstance(taken, Entry)
                yield taken
            if records:
                last_news, delay = time.monotonic(), _POLL_MIN
                continue
            idle = time.monotonic() - last_news
            stop = not self.options.follow or (idle_timeout is not None and idle >= idle_timeout)
            # Before stopping, wait until every claim seen held is done or proven alive,
            # and every sample this reader stands in for has had its turn.
            settled = self._leases is None or self._leases.settled()
            if stop and settled and not (turns is not None and turns.waiting):
                return
            token.sleep(delay)
            cap = _POLL_STREAMING if idle < _STREAMING else self._poll_max
            delay = min(delay * 2, max(_POLL_MIN, min(cap, self._poll_max)))

    def _pulled(self, names: Sequence[str], token: CancelToken) -> Iterator[Entry | Outcome]:
        pending, started, delay = list(names), time.monotonic(), _POLL_MIN
        timeout = self.options.lock_timeout
        while pending and not token.cancelled:
            keys = [data_key(self.prefix, n) for n in pending]
            found = self.client.exists(keys + [failed_key(self.prefix, n) for n in pending])
            failed = found[len(keys) :]
            ready = [(n, found[i]) for i, n in enumerate(pending) if found[i] or failed[i]]
            pending = [n for n in pending if n not in {r for r, _ in ready}]
            for name, ok in ready:
                yield Entry(name, ok)
            if ready:
                delay = _POLL_MIN
                continue
            if timeout is not None and time.monotonic() - started >= timeout:
                for name in pending:
                    yield _timed_out(self.address(name), name, timeout)
                return
            token.sleep(delay)
            delay = min(delay * 2, self._poll_max)

    # -- one entry --------------------------------------------------------------------

    def _decide(self, entry: Entry) -> Outcome | Fetched:
        """Claim (when asked to) and fetch one announced sample."""
        if self._leases is None:
            return self._fetch(entry, None)
        claim = self._leases.claim(entry.name, entry)
        if claim is None:
            return Outcome(OutcomeKind.CLAIMED, entry.name)
        try:
            decision = self._fetch(entry, claim)
        except BaseException:
            settle(claim, Ending.RETURNED)
            raise
        if isinstance(decision, Outcome) and decision.kind is OutcomeKind.VANISHED:
            settle(claim, Ending.GONE)
        return decision

    def _fetch(self, entry: Entry, claim: HeldClaim | None) -> Outcome | Fetched:
        return fetch(self.client, entry.name, self.address(entry.name), entry.record,
                     entry.ok, claim)  # fmt: skip


def _timed_out(where: str, name: str, timeout: float) -> Outcome:
    error = LockTimeoutError(
        where,
        f"neither the sample nor a failure record appeared within {timeout:g} s "
        "(the request has not finished, or its producer died before publishing it)",
    )
    return Outcome(OutcomeKind.TIMED_OUT, name, error=error)


def _holds_sample(decision: Outcome | Fetched) -> bool:
    return isinstance(decision, Fetched)


def _no_wait() -> None:
    """``room`` of a pass read in the caller's thread: never waits."""


def _check_store_options(options: ReaderOptions) -> None:
    if options.on_consumed not in ("keep", "delete"):
        raise ValueError(
            f"on_consumed: a store reader can 'keep' or 'delete', not {options.on_consumed!r}"
        )
    if options.done_dir is not None or options.watch != "auto":
        raise ValueError("done_dir and watch apply to directories, not to a mooncake:// store")
