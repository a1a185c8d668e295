"""speculators 0.9.0's own code reads our files and ``hidden-state export``'s output.

speculators and hs-connectors are imported the way their users import them, from
``.venv-spec`` (``make install``; see tests/speculators_env.py): ``FileTransfer`` and
``check_hidden_states`` on files of our writer, and the trainer's data path
(``ArrowDataset``, ``CollateFn``, ``create_train_val_loaders``) on an export.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hidden_state_reader import CorruptSampleError, load_sample
from hidden_state_reader.apps.cli import main as cli_main
from hidden_state_reader.apps.export.masks import DefaultMask, MaskSource, loss_mask
from hidden_state_reader.apps.export.speculators import export_speculators
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import lock_path, sample_metadata
from hidden_state_reader.sample.sample import Sample

from procs import LockHolder
from samples import make_tensors, write_samples
from speculators_env import env, spec_packages, use_speculators

CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]
LAYERS, HIDDEN = 4, 16  # 3 auxiliary layers + the verifier's last, as EAGLE-3 trains
PAST = time.time() - 3600


@pytest.fixture(scope="module")
def spec() -> SimpleNamespace:
    """speculators' modules, imported once (transformers makes this take seconds)."""
    use_speculators()
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    return SimpleNamespace(
        FileTransfer=FileTransfer,
        check_hidden_states=check_hidden_states,
        ArrowDataset=ArrowDataset,
        CollateFn=CollateFn,
        create_train_val_loaders=create_train_val_loaders,
        save_token_frequency_distribution=save_token_frequency_distribution,
    )


def export(
    *args: object, spec_env: bool = True, without_datasets: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``hidden-state export ...`` as a user runs it (a subprocess).

    ``without_datasets``: a folder put first on the path in which ``import datasets``
    fails (the fault of an environment without it: ``make install`` brings it).
    """
    environment = env() if spec_env else dict(os.environ)
    if without_datasets is not None:
        (without_datasets / "datasets").mkdir(parents=True, exist_ok=True)
        (without_datasets / "datasets" / "__init__.py").write_text(
            "raise ModuleNotFoundError(\"No module named 'datasets'\", name='datasets')\n"
        )
        path = environment.get("PYTHONPATH", "")
        environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(without_datasets), path) if p)
    return subprocess.run(
        [*CLI, "export", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )


def call(capsys: pytest.CaptureFixture[str], *args: object) -> SimpleNamespace:
    """``hidden-state export ...`` in this process (a subprocess costs seconds of imports)."""
    capsys.readouterr()
    rc = cli_main.main(["export", *map(str, args)])
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


def write(path: Path, index: int, tokens: int, prompt: int | None = None) -> Sample:
    """One sample through our writer; returns what it holds."""
    ids, hidden = make_tensors(index, tokens, LAYERS, HIDDEN)
    meta = sample_metadata(layer_ids=[2, 5, 8, 12], num_prompt_tokens=prompt)
    write_sample(path, ids, hidden, metadata=meta)
    return Sample(ids, hidden, str(path), meta)


def expected_mask(tokens: int, prompt: int | None) -> torch.Tensor:
    mask = torch.ones(tokens, dtype=torch.int64)
    if prompt is not None and prompt < tokens:
        mask[:prompt] = 0
    return mask


def mapping(dst: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (dst / "export.jsonl").read_text().splitlines()]


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: inode, mtime and bytes (SRC must stay exactly so)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_mtime_ns, p.read_bytes())
    return out


# -- our files, read by speculators' FileTransfer ------------------------------------------


def test_file_transfer_and_check_hidden_states_read_our_writer_files(
    spec: SimpleNamespace, hs_dir: Path
) -> None:
    paths = write_samples(hs_dir, 3, tokens=[8, 13, 21], layers=LAYERS, hidden=HIDDEN)
    transfer = spec.FileTransfer(hs_dir)
    for i, path in enumerate(paths):
        ours = load_sample(path)
        theirs = transfer.get_cached(i)
        spec.check_hidden_states(theirs, ours.token_ids.tolist())  # raises on any mismatch
        assert torch.equal(theirs["token_ids"], ours.token_ids)
        assert torch.equal(theirs["hidden_states"], ours.hidden_states)
        assert theirs["hidden_states"].shape == (ours.num_tokens, LAYERS, HIDDEN)
        # FileTransfer takes the lock once the writer is done, then deletes the lock file:
        # one reason the export gives speculators a folder of its own.
        assert not Path(lock_path(str(path))).exists()
    assert transfer.get_cached(3) is None  # no such sample


def test_file_transfer_waits_for_our_writer_lock(
    spec: SimpleNamespace, hs_dir: Path, holder: LockHolder
) -> None:
    [path] = write_samples(hs_dir, 1, tokens=9, layers=LAYERS, hidden=HIDDEN)
    holder.lock(path)  # a writer still at work on this sample
    got: list[dict[str, torch.Tensor]] = []
    reader = threading.Thread(target=lambda: got.append(spec.FileTransfer(hs_dir).get_cached(0)))
    reader.start()
    reader.join(0.5)
    assert reader.is_alive() and not got, "FileTransfer did not wait for the held lock"
    holder.release(path)
    reader.join(30)
    assert torch.equal(got[0]["hidden_states"], load_sample(path).hidden_states)


# -- hidden-state export --format speculators -> speculators' trainer data path ------------


@pytest.fixture(scope="module")
def exported(spec: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Six samples (three with generated tokens) exported by the CLI."""
    root = tmp_path_factory.mktemp("export")
    src, dst = root / "hs", root / "spec"
    src.mkdir()
    plan = [(10, 8, None), (2, 12, 5), (1, 9, None), (3, 20, 20), (22, 15, 4), (4, 8, 7)]
    samples = {
        name: write(src / f"hs_{name}.safetensors", name, tokens, prompt)
        for name, tokens, prompt in plan
    }
    before = snapshot(src)
    proc = export("--format", "speculators", src, dst)
    assert proc.returncode == 0, proc.stderr
    assert snapshot(src) == before  # SRC untouched: same inodes, times, bytes
    order = sorted(samples)  # natural order: hs_1, hs_2, hs_3, hs_4, hs_10, hs_22
    prompts = {name: prompt for name, _, prompt in plan}
    return SimpleNamespace(
        src=src, dst=dst, proc=proc, order=[samples[n] for n in order],
        prompts=[prompts[n] for n in order],
    )  # fmt: skip


def test_export_layout_order_links_and_mapping(exported: SimpleNamespace) -> None:
    dst = exported.dst
    assert {"dataset_info.json", "state.json", "token_freq.pt", "export.jsonl"} <= {
        p.name for p in dst.iterdir()
    }
    rows = mapping(dst)
    assert [r["row"] for r in rows] == list(range(6))
    assert [r["source"] for r in rows] == [s.path for s in exported.order]
    for r, sample in zip(rows, exported.order, strict=True):
        assert r["file"] == f"hidden_states/hs_{r['row']}.safetensors"
        assert (dst / r["file"]).stat().st_ino == Path(sample.path).stat().st_ino  # hard link
        assert r["placed"] == "link" and r["tokens"] == sample.num_tokens
    assert not list((dst / "hidden_states").glob("*.lock"))
    # hs_1: no prompt length; hs_3: prompt only (20 of 20); the others have generated tokens
    masks = ["all", "generated", "all", "generated", "all", "generated"]
    assert [r["loss_mask"] for r in rows] == masks
    summary = json.loads((dst / "export.json").read_text())
    assert summary["rows"] == 6 and summary["skipped"] == []
    assert summary["layers"]["layer_ids"] == [2, 5, 8, 12]
    out = exported.proc.stdout
    assert "exported 6 samples" in out and "6 hard-linked, 0 copied" in out
    assert "--target-layer-ids 2 5 8" in out


def test_arrow_dataset_returns_exactly_our_tokens_masks_and_hidden_states(
    spec: SimpleNamespace, exported: SimpleNamespace
) -> None:
    ds = spec.ArrowDataset(max_len=64, datapath=exported.dst, on_missing="raise")
    assert len(ds) == 6
    assert ds.approx_lengths == [s.num_tokens for s in exported.order]
    for i, (sample, prompt) in enumerate(zip(exported.order, exported.prompts, strict=True)):
        item = ds[i]
        assert torch.equal(item["input_ids"], sample.token_ids)
        assert torch.equal(item["loss_mask"], expected_mask(sample.num_tokens, prompt))
        assert torch.equal(item["hidden_states"], sample.hidden_states[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], sample.hidden_states[:, -1])
        assert item["lengths"].tolist() == [sample.num_tokens]


def test_collate_packs_rows_exactly(spec: SimpleNamespace, exported: SimpleNamespace) -> None:
    ds = spec.ArrowDataset(max_len=64, datapath=exported.dst, on_missing="raise")
    collate = spec.CollateFn(max_len=64, hidden_size=HIDDEN, num_target_layers=LAYERS - 1)
    batch = collate([ds[0], ds[1], ds[2]])
    first = exported.order[:3]
    n = sum(s.num_tokens for s in first)
    ids = torch.cat([s.token_ids for s in first])
    masks = torch.cat(
        [expected_mask(s.num_tokens, p) for s, p in zip(first, exported.prompts[:3], strict=True)]
    )
    assert torch.equal(batch["input_ids"][0, :n], ids)
    assert not batch["input_ids"][0, n:].any()  # padding
    assert torch.equal(batch["loss_mask"][0, :n], masks)
    hidden = torch.cat([s.hidden_states for s in first])
    assert torch.equal(batch["hidden_states"][0, :n], hidden[:, :-1].flatten(1))
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n], hidden[:, -1])
    documents = [d for d, s in enumerate(first) for _ in range(s.num_tokens)]
    assert batch["document_ids"][0, :n].tolist() == documents


def test_trainer_loaders_see_every_row_once(
    spec: SimpleNamespace, exported: SimpleNamespace
) -> None:
    # What `speculators train --data-path DST --on-missing raise` builds.
    train, val = spec.create_train_val_loaders(
        data_path=str(exported.dst),
        total_seq_len=64,
        hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1",  # never contacted: every row has its file
        on_missing="raise",
        verifier_name_or_path="unused",
        request_timeout=None,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=HIDDEN,
        num_target_layers=LAYERS - 1,
        num_workers=0,
        prefetch_factor=None,
        preprocess=None,
        train_data_ratio=0.5,
    )
    seen = []
    for loader in (train, val):
        for batch in loader:
            assert batch["error_records"] == 0
            ids = batch["input_ids"][0]
            for d in range(int(batch["document_ids"].max()) + 1):
                seen.append(ids[batch["document_ids"][0] == d].tolist())
    assert sorted(seen) == sorted(s.token_ids.tolist() for s in exported.order)


def test_token_freq_equals_speculators_own_count(
    spec: SimpleNamespace, exported: SimpleNamespace, tmp_path: Path
) -> None:
    from datasets import load_from_disk

    theirs = tmp_path / "token_freq.pt"
    spec.save_token_frequency_distribution(load_from_disk(str(exported.dst)), theirs)
    ours = torch.load(exported.dst / "token_freq.pt", weights_only=True)
    assert ours == torch.load(theirs, weights_only=True) and ours


# -- what is skipped, copied, refused ------------------------------------------------------


def test_held_failed_and_broken_samples_are_skipped_and_reported(
    spec: SimpleNamespace,
    capsys: pytest.CaptureFixture[str],
    hs_dir: Path,
    tmp_path: Path,
    holder: LockHolder,
) -> None:
    write_samples(hs_dir, 4, tokens=8, layers=LAYERS, hidden=HIDDEN)
    holder.lock(hs_dir / "hs_1.safetensors")  # still being written
    good = (hs_dir / "hs_0.safetensors").read_bytes()
    (hs_dir / "hs_2.safetensors").write_bytes(good[:-40])  # truncated, writer gone
    (hs_dir / "hs_3.safetensors").write_bytes(b"not a safetensors file at all")
    for p in hs_dir.iterdir():
        os.utime(p, (PAST, PAST))
    try:
        proc = call(capsys, "--format", "speculators", hs_dir, tmp_path / "spec")
    finally:
        holder.release(hs_dir / "hs_1.safetensors")
    assert proc.returncode == 0, proc.stderr
    assert "skipped hs_1.safetensors: pending" in proc.stderr
    states = {
        s["name"]: s["state"]
        for s in json.loads((tmp_path / "spec/export.json").read_text())["skipped"]
    }
    assert states == {"hs_1.safetensors": "pending", "hs_2.safetensors": "incomplete",
                      "hs_3.safetensors": "corrupt"}  # fmt: skip
    assert [r["source"] for r in mapping(tmp_path / "spec")] == [str(hs_dir / "hs_0.safetensors")]
    assert "exported 1 samples" in proc.stdout and "3 skipped" in proc.stdout


def test_wait_includes_a_sample_whose_writer_finishes(
    spec: SimpleNamespace, hs_dir: Path, tmp_path: Path, holder: LockHolder
) -> None:
    write_samples(hs_dir, 2, tokens=8, layers=LAYERS, hidden=HIDDEN)
    holder.lock(hs_dir / "hs_1.safetensors")
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(export_speculators(hs_dir, tmp_path / "spec", wait=120))
    )
    worker.start()
    holder.release(hs_dir / "hs_1.safetensors")  # the writer finishes, whenever that is
    worker.join(120)
    assert [len(done[0].rows), done[0].skipped] == [2, []]


def test_other_filesystem_is_copied_and_reported(
    spec: SimpleNamespace, capsys: pytest.CaptureFixture[str], hs_dir: Path
) -> None:
    write_samples(hs_dir, 2, tokens=8, layers=LAYERS, hidden=HIDDEN)
    assert os.stat("/dev/shm").st_dev != hs_dir.stat().st_dev  # tmpfs: another filesystem
    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        proc = call(capsys, "--format", "speculators", hs_dir, shm / "spec")
        assert proc.returncode == 0, proc.stderr
        assert "0 hard-linked, 2 copied; 2 copied because SRC and DST are on different" in (
            proc.stdout
        )
        for row in mapping(shm / "spec"):
            copied = (shm / "spec" / row["file"]).read_bytes()
            assert copied == Path(row["source"]).read_bytes() and row["placed"] == "copy"
        assert spec.FileTransfer(shm / "spec" / "hidden_states").get_cached(1) is not None
    finally:
        shutil.rmtree(shm)


def test_int32_token_ids_are_rewritten_as_int64(
    spec: SimpleNamespace, capsys: pytest.CaptureFixture[str], hs_dir: Path
) -> None:
    ids, hidden = make_tensors(0, 9, LAYERS, HIDDEN)
    save_file({"token_ids": ids.to(torch.int32), "hidden_states": hidden}, hs_dir / "a.safetensors")
    dst = hs_dir.parent / "spec"
    assert call(capsys, "--format", "speculators", hs_dir, dst).returncode == 0
    [row] = mapping(dst)
    assert row["placed"] == "copy" and "int64" in row["why_copy"]
    item = spec.ArrowDataset(max_len=16, datapath=dst, on_missing="raise")[0]
    assert torch.equal(item["input_ids"], ids) and item["input_ids"].dtype == torch.int64
    assert torch.equal(item["verifier_last_hidden_states"], hidden[:, -1])


def test_refusals_name_the_path_and_create_nothing(
    spec: SimpleNamespace,
    capsys: pytest.CaptureFixture[str],
    hs_dir: Path,
    tmp_path: Path,
    holder: LockHolder,
) -> None:
    write_samples(hs_dir, 1, tokens=8, layers=LAYERS, hidden=HIDDEN)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    proc = call(capsys, "--format", "speculators", hs_dir, busy)
    assert proc.returncode == 2 and f"{busy}: exists and is not empty" in proc.stderr
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    proc = call(capsys, "--format", "speculators", tmp_path / "nope", tmp_path / "out")
    assert proc.returncode == 2 and f"{tmp_path / 'nope'}: no such directory" in proc.stderr
    holder.lock(hs_dir / "hs_0.safetensors")
    try:
        proc = call(capsys, "--format", "speculators", hs_dir, tmp_path / "out")
    finally:
        holder.release(hs_dir / "hs_0.safetensors")
    assert proc.returncode == 1 and "no sample could be exported (1 skipped: 1 pending)" in (
        proc.stderr
    )
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    no_datasets = tmp_path / "no-datasets"
    proc = export("--format", "speculators", hs_dir, tmp_path / "out", without_datasets=no_datasets)
    assert proc.returncode == 2 and "pip install 'datasets>=4'" in proc.stderr


def test_one_layer_or_mixed_shapes_are_skipped(spec: SimpleNamespace, hs_dir: Path) -> None:
    write_samples(hs_dir, 2, tokens=8, layers=LAYERS, hidden=HIDDEN)
    write_samples(hs_dir, 1, start=2, tokens=8, layers=1, hidden=HIDDEN)
    write_samples(hs_dir, 1, start=3, tokens=8, layers=LAYERS, hidden=HIDDEN * 2)
    result = export_speculators(hs_dir, hs_dir.parent / "spec")
    assert len(result.rows) == 2
    reasons = {s.name: s.reason for s in result.skipped}
    assert "speculators needs the auxiliary layers plus the last" in reasons["hs_2.safetensors"]
    assert "x 32 BF16, but the export has 4 layers" in reasons["hs_3.safetensors"]


# -- the verifier layer: the model's last ---------------------------------------------------


def write_capture(root: Path, count: int, layer_ids: list[int], model_layers: int | None) -> None:
    """``count`` samples of a capture at ``layer_ids`` (``model_layers``: None = older writer)."""
    root.mkdir(exist_ok=True)
    for i in range(count):
        ids, hidden = make_tensors(i, 8, len(layer_ids), HIDDEN)
        meta = sample_metadata(
            layer_ids=layer_ids, model="tiny", num_hidden_layers=model_layers, num_prompt_tokens=4
        )
        write_sample(root / f"hs_{i}.safetensors", ids, hidden, metadata=meta)


def test_a_capture_without_the_models_last_layer_is_refused_unless_allowed(
    spec: SimpleNamespace, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    src, dst = tmp_path / "hs", tmp_path / "spec"
    write_capture(src, 3, [1, 2], 4)  # a 4-layer model captured at layers 1 and 2
    refused = call(capsys, "--format", "speculators", src, dst)
    assert refused.returncode == 1
    assert (
        f"{src / 'hs_0.safetensors'}: captured layers [1, 2], but the model (tiny) has 4 "
        "layers and its last layer, id 4, is missing: speculators reads the last captured "
        "layer (2) as the verifier's last hidden state"
    ) in refused.stderr
    assert (
        "Re-capture with layer 4 appended (hidden-state extract or serve with --layers "
        "1,2,4, or --include-last), or pass --allow-missing-last-layer to export anyway"
    ) in refused.stderr
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hs"]
    allowed = call(capsys, "--format", "speculators", src, dst, "--allow-missing-last-layer")
    assert allowed.returncode == 0, allowed.stderr
    assert allowed.stderr.count("warning:") == 1
    assert "3 of 3 exported samples lack the model's last layer" in allowed.stderr
    assert "reads layer 2 as the verifier's last hidden state (NOT the model's last layer 4)" in (
        allowed.stdout
    )
    summary = json.loads((dst / "export.json").read_text())
    assert summary["last_layer"] == {
        "num_hidden_layers": 4, "present": 0, "missing": 3, "unchecked": 0,
    }  # fmt: skip
    assert summary["warnings"] == [allowed.stderr.split("warning: ", 1)[1].strip()]


def test_a_capture_with_the_last_layer_exports_and_older_files_are_warned_about_once(
    spec: SimpleNamespace, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    write_capture(tmp_path / "new", 2, [1, 2, 4], 4)
    checked = call(capsys, "--format", "speculators", tmp_path / "new", tmp_path / "a")
    assert checked.returncode == 0 and checked.stderr == ""
    assert "reads layer 4 as the verifier's last hidden state (the model's last of 4 " in (
        checked.stdout
    )
    write_capture(tmp_path / "old", 3, [1, 2], None)  # files that do not say: older writers
    old = call(capsys, "--format", "speculators", tmp_path / "old", tmp_path / "b")
    assert old.returncode == 0
    assert old.stderr.count("warning:") == 1
    assert (
        "3 of 3 exported samples do not record the model's layer count (files of an older "
        "writer or of vLLM's own connector): cannot check that their last layer (2) is the "
        "model's last layer"
    ) in old.stderr
    result = export_speculators(tmp_path / "new", tmp_path / "c")  # the API says the same
    assert result.warnings == []
    assert (result.last_layer.present, result.last_layer.unchecked) == (2, 0)


def test_help_has_an_example_and_start_up_imports_no_torch() -> None:
    code = (
        "import sys\nfrom hidden_state_reader.apps.cli.main import main\n"
        "rc = main(['export', '--help'])\n"
        "print('HEAVY', sorted(m for m in ('torch', 'numpy', 'datasets') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "hidden-state export --format speculators /data/hs /data/spec" in proc.stdout
    assert proc.stdout.strip().endswith("HEAVY []"), proc.stdout[-500:]


# -- loss masks ----------------------------------------------------------------------------


def test_masks_stored_in_files_reach_speculators_and_unsupervised_rows_are_dropped(
    spec: SimpleNamespace, hs_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The loss masks our writer stores (online kv_transfer_params, extract's chat rows)
    # are what speculators trains on; one that trains nothing is left out, as prepare-data
    # leaves such rows out.
    masks = {0: [0, 0, 1, 1, 0, 1, 1, 1, 0, 1], 1: [0] * 10, 2: [1] * 4 + [0] * 6}
    for index, mask in masks.items():
        ids, hidden = make_tensors(index, 10, LAYERS, HIDDEN)
        meta = sample_metadata(layer_ids=[2, 5, 8, 12], num_prompt_tokens=3)
        write_sample(hs_dir / f"hs_{index}.safetensors", ids, hidden, metadata=meta, loss_mask=mask)
    dst = tmp_path / "spec"
    proc = call(capsys, "--format", "speculators", hs_dir, dst)
    assert proc.returncode == 0, proc.stderr
    assert "hs_1.safetensors" in proc.stderr and "no 1s" in proc.stderr
    rows = mapping(dst)
    assert [r["source"] for r in rows] == [str(hs_dir / f"hs_{i}.safetensors") for i in (0, 2)]
    assert [r["loss_mask"] for r in rows] == ["file", "file"]
    ds = spec.ArrowDataset(max_len=64, datapath=dst, on_missing="raise")
    assert len(ds) == 2
    for row, index in enumerate((0, 2)):
        assert ds[row]["loss_mask"].tolist() == masks[index]
        stored = load_sample(hs_dir / f"hs_{index}.safetensors")
        assert torch.equal(ds[row]["input_ids"], stored.token_ids)
    summary = json.loads((dst / "export.json").read_text())
    assert [s["state"] for s in summary["skipped"]] == ["unsupervised"]


def test_mask_rules() -> None:
    ids, hidden = make_tensors(0, 10, LAYERS, HIDDEN)

    def sample(prompt: int | None) -> Sample:
        return Sample(ids, hidden, "x.safetensors", sample_metadata(num_prompt_tokens=prompt))

    mask, source = loss_mask(sample(6), DefaultMask.GENERATED)
    assert mask.tolist() == [0] * 6 + [1] * 4 and source is MaskSource.GENERATED
    for prompt in (None, 10):  # no generated tokens: nothing to go by, train on all
        mask, source = loss_mask(sample(prompt), DefaultMask.GENERATED)
        assert mask.tolist() == [1] * 10 and source is MaskSource.ALL
    mask, source = loss_mask(sample(6), DefaultMask.ALL)
    assert mask.tolist() == [1] * 10 and source is MaskSource.ALL
    own = sample(6)
    own.loss_mask = torch.tensor([1, 0] * 5, dtype=torch.bool)  # type: ignore[attr-defined]
    mask, source = loss_mask(own, DefaultMask.GENERATED)
    assert mask.tolist() == [1, 0] * 5 and source is MaskSource.FILE
    own.loss_mask = torch.ones(9)  # type: ignore[attr-defined]
    with pytest.raises(CorruptSampleError, match=r"x\.safetensors: loss_mask has 9 entries for 10"):
        loss_mask(own, DefaultMask.ALL)
    own.loss_mask = torch.full((10,), 2)  # type: ignore[attr-defined]
    with pytest.raises(CorruptSampleError, match="values other than 0 and 1"):
        loss_mask(own, DefaultMask.ALL)
    with pytest.raises(CorruptSampleError, match=r"num_prompt_tokens=11 is outside 0\.\.10"):
        loss_mask(sample(11), DefaultMask.GENERATED)


# -- docs/training.md: the speculators section runs as written -----------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def doc_blocks(heading: str) -> dict[str, list[str]]:
    """The fenced blocks of one section of the doc, by language."""
    text = DOC.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for chunk in section.split("```")[1::2]:
        lang, _, body = chunk.partition("\n")
        blocks.setdefault(lang.strip(), []).append(body)
    return blocks


def shell_commands(block: str) -> list[list[str]]:
    """Commands of a bash block: comments dropped, continuation lines joined."""
    lines = [line.split("#", 1)[0].rstrip() for line in block.splitlines()]
    joined = " ".join(line[:-1] if line.endswith("\\") else line + "\n" for line in lines)
    return [shlex.split(cmd) for cmd in joined.splitlines() if cmd.strip()]


def test_training_doc_speculators_workflow_runs_as_written(
    spec: SimpleNamespace, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from speculators.train.config import TrainConfig

    blocks = doc_blocks("How do I train a drafter with speculators?")
    [bash], [python] = blocks["bash"], blocks["python"]
    src, dst = tmp_path / "hs", tmp_path / "spec"
    src.mkdir()
    for i in range(3):  # Llama-3.1-8B's layers: EAGLE-3's 2, 16, 29 and the last, 32
        ids, hidden = make_tensors(i, 12, LAYERS, HIDDEN)
        write_sample(src / f"hs_{i}.safetensors", ids, hidden, metadata=sample_metadata(
            layer_ids=[2, 16, 29, 32], num_hidden_layers=32, num_prompt_tokens=4))  # fmt: skip
    commands = shell_commands(bash.replace("/data/hs", str(src)).replace("/data/spec", str(dst)))
    assert [c[:2] for c in commands] == [
        ["hidden-state", "extract"],
        ["hidden-state", "serve"],
        ["hidden-state", "export"],
        ["speculators", "train"],
    ]
    parser = cli_main.build_parser()
    for argv in commands[:2]:  # real options of the real commands (not run: no model here)
        assert parser.parse_args(argv[1:]).include_last
    rc = cli_main.main(commands[2][1:])
    out, err = capsys.readouterr()
    assert rc == 0 and "exported 3 samples" in out and err == ""  # the last layer: checked
    train = commands[3]
    aux = train[train.index("--target-layer-ids") + 1 : train.index("--on-missing")]
    assert f"--target-layer-ids {' '.join(aux)}" in out  # what export told the user to pass
    cfg = TrainConfig.resolve(train[2:])  # speculators' own parsing of the command line
    assert cfg.data.data_path == str(dst) and cfg.speculator_type == "eagle3"
    exec(compile(python.replace("/data/spec", str(dst)), str(DOC), "exec"), {})


def _pip_is_uv(bin_dir: Path) -> None:
    """A ``pip`` on PATH that is ``uv pip`` for this interpreter, with the machine's pip
    configuration (``tools/uv_flags.py``, as the Makefile): pip itself takes 30-40 s here
    for these wheels, uv 4 s from the cache ``make install`` filled with the same list."""
    uv = Path(sys.executable).with_name("uv")
    assert uv.exists(), f"{uv} missing: run `make install`"
    root = Path(__file__).resolve().parents[2]
    flags = subprocess.run([sys.executable, str(root / "tools" / "uv_flags.py")],
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    extra = " ".join(shlex.quote(f) for f in ["--python", sys.executable, *flags])
    pip = bin_dir / "pip"
    pip.write_text(f'#!/bin/sh\nexec {shlex.quote(str(uv))} pip "$@" {extra}\n')
    pip.chmod(0o755)


def test_training_doc_speculators_install_runs_as_written(tmp_path: Path) -> None:
    """The documented install keeps this venv's torch and gives a working `speculators`."""
    [bash] = doc_blocks("How do I install speculators without replacing my torch?")["bash"]
    install = shell_commands(bash)[0]
    assert install[:5] == ["pip", "install", "--no-deps", "--target", "./speculators-0.9.0"]
    assert install[5:] == spec_packages()  # the Makefile's list: one route, tested by all
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    _pip_is_uv(bin_dir)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", bash], cwd=work, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PATH": path})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{torch.__version__} 0.9.0" in proc.stdout.splitlines()  # this venv's torch
    assert "--data-path" in proc.stdout and "--speculator-type" in proc.stdout  # train --help
    target = work / "speculators-0.9.0"
    assert (target / "speculators").is_dir()
    assert not [p.name for p in target.iterdir() if p.name.startswith(("torch", "nvidia"))]
