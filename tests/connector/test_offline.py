"""The connector inside a real offline vLLM engine (CPU build): values, paths, leaks."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_connector.engine.compat import vllm_version
from hidden_state_reader import HiddenStateReader, Sample
from hidden_state_reader.files.header import read_header
from hidden_state_reader.files.locks import SharedLock
from hidden_state_reader.format import lock_path

from conftest import HFReference, assert_matches_reference
from procs import IN_PROCESS_ENGINE
from speculators_env import use_speculators

pytestmark = pytest.mark.vllm

# Configured out of order on purpose: the model captures in layer order.
CONFIGURED_LAYERS = [4, 1, 2]
CAPTURED_LAYERS = [1, 2, 4]
VOCAB = 250


@dataclass
class Engine:
    llm: object
    out: Path
    outside: Path


# Enough requests that anything left open per request would show (every prompt length
# from 1 to 64 tokens, four times).
MANY_REQUESTS = 256


@pytest.fixture(scope="module")
def engine(tiny_model_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    from vllm import LLM

    base = tmp_path_factory.mktemp("offline")
    out, outside = base / "hs", base / "outside"
    out.mkdir()
    outside.mkdir()
    os.symlink(outside, out / "escape")  # a symlink inside the root that leads out of it
    # The engine runs in this test process (vLLM's in-process mode): what is checked here
    # does not depend on the process layout, and test_delivery.py runs every layout.
    env = pytest.MonkeyPatch()
    for key, value in IN_PROCESS_ENGINE.items():
        env.setenv(key, value)
    llm = LLM(
        model=str(tiny_model_fp32),
        dtype="float32",
        max_model_len=2048,
        max_num_batched_tokens=128,  # prompts over 128 tokens take chunked prefill
        enable_prefix_caching=True,
        enforce_eager=True,
        kv_cache_memory_bytes=512 * 1024**2,  # CPU build: KV space in host memory
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=speculative_config(CONFIGURED_LAYERS),
        kv_transfer_config=kv_transfer_config(
            str(out),
            {
                "allow_custom_save_path": True,  # CRC32: on by default, verified by read()
                # Tiny buffers: many chunks per request and slab back-pressure.
                "chunk_bytes": 64 * 1024,
                "host_buffer_bytes": 256 * 1024,
                "num_writer_threads": 2,
                "stats_interval": 0,
            },
        ),
    )
    try:
        yield Engine(llm, out, outside)
    finally:
        env.undo()
        del llm
        gc.collect()


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


def generate(
    engine: Engine, prompts: list[list[int]], *, max_tokens: int = 1, params: dict | None = None
) -> list[dict]:
    from vllm import SamplingParams

    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        detokenize=False,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    return [
        dict(o.kv_transfer_params or {}) | {"output": list(o.outputs[0].token_ids)} for o in outputs
    ]


def read(path: str) -> Sample:
    """Read one sample through the reader (it waits on the lock until the file is final)."""
    root, name = os.path.split(path)
    samples = list(HiddenStateReader(root, names=[name], on_error="raise", verify_checksum=True))
    assert len(samples) == 1
    return samples[0]


def test_values_equal_hf_transformers_including_chunked_prefill(
    engine: Engine, hf_fp32: HFReference, tiny_model_fp32: Path
) -> None:
    lengths = [1, 7, 16, 17, 129, 300]  # block edges, and prompts split by chunked prefill
    prompts = [prompt(n, seed=n) for n in lengths]
    results = generate(engine, prompts)
    for p, result in zip(prompts, results, strict=True):
        sample = read(result["hidden_states_path"])
        assert sample.token_ids.tolist() == p
        assert sample.hidden_states.shape == (len(p), 3, 128)
        assert sample.layer_ids == CAPTURED_LAYERS
        assert sample.metadata["request_id"]
        assert sample.metadata["num_prompt_tokens"] == str(len(p))
        assert sample.metadata["nonfinite"] == "0"
        # What the capture is: the model, its layer count and dtype, the vLLM; a CRC by default.
        header = read_header(sample.path)
        assert (
            header.model, header.num_hidden_layers, header.captures_last_layer,
            header.model_dtype, header.vllm_version, header.model_revision,
            len(header.metadata.get("crc32", "")),
        ) == (str(tiny_model_fp32), 4, True, "F32", vllm_version(), None, 8)  # fmt: skip
        assert_matches_reference(sample, hf_fp32)


def test_prefix_caching_with_shared_prefixes_keeps_values_right(
    engine: Engine, hf_fp32: HFReference
) -> None:
    shared = prompt(64, seed=1234)
    first = [shared + prompt(10 + i, seed=500 + i) for i in range(3)]
    generate(engine, first)  # fills the prefix cache
    again = [shared + prompt(20 + i, seed=600 + i) for i in range(3)]
    for p, result in zip(again, generate(engine, again), strict=True):
        sample = read(result["hidden_states_path"])
        assert sample.token_ids.tolist() == p
        assert_matches_reference(sample, hf_fp32)


def test_include_output_tokens_saves_generated_tokens_but_the_last(
    engine: Engine, hf_fp32: HFReference
) -> None:
    p = prompt(30, seed=77)
    [result] = generate(engine, [p], max_tokens=5, params={"include_output_tokens": True})
    sample = read(result["hidden_states_path"])
    generated = result["output"]
    assert len(generated) == 5
    # The last generated token was never fed back, so it has no hidden state.
    assert sample.token_ids.tolist() == p + generated[:-1]
    assert sample.metadata["num_prompt_tokens"] == "30"
    assert_matches_reference(sample, hf_fp32)


def test_custom_path_inside_root_is_used(engine: Engine) -> None:
    [result] = generate(
        engine, [prompt(12, 1)], params={"hidden_states_path": "custom/sample_a.safetensors"}
    )
    assert result["hidden_states_path"] == str(engine.out / "custom" / "sample_a.safetensors")
    assert read(result["hidden_states_path"]).num_tokens == 12


def test_one_changed_byte_in_a_default_file_fails_verify_checksums(engine: Engine) -> None:
    from hidden_state_reader.apps.cli.main import main as cli

    [result] = generate(engine, [prompt(20, 7)], params={"hidden_states_path": "crc/a.safetensors"})
    path = Path(read(result["hidden_states_path"]).path)  # published (and its CRC verified)
    assert cli(["verify", str(path.parent), "--checksums"]) == 0
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # one bit of hidden_states (the CRC32 is on by default)
    path.write_bytes(bytes(data))
    assert cli(["verify", str(path.parent), "--checksums"]) == 1


def test_unusable_custom_directory_is_refused_with_hidden_states_error(engine: Engine) -> None:
    (engine.out / "blocker").write_text("a regular file where a directory is asked for")
    bad, good = generate(
        engine,
        [prompt(12, 2)],
        params={"hidden_states_path": "blocker/sample_b.safetensors"},
    ) + generate(engine, [prompt(12, 3)])
    assert "not a directory" in bad["hidden_states_error"]
    assert "blocker" in bad["hidden_states_error"]
    assert not os.path.exists(lock_path(bad["hidden_states_path"]))
    assert "hidden_states_error" not in good  # the server keeps serving
    assert read(good["hidden_states_path"]).num_tokens == 12


def test_loss_masks_sent_online_come_back_exactly_and_a_bad_one_is_refused(
    engine: Engine,
) -> None:
    from vllm import SamplingParams

    from hidden_state_reader.training.collate import pad_collate

    prompts = [prompt(12, 21), prompt(20, 22), prompt(10, 23)]
    listed = [0] * 5 + [1] * 4 + [0, 1, 1]
    requests = [
        ({"loss_mask": listed}, 1),
        ({"loss_mask_spans": [[15, 20], [2, 4]], "include_output_tokens": True}, 4),
        ({"loss_mask": [1] * 9}, 1),  # one short of the prompt
    ]
    sampling = [
        SamplingParams(
            max_tokens=n, temperature=0.0, detokenize=False, extra_args={"kv_transfer_params": kv}
        )
        for kv, n in requests
    ]
    outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    masked, spans, bad = (dict(o.kv_transfer_params or {}) for o in outputs)
    assert "hidden_states_error" not in masked and "hidden_states_error" not in spans
    first, second = read(masked["hidden_states_path"]), read(spans["hidden_states_path"])
    assert first.loss_mask is not None and first.loss_mask.int().tolist() == listed
    generated = list(outputs[1].outputs[0].token_ids)
    assert second.token_ids.tolist() == prompts[1] + generated[:-1]
    expected = [0, 0, 1, 1] + [0] * 11 + [1] * 5 + [1] * 3  # generated tokens count
    assert second.loss_mask is not None and second.loss_mask.int().tolist() == expected
    batch = pad_collate([first, second])
    assert batch["loss_mask"].int().tolist() == [listed + [0] * 11, expected]
    assert batch["has_loss_mask"].tolist() == [True, True]
    assert "loss_mask has 9 entries" in bad["hidden_states_error"]
    assert "the prompt's 10" in bad["hidden_states_error"]
    assert not os.path.lexists(bad["hidden_states_path"])
    assert not os.path.lexists(lock_path(bad["hidden_states_path"]))


@pytest.mark.parametrize(
    "hostile",
    [
        "../evil.safetensors",
        "/tmp/evil-absolute.safetensors",
        "escape/evil.safetensors",  # through a symlink that leaves the root
        "a/../../evil.safetensors",
        "x" * 300 + ".safetensors",
        "nul\x00byte.safetensors",
        "not-a-sample.txt",
    ],
)
def test_hostile_paths_are_refused_and_nothing_is_written_outside(
    engine: Engine, hostile: str
) -> None:
    [result] = generate(engine, [prompt(9, 2)], params={"hidden_states_path": hostile})
    path = Path(result["hidden_states_path"])
    assert path.parent == engine.out, f"{hostile!r} was not refused: {path}"
    assert read(str(path)).num_tokens == 9
    assert not list(engine.outside.iterdir())
    assert not Path("/tmp/evil-absolute.safetensors").exists()
    assert not (engine.out.parent / "evil.safetensors").exists()


def test_vllm_load_hidden_states_reads_our_files(engine: Engine) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        load_hidden_states,
    )

    [result] = generate(engine, [prompt(40, 3)])
    theirs = load_hidden_states(result["hidden_states_path"])
    ours = read(result["hidden_states_path"])
    assert torch.equal(theirs["token_ids"], ours.token_ids)
    assert torch.equal(theirs["hidden_states"], ours.hidden_states)


def test_speculators_reads_the_connector_files_and_their_export(
    engine: Engine, tmp_path: Path
) -> None:
    use_speculators()  # speculators 0.9.0's own code, as its users import it
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    from hidden_state_reader.apps.export.speculators import export_speculators

    p1, p2 = prompt(9, seed=901), prompt(24, seed=902)
    [r1] = generate(engine, [p1], params={"hidden_states_path": "spec/a.safetensors"})
    [r2] = generate(
        engine,
        [p2],
        max_tokens=4,
        params={"hidden_states_path": "spec/b.safetensors", "include_output_tokens": True},
    )
    tokens2 = p2 + r2["output"][:-1]  # the last generated token has no hidden state
    # Online, speculators loads a response's file through its kv_transfer_params.
    online = FileTransfer(engine.out).get_generated(r1)
    check_hidden_states(online, p1)
    assert torch.equal(online["hidden_states"], read(r1["hidden_states_path"]).hidden_states)
    # Offline: export the folder, then the trainer's dataset reads it. b's writer may still
    # hold its lock when generate() returns: the export waits for it.
    result = export_speculators(engine.out / "spec", tmp_path / "spec", wait=60)
    assert result.skipped == []
    assert [r.source for r in result.rows] == [r1["hidden_states_path"], r2["hidden_states_path"]]
    dataset = ArrowDataset(max_len=64, datapath=tmp_path / "spec", on_missing="raise")
    expected = [(p1, [1] * 9), (tokens2, [0] * 24 + [1] * 3)]  # prompt-only: all tokens
    for i, (tokens, mask) in enumerate(expected):
        item, ours = dataset[i], read(result.rows[i].source)
        assert item["input_ids"].tolist() == tokens and item["loss_mask"].tolist() == mask
        assert torch.equal(item["hidden_states"], ours.hidden_states[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], ours.hidden_states[:, -1])
        check_hidden_states(FileTransfer(tmp_path / "spec" / "hidden_states").get_cached(i), tokens)


def _open_files_under(root: Path) -> list[str]:
    me = psutil.Process()
    found = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            found += [f.path for f in proc.open_files() if f.path.startswith(str(root))]
        except psutil.Error:
            continue
    return found


def _released(path: str) -> bool:
    lock = SharedLock.acquire(path, timeout=60.0)  # sleeps until the writer releases
    if lock is None:
        return False
    lock.release()
    return True


def test_hundreds_of_requests_leave_no_open_files_locks_or_temp_files(engine: Engine) -> None:
    prompts = [prompt(1 + i % 64, seed=10_000 + i) for i in range(MANY_REQUESTS)]
    results = generate(engine, prompts)
    paths = [r["hidden_states_path"] for r in results]
    assert len(set(paths)) == MANY_REQUESTS
    names = [os.path.basename(p) for p in paths]
    reader = HiddenStateReader(engine.out, names=names, on_error="raise")
    lengths = {s.path: s.num_tokens for s in reader}  # yielded in completion order
    assert lengths == {path: len(p) for path, p in zip(paths, prompts, strict=True)}
    assert reader.stats.yielded == MANY_REQUESTS
    # A small published file is read without its lock, which its writer releases just
    # after the rename: every lock is given up without another engine call ...
    assert all(_released(p) for p in paths)
    assert _open_files_under(engine.out) == []  # ... and nothing under out stays open
    assert not [f for f in os.listdir(engine.out) if ".tmp." in f]
