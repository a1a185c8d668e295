"""What the connector's two halves tell each other each step.

``HiddenStateConnectorMetadata`` goes from the scheduler half to the workers;
``RowsLetGo`` comes back (vLLM's worker metadata, ``build_connector_worker_meta``).
Plain dataclasses: importing this module imports no vLLM (importing vLLM's connector base
costs about 10 CPU-seconds). The connector facade registers them as virtual subclasses of
vLLM's ``KVConnectorMetadata`` and ``KVConnectorWorkerMetadata`` when vLLM builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NewSample:
    """A request was scheduled for the first time: create its lock now."""

    req_id: str
    path: str


@dataclass
class SaveOrder:
    """A request finished: write its hidden states (or, with ``failure``, give up).

    Attributes:
        req_id: vLLM request id.
        path: Final data path.
        token_ids: The tokens whose hidden states are saved.
        block_ids: The request's blocks in the hidden-state cache group.
        num_prompt_tokens: Prompt length (the rest of ``token_ids`` were generated).
        failure: Why the sample cannot be written (aborted, nothing computed, ...).
        written_this_step: The step that carries this order computes the last of
            ``token_ids`` (a prompt whose prefill ends in it): the worker starts the
            save after that step's forward pass, without waiting for the request to
            finish. Otherwise every token was computed in earlier steps.
        loss_mask: The client's 0/1 per token of ``token_ids`` (None: no mask).
        tags: The client's checked tags, recorded in the file's metadata (None: none).
        num_draft_tokens: With speculative decoding, the draft tokens the target model
            verified for the generated tokens (None: no speculation, or not known).
        num_accepted_tokens: Those it accepted (None alike).
    """

    req_id: str
    path: str
    token_ids: list[int]
    block_ids: list[int]
    num_prompt_tokens: int
    failure: str | None = None
    written_this_step: bool = False
    loss_mask: list[int] | None = None
    tags: dict[str, str] | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


@dataclass
class StepRows:
    """Forward capture: a captured request's tokens computed in this step.

    Attributes:
        req_id: vLLM request id.
        computed_before: Position of the first token computed in this step.
        scheduled: Tokens computed in this step.
        block_ids: The KV blocks (the attention group) that hold this step's tokens: the
            request's block table from block ``computed_before // block_size`` on. The
            worker maps each row of the batch to a request and position through them
            and the step's slot mapping (the table itself is the scheduler half's).
        table_blocks: Length of the request's whole block table (named when short).
        cached_rows: Prefix caching: the held rows (``PrefixRowIndex`` entry ids) of
            each prefix block ``0 .. computed_before // block`` that vLLM served from its
            cache (-1: not held), on a request's first step; None when none.
        filled_rows: Prefix caching: ``(prefix block index, entry id)`` of each full
            prefix block this step completes whose rows are to be held; None when none.
    """

    req_id: str
    computed_before: int
    scheduled: int
    block_ids: list[int]
    table_blocks: int
    cached_rows: list[int] | None = None
    filled_rows: list[tuple[int, int]] | None = None


@dataclass
class HiddenStateConnectorMetadata:
    """Per-step instructions for the worker.

    Attributes:
        new_samples: Locks to create.
        saves: Samples to write.
        preempted: Requests preempted since the last step whose samples were ordered
            before they finished: their blocks may be reused by this step, so the
            worker finishes copying them before the forward pass.
        steps: Forward capture only: the captured requests this step computes rows for.
        batch_tokens: Forward capture only: tokens the step computes in all (the rows of
            the batch that are not padding).
        released_rows: Forward capture with prefix caching: held prefix rows (entry ids)
            the worker lets go of, after this step's rows are stored.
    """

    new_samples: list[NewSample] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    steps: list[StepRows] = field(default_factory=list)
    batch_tokens: int = 0
    released_rows: list[int] = field(default_factory=list)


@dataclass
class RowsLetGo:
    """Worker to scheduler, per step: requests whose rows the worker has let go of.

    Their saves have copied the rows out (the sample is written or failed), possibly
    while the request still runs (a prompt-only sample is ordered in the step that
    computes its prompt's last token): what their rows held counts no more.

    Attributes:
        req_ids: The requests.
    """

    req_ids: list[str] = field(default_factory=list)

    def aggregate(self, other: object) -> RowsLetGo:
        """Merge another worker's ids into these (vLLM merges its workers' metadata per step)."""
        return RowsLetGo(self.req_ids + list(getattr(other, "req_ids", ())))
