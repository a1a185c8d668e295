"""``hidden-state extract`` end to end through real vLLM (CPU): mixed and invalid inputs,
resume after SIGKILL, generated tokens. Its parts without vLLM are tested in
``tests/connector_unit/test_extract_cli.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from extract_kit import (
    LAYERS,
    MULTI_TURN,
    PLAIN_TAGGED,
    RESUME_RECORDS,
    expected_ids,
    extract_argv,
    mask_of,
    oracle_mask,
    poisoned_vllm,
    run_extract,
    temp_files,
    write_jsonl,
)

from hidden_state_connector.apps.offline.manifest import MANIFEST_NAME, Manifest
from hidden_state_connector.engine.compat import vllm_version
from hidden_state_reader import HiddenStateReader, read_header

from conftest import HFReference, assert_matches_reference
from procs import IN_PROCESS_ENGINE

# -- vLLM end to end ----------------------------------------------------------------------


MIXED_RECORDS: list[Any] = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Why is the sky blue?"},
        ]
    },
    {"token_ids": list(range(10, 40))},
    '{"text": "unterminated',
    {"text": "y" * 200},  # 200 tokens > max_model_len - 1
    {"token_ids": [1, 2, 5000]},  # out of vocabulary
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    "",
    {"messages": [*MULTI_TURN[1:3], {"role": "user", "content": "And?"}]},
    {"input_ids": list(range(60, 72)), "loss_mask": [0] * 5 + [1] * 7},  # speculators'
    {"input_ids": list(range(60, 72)), "loss_mask": [1] * 11},
]
"""One JSONL input of every kind: texts, chats (OpenAI and ShareGPT), token ids, masks,
and five bad lines (indexes 3, 4, 5, 7, 10)."""
MIXED_OK = {0, 1, 2, 6, 8, 9}


def _check_mixed_ok_samples(out: Path, tokenizer: Any) -> None:
    """The good records' samples: token ids, layers and loss masks as expected."""
    records = MIXED_RECORDS
    sharegpt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chats = {1: records[1]["messages"], 6: sharegpt, 8: records[8]["messages"]}
    for index in MIXED_OK:
        [sample] = HiddenStateReader(out, names=[f"hs_{index}.safetensors"], on_error="raise")
        mask = None
        if index in chats:  # the assistant mask as transformers computes it from tags
            want, mask = oracle_mask(tokenizer, PLAIN_TAGGED, chats[index])
            assert want == expected_ids(tokenizer, {"messages": chats[index]})
        elif index == 9:
            want, mask = records[9]["input_ids"], records[9]["loss_mask"]
        else:
            want = expected_ids(tokenizer, records[index])
        assert sample.token_ids.tolist() == want, index
        assert sample.hidden_states.shape == (len(want), 2, 128)
        assert sample.layer_ids == LAYERS
        got = None if sample.loss_mask is None else sample.loss_mask.int().tolist()
        assert got == mask, index
    assert sum(mask_of(out, 8)) == len("Rayleigh scattering.")  # a reply mid-conversation
    assert sum(mask_of(out, 1)) == 0  # a chat without a reply yet: nothing to learn


@pytest.mark.vllm
def test_mixed_input_writes_ok_samples_and_records_failures(
    tmp_path: Path, tiny_model_fp32: Path, tokenizer: Any
) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", MIXED_RECORDS)
    out = tmp_path / "out"
    started = time.monotonic()
    result = run_extract(
        str(tiny_model_fp32),
        "--input",
        str(data),
        "--out",
        str(out),
        "--layers",
        "1,3",
        "--max-model-len",
        "128",
        "--batch-size",
        "2",
        env={**IN_PROCESS_ENGINE, "VLLM_LOGGING_LEVEL": "INFO"},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    # vLLM's logs go to stderr; stdout is the summary alone, ending with the manifest.
    assert "INFO" in result.stderr and "INFO" not in result.stdout, result.stdout[:3000]
    summary = result.stdout.splitlines()
    assert summary[0].startswith("done: 6 ok"), result.stdout[:3000]
    assert summary[-1] == f"manifest: {out / 'manifest.jsonl'}"
    assert "extract: 11/11 (100.0%), 5 failed" in result.stderr  # the final progress line
    _check_mixed_ok_samples(out, tokenizer)
    state = Manifest(str(out)).samples
    assert {i for i, r in state.items() if r.ok} == MIXED_OK
    reasons = {i: r.error or "" for i, r in state.items() if not r.ok}
    assert set(reasons) == {3, 4, 5, 7, 10}
    assert reasons[10] == "'loss_mask' has 11 entries for 12 token ids"
    assert reasons[3].startswith("invalid JSON")
    assert reasons[4] == "prompt has 200 tokens, more than max_model_len - 1 = 127"
    assert "out of vocabulary" in reasons[5]
    assert reasons[7] == "empty line"
    for index, reason in reasons.items():
        assert f"#{index}: {reason}" in result.stdout
        assert not (out / f"hs_{index}.safetensors").exists()
    assert "failed samples (5):" in result.stdout
    assert temp_files(out) == []
    print(f"mixed input run: {elapsed:.1f}s")


def _kill_after_three_samples(args: list[str], out: Path) -> dict[int, Any]:
    """Run ``extract ARGS``, SIGKILL it once a reader saw 3 samples; the manifest then."""
    # Both runs are in-process engines (the layout is not the point; a killed multiprocess
    # server is tests/reliability/test_server_kill.py): SIGKILL ends the whole engine.
    proc = subprocess.Popen(
        extract_argv(*args, module=True),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, frozen and killed as one
        env={**os.environ, **IN_PROCESS_ENGINE},
    )
    try:
        seen = sum(1 for _ in HiddenStateReader(out, follow=True, max_samples=3, idle_timeout=300))
        # Freeze the whole group the moment the third sample is yielded: nothing moves between
        # this count and the SIGKILL (a fast run used to finish all of them before a kill).
        os.killpg(proc.pid, signal.SIGSTOP)
        before = Manifest(str(out)).samples
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert seen == 3
    return before


@pytest.mark.vllm
def test_resume_after_sigkill_records_every_index_once(
    tmp_path: Path, tiny_model_fp32: Path
) -> None:
    gen = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    records = [
        {"text": "".join(letters[i] for i in torch.randint(0, 27, (240,), generator=gen))}
        for _ in range(RESUME_RECORDS)
    ]
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    out.mkdir()
    args = [
        str(tiny_model_fp32),
        "--input",
        str(data),
        "--out",
        str(out),
        "--layers",
        "1,3",
        "--batch-size",
        "4",
        "--max-model-len",
        "512",
    ]
    started = time.monotonic()
    before = _kill_after_three_samples(args, out)
    assert len(before) < RESUME_RECORDS, "the run finished before the kill"
    killed_at = time.monotonic() - started

    resumed = run_extract(*args, module=True, env=IN_PROCESS_ENGINE)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-3000:]
    # It did not start over: the 3 files seen before the kill were skipped (recorded) or
    # verified and kept (on disk, not yet recorded), never recomputed.
    summary = re.search(
        r"(\d+) written, (\d+) already on disk\), 0 failed, (\d+) skipped", resumed.stdout
    )
    assert summary, resumed.stdout
    written, kept, skipped = map(int, summary.groups())
    assert (
        written + kept + skipped == RESUME_RECORDS
        and kept + skipped >= 3
        and skipped == len(before)
    )
    lines = [json.loads(line) for line in (out / MANIFEST_NAME).read_text().splitlines()]
    ok_counts = Counter(doc["index"] for doc in lines if doc.get("status") == "ok")
    assert ok_counts == Counter(range(RESUME_RECORDS)), "every index ok exactly once"
    state = Manifest(str(out)).samples
    assert all(
        state[i].ok and (out / f"hs_{i}.safetensors").exists() for i in range(RESUME_RECORDS)
    )
    assert temp_files(out) == []
    resumed_at = time.monotonic() - started

    third_started = time.monotonic()
    third = run_extract(*args, module=True, env=poisoned_vllm(tmp_path))
    assert third.returncode == 0, third.stderr
    assert third.stdout.startswith(f"nothing to do: all {RESUME_RECORDS} samples")
    third_seconds = time.monotonic() - third_started  # reported, not asserted (no vLLM start)
    print(
        f"killed after {killed_at:.1f}s with {len(before)} recorded; resumed run done at "
        f"{resumed_at:.1f}s; nothing-to-do run {third_seconds:.1f}s"
    )


@pytest.mark.vllm
def test_include_output_tokens_stores_prompt_and_generated_tokens(
    tmp_path: Path, tiny_model_fp32: Path, tokenizer: Any, hf_fp32: HFReference
) -> None:
    # Also the suite's real-vLLM round trip of fp8 storage (no engine of its own).
    records = [{"text": "Once upon a time"}, {"token_ids": list(range(50, 90))}]
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    result = run_extract(
        str(tiny_model_fp32),
        "--input",
        str(data),
        "--out",
        str(out),
        "--layers",
        "1,3",
        "--max-tokens",
        "4",
        "--include-output-tokens",
        "--storage-dtype",
        "fp8_e4m3",
        "--dtype",
        "float32",  # vLLM equals HF here to 1e-4: the rest of the error is fp8's
        env=IN_PROCESS_ENGINE,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    state = Manifest(str(out)).samples
    for index, record in enumerate(records):
        prompt = expected_ids(tokenizer, record)
        [sample] = HiddenStateReader(out, names=[f"hs_{index}.safetensors"], on_error="raise")
        assert sample.num_tokens == len(prompt) + 3  # 4 generated, the last never fed back
        assert sample.token_ids[: len(prompt)].tolist() == prompt
        assert sample.metadata["num_prompt_tokens"] == str(len(prompt))
        assert (state[index].tokens, state[index].prompt_tokens) == (len(prompt) + 3, len(prompt))
        header = read_header(sample.path)
        assert header.hidden.dtype == "F8_E4M3" and header.metadata["model_dtype"] == "F32"
        # What the capture is (layers 1 and 3 of 4: not the last), with a CRC by default.
        assert (
            header.num_hidden_layers, header.captures_last_layer, header.vllm_version,
            len(header.metadata.get("crc32", "")), header.model,
        ) == (4, False, vllm_version(), 8, str(tiny_model_fp32))  # fmt: skip
        assert sample.hidden_states.dtype == torch.float32  # dequantized to the model's dtype
        assert_matches_reference(sample, hf_fp32, rtol=2**-4)  # the documented fp8 bound
