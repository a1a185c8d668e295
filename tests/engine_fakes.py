"""Fake vLLM scheduler objects for the connector's unit tests (no engine).

``SimpleNamespace`` objects with the fields the connector reads from vLLM's
``NewRequestData``, ``SchedulerOutput`` (with its ``CachedRequestData``) and ``Request``.
In every fake the main model's KV-cache group comes first and the hidden-state group
second, with different block ids, so a mix-up of the groups shows.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

MAIN_GROUP_OFFSET = 1000  # main-group block id = hidden-state block id + this


def _both_groups(hs_blocks: list[int]) -> tuple[list[int], list[int]]:
    return [MAIN_GROUP_OFFSET + b for b in hs_blocks], list(hs_blocks)


def new_request(
    req_id: str, prompt: list[int], hs_blocks: list[int], params: dict | None = None
) -> SimpleNamespace:
    """``NewRequestData``: first scheduling of a request, with its ``kv_transfer_params``."""
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=prompt,
        num_computed_tokens=0,
        block_ids=_both_groups(hs_blocks),
        sampling_params=SimpleNamespace(
            extra_args={"kv_transfer_params": params} if params is not None else None
        ),
    )


def scheduler_output(
    *,
    new: tuple[SimpleNamespace, ...] = (),
    cached: tuple[tuple[str, int, list[int] | None], ...] = (),
    resumed: frozenset[str] = frozenset(),
    scheduled: dict[str, int] | None = None,
    preempted: frozenset[str] = frozenset(),
) -> SimpleNamespace:
    """``SchedulerOutput``; ``cached`` holds ``(req_id, computed_before, new hs blocks)``."""
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            num_computed_tokens=[c[1] for c in cached],
            new_block_ids=[None if c[2] is None else _both_groups(c[2]) for c in cached],
            resumed_req_ids=set(resumed),
        ),
        num_scheduled_tokens=dict(scheduled or {}),
        preempted_req_ids=set(preempted),
    )


def finished_request(
    req_id: str, prompt: list[int], output: list[int], status: Any = "length_capped"
) -> SimpleNamespace:
    """A ``Request`` that ended with every token computed but the last output token.

    ``status`` is what ``compat.request_was_aborted`` is asked about: vLLM's
    ``RequestStatus`` where the real lookup runs, a plain string where it is replaced.
    """
    tokens = prompt + output
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        all_token_ids=tokens,
        num_computed_tokens=len(tokens) - 1,  # the last output token was never fed back
        status=status,
    )


class TokenBuffer(array):
    """vLLM 0.34's ``TokenBuffer``: prompts and token lists are an ``array('i')`` subclass.

    Only what distinguishes it from a list matters here: it is not a ``list``, its
    slices are lists, and ``+`` gives a list (as in ``vllm/v1/token_buffer.py``).
    """

    def __new__(cls, tokens: Iterable[int] = ()) -> TokenBuffer:
        return super().__new__(cls, "i", tokens)

    def __getitem__(self, index: Any) -> Any:
        item = array.__getitem__(self, index)
        return item.tolist() if isinstance(index, slice) else item

    def __add__(self, other: Any) -> Any:
        return self.tolist() + list(other)


def scheduler_output_v034(
    *,
    new: tuple[SimpleNamespace, ...] = (),
    cached: tuple[tuple[str, int, list[int] | None], ...] = (),
    scheduled: dict[str, int] | None = None,
    preempted: frozenset[str] = frozenset(),
) -> SimpleNamespace:
    """0.34's ``SchedulerOutput``: no ``resumed_req_ids``; a resumed request is a new one."""
    output = scheduler_output(new=new, cached=cached, scheduled=scheduled, preempted=preempted)
    del output.scheduled_cached_reqs.resumed_req_ids
    return output
