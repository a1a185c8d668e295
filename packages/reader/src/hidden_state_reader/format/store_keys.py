"""Format v1 in a key-value store: which keys a sample, its failure and its commit use.

The connector's store backend and the reader's store source both follow this layout
(``docs/scale-out.md``); it needs neither torch nor a store client. Under a namespace
``PREFIX``:

* ``PREFIX/data/NAME``: the sample, byte for byte the ``NAME`` file the file backend
  would publish (safetensors header with ``crc32`` metadata, then the tensors);
* ``PREFIX/failed/NAME``: why the writer gave up on ``NAME`` (JSON), instead of a sample;
* ``PREFIX/log/SLOT/SEQ``: the commit record of one producer's ``SEQ``-th outcome (JSON
  ``CommitRecord``), written after the data or failure key: followers read these in
  order, so a sample is announced only once it is complete;
* ``PREFIX/producers/SLOT``: who owns producer slot ``SLOT`` (0, 1, 2, ...), taken
  first-put-wins when a producer starts;
* ``PREFIX/claims/GROUP/NAME/G``: which reader of consumer group ``GROUP`` owns ``NAME``
  in claim generation ``G`` (0 first, G+1 when a claim whose owner stopped renewing is
  taken over), taken first-put-wins (a put to an existing key keeps the old value);
* ``PREFIX/claims/GROUP/NAME/G/renew/K``: the owner of generation ``G`` is alive (its
  ``K``-th renewal, K = 1, 2, ...; removed once the sample is consumed);
* ``PREFIX/claims/GROUP/NAME/done``: ``GROUP`` has consumed ``NAME``;
* ``PREFIX/members/GROUP/SEQ``: the ``SEQ``-th entry of ``GROUP``'s membership log, one
  following reader joining or leaving (JSON), taken first-put-wins;
* ``PREFIX/members/GROUP/SEQ/renew/K``: the member that joined at ``SEQ`` is alive;
* ``PREFIX/consumed/NAME``: keyed ``NAME`` was consumed (record: ``format/consumed.py``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from hidden_state_reader.errors import CorruptSampleError

_MAX_RECORD_BYTES = 64 * 1024


def data_key(prefix: str, name: str) -> str:
    """Key of sample ``name``'s bytes."""
    return f"{prefix}/data/{name}"


def failed_key(prefix: str, name: str) -> str:
    """Key of the failure record of sample ``name``."""
    return f"{prefix}/failed/{name}"


def log_key(prefix: str, slot: int, seq: int) -> str:
    """Key of producer ``slot``'s ``seq``-th commit record."""
    return f"{prefix}/log/{slot}/{seq}"


def producer_key(prefix: str, slot: int) -> str:
    """Key that owns producer slot ``slot``."""
    return f"{prefix}/producers/{slot}"


def claim_key(prefix: str, group: str, name: str, generation: int) -> str:
    """Key whose first writer owns ``name`` for consumer group ``group`` in ``generation``."""
    return f"{prefix}/claims/{group}/{name}/{generation}"


def renewal_key(prefix: str, group: str, name: str, generation: int, renewal: int) -> str:
    """Key of the ``renewal``-th lease renewal of claim ``generation`` of ``name``."""
    return f"{claim_key(prefix, group, name, generation)}/renew/{renewal}"


def done_key(prefix: str, group: str, name: str) -> str:
    """Key that says consumer group ``group`` has consumed ``name``."""
    return f"{prefix}/claims/{group}/{name}/done"


def member_key(prefix: str, group: str, seq: int) -> str:
    """Entry ``seq`` of a consumer group's membership log: one join or leave."""
    return f"{prefix}/members/{group}/{seq}"


def member_renewal_key(prefix: str, group: str, seq: int, renewal: int) -> str:
    """A member's lease renewal (``seq``: its join entry)."""
    return f"{member_key(prefix, group, seq)}/renew/{renewal}"


def consumed_key(prefix: str, name: str) -> str:
    """Key of the consumed-key record of sample ``name`` (``format/consumed.py``)."""
    return f"{prefix}/consumed/{name}"


def check_prefix(prefix: str) -> str:
    """A namespace prefix: non-empty, no spaces, no leading/trailing ``/``.

    Raises:
        ValueError: The prefix is unusable (the message says why).
    """
    if not prefix or prefix != prefix.strip("/") or any(c.isspace() for c in prefix):
        raise ValueError(
            f"store prefix {prefix!r}: must be non-empty, without spaces or leading/trailing '/'"
        )
    return prefix


@dataclass(frozen=True)
class CommitRecord:
    """One producer outcome, as written at ``log/SLOT/SEQ``.

    Attributes:
        name: The sample's name (its key below ``data/`` or ``failed/``).
        ok: True: ``data/NAME`` holds the sample; False: ``failed/NAME`` says why.
        size: Bytes of the sample (0 when failed).
        crc32: The CRC32 recorded in the sample's header (8 hex digits, "" when failed).
    """

    name: str
    ok: bool
    size: int = 0
    crc32: str = ""

    def encode(self) -> bytes:
        """The record as JSON bytes."""
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, key: str, raw: bytes) -> CommitRecord:
        """Parse a record read from ``key``.

        Raises:
            CorruptSampleError: The record is not one this format writes (names the key).
        """
        if len(raw) > _MAX_RECORD_BYTES:
            raise CorruptSampleError(key, f"commit record of {len(raw)} bytes is implausible")
        try:
            doc = json.loads(raw)
            record = cls(str(doc["name"]), bool(doc["ok"]), int(doc["size"]), str(doc["crc32"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptSampleError(key, f"not a commit record ({exc!r})") from exc
        if not record.name or record.size < 0:
            raise CorruptSampleError(key, f"commit record with bad fields: {doc!r}")
        return record
