"""Reading what is in a directory now: formats, selection, bad files, what happens after use."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import time
from pathlib import Path

import pytest
import torch

from hidden_state_reader import (
    CorruptSampleError,
    HiddenStateReader,
    IncompleteSampleError,
    load_sample,
    read_header,
)
from hidden_state_reader.files.locks import WriterLock
from hidden_state_reader.options import LoadOptions, ReaderOptions

from samples import make_tensors, write_samples, write_vllm_style


def test_sample_unpacks_as_token_ids_and_hidden_states(hs_dir: Path) -> None:
    write_samples(hs_dir, 3, tokens=[5, 6, 7], layer_ids=[2, 16, 29])
    reader = HiddenStateReader(hs_dir)
    out = []
    for token_ids, hidden_states in reader:
        out.append((token_ids, hidden_states))
    assert [t.shape[0] for t, _ in out] == [5, 6, 7]
    for i, (token_ids, hidden_states) in enumerate(out):
        exp_tokens, exp_hidden = make_tensors(i, tokens=5 + i)
        assert torch.equal(token_ids, exp_tokens)
        assert torch.equal(hidden_states, exp_hidden)
    sample = next(iter(HiddenStateReader(hs_dir)))
    assert sample.path.endswith("hs_0.safetensors")
    assert sample.layer_ids == [2, 16, 29]
    assert sample.metadata["request_id"] == "req-0"
    assert reader.stats.yielded == 3


def test_natural_order_hs_2_before_hs_10(hs_dir: Path) -> None:
    write_samples(hs_dir, 12)
    names = [os.path.basename(s.path) for s in HiddenStateReader(hs_dir)]
    assert names == [f"hs_{i}.safetensors" for i in range(12)]


def test_reads_the_exact_layout_vllm_writes(hs_dir: Path) -> None:
    # vLLM's ExampleHiddenStatesConnector: safetensors.save_file, an empty lock file.
    path = write_vllm_style(hs_dir / "cmpl-abc-0.safetensors", 4, tokens=9, layers=4)
    fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.close(fd)
    [sample] = list(HiddenStateReader(hs_dir, on_error="raise"))
    token_ids, hidden = make_tensors(4, tokens=9, layers=4)
    assert torch.equal(sample.token_ids, token_ids)
    assert torch.equal(sample.hidden_states, hidden)
    assert sample.metadata == {}
    assert sample.layer_ids is None


def test_layer_and_dtype_selection_on_read(hs_dir: Path) -> None:
    write_samples(hs_dir, 1, layers=4, layer_ids=[2, 16, 29, 32])
    _, full = make_tensors(0, layers=4)
    [by_pos] = list(HiddenStateReader(hs_dir, layers=[0, -1], dtype=torch.float32))
    assert by_pos.hidden_states.dtype == torch.float32
    assert torch.equal(by_pos.hidden_states, full[:, [0, 3]].float())
    assert by_pos.layer_ids == [2, 32]
    [by_id] = list(HiddenStateReader(hs_dir, layer_ids=[29]))
    assert torch.equal(by_id.hidden_states, full[:, [2]])


def test_headers_give_lengths_without_loading(hs_dir: Path) -> None:
    paths = write_samples(hs_dir, 3, tokens=[3, 30, 300], layers=2, hidden=4)
    headers = [read_header(p) for p in paths]
    assert [h.num_tokens for h in headers] == [3, 30, 300]
    assert headers[2].num_layers == 2 and headers[2].hidden_size == 4
    assert headers[2].hidden_dtype == torch.bfloat16


def _make_bad_files(root: Path) -> dict[str, type[Exception]]:
    good = write_samples(root, 1, prefix="good_")[0]
    blob = good.read_bytes()
    (root / "truncated.safetensors").write_bytes(blob[: len(blob) - 10])
    (root / "garbage.safetensors").write_bytes(os.urandom(300))
    (root / "empty.safetensors").write_bytes(b"")
    from safetensors.torch import save_file

    save_file(
        {
            "hidden_states": torch.zeros(3, 1, 4, dtype=torch.int32),
            "token_ids": torch.zeros(3, dtype=torch.int64),
        },
        str(root / "wrong_dtype.safetensors"),
    )
    save_file({"hidden_states": torch.zeros(3, 1, 4)}, str(root / "missing_tokens.safetensors"))
    save_file(
        {"hidden_states": torch.zeros(3, 1, 4), "token_ids": torch.zeros(4, dtype=torch.int64)},
        str(root / "mismatch.safetensors"),
    )
    save_file(
        {"hidden_states": torch.zeros(3, 4), "token_ids": torch.zeros(3, dtype=torch.int64)},
        str(root / "two_dims.safetensors"),
    )
    # Leftovers of writers that died a while ago: older than the grace period, during
    # which a lock-less file that does not parse yet may still be being written.
    old = time.time() - 60
    for name in ("truncated", "empty"):
        os.utime(root / f"{name}.safetensors", (old, old))
    return {
        "truncated.safetensors": IncompleteSampleError,
        "garbage.safetensors": CorruptSampleError,
        "empty.safetensors": IncompleteSampleError,
        "wrong_dtype.safetensors": CorruptSampleError,
        "missing_tokens.safetensors": CorruptSampleError,
        "mismatch.safetensors": CorruptSampleError,
        "two_dims.safetensors": CorruptSampleError,
    }


def test_bad_files_are_skipped_counted_and_warned_about(
    hs_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = _make_bad_files(hs_dir)
    reader = HiddenStateReader(hs_dir)
    yielded = [os.path.basename(s.path) for s in reader]
    assert yielded == ["good_0.safetensors"]
    assert reader.stats.corrupt + reader.stats.incomplete == len(bad)
    for name in bad:
        assert sum(name in r.getMessage() for r in caplog.records) == 1, name
        assert (hs_dir / name).exists(), "a plain reader leaves files alone"


def test_on_error_raise_gives_a_typed_error_naming_the_file(hs_dir: Path) -> None:
    bad = _make_bad_files(hs_dir)
    for name, error in bad.items():
        with pytest.raises(error, match=name.replace(".", r"\.")):
            load_sample(hs_dir / name)


def test_delete_after_use_removes_data_and_lock(hs_dir: Path) -> None:
    write_samples(hs_dir, 4)
    reader = HiddenStateReader(hs_dir, on_consumed="delete")
    assert len(list(reader)) == 4
    assert [p for p in os.listdir(hs_dir) if not p.startswith(".")] == []


def test_move_after_use_keeps_samples_in_a_done_folder(hs_dir: Path, tmp_path: Path) -> None:
    write_samples(hs_dir, 3)
    done = tmp_path / "done"
    assert len(list(HiddenStateReader(hs_dir, on_consumed="move", done_dir=done))) == 3
    assert sorted(os.listdir(done)) == [f"hs_{i}.safetensors" for i in range(3)]
    assert len(list(HiddenStateReader(done))) == 3


def test_rejected_files_are_quarantined_only_when_the_reader_owns_them(hs_dir: Path) -> None:
    _make_bad_files(hs_dir)
    reader = HiddenStateReader(hs_dir, on_consumed="delete")
    assert len(list(reader)) == 1
    assert reader.stats.quarantined == 7
    quarantine = hs_dir / ".quarantine"
    assert (quarantine / "garbage.safetensors").exists()
    assert "garbage.safetensors" in (quarantine / "garbage.safetensors.reason").read_text()


def test_failed_writer_status_is_reported(hs_dir: Path) -> None:
    lock = WriterLock.create(str(hs_dir / "hs_9.safetensors"))
    lock.mark_failed("disk full")
    lock.release()
    reader = HiddenStateReader(hs_dir)
    assert list(reader) == []
    assert reader.stats.failed == 1


def test_vanished_file_between_listing_and_reading_is_not_an_error(hs_dir: Path) -> None:
    write_samples(hs_dir, 2)
    names = ["hs_0.safetensors", "hs_1.safetensors"]
    os.remove(hs_dir / "hs_0.safetensors")
    os.remove(hs_dir / "hs_0.safetensors.lock")
    reader = HiddenStateReader(hs_dir, names=names)
    assert [os.path.basename(s.path) for s in reader] == ["hs_1.safetensors"]
    assert reader.stats.vanished == 1


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        HiddenStateReader(tmp_path / "does-not-exist")


def test_reader_parameters_are_the_options_fields_names_types_and_defaults() -> None:
    # ReaderOptions is what the backends read; the reader's typed keyword-only
    # parameters must match its fields exactly, so the two cannot drift apart.
    params = inspect.signature(HiddenStateReader).parameters
    options = {n: p for n, p in params.items() if n != "path"}
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in options.values())
    fields = {f.name: (f.type, f.default) for f in dataclasses.fields(ReaderOptions)}
    assert {n: (p.annotation, p.default) for n, p in options.items()} == fields
    # The reader's own options come first, then the LoadOptions ones (as help() shows).
    loading = [f.name for f in dataclasses.fields(LoadOptions)]
    assert list(options)[-len(loading) :] == loading
    # Every option is documented in the reader's Args.
    doc = HiddenStateReader.__doc__ or ""
    args = doc.split("    Args:\n", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^        (\w+): ", args, flags=re.MULTILINE)
    assert documented == list(params)


def test_unknown_and_bad_options_name_the_option(hs_dir: Path) -> None:
    with pytest.raises(TypeError, match="colour"):
        HiddenStateReader(hs_dir, colour="blue")  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="on_error"):
        HiddenStateReader(hs_dir, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="claim_steal_after"):
        HiddenStateReader(hs_dir, claim_steal_after=0)


@pytest.mark.parametrize("mmap", [True, False])
def test_large_files_read_the_same_mapped_or_copied(hs_dir: Path, mmap: bool) -> None:
    token_ids, hidden = make_tensors(1, tokens=600, layers=4, hidden=512)  # ~2.4 MB
    write_samples(hs_dir, 1, tokens=600, layers=4, hidden=512, start=1)
    reader = HiddenStateReader(hs_dir, mmap=mmap, on_consumed="delete")
    [sample] = list(reader)
    assert not os.listdir(hs_dir) or os.listdir(hs_dir) == [".claims"]  # files are gone...
    assert torch.equal(sample.hidden_states, hidden)  # ...the tensors stay valid
    sample.hidden_states[0, 0, 0] = 1.0  # and writable (private to this process)
    assert torch.equal(sample.token_ids, token_ids)


def test_watch_counters_report_the_follow_watch_and_are_none_otherwise(hs_dir: Path) -> None:
    write_samples(hs_dir, 3)
    snapshot = HiddenStateReader(hs_dir)
    assert [s.num_tokens for s in snapshot] == [8, 8, 8]
    assert snapshot.watch_counters is None  # not following: no watch
    follower = HiddenStateReader(hs_dir, follow=True, max_samples=3, watch="poll")
    assert follower.watch_counters is None  # nothing opened before iteration
    assert len(list(follower)) == 3
    counters = follower.watch_counters
    assert counters is not None
    assert counters.tracked == 3 and counters.rescans >= 1 and counters.overflows == 0
    follower.close()
