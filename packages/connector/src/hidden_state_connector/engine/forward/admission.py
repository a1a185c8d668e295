"""Back-pressure on the host arena: a request waits for room instead of failing its sample.

The worker keeps each captured request's rows in the host arena (``arena.py``) until its
sample is written; a full arena fails the sample of the request whose rows do not fit.
The scheduler half counts the arena blocks of every request it let in (its prompt's rows
at admission, more as its stored generated tokens are computed) and of the held prefix
rows' budget, and lets a new request in only when its prompt's rows fit beside them
(vLLM's ``get_num_new_matched_tokens`` answers None: the request stays waiting). A
request's blocks count until the worker reports its rows copied out (a prompt-only
sample's while its request still decodes: ``RowsLetGo``). Requests get in first
come, first served: one waiting for room is not overtaken by later, smaller ones.

A prompt larger than the whole arena can never fit: it is let in with a warning naming
``capture_buffer_bytes`` and its sample fails with the arena's reason, rather than
waiting forever. Rows of generated tokens can still outgrow the arena (they are counted
as they come, not reserved up front, which would bound concurrency by ``max_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable

from hidden_state_connector.logs import get_logger

log = get_logger(__name__)


class ArenaAdmission:
    """Counts the arena blocks of the requests let in; admits first come, first served.

    Args:
        budget_blocks: Arena blocks for requests' rows (the arena less the held-prefix budget).
        block_tokens: Rows per arena block.
        block_bytes: Bytes of one arena block (for messages).
    """

    def __init__(self, budget_blocks: int, block_tokens: int, block_bytes: int) -> None:
        self.budget_blocks = budget_blocks
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self._blocks: dict[str, int] = {}  # blocks counted per request let in
        self._in_use = 0
        # Requests waiting for room, oldest first (a dict: vLLM asks about every waiting
        # request each step, so membership and removal must not scan).
        self._waiting: dict[str, None] = {}
        self.waits = 0  # admissions refused for room (a counter for logs and tests)

    @property
    def blocks_in_use(self) -> int:
        """Blocks counted for the requests let in and not yet reported done."""
        return self._in_use

    def admits(self, req_id: str, rows: int) -> bool:
        """Whether a request with ``rows`` prompt rows may start now (False: it waits)."""
        if req_id in self._blocks:
            return True  # let in before (a retry of the scheduler's look at it)
        need = self._span(rows)
        if need > self.budget_blocks:
            log.warning(
                "request %s: its %d prompt rows need %.0f MiB of the host arena, which holds "
                "%.0f MiB for requests (capture_buffer_bytes, less prefix_rows_bytes with "
                "prefix caching); its sample will fail: raise capture_buffer_bytes",
                req_id,
                rows,
                need * self.block_bytes / 2**20,
                self.budget_blocks * self.block_bytes / 2**20,
            )
            self._count(req_id, 0)
            return True
        first = next(iter(self._waiting), req_id)
        if first != req_id or self._in_use + need > self.budget_blocks:
            if req_id not in self._waiting:
                self._waiting[req_id] = None
                log.debug("request %s waits for room in the host arena", req_id)
            self.waits += 1
            return False
        self._waiting.pop(req_id, None)
        self._count(req_id, need)
        return True

    def grow(self, req_id: str, rows: int) -> None:
        """A request's rows now reach ``rows`` (its stored generated tokens)."""
        have = self._blocks.get(req_id)
        if have is not None and have:
            need = self._span(rows)
            if need > have:
                self._count(req_id, need)

    def forget(self, req_id: str) -> None:
        """A request ended before it was let in: it waits no more."""
        self._waiting.pop(req_id, None)

    def freed(self, req_ids: Iterable[str]) -> None:
        """The worker is done with these requests' rows: their blocks count no more."""
        for req_id in req_ids:
            self._in_use -= self._blocks.pop(req_id, 0)

    def _count(self, req_id: str, blocks: int) -> None:
        self._in_use += blocks - self._blocks.get(req_id, 0)
        self._blocks[req_id] = blocks

    def _span(self, rows: int) -> int:
        return -(-rows // self.block_tokens)
