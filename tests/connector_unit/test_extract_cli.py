"""``hidden-state extract`` without vLLM: inputs, chat masks, manifest, progress, usage.

Real files; the command runs as a subprocess or in this process. Recovery of files
already on disk is checked with vLLM made unimportable (a finished run never starts it).
The runs through real vLLM are in ``tests/connector/test_extract.py``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from extract_kit import (
    CHATML,
    CHATML_TAGGED,
    LAYERS,
    MULTI_TURN,
    PLAIN,
    PLAIN_TAGGED,
    expected_ids,
    oracle_mask,
    poisoned_vllm,
    run_extract,
    run_in_process,
    temp_files,
    with_template,
    write_jsonl,
    write_valid_sample,
)

from hidden_state_connector.apps.offline.engine import VllmEngine
from hidden_state_connector.apps.offline.errors import UsageError
from hidden_state_connector.apps.offline.inputs import PromptEncoder, open_input
from hidden_state_connector.apps.offline.manifest import MANIFEST_NAME, Manifest, SampleRecord
from hidden_state_connector.apps.offline.progress import ExtractCounters, format_duration
from hidden_state_connector.apps.offline.resume import remove_stale_temp_files
from hidden_state_reader.files.publish import write_sample

# -- fast: inputs, manifest, progress, CLI usage ------------------------------------------


def test_help_has_description_and_examples() -> None:
    code, out, _ = run_in_process("--help")
    assert code == 0
    assert "hs_{index}.safetensors" in out and "manifest.jsonl" in out
    assert "examples:" in out and "--include-output-tokens" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
        (["--engine-args", "{not json"], "--engine-args: invalid JSON"),
        (["--engine-args", "[1]"], "--engine-args: expected a JSON object"),
        (["--engine-args", '{"dtype": "half"}'], "'dtype' is set by --dtype"),
        (["--engine-args", "@nope.json"], "--engine-args nope.json: cannot read"),
        (["--connector-config", '{"fsycn": true}'], "unknown key 'fsycn'"),
        (["--connector-config", '{"num_writer_threads": "x"}'], "num_writer_threads"),
        (["--connector-config", '{"allow_custom_save_path": false}'], "must stay true"),
        (["--layers", "1,99"], "layer ids must be <= 4"),
        pytest.param(  # checked against the installed vLLM's EngineArgs (no engine starts)
            ["--engine-args", '{"not_an_arg": 1}'],
            "unknown vLLM engine argument 'not_an_arg'",
            marks=pytest.mark.vllm,
        ),
    ],
)
def test_usage_errors_exit_2_with_one_line_naming_the_culprit(
    tmp_path: Path, tiny_model_fp32: Path, extra: list[str], needle: str
) -> None:
    data = write_jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    args = [str(tiny_model_fp32), "--input", str(data), "--out", str(tmp_path / "out"), *extra]
    code, out, err = run_in_process(*args)
    assert code == 2, (out, err)
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_records_of_every_kind_and_bad_ones(tmp_path: Path, tokenizer: Any) -> None:
    chat = [{"role": "user", "content": "hello"}]
    lines: list[Any] = [
        {"text": "plain"},
        {"messages": chat},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        {"token_ids": [5, 6]},
        [7, 8, 9],
        json.dumps("bare text"),
        "",
        '{"text": ',
        {"text": ""},
        {"token_ids": [1, -2]},
        {"token_ids": []},
        {"other": 1},
        {"messages": [{"content": "no role"}]},
        42,
    ]
    source = open_input(str(write_jsonl(tmp_path / "in.jsonl", lines)))
    assert source.total == len(lines)
    prompts = PromptEncoder(tokenizer).encode(list(source.items(lambda i: True)))
    assert [p.index for p in prompts] == list(range(len(lines)))
    sharegpt = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert prompts[0].token_ids == expected_ids(tokenizer, {"text": "plain"})
    assert prompts[1].token_ids == expected_ids(tokenizer, {"messages": chat})
    assert prompts[2].token_ids == expected_ids(tokenizer, {"messages": sharegpt})
    assert prompts[3].token_ids == [5, 6] and prompts[4].token_ids == [7, 8, 9]
    assert prompts[5].token_ids == expected_ids(tokenizer, {"text": "bare text"})
    errors = {p.index: p.error for p in prompts if p.error}
    assert set(errors) == set(range(6, len(lines)))
    assert errors[6] == "empty line"
    assert errors[7].startswith("invalid JSON")
    assert "'text' is empty" in errors[8]
    assert "negative" in errors[9] and "empty" in errors[10]
    assert "keys: other" in errors[11] and "role" in errors[12] and "int" in errors[13]


# Chat templates for the mask tests, each with an oracle twin that marks the assistant
# turns with {% generation %} (the newlines are expressions: HF's Jinja trims the ones
# after block tags).
@pytest.mark.parametrize(("template", "tagged"), [(PLAIN, PLAIN_TAGGED), (CHATML, CHATML_TAGGED)])
def test_chat_masks_mark_assistant_turns_as_generation_tags_would(
    tokenizer: Any, template: str, tagged: str
) -> None:
    chats = [MULTI_TURN, MULTI_TURN[:4], MULTI_TURN[1:3]]  # ends with a reply or a question
    items = [(i, {"messages": chat}, None) for i, chat in enumerate(chats)]
    derived = PromptEncoder(with_template(tokenizer, template)).encode(items)
    from_tags = PromptEncoder(with_template(tokenizer, tagged)).encode(items)
    for chat, prompt, tagged_prompt in zip(chats, derived, from_tags, strict=True):
        ids, mask = oracle_mask(tokenizer, tagged, chat)
        assert prompt.error is None and prompt.token_ids == ids
        assert prompt.loss_mask == mask and tagged_prompt.loss_mask == mask
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
        marked = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        eot = "<|im_end|>" if template == CHATML else ""
        assert marked == "".join(r + eot for r in replies)


def test_pre_tokenized_masks_are_kept_and_bad_ones_fail_the_record(tokenizer: Any) -> None:
    records: list[Any] = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        {"token_ids": [5, 6], "loss_mask": [True, False]},
        {"input_ids": [5, 6, 7]},
        [5, 6, 7],
        {"text": "plain"},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1]},
        {"input_ids": [5, 6], "loss_mask": [0, 2]},
        {"input_ids": [5, 6], "loss_mask": "01"},
    ]
    prompts = PromptEncoder(tokenizer).encode([(i, r, None) for i, r in enumerate(records)])
    assert [p.loss_mask for p in prompts[:5]] == [[0, 1, 1], [1, 0], None, None, None]
    assert [p.error for p in prompts[:5]] == [None] * 5
    assert prompts[5].error == "'loss_mask' has 2 entries for 3 token ids"
    assert prompts[6].error == "'loss_mask[1]' is 2; every entry must be 0 or 1"
    assert prompts[7].error == "'loss_mask' must be a list of 0/1"


def test_a_template_that_rewrites_earlier_turns_fails_the_chat_not_the_run(
    tokenizer: Any,
) -> None:
    # Hides earlier replies once the conversation goes on (as reasoning templates do).
    hiding = CHATML.replace(
        "{{ m['content'] }}",
        "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}"
        "{{ m['content'] }}{% endif %}",
    )
    items = [(0, {"messages": MULTI_TURN}, None), (1, {"messages": MULTI_TURN[1:3]}, None)]
    bad, good = PromptEncoder(with_template(tokenizer, hiding)).encode(items)
    assert bad.token_ids is None and bad.error is not None
    assert "cannot mark assistant tokens" in bad.error and "turn 2" in bad.error
    assert good.error is None and good.loss_mask is not None and sum(good.loss_mask) > 0


def test_verify_file_checks_the_stored_mask(tmp_path: Path) -> None:
    from hidden_state_connector.apps.offline.sample_check import verify_file

    path = tmp_path / "hs_0.safetensors"
    ids = list(range(10, 16))
    write_sample(path, torch.tensor(ids), torch.randn(6, 2, 4), loss_mask=[0, 0, 1, 1, 1, 1])
    check = {"layer_ids": LAYERS, "include_output": True}
    assert verify_file(str(path), ids[:4], loss_mask=[0, 0, 1, 1], **check)[0] == 6
    with pytest.raises(ValueError, match="loss_mask differs"):
        verify_file(str(path), ids[:4], loss_mask=[0, 1, 1, 1], **check)
    with pytest.raises(ValueError, match="holds a loss_mask, but the record has none"):
        verify_file(str(path), ids[:4], **check)
    plain = tmp_path / "hs_1.safetensors"
    write_sample(plain, torch.tensor(ids), torch.randn(6, 2, 4))
    with pytest.raises(ValueError, match="holds no loss_mask, but the record has one"):
        verify_file(str(plain), ids, layer_ids=LAYERS, include_output=False, loss_mask=[1] * 6)


def test_json_array_gzip_and_limit(tmp_path: Path) -> None:
    array = tmp_path / "in.json"
    array.write_text(json.dumps([{"text": str(i)} for i in range(5)]))
    source = open_input(str(array), limit=3)
    assert source.total == 3
    assert [i for i, _, _ in source.items(lambda i: i != 1)] == [0, 2]
    packed = tmp_path / "in.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write('{"text": "a"}\n{"text": "b"}')  # no final newline
    assert [r for _, r, _ in open_input(str(packed)).items(lambda i: True)] == [
        {"text": "a"},
        {"text": "b"},
    ]


def test_hf_dataset_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "dataset_dict.json").write_text("{}")
    splits = {"train": [{"text": "a"}, {"text": "b"}], "test": [{"text": "c"}]}
    fake = SimpleNamespace(load_from_disk=lambda path: splits)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    source = open_input(str(folder))
    assert source.total == 2 and "split 'train'" in source.description
    assert [r for _, r, _ in open_input(str(folder), split="test").items(lambda i: True)] == [
        {"text": "c"}
    ]
    with pytest.raises(UsageError, match="--split dev: not in"):
        open_input(str(folder), split="dev")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(UsageError, match="pip install datasets"):
        open_input(str(folder))
    (tmp_path / "plain").mkdir()
    with pytest.raises(UsageError, match="not a Hugging Face dataset"):
        open_input(str(tmp_path / "plain"))


def test_manifest_last_record_wins_and_a_torn_line_is_ignored(tmp_path: Path) -> None:
    manifest = Manifest(str(tmp_path))
    manifest.event("start", layers=LAYERS)
    manifest.append(SampleRecord(0, "failed", error="boom"))
    manifest.append(SampleRecord(0, "ok", "hs_0.safetensors", 3, 3, 100))
    manifest.close()
    with open(tmp_path / MANIFEST_NAME, "a") as f:
        f.write('{"index": 1, "status": "o')  # killed mid-write
    again = Manifest(str(tmp_path))
    assert again.ignored_lines == 1 and set(again.samples) == {0}
    assert again.samples[0].ok and again.samples[0].tokens == 3
    assert again.last_start() is not None and again.last_start()["layers"] == LAYERS
    again.append(SampleRecord(1, "ok", "hs_1.safetensors", 2, 2, 50))
    again.close()
    assert set(Manifest(str(tmp_path)).samples) == {0, 1}


def test_progress_line_rates_eta_and_throttling() -> None:
    now = [0.0]
    stream = io.StringIO()
    progress = ExtractCounters(10, stream=stream, interval=1.0, clock=lambda: now[0])
    progress.mark_engine_ready()
    now[0] = 2.0
    progress.add_ok(100, 2_000_000, computed=True)
    progress.add_ok(100, 2_000_000, computed=True)
    progress.add_failed()
    progress.maybe_print()
    progress.maybe_print()  # throttled
    now[0] = 2.5
    progress.maybe_print()  # still throttled
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("extract: 3/10 (30.0%), 1 failed")
    assert "1.0 samples/s" in lines[0] and "100 tok/s" in lines[0] and "2.0 MB/s" in lines[0]
    assert "ETA 7.0s" in lines[0]
    assert format_duration(3725) == "1h02m" and format_duration(75) == "1m15s"


class FakeLLM:
    """Stands in for vllm.LLM: enqueue + llm_engine.step (vLLM's id suffixes included)."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad
        self.queue: list[SimpleNamespace] = []
        self.counter = 0
        self.llm_engine = self

    def enqueue(self, prompts: list[dict[str, Any]], params: Any, use_tqdm: bool) -> list[str]:
        if self.bad in prompts[0]["prompt_token_ids"]:
            raise ValueError("Token id is out of vocabulary\nmore detail")
        external = str(self.counter)
        self.counter += 1
        self.queue.append(SimpleNamespace(request_id=external, finished=True, prompt=prompts[0]))
        return [f"{external}-1a2b3c4d"]

    def has_unfinished_requests(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[SimpleNamespace]:
        out, self.queue = self.queue[:2], self.queue[2:]
        return out[::-1]  # finishing out of order


def test_engine_maps_outputs_back_to_indices_and_reports_rejections() -> None:
    engine = VllmEngine(FakeLLM(bad=99), lambda index, _mask: index)
    assert engine.submit(10, [1]) is None
    assert engine.submit(11, [2]) is None
    assert engine.submit(12, [99]) == "vLLM rejected the prompt: Token id is out of vocabulary"
    assert engine.submit(13, [3]) is None
    assert engine.in_flight == 3
    seen = []
    while engine.in_flight:
        seen += [(i, o.prompt["prompt_token_ids"]) for i, o, _ in engine.step()]
    assert sorted(seen) == [(10, [1]), (11, [2]), (13, [3])]


def test_engine_without_enqueue_isolates_a_bad_prompt_of_a_batch() -> None:
    class OldLLM:
        def generate(self, prompts: list[Any], params: list[Any], use_tqdm: bool) -> list[Any]:
            if any(9 in p["prompt_token_ids"] for p in prompts):
                raise ValueError("bad prompt")
            return [SimpleNamespace(ids=p["prompt_token_ids"]) for p in prompts]

    engine = VllmEngine(OldLLM(), lambda index, _mask: index)
    for index, ids in ((0, [1]), (1, [9]), (2, [3])):
        engine.submit(index, ids)
    results = {i: (o.ids if o else err) for i, o, err in engine.step()}
    assert results == {0: [1], 1: "vLLM rejected the prompt: bad prompt", 2: [3]}


def test_stale_temp_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (tmp_path / f"hs_1.safetensors.tmp.{dead}.abc").write_bytes(b"partial")
    (tmp_path / f"hs_1.safetensors.lock.tmp.{dead}.abc").write_bytes(b"")
    mine = tmp_path / f"hs_2.safetensors.tmp.{os.getpid()}.abc"
    mine.write_bytes(b"in progress")
    (tmp_path / f"other.safetensors.tmp.{dead}.abc").write_bytes(b"not ours")
    assert remove_stale_temp_files(str(tmp_path)) == 2
    assert temp_files(tmp_path) == sorted([mine.name, f"other.safetensors.tmp.{dead}.abc"])


def test_files_on_disk_are_verified_and_a_finished_run_never_starts_vllm(
    tmp_path: Path, tiny_model_fp32: Path, tokenizer: Any
) -> None:
    records = [{"text": "first"}, {"text": "second"}, {"token_ids": [4, 5, 6]}]
    data = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    out.mkdir()
    # A killed run left: good files, a file of another prompt, a partial temp file.
    write_valid_sample(out / "hs_0.safetensors", expected_ids(tokenizer, records[0]))
    write_valid_sample(out / "hs_1.safetensors", expected_ids(tokenizer, records[1]))
    write_valid_sample(out / "hs_2.safetensors", [1, 2, 3])
    (out / "hs_2.safetensors.tmp.999999999.abcd").write_bytes(b"partial")
    env = poisoned_vllm(tmp_path)
    args = [str(tiny_model_fp32), "--input", str(data), "--out", str(out), "--layers", "1,3"]
    first = run_extract(*args, env=env, timeout=120)
    # hs_2 does not check out: deleted, and vLLM is needed for it (poisoned here).
    assert first.returncode == 1, first.stderr
    assert "cannot import vLLM (vllm must not be imported here)" in first.stderr
    assert not (out / "hs_2.safetensors").exists()
    assert temp_files(out) == []
    state = Manifest(str(out)).samples
    assert sorted(state) == [0, 1] and all(r.ok for r in state.values())
    assert state[0].tokens == len(expected_ids(tokenizer, records[0]))
    # Once hs_2 exists and checks out, nothing is left: no vLLM, "nothing to do".
    write_valid_sample(out / "hs_2.safetensors", [4, 5, 6])
    second = run_extract(*args, env=env, timeout=120)
    assert second.returncode == 0, second.stderr
    assert "1 ok (0 written, 1 already on disk)" in second.stdout
    third = run_extract(*args, env=env, timeout=120)  # the poisoned vLLM proves it stays out
    assert third.returncode == 0, third.stderr
    assert third.stdout.startswith("nothing to do")
    # Other layers in the same directory are refused.
    code, _, err = run_in_process(*args[:-1], "1,2")
    assert code == 2 and "layers=[1, 3]" in err
