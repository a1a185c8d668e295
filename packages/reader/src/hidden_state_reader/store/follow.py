"""Discovery without a shared filesystem: read every producer's commit log in order.

Each producer appends ``CommitRecord``s to ``log/SLOT/0, 1, 2, ...`` (``publish``).
``CommitLog.poll`` finds new producer slots and the next records of every known slot
with one ``batch_is_exist`` call, then reads the records that are there. A record whose
successor exists while it does not (a producer died between taking a sequence number
and writing the record) is skipped once it has been missing for ``hole_grace`` seconds,
so one lost record never stalls the log.
"""

from __future__ import annotations

import logging
import time

from hidden_state_reader.format.store_keys import CommitRecord, log_key, producer_key
from hidden_state_reader.store.client import StoreClient

log = logging.getLogger(__name__)

_LOOKAHEAD = 4  # records (and slots) probed past the next expected one


class CommitLog:
    """A cursor over the commit logs of all producers of one prefix.

    Args:
        client: A joined store client.
        hole_grace: Seconds a missing record may be overtaken before it is skipped.
    """

    def __init__(self, client: StoreClient, *, hole_grace: float) -> None:
        self.client = client
        self.prefix = client.settings.prefix
        self.hole_grace = hole_grace
        self.next_seq: list[int] = []  # per slot
        self._holes: dict[tuple[int, int], float] = {}
        self.skipped_holes = 0

    def poll(self) -> list[tuple[str, CommitRecord]]:
        """Records that appeared since the last call, each with its key, in log order."""
        slots = len(self.next_seq)
        probe = [producer_key(self.prefix, s) for s in range(slots, slots + _LOOKAHEAD)]
        for slot, seq in enumerate(self.next_seq):
            probe += [log_key(self.prefix, slot, seq + i) for i in range(_LOOKAHEAD + 1)]
        found = self.client.exists(probe)
        for present in found[:_LOOKAHEAD]:
            if not present:
                break
            self.next_seq.append(0)
        out: list[tuple[str, CommitRecord]] = []
        for slot in range(slots):
            window = found[_LOOKAHEAD + slot * (_LOOKAHEAD + 1) :][: _LOOKAHEAD + 1]
            out += self._advance(slot, window)
        if len(self.next_seq) > slots:  # new producers: read their records now
            out += self.poll()
        return out

    def _advance(self, slot: int, window: list[bool]) -> list[tuple[str, CommitRecord]]:
        """Consume the records of ``slot`` present from its next sequence number on."""
        start = self.next_seq[slot]
        out = []
        for i, present in enumerate(window):
            seq = start + i
            key = log_key(self.prefix, slot, seq)
            raw = self.client.get(key) if present else None
            if raw is not None:
                out.append((key, CommitRecord.decode(key, raw)))
            elif any(window[i + 1 :]) and self._hole_expired(slot, seq):
                log.warning("%s: commit record never written (producer died?); skipped", key)
                self.skipped_holes += 1
            else:
                break
            self._holes.pop((slot, seq), None)
            self.next_seq[slot] = seq + 1
        return out

    def _hole_expired(self, slot: int, seq: int) -> bool:
        first = self._holes.setdefault((slot, seq), time.monotonic())
        return time.monotonic() - first >= self.hole_grace
