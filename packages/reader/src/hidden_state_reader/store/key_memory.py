"""A deleting store reader's part in remembering consumed idempotency keys.

As the directory reader does (``read.directory``): a keyed sample (its header records
``Meta.IDEMPOTENCY_KEY``) that the reader deletes gets its record first
(``store.consumed.record_consumed``); a keyed sample whose key has a live record is a
copy published after the first was consumed (a retry that was in flight), and is
removed unread instead of handed out. Used only with ``on_consumed="delete"`` and a
``consumed_key_retention`` above 0.
"""

from __future__ import annotations

import logging

from hidden_state_reader.errors import SampleError
from hidden_state_reader.format.header import Meta
from hidden_state_reader.format.store_keys import data_key
from hidden_state_reader.options import ReaderOptions
from hidden_state_reader.read.claim_lifecycle import Ending, settle
from hidden_state_reader.store.client import StoreClient, StoreError
from hidden_state_reader.store.consumed import is_consumed, record_consumed
from hidden_state_reader.store.fetch import Fetched
from hidden_state_reader.store.publish import parse_sample_header

log = logging.getLogger(__name__)


class KeyMemory:
    """Which fetched samples are keyed; records their keys; drops consumed copies.

    Args:
        client: The reader's store client.
        retention: Seconds a consumed key is remembered (``consumed_key_retention``).
    """

    def __init__(self, client: StoreClient, retention: float) -> None:
        self.client = client
        self.retention = retention
        self._keyed: set[str] = set()  # fetched keyed samples not yet consumed

    @classmethod
    def of(cls, client: StoreClient, options: ReaderOptions) -> KeyMemory | None:
        """What a reader with ``options`` needs (None: it keeps samples, or retention 0)."""
        if options.on_consumed != "delete" or options.consumed_key_retention <= 0:
            return None
        return cls(client, options.consumed_key_retention)

    def drops(self, fetched: Fetched) -> bool:
        """Whether ``fetched`` is a consumed key's copy: then it is removed, unread.

        Otherwise a keyed sample is noted, so that ``before_delete`` records its key.
        Runs where the sample is fetched (the read-ahead thread), from the bytes' header.
        """
        try:
            header = parse_sample_header(fetched.where, fetched.data.data)
        except SampleError:
            return False  # loading judges it
        if Meta.IDEMPOTENCY_KEY not in header.metadata:
            return False
        if not is_consumed(self.client, fetched.name):
            self._keyed.add(fetched.name)
            return False
        log.info("%s: its idempotency key was consumed already; removing this copy unread",
                 fetched.where)  # fmt: skip
        # Settled first, as ``StoreBackend.consumed`` does: never a second delivery.
        settle(fetched.claim, Ending.CONSUMED)
        self.client.remove(data_key(self.client.settings.prefix, fetched.name))
        return True

    def before_delete(self, name: str) -> bool:
        """Record the key of ``name`` if it is keyed; False if the record failed (keep it)."""
        if name not in self._keyed:
            return True
        self._keyed.discard(name)
        try:
            record_consumed(self.client, name, self.retention)
        except StoreError as exc:
            log.warning(
                "cannot record the consumed key of %s (%s): the sample is kept, not deleted, "
                "so that a retry of its key is not written again",
                name,
                exc,
            )
            return False
        return True
