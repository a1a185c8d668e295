"""Claims that outlive no reader: generations, leases and takeover without compare-and-set.

Mooncake offers one atomic primitive: a put to an existing key keeps the old value, so
the first put of a key wins (``StoreClient.put_first``). Claims are built on it:

* a reader claims ``NAME`` for its group by winning ``claims/GROUP/NAME/0``;
* while it holds the claim, a background thread puts ``.../0/renew/1``, ``/2``, ...
  every ``lease / 4`` seconds: the lease renewals;
* a reader that lost the claim watches it. If it sees no new renewal for ``lease``
  seconds of its own clock (no clocks are compared across hosts), the owner is taken to
  be dead and the watcher races for generation 1, first put wins. The winner re-checks
  ``done`` and delivers the sample again (``stats.reclaimed``);
* after use the owner puts ``claims/GROUP/NAME/done`` and removes its renewals; a later
  reader that wins a generation finds ``done`` and drops the sample.

The result is at-least-once delivery per group: a sample is delivered again only when
its reader stopped renewing for a whole lease (it died, or was paused or cut off that
long). A reader about to stop (end of the log, idle timeout) first waits until the
owner of every claim it watches is known to be alive (``settled``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field

from hidden_state_reader.format.store_keys import claim_key, done_key, renewal_key
from hidden_state_reader.store.client import StoreClient

log = logging.getLogger(__name__)

_WINDOW = 4  # renewals probed past the last one seen


@dataclass
class _Watched:
    """A claim another reader holds, as this reader last saw it."""

    name: str
    entry: object  # what the caller yields when it takes the claim over
    generation: int = 0
    renewals: int = 0  # highest renewal seen
    lease: float = 0.0  # the owner's lease (from its claim record)
    since: float = field(default_factory=time.monotonic)  # last progress seen
    proven: bool = False  # the owner renewed while this reader watched


@dataclass
class StoreClaim:
    """This reader's claim on one sample of the store (a ``claim_lifecycle.HeldClaim``).

    Attributes:
        claims: The reader's claims.
        name: The sample.
        reclaimed: Taken over from a reader that stopped renewing it.
    """

    claims: StoreClaims
    name: str
    reclaimed: bool = False

    def done(self) -> None:
        """The group consumed the sample: no reader of it gets the sample again."""
        self.claims.finish(self.name)

    def remove(self) -> None:
        """The sample is gone: the group is done with it all the same."""
        self.claims.finish(self.name)

    def abandon(self) -> None:
        """Stop renewing: after one lease another reader of the group takes it over."""
        self.claims.give_back(self.name)


class StoreClaims:
    """One reader's claims in one consumer group.

    Args:
        client: A joined store client (used from the renewal thread too: it is
            thread-safe).
        group: The consumer group.
        token: This reader's identity, unique per reader.
        lease: Seconds a claim of this reader survives without a renewal.
        takes_over: Whether this reader watches lost claims and takes them over (it
            reads the commit logs); pulling by name claims generation 0 only.
    """

    def __init__(
        self, client: StoreClient, group: str, token: str, lease: float, *, takes_over: bool
    ) -> None:
        if lease <= 0:
            raise ValueError(f"claim lease must be positive seconds, got {lease!r}")
        self.client = client
        self.prefix = client.settings.prefix
        self.group = group
        self.token = token
        self.lease = lease
        self.takes_over = takes_over
        self._record = json.dumps({"reader": token, "lease": lease}).encode()
        self._held: dict[str, list[int]] = {}  # name -> [generation, renewals put]
        self._given_back: dict[str, int] = {}  # name -> generation given back unused
        self._watched: dict[str, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_when_released = False
        # Starting and stopping the renewal thread (and the decision to) happen under it;
        # the renewal loop itself only takes ``_lock``, so joining it here is safe.
        self._life = threading.RLock()
        self._next_check = 0.0

    # -- owning -------------------------------------------------------------------

    def claim(self, name: str, entry: object) -> StoreClaim | None:
        """This reader's claim on ``name`` (claimed now, or taken over earlier), or None.

        A claim lost to a live reader is watched for ``takeovers``, which hand back
        ``entry`` once it is taken over.
        """
        held = self._held.get(name)
        if held is not None:
            return StoreClaim(self, name, reclaimed=held[0] > 0)
        if name in self._watched:
            return None
        given = self._given_back.get(name)
        if given is not None and self.takes_over:
            # Given back earlier (read ahead, then the caller stopped): its claim is still
            # this reader's record, but another reader may have taken it over since, so
            # it does not count as won; it is raced for after its lease, like any other.
            if not self._is_done(name):
                self._watched[name] = _Watched(name, entry, generation=given,
                                               lease=self._owner_lease(name, given))  # fmt: skip
            return None
        if self._win(name, 0):
            return StoreClaim(self, name)
        if not self._is_done(name):
            self._watched[name] = _Watched(name, entry, lease=self._owner_lease(name, 0))
        return None

    def _win(self, name: str, generation: int) -> bool:
        """Race for ``generation`` of ``name``; True if this reader won and it is not done."""
        key = claim_key(self.prefix, self.group, name, generation)
        # In a full store a claim waits for room like a producer's put (up to a lease).
        if self.client.put_first(key, self._record, full_timeout=self.lease) != self._record:
            return False
        if self._is_done(name):  # finished by the previous owner (or this reader) after all
            return False
        with self._life:  # a release deciding to stop the renewals cannot come between
            with self._lock:
                self._held[name] = [generation, 0]
            self._stop_when_released = False
            self._given_back.pop(name, None)
            self._start_renewing()
        return True

    def finish(self, name: str) -> None:
        """Mark ``name`` consumed by the group and stop renewing its claim."""
        with self._lock:
            held = self._held.get(name)
        if held is None:
            return
        self.client.put(done_key(self.prefix, self.group, name), self._record,
                        full_timeout=self.lease)  # fmt: skip
        self.release(name)

    def give_back(self, name: str) -> None:
        """Stop renewing the claim of ``name`` without using the sample (see ``claim``)."""
        with self._lock:
            held = self._held.get(name)
        if held is not None:
            self._given_back[name] = held[0]
            self.release(name)

    def release(self, name: str) -> None:
        """Stop renewing the claim of ``name`` (without marking it done) and drop its renewals."""
        with self._life:
            with self._lock:
                held = self._held.pop(name, None)
                idle = not self._held
            if held is None:
                return
            if idle and self._stop_when_released:
                self.stop()
        generation, renewals = held
        for k in range(1, renewals + 1):
            self.client.remove(renewal_key(self.prefix, self.group, name, generation, k))

    def _is_done(self, name: str) -> bool:
        return self.client.exists([done_key(self.prefix, self.group, name)])[0]

    def _owner_lease(self, name: str, generation: int) -> float:
        raw = self.client.get(claim_key(self.prefix, self.group, name, generation))
        try:
            return float(json.loads(raw or b"{}").get("lease", self.lease))
        except (ValueError, TypeError, AttributeError):
            return self.lease  # not a record this version writes: assume our own lease

    # -- renewing -----------------------------------------------------------------

    def _start_renewing(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name="hidden-state-claim-lease")  # fmt: skip
            self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease / 4):
            with self._lock:
                due = [(n, h[0], h[1] + 1) for n, h in self._held.items()]
            for name, generation, k in due:
                try:
                    # One byte: Mooncake refuses empty values (-600).
                    self.client.put(renewal_key(self.prefix, self.group, name, generation, k),
                                    b"r", full_timeout=self.lease / 4)  # fmt: skip
                except Exception as exc:  # keep renewing the others; a watcher may take it
                    log.warning("%s: cannot renew the claim lease: %s", name, exc)
                    continue
                with self._lock:
                    if self._held.get(name, [None])[0] == generation:
                        self._held[name][1] = k

    def stop_when_released(self) -> None:
        """Stop renewing once no claim is held: now, or when the last one is released.

        A pass ends while claims handed out to a training loop still wait for it to
        acknowledge them (``training.acknowledgement``); they keep their leases until then.
        """
        with self._life:
            with self._lock:
                idle = not self._held
            if idle:
                self.stop()
            else:
                self._stop_when_released = True

    def stop(self) -> None:
        """Stop the renewal thread (held claims then expire after one lease)."""
        with self._life:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._stop.clear()

    # -- watching -----------------------------------------------------------------

    def settled(self) -> bool:
        """Whether the owner of every watched claim is alive, as far as this reader knows.

        Alive: seen renewing, the last time less than its lease ago. A reader that is
        about to stop keeps going while this is False: until each silent claim is
        taken over (by it or another watcher) or renewed, or it is done.
        """
        now = time.monotonic()
        return all(w.proven and now - w.since < w.lease for w in self._watched.values())

    def takeovers(self) -> list[object]:
        """The entries of watched claims this reader has just taken over.

        Checks at most every ``lease / 8`` seconds; one ``batch_is_exist`` for all.
        """
        now = time.monotonic()
        if not self._watched or now < self._next_check:
            return []
        self._next_check = now + self.lease / 8
        watched = list(self._watched.values())
        probe: list[str] = []
        for w in watched:
            probe.append(done_key(self.prefix, self.group, w.name))
            probe.append(claim_key(self.prefix, self.group, w.name, w.generation + 1))
            probe += [renewal_key(self.prefix, self.group, w.name, w.generation, w.renewals + i)
                      for i in range(1, _WINDOW + 1)]  # fmt: skip
        found = self.client.exists(probe)
        won = []
        for i, w in enumerate(watched):
            done, newer, *renewed = found[i * (_WINDOW + 2) :][: _WINDOW + 2]
            if done or self._progress(w, newer, renewed):
                if done:
                    del self._watched[w.name]
                continue
            if now - w.since >= w.lease:
                won += self._take_over(w)
        return won

    def _progress(self, w: _Watched, newer: bool, renewed: list[bool]) -> bool:
        if newer:  # someone took it over: watch their lease now
            w.generation, w.renewals = w.generation + 1, 0
            w.lease = self._owner_lease(w.name, w.generation)
        elif any(renewed):
            w.renewals += max(i + 1 for i, r in enumerate(renewed) if r)
            w.proven = True
        else:
            return False
        w.since = time.monotonic()
        return True

    def _take_over(self, w: _Watched) -> list[object]:
        generation = w.generation + 1
        if self._win(w.name, generation):
            del self._watched[w.name]
            log.warning("%s: took over the claim of a reader silent for %.1f s (generation %d)",
                        w.name, w.lease, generation)  # fmt: skip
            return [w.entry]
        if self._is_done(w.name):
            del self._watched[w.name]
        else:  # another watcher won: watch its lease
            w.generation, w.renewals, w.since = generation, 0, time.monotonic()
            w.lease = self._owner_lease(w.name, generation)
        return []
