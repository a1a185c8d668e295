"""The connector's halves in vLLM 0.34's V2 model-runner order, with fakes; no vLLM.

vLLM 0.33 and 0.34 need torch 2.14 and cannot run here, so their call order is
reproduced (``vllm/v1/worker/gpu/model_runner.py``, ``gpu/kv_connector.py``,
``extensible_kv_cache.py`` of the 0.34.0 wheel):

- the worker-side connector is created after warm-up and CUDA-graph capture, and
  ``register_kv_caches`` gets views whose storage spans exactly the committed blocks;
- per step: ``handle_preemptions`` and bind (``pre_forward``), the target model's
  forward, ``get_transfer_results`` (default: ``get_finished``) *before* the
  ``ExtractHiddenStatesSpeculator``'s ``propose`` writes the step's hidden states into
  the cache-only layer, then ``wait_for_save`` and clearing the metadata
  (``finalize_step``, deferred because a speculator exists);
- prompts are ``TokenBuffer`` (an ``array('i')``), and a request resumed after
  preemption is sent again as a new request (no ``resumed_req_ids``);
- sleep: ``unregister_kv_caches`` before the cache is released, ``restore_kv_caches``
  after wake-up.

Also per-request tags (``metadata``) and idempotency keys, which do not depend on the
release. Files are real and read back with ``hidden_state_reader``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from disk_faults import StuckDisk
from engine_fakes import (
    TokenBuffer,
    finished_request,
    new_request,
    scheduler_output_v034,
)

from hidden_state_connector.engine import compat
from hidden_state_connector.engine.config import ConnectorConfig
from hidden_state_connector.engine.engines import CapturePlan, scheduler_side, worker_side
from hidden_state_connector.engine.sample_params import EXISTED_PARAM
from hidden_state_connector.engine.scheduler_side import ERROR_PARAM, PATH_PARAM
from hidden_state_connector.engine.sleep_guard import RELEASE_REASON
from hidden_state_connector.engine.stats import WriteStats
from hidden_state_connector.engine.worker_side import WorkerSide
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.locks import read_status
from hidden_state_reader.format import lock_path, sample_tags

BLOCK, LAYERS, HIDDEN = 4, 3, 8
CAPACITY, COMMITTED = 64, 16  # reserved blocks, blocks committed after warm-up
HS_GROUP = 1
LAYER_IDS = [1, 2, 4]
BLOCK_BYTES = BLOCK * LAYERS * HIDDEN * 4
WAIT_S = 10.0


@pytest.fixture(autouse=True)
def _no_vllm_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``compat`` calls that ask vLLM itself, answered as a 0.34 engine would."""
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.34.0")
    monkeypatch.setattr(compat, "tensor_parallel_rank", lambda: 0)
    monkeypatch.setattr(compat, "find_cache_only_layer", lambda _cfg, caches: next(iter(caches)))
    monkeypatch.setattr(compat, "request_was_aborted", lambda request: request.status == "aborted")


def committed_view(blocks: int) -> torch.Tensor:
    """A cache-only layer's view over the committed blocks only (0.34's extensible cache).

    ``[blocks, layers, block_size, hidden]`` (0.27+ order) on a storage of exactly the
    committed bytes, filled with NaN: only what ``propose`` writes is real.
    """
    view = torch.full((blocks, LAYERS, BLOCK, HIDDEN), float("nan"))
    assert view.untyped_storage().nbytes() == blocks * BLOCK_BYTES
    return view


class V2Engine:
    """Both halves of one engine, driven in the V2 runner's order (module docstring)."""

    def __init__(self, root: Path, *, sleep_mode: bool = False, **extra: Any) -> None:
        settings: dict[str, Any] = {
            "chunk_bytes": BLOCK_BYTES,
            "host_buffer_bytes": BLOCK_BYTES,
            "num_writer_threads": 1,
            "shutdown_timeout": 5.0,
        }
        settings.update(extra)
        self.config = ConnectorConfig(shared_storage_path=str(root), instance_id="v2", **settings)
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model="fake-model", enable_sleep_mode=sleep_mode),
            kv_transfer_config=SimpleNamespace(engine_id=f"v2-{uuid.uuid4().hex}"),
            parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_rank=0),
        )
        self.stats = WriteStats(0)
        self.scheduler = scheduler_side(
            self.config, self.vllm_config, CapturePlan(HS_GROUP, BLOCK), self.stats
        )
        self.worker: WorkerSide | None = None  # created after warm-up
        self.cache = committed_view(COMMITTED)
        self.announced: set[str] = set()

    def warm_up_and_register(self) -> None:
        """``extend_kv_cache``: the worker connector is built now, on committed views."""
        self.worker = worker_side(
            self.config, self.vllm_config, CapturePlan(HS_GROUP, BLOCK, LAYER_IDS), self.stats
        )
        self.worker.register({"model.drafter.cache_only": self.cache})

    def propose(self, tokens: dict[int, torch.Tensor]) -> None:
        """The speculator stores this step's hidden states: ``{slot: [layers, hidden]}``."""
        for slot, states in tokens.items():
            self.cache[slot // BLOCK, :, slot % BLOCK] = states

    def step(self, output: SimpleNamespace, written: dict[int, torch.Tensor]) -> set[str]:
        """One ``execute_model`` with a speculator (deferred finalisation)."""
        assert self.worker is not None
        meta = self.scheduler.build_metadata(output)
        self.worker.before_forward(meta)  # pre_forward: handle_preemptions, bind
        finished, self.announced = self.announced, set()
        done, _ = self.worker.get_finished(meta, finished)  # post_forward(defer_finalize)
        self.propose(written)  # the step's hidden states exist only from here on
        self.worker.after_forward(meta)  # finalize_step: wait_for_save, clear metadata
        return done or set()

    def finish(self, request: SimpleNamespace, block_ids: list[int]) -> dict[str, Any]:
        keep, params = self.scheduler.request_finished(request, block_ids)
        assert params is not None
        if keep:
            self.announced.add(request.request_id)
        return params

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    made: list[V2Engine] = []

    def make(**extra: Any) -> V2Engine:
        made.append(V2Engine(tmp_path, **extra))
        made[-1].warm_up_and_register()
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def states_for(slots: list[int], seed: int) -> dict[int, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {slot: torch.randn(LAYERS, HIDDEN, generator=gen) for slot in slots}


def slots_of(blocks: list[int], first: int, count: int) -> list[int]:
    """Cache slots of token positions ``first .. first+count-1`` in these blocks."""
    return [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(first, first + count)]


def expected(written: dict[int, torch.Tensor], slots: list[int]) -> torch.Tensor:
    return torch.stack([written[s] for s in slots])


def read(path: str) -> Any:
    reader = HiddenStateReader(
        os.path.dirname(path), names=[os.path.basename(path)], on_error="raise", lock_timeout=WAIT_S
    )
    (sample,) = list(reader)
    return sample


# -- the V2 runner's order -------------------------------------------------------------


@pytest.mark.parametrize("include_output", [False, True], ids=["prompt", "with-output"])
def test_the_step_that_completes_a_prompt_saves_what_propose_wrote_after_transfer_results(
    engines: Any, include_output: bool
) -> None:
    engine = engines(include_output_tokens=include_output)
    prompt, blocks = TokenBuffer(range(100, 110)), [3, 9, 14]  # 10 tokens, chunked 8 + 2
    first = states_for(slots_of(blocks, 0, 8), seed=1)
    request = new_request("r", prompt, blocks)
    assert engine.step(scheduler_output_v034(new=(request,), scheduled={"r": 8}), first) == set()
    last = states_for(slots_of(blocks, 8, 2), seed=2)
    engine.step(scheduler_output_v034(cached=(("r", 8, None),), scheduled={"r": 2}), last)
    output = [7, 8] if include_output else [7]
    if include_output:  # one decode step: the first generated token's state
        decoded = states_for(slots_of(blocks, 10, 1), seed=3)
        engine.step(scheduler_output_v034(cached=(("r", 10, None),), scheduled={"r": 1}), decoded)
        last |= decoded
    done = finished_request("r", prompt, output)
    done.all_token_ids = TokenBuffer(list(prompt) + output)
    path = engine.finish(done, blocks)[PATH_PARAM]
    sample = read(path)
    stored = len(prompt) + len(output) - 1
    assert sample.token_ids.tolist() == list(prompt) + output[:-1]
    slots = slots_of(blocks, 0, stored)
    assert torch.equal(sample.hidden_states, expected(first | last, slots))
    assert not bool(sample.hidden_states.isnan().any())


def test_a_request_resumed_as_a_new_one_is_saved_from_its_new_blocks(engines: Any) -> None:
    engine = engines()
    prompt = TokenBuffer(range(12))
    old_blocks, new_blocks = [1, 2, 3], [5, 6, 7]
    request = new_request("p", prompt, old_blocks)
    engine.step(scheduler_output_v034(new=(request,), scheduled={"p": 8}), {})
    # Preempted (blocks freed) before its prompt completed; 0.34 re-sends it as new.
    again = new_request("p", prompt, new_blocks)
    recomputed = states_for(slots_of(new_blocks, 0, 12), seed=4)
    engine.step(
        scheduler_output_v034(new=(again,), scheduled={"p": 12}, preempted=frozenset({"p"})),
        recomputed,
    )
    path = engine.finish(finished_request("p", prompt, [0]), new_blocks)[PATH_PARAM]
    assert torch.equal(read(path).hidden_states, expected(recomputed, slots_of(new_blocks, 0, 12)))


def test_blocks_are_reported_by_transfer_results_only_after_their_copies(engines: Any) -> None:
    engine = engines()
    prompt, blocks = TokenBuffer(range(8)), [10, 11]
    written = states_for(slots_of(blocks, 0, 8), seed=5)
    engine.step(
        scheduler_output_v034(new=(new_request("b", prompt, blocks),), scheduled={"b": 8}), written
    )
    engine.finish(finished_request("b", prompt, [0]), blocks)
    assert engine.worker is not None and engine.worker.pipeline is not None
    assert engine.worker.pipeline.wait_copied("b", WAIT_S)
    assert engine.step(scheduler_output_v034(), {}) == {"b"}  # reported once announced
    assert engine.step(scheduler_output_v034(), {}) == set()


# -- sleep mode ----------------------------------------------------------------------------


def test_sleep_drains_every_copy_before_the_cache_is_released_and_capture_continues(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = StuckDisk(monkeypatch)
    engine = engines(sleep_mode=True)
    assert engine.worker is not None
    prompt, blocks = TokenBuffer(range(16)), [4, 5, 6, 7]  # 4 chunks through 1 slab
    written = states_for(slots_of(blocks, 0, 16), seed=6)
    engine.step(
        scheduler_output_v034(new=(new_request("s", prompt, blocks),), scheduled={"s": 16}), written
    )
    path = engine.finish(finished_request("s", prompt, [0]), blocks)[PATH_PARAM]
    assert disk.entered.wait(WAIT_S)  # chunk 1 is being written; chunks 2-4 wait for the slab
    threading.Timer(0.2, disk.release.set).start()  # the disk moves on
    engine.worker.sleep.before_release(engine.worker.pipeline)  # unregister_kv_caches
    engine.cache.fill_(float("nan"))  # sleep released the cache: its contents are gone
    engine.worker.sleep.after_restore()  # restore_kv_caches after wake_up
    assert torch.equal(read(path).hidden_states, expected(written, slots_of(blocks, 0, 16)))
    # After wake-up capture continues into the same (restored) cache.
    more = states_for(slots_of([8, 9], 0, 8), seed=7)
    request = new_request("w", TokenBuffer(range(8)), [8, 9])
    engine.step(scheduler_output_v034(new=(request,), scheduled={"w": 8}), more)
    path = engine.finish(finished_request("w", TokenBuffer(range(8)), [0]), [8, 9])[PATH_PARAM]
    assert torch.equal(read(path).hidden_states, expected(more, slots_of([8, 9], 0, 8)))


def test_a_copy_that_cannot_finish_before_the_release_fails_its_sample_loudly(
    engines: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = StuckDisk(monkeypatch)
    engine = engines(sleep_mode=True, shutdown_timeout=0.1)
    assert engine.worker is not None
    prompt, blocks = TokenBuffer(range(12)), [1, 2, 3]
    engine.step(
        scheduler_output_v034(new=(new_request("f", prompt, blocks),), scheduled={"f": 12}),
        states_for(slots_of(blocks, 0, 12), seed=8),
    )
    path = engine.finish(finished_request("f", prompt, [0]), blocks)[PATH_PARAM]
    assert disk.entered.wait(WAIT_S)
    engine.worker.sleep.before_release(engine.worker.pipeline)  # the disk never frees the slab
    disk.release.set()
    assert engine.worker.pipeline is not None and engine.worker.pipeline.wait_copied("f", WAIT_S)
    engine.close()
    status = read_status(lock_path(path))
    assert status.failed and RELEASE_REASON in status.reason
    assert not os.path.exists(path)


# -- tags and idempotency keys -------------------------------------------------------------


def _one_request(
    engine: V2Engine, req_id: str, params: dict[str, Any] | None, seed: int = 0
) -> dict[str, Any]:
    prompt, blocks = TokenBuffer(range(20, 28)), [seed % 8 * 2, seed % 8 * 2 + 1]
    request = new_request(req_id, prompt, blocks, params)
    written = states_for(slots_of(blocks, 0, 8), seed=seed)
    engine.step(scheduler_output_v034(new=(request,), scheduled={req_id: 8}), written)
    return engine.finish(finished_request(req_id, prompt, [0]), blocks)


def test_tags_round_trip_into_sample_metadata(engines: Any) -> None:
    engine = engines()
    tags = {"policy_version": "step-1200", "row_id": "train-000042"}
    result = _one_request(engine, "t", {"metadata": tags})
    assert ERROR_PARAM not in result
    sample = read(result[PATH_PARAM])
    assert sample.metadata["policy_version"] == "step-1200"
    assert sample.metadata["row_id"] == "train-000042"
    assert sample_tags(sample.metadata) == tags


@pytest.mark.parametrize(
    ("tags", "reason"),
    [
        ("v1", "metadata must be an object of string keys to string values, got str"),
        ({"policy": 3}, "metadata['policy'] must be a string, got int"),
        ({"bad key": "x"}, "metadata key 'bad key' must be a letter"),
        ({"request_id": "x"}, "is one of the format's own keys"),
        ({"k": "x" * 1025}, "has 1025 characters; at most 1024"),
        ({f"k{i}": "x" for i in range(33)}, "has 33 entries; at most 32"),
        ({f"k{i}": "x" * 1000 for i in range(9)}, "bytes of keys and values; at most 8192"),
    ],
    ids=["not-a-map", "not-a-string", "bad-key", "reserved", "long-value", "many", "big"],
)
def test_bad_tags_are_refused_and_no_sample_is_written(
    engines: Any, tags: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = engines()
    with caplog.at_level("WARNING"):
        result = _one_request(engine, "bad", {"metadata": tags})
    assert reason in result[ERROR_PARAM] and reason in caplog.text
    assert not os.path.lexists(lock_path(result[PATH_PARAM]))
    good = _one_request(engine, "good", {"metadata": {"row_id": "1"}}, seed=1)
    assert read(good[PATH_PARAM]).metadata["row_id"] == "1"


def test_a_retried_idempotency_key_yields_one_sample(engines: Any, tmp_path: Path) -> None:
    engine = engines()
    params = {"idempotency_key": "rollout-7.sample-3", "metadata": {"policy_version": "9"}}
    first = _one_request(engine, "attempt-1", params, seed=1)
    assert first[PATH_PARAM] == str(tmp_path / "rollout-7.sample-3.safetensors")
    sample = read(first[PATH_PARAM])
    # The retry (a new request id, the same key) finds it complete: nothing is written.
    retry = _one_request(engine, "attempt-2", params, seed=2)
    assert retry[PATH_PARAM] == first[PATH_PARAM] and retry[EXISTED_PARAM] is True
    assert torch.equal(read(retry[PATH_PARAM]).hidden_states, sample.hidden_states)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".safetensors"))
    assert names == ["rollout-7.sample-3.safetensors"]


def test_a_retry_racing_the_first_attempt_replaces_it_atomically(
    engines: Any, tmp_path: Path
) -> None:
    engine = engines()
    params = {"idempotency_key": "k1"}
    prompt = TokenBuffer(range(20, 28))
    # Both attempts are in flight before either is finished (a client retried on a timeout).
    a = new_request("a", prompt, [0, 1], params)
    b = new_request("b", prompt, [2, 3], params)
    written = states_for(slots_of([0, 1], 0, 8) + slots_of([2, 3], 0, 8), seed=3)
    engine.step(scheduler_output_v034(new=(a, b), scheduled={"a": 8, "b": 8}), written)
    first = engine.finish(finished_request("a", prompt, [0]), [0, 1])
    second = engine.finish(finished_request("b", prompt, [0]), [2, 3])
    assert first[PATH_PARAM] == second[PATH_PARAM] and EXISTED_PARAM not in second
    assert engine.worker is not None and engine.worker.pipeline is not None
    for req_id in ("a", "b"):
        assert engine.worker.pipeline.wait_copied(req_id, WAIT_S)
    engine.close()  # both writes done: the last rename won
    names = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert names == ["k1.safetensors"]
    sample = read(first[PATH_PARAM])
    assert any(
        torch.equal(sample.hidden_states, expected(written, slots_of(blocks, 0, 8)))
        for blocks in ([0, 1], [2, 3])
    )


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ({"idempotency_key": 7}, "idempotency_key must be a string, got int"),
        ({"idempotency_key": "../x"}, "must be 1-200 letters, digits"),
        ({"idempotency_key": "a.tmp.b"}, "would name a temporary file"),
        ({"idempotency_key": "k", "hidden_states_path": "k.safetensors"}, "not both"),
    ],
    ids=["not-a-string", "path", "temporary", "with-path"],
)
def test_a_bad_idempotency_key_is_refused(
    engines: Any, params: dict[str, Any], reason: str
) -> None:
    engine = engines()
    result = _one_request(engine, "bad-key", params)
    assert reason in result[ERROR_PARAM]
    assert not os.path.lexists(lock_path(result[PATH_PARAM]))


def test_a_key_naming_a_file_another_request_is_writing_is_refused(engines: Any) -> None:
    engine = engines()
    prompt = TokenBuffer(range(20, 28))
    plain = new_request("x", prompt, [0, 1])  # default name x.v2.safetensors
    keyed = new_request("y", prompt, [2, 3], {"idempotency_key": "x.v2"})
    written = states_for(slots_of([0, 1], 0, 8), seed=4)
    engine.step(scheduler_output_v034(new=(plain, keyed), scheduled={"x": 8, "y": 8}), written)
    refused = engine.finish(finished_request("y", prompt, [0]), [2, 3])
    assert "which a request without that key is writing" in refused[ERROR_PARAM]
    kept = engine.finish(finished_request("x", prompt, [0]), [0, 1])
    assert torch.equal(
        read(kept[PATH_PARAM]).hidden_states, expected(written, slots_of([0, 1], 0, 8))
    )
