"""Forward capture's parts without an engine: config keys, routing, the arena, family adapters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import choose_capture
from hidden_state_connector.engine.forward.adapter import (
    FAMILIES,
    UnsupportedFamilyError,
    family_of,
    stream_before,
)
from hidden_state_connector.engine.forward.arena import RowArena
from hidden_state_connector.engine.forward.routing import RowRouter
from hidden_state_connector.engine.metadata import StepRows


def test_capture_keys_are_checked_by_name() -> None:
    cfg = ConnectorConfig.from_extra_config({"capture": "forward", "layer_ids": [4, 1]})
    assert cfg.capture == "forward" and cfg.layer_ids == (4, 1)
    assert ConnectorConfig.from_extra_config({}).capture is None  # chosen per engine
    with pytest.raises(ValueError, match="layer_ids: an empty list"):
        ConnectorConfig.from_extra_config({"capture": "forward", "layer_ids": []})
    with pytest.raises(ValueError, match="layer_ids: expected a list"):
        ConnectorConfig.from_extra_config({"capture": "forward", "layer_ids": "1,2"})
    with pytest.raises(ValueError, match="layer_ids: only for forward capture"):
        ConnectorConfig.from_extra_config({"capture": "extract", "layer_ids": [1]})
    with pytest.raises(ValueError, match="capture: must be"):
        ConnectorConfig.from_extra_config({"capture": "hooks"})


def _engine_config(method: str | None, layers: int | None) -> SimpleNamespace:
    """What ``choose_capture`` reads of vLLM's config: the speculative method, layers."""
    spec = None if method is None else SimpleNamespace(method=method)
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers)
    return SimpleNamespace(speculative_config=spec, model_config=model)


def test_forward_capture_is_the_default_and_extract_keeps_its_configs() -> None:
    plain = ConnectorConfig.from_extra_config({})
    chosen = choose_capture(plain, _engine_config(None, 32))
    assert chosen.capture == "forward" and chosen.layer_ids == (2, 16, 29, 32)
    assert choose_capture(plain, _engine_config("ngram", 32)).capture == "forward"
    extract = choose_capture(plain, _engine_config("extract_hidden_states", 32))
    assert extract.capture == "extract" and extract.layer_ids is None
    given = ConnectorConfig.from_extra_config({"layer_ids": [1, 3]})
    assert choose_capture(given, _engine_config(None, 4)).layer_ids == (1, 3)
    with pytest.raises(ValueError, match="layer_ids: only for forward capture"):
        choose_capture(given, _engine_config("extract_hidden_states", 4))
    with pytest.raises(ValueError, match=r"set kv_connector_extra_config\.layer_ids"):
        choose_capture(plain, _engine_config(None, None))


def _by_entry(router: RowRouter, slots: torch.Tensor, steps: list[StepRows]) -> dict:
    """``route_flat`` per step entry: ``{req_id: (rows, positions, failure)}``."""
    flat = router.route_flat(slots, steps)
    return {
        step.req_id: (
            flat.rows[flat.owner == i].tolist(),
            flat.positions[flat.owner == i].tolist(),
            flat.failures.get(i),
        )
        for i, step in enumerate(steps)
    }


def test_rows_are_routed_by_slot_whatever_the_batch_order() -> None:
    router = RowRouter(block_size=4)
    # a: prefill chunk, tokens [0, 6) in blocks 7, 2; b: decode of token 9 (block 5, slot 1).
    # (Each names the blocks of its tokens: b's table is [3, 8, 5], token 9 is in block 2.)
    steps = [StepRows("a", 0, 6, [7, 2], 2), StepRows("b", 9, 1, [5], 3)]
    # The runner put b first and padded the batch to 8 rows (slot -1).
    slots = torch.tensor([5 * 4 + 1, 7 * 4, 7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 2 * 4, 2 * 4 + 1, -1])
    routed = _by_entry(router, slots, steps)
    assert routed["b"] == ([0], [9], None)
    assert routed["a"] == ([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5], None)


def test_missing_rows_fail_the_request_not_store_wrong_ones() -> None:
    router = RowRouter(block_size=4)
    steps = [StepRows("a", 0, 3, [7], 1), StepRows("b", 0, 1, [1], 1)]
    # a: one of its rows is missing; b: its row maps outside the token it computes.
    routed = _by_entry(router, torch.tensor([7 * 4, 7 * 4 + 1, 1 * 4 + 2, -1]), steps)
    assert routed["a"][2] is not None and "2 rows of the batch" in routed["a"][2]
    assert routed["b"][2] is not None and "expected 1" in routed["b"][2]


def test_arena_stores_by_position_and_reports_gaps_and_full() -> None:
    arena = RowArena(
        2 * 4 * 2 * 3 * 4, block_size=4, num_layers=2, hidden_size=3, dtype=torch.float32
    )
    assert arena.num_blocks == 2
    rows = torch.arange(5 * 2 * 3, dtype=torch.float32).reshape(5, 2, 3)

    def write(req_id: str, positions: torch.Tensor) -> str | None:
        start, stop = int(positions.min()), int(positions.max()) + 1
        index, owner = torch.arange(len(positions)), torch.zeros(len(positions), dtype=torch.int64)
        return arena.write_step([(req_id, start, stop)], index, owner, positions, rows).get(0)

    assert write("a", torch.arange(5)) is None
    assert arena.filled("a") == 5 and len(arena.blocks("a")) == 2
    # Recomputed after a preemption (or after rejected drafts): the same positions,
    # overwritten; rows past them are stale, not counted, and their block goes back.
    assert write("a", torch.arange(2)) is None
    assert arena.filled("a") == 2 and len(arena.blocks("a")) == 1
    flat = arena.data[arena.blocks("a")].reshape(-1, 2, 3)
    assert torch.equal(flat[:2], rows[:2])
    assert write("a", torch.arange(5)) is None
    assert arena.filled("a") == 5 and len(arena.blocks("a")) == 2
    full = write("b", torch.arange(1))
    assert full is not None and "all in use" in full
    arena.release("a")
    gap = write("b", torch.arange(6, 7))
    assert gap is not None and "[0, 6)" in gap  # rows [0, 6) missing


def test_the_embeddings_are_found_whatever_the_layer_signature() -> None:
    positions = torch.arange(3)
    embeddings = torch.randn(3, 8)
    # Llama-style (positions, hidden_states, residual); gpt-oss (hidden_states, positions,
    # residual); Nemotron-H by keyword; DeepSeek-V2 with a float scaling argument after.
    assert stream_before((positions, embeddings, None), {}) is embeddings
    assert stream_before((embeddings, positions, None), {}) is embeddings
    assert stream_before((), {"positions": positions, "hidden_states": embeddings}) is embeddings
    scaling = torch.ones(3, 1)
    assert stream_before((positions, embeddings, None, scaling), {}) is embeddings
    with pytest.raises(RuntimeError, match="got a residual"):
        stream_before((positions, embeddings, torch.randn(3, 8)), {})
    with pytest.raises(RuntimeError, match="got no embeddings"):
        stream_before((positions,), {})


def test_an_unknown_family_is_refused_naming_it_and_the_known_ones() -> None:
    with pytest.raises(UnsupportedFamilyError) as info:
        family_of(["MistralForCausalLM"])
    assert "capture='forward' does not support MistralForCausalLM yet" in str(info.value)
    for name in ("Gemma3ForCausalLM", "GptOssForCausalLM", "NemotronHForCausalLM"):
        assert name in str(info.value) and family_of([name]) is FAMILIES[name]


@pytest.mark.vllm
def test_deepseek_is_refused_where_its_layers_leave_hfs_stream() -> None:
    family = FAMILIES["DeepseekV2ForCausalLM"]

    yarn = {"rope_type": "yarn", "factor": 40.0}

    def engine(
        dtype: torch.dtype, sp_moe: bool = False, rope: dict | None = yarn, ops: tuple = ("all",)
    ) -> SimpleNamespace:
        hf_config = SimpleNamespace(rope_parameters=rope)
        return SimpleNamespace(
            model_config=SimpleNamespace(dtype=dtype, hf_config=hf_config),
            parallel_config=SimpleNamespace(use_sequence_parallel_moe=sp_moe),
            compilation_config=SimpleNamespace(custom_ops=list(ops)),
        )

    assert family.refusal(engine(torch.bfloat16)) is None
    assert "in float16" in str(family.refusal(engine(torch.float16)))
    assert "sequence-parallel MoE" in str(family.refusal(engine(torch.float32, sp_moe=True)))
    # This is the CPU build: plain RoPE goes through its rotary kernel unless turned off.
    plain = {"rope_type": "default"}
    assert "'-rotary_embedding'" in str(family.refusal(engine(torch.float32, rope=plain)))
    off = ("all", "-rotary_embedding")
    assert family.refusal(engine(torch.float32, rope=plain, ops=off)) is None


@pytest.mark.vllm
def test_rows_are_routed_through_a_group_that_holds_every_token() -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    shape = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float32}
    sliding = KVCacheGroupSpec(["l.0"], SlidingWindowSpec(block_size=16, sliding_window=8, **shape))
    full = KVCacheGroupSpec(["l.1", "l.3"], FullAttentionSpec(block_size=32, **shape))
    mla = KVCacheGroupSpec(["m.0"], MLAAttentionSpec(block_size=16, **shape))
    assert compat.attention_group(SimpleNamespace(kv_cache_groups=[sliding, full])) == (1, "l.1")
    assert compat.attention_group(SimpleNamespace(kv_cache_groups=[mla])) == (0, "m.0")
    with pytest.raises(ValueError, match=r"has none \(groups: SlidingWindowSpec\)"):
        compat.attention_group(SimpleNamespace(kv_cache_groups=[sliding]))


def test_arena_admission_is_first_come_first_served_and_counts_until_freed() -> None:
    from hidden_state_connector.engine.forward.admission import ArenaAdmission

    admission = ArenaAdmission(budget_blocks=10, block_tokens=4, block_bytes=1024)
    assert admission.admits("a", 24)  # 6 blocks
    assert not admission.admits("b", 20)  # 5 more do not fit: b waits ...
    assert not admission.admits("c", 4)  # ... and c, which fits, does not overtake it
    assert admission.admits("a", 24)  # a looked at again: let in before
    admission.grow("a", 28)  # its generated tokens: 7 blocks
    assert admission.blocks_in_use == 7
    admission.freed(["a"])  # the worker wrote a's sample
    assert admission.admits("b", 20) and admission.admits("c", 4)
    assert admission.blocks_in_use == 6
    assert admission.admits("huge", 44)  # never fits: let in to fail, not to wait forever
    admission.forget("d")  # ended while not waiting: nothing changes
    admission.freed(["b", "c", "huge"])
    assert admission.blocks_in_use == 0 and admission.waits == 2
