"""``hidden-state export --format speculators``: a directory speculators' trainer reads.

speculators' ``ArrowDataset(datapath)`` (what ``speculators train --data-path DST`` builds)
loads row *i* of the dataset saved in DST (``input_ids``, ``loss_mask``, ``seq_len``) and
the hidden states of ``DST/hidden_states/hs_{i}.safetensors`` (``FileTransfer``), and
checks that the file's ``token_ids`` equal the row's ``input_ids``. The export makes
exactly that from a hidden-state directory::

    DST/data-00000-of-00001.arrow, state.json, dataset_info.json   the rows
    DST/token_freq.pt          supervised-token counts (for --draft-vocab-size)
    DST/hidden_states/hs_{i}.safetensors                             hard links (or copies)
    DST/export.jsonl           one line per row: row -> source file, mask, placement
    DST/export.json            the summary, with every skipped sample and why

The rules (which samples, in which order, loss masks, links or copies, the layer axis
and the verifier-layer check) are in docs/training.md, "How do I train a drafter with
speculators?". In short: only complete, validated samples sharing one layer axis of at
least two layers, in natural name order; SRC is never modified; DST appears complete or
not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

from hidden_state_reader.apps.export.masks import DefaultMask, loss_mask
from hidden_state_reader.apps.export.outcome import (
    ALLOW_FLAG,
    ExportResult,
    Geometry,
    Row,
    Skipped,
)
from hidden_state_reader.apps.export.placement import Placement, place
from hidden_state_reader.apps.export.rows import RowWriter, require_datasets
from hidden_state_reader.errors import HiddenStateError, SampleError
from hidden_state_reader.files.atomic import publish_directory
from hidden_state_reader.files.fileio import NotRegularFileError, open_regular
from hidden_state_reader.files.header import read_header_fd
from hidden_state_reader.files.locks import SharedLock
from hidden_state_reader.format.header import Meta, SampleHeader
from hidden_state_reader.sample.health import SampleHealth, scan_health
from hidden_state_reader.sample.states import GRACE, SampleState

if TYPE_CHECKING:
    from hidden_state_reader.sample.sample import Sample

HS_DIR = "hidden_states"
MAPPING = "export.jsonl"
SUMMARY = "export.json"

Progress = Callable[[int, int], None]


class ExportError(HiddenStateError):
    """The export cannot run: bad SRC or DST; the message names the path and the fix."""


class NothingToExportError(ExportError):
    """No sample of SRC could be exported (the message counts what was skipped, and why)."""


class MissingLastLayerError(ExportError):
    """The capture lacks the model's last layer, which speculators reads as the verifier's."""


def missing_last_layer_message(path: str, header: SampleHeader) -> str:
    """Why a capture without the model's last layer is refused, and the two ways out."""
    ids = header.layer_ids or []
    n = header.num_hidden_layers or 0  # recorded: the caller checked captures_last_layer
    model = f" ({header.model})" if header.model else ""
    fixed = ",".join(str(i) for i in sorted({*ids, n}))
    return (
        f"{path}: captured layers {ids}, but the model{model} has {n} layers and its last "
        f"layer, id {n}, is missing: speculators reads the last captured layer ({ids[-1]}) "
        f"as the verifier's last hidden state, so a drafter trained on this export would "
        f"learn the wrong one. Re-capture with layer {n} appended (hidden-state extract or "
        f"serve with --layers {fixed}, or --include-last), or pass {ALLOW_FLAG} to export "
        "anyway. Nothing was exported."
    )


def export_speculators(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    default_mask: DefaultMask | str = DefaultMask.GENERATED,
    copy: bool = False,
    wait: float = 0.0,
    grace: float = GRACE,
    progress: Progress | None = None,
    allow_missing_last_layer: bool = False,
) -> ExportResult:
    """Export the complete samples of ``source`` into a speculators data directory.

    Args:
        source: The hidden-state directory (not searched recursively).
        target: The new directory (``speculators train --data-path``).
        default_mask: Loss-mask rule for samples without their own ``loss_mask``
            (``hidden_state_reader.apps.export.masks``).
        copy: Copy the files instead of hard-linking them.
        wait: Seconds to wait, all together, for samples still being written.
        grace: See ``hidden_state_reader.sample.states.GRACE``.
        progress: Called as ``progress(done, total)`` after each sample.
        allow_missing_last_layer: Export a capture whose last layer is not the model's
            last (with a warning in ``ExportResult.warnings``) instead of refusing it.

    Returns:
        What was exported and skipped, and warnings (``ExportResult.warnings``).

    Raises:
        ExportError: Bad paths (nothing is written).
        MissingLastLayerError: The files record the model's layer count and the last
            captured layer is not its last (nothing is written).
        NothingToExportError: No sample could be exported (DST is not created).
        MissingDependencyError: ``datasets`` is not installed.
        OSError: Writing DST failed (e.g. no space); nothing is left at DST.
    """
    src, dst = _check_paths(os.fspath(source), os.fspath(target))
    rule = DefaultMask(default_mask)
    require_datasets()  # before anything is created
    staging = _make_staging(dst)
    try:
        export = _Export(
            src, staging, rule, copy=copy, wait=wait, allow_missing_last=allow_missing_last_layer
        )
        result = export.run(grace, progress)
        result.target = dst
        if not result.rows:
            raise NothingToExportError(
                f"{src}: no sample could be exported ({skipped_summary(result)}); "
                "DST was not created"
            )
        _move_into_place(staging, dst, result)
    except BaseException:
        # Only names are removed: the hard links' source files keep their data.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return result


def _move_into_place(staging: str, dst: str, result: ExportResult) -> None:
    """Write the summary into ``staging``, then rename it to ``dst`` (empty or absent)."""
    with open(os.path.join(staging, SUMMARY), "w", encoding="utf-8") as f:
        json.dump(result.as_dict(), f, indent=2)
        f.write("\n")
    publish_directory(staging, dst)  # dst was checked empty or absent


def skipped_summary(result: ExportResult) -> str:
    """E.g. ``"3 skipped: 2 pending, 1 corrupt"`` or ``"none skipped"``."""
    if not result.skipped:
        return "none skipped"
    counts: dict[str, int] = {}
    for s in result.skipped:
        counts[s.state] = counts.get(s.state, 0) + 1
    parts = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"{len(result.skipped)} skipped: {parts}"


def _check_paths(src: str, dst: str) -> tuple[str, str]:
    src, dst = os.path.abspath(src), os.path.abspath(dst)
    if not os.path.isdir(src):
        raise ExportError(f"{src}: no such directory (SRC must be a hidden-state directory)")
    if os.path.lexists(dst) and (not os.path.isdir(dst) or os.path.islink(dst)):
        raise ExportError(f"{dst}: exists and is not a directory; choose a new DST")
    if os.path.isdir(dst) and os.listdir(dst):
        raise ExportError(f"{dst}: exists and is not empty; choose a new DST (nothing is replaced)")
    if os.path.realpath(dst) == os.path.realpath(src):
        raise ExportError(f"{dst}: DST must be another directory than SRC")
    return src, dst


def _make_staging(dst: str) -> str:
    parent, name = os.path.split(dst)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{name}.export-{os.getpid()}")
    os.mkdir(staging)  # FileExistsError: another export of this process is running there
    os.mkdir(os.path.join(staging, HS_DIR))
    return staging


class _Export:
    """One export run into ``staging``: samples in order, rows and links as it goes."""

    def __init__(
        self,
        src: str,
        staging: str,
        rule: DefaultMask,
        *,
        copy: bool,
        wait: float,
        allow_missing_last: bool = False,
    ) -> None:
        self.src = src
        self.staging = staging
        self.rule = rule
        self.copy = copy
        self.allow_missing_last = allow_missing_last
        self.deadline = time.monotonic() + wait
        self.result = ExportResult(src, staging, rule.value)

    def run(self, grace: float, progress: Progress | None) -> ExportResult:
        healths = list(scan_health(self.src, grace=grace, include_temps=False))
        writer = RowWriter(self.staging)
        try:
            with open(os.path.join(self.staging, MAPPING), "w", encoding="utf-8") as mapping:
                for done, health in enumerate(healths, 1):
                    self._take(health, writer, mapping)
                    if progress is not None:
                        progress(done, len(healths))
            if self.result.rows:
                writer.finish()
            else:
                writer.abort()
        except BaseException:
            writer.abort()
            raise
        self.result.warnings += self.result.last_layer.warnings()
        return self.result

    def _take(self, health: SampleHealth, writer: RowWriter, mapping: IO[str]) -> None:
        if health.state not in (SampleState.READY, SampleState.PENDING):
            self._skip(health.name, health.state.value, health.reason or health.state.value)
            return
        lock = SharedLock.acquire(health.path, timeout=max(0.0, self.deadline - time.monotonic()))
        if lock is None:
            reason = "its writer still holds the lock (export again later, or pass --wait S)"
            self._skip(health.name, SampleState.PENDING.value, reason)
            return
        with lock:
            try:
                fd = open_regular(health.path)
            except (FileNotFoundError, NotRegularFileError) as exc:
                self._skip(health.name, "gone", f"cannot open it any more ({exc})")
                return
            try:
                row = self._export(fd, health, writer)
            except SampleError as exc:
                self._skip(health.name, "unusable", exc.reason)
                return
            finally:
                os.close(fd)
        if row is not None:
            self.result.rows.append(row)
            mapping.write(json.dumps(row.as_dict()) + "\n")

    def _export(self, fd: int, health: SampleHealth, writer: RowWriter) -> Row | None:
        """Validate, mask, place and record one sample held under its shared lock."""
        from hidden_state_reader.sample.load import load_fd

        path = health.path
        header = read_header_fd(fd, path)
        problem = self._geometry_problem(header)
        if problem:
            self._skip(health.name, "mismatch", problem)
            return None
        last = header.captures_last_layer
        if last is False and not self.allow_missing_last:
            raise MissingLastLayerError(missing_last_layer_message(path, header))
        sample = load_fd(fd, path)  # validates again; maps large files, reads no hidden data
        if sample.num_tokens == 0:
            self._skip(health.name, SampleState.EMPTY.value, "no tokens")
            return None
        mask, mask_source = loss_mask(sample, self.rule)
        supervised = int(mask.sum())
        if supervised == 0:
            reason = "its loss mask has no 1s: nothing to train on (prepare-data drops these)"
            self._skip(health.name, "unsupervised", reason)
            return None
        index = len(self.result.rows)
        name = os.path.join(HS_DIR, f"hs_{index}.safetensors")
        placement = self._place(fd, header, sample, os.path.join(self.staging, name))
        writer.add(sample.token_ids.numpy().copy(), mask)
        self.result.last_layer.count(last, header.layer_ids, header.num_hidden_layers)
        return Row(
            row=index,
            file=name,
            source=path,
            tokens=sample.num_tokens,
            supervised=supervised,
            loss_mask=mask_source.value,
            placed=placement.how,
            why_copy=placement.why,
        )

    def _geometry_problem(self, header: SampleHeader) -> str:
        ids = header.layer_ids
        mine = Geometry(
            header.num_layers,
            header.hidden_size,
            header.hidden.dtype,
            None if ids is None else tuple(ids),
        )
        if mine.num_layers < 2:
            return (
                f"{mine.describe()}: speculators needs the auxiliary layers plus the last "
                "(serve or extract with --include-last)"
            )
        if self.result.geometry is None:
            self.result.geometry = mine
        elif mine != self.result.geometry:
            return f"{mine.describe()}, but the export has {self.result.geometry.describe()}"
        return ""

    def _place(self, fd: int, header: SampleHeader, sample: Sample, target: str) -> Placement:
        if header.tokens.dtype == "I64":
            return place(fd, sample.path, target, copy=self.copy)
        # speculators compares token_ids with int64 input_ids (torch.equal): rewrite.
        from hidden_state_reader.files.publish import write_sample

        meta = {k: v for k, v in sample.metadata.items() if k != Meta.CRC32}
        # sample.token_ids is int64 already (load_fd converts); the lock is not needed: the
        # file is published by rename into a folder nobody reads yet.
        write_sample(target, sample.token_ids, sample.hidden_states, metadata=meta, use_lock=False)
        return Placement("copy", "token_ids rewritten as int64 (the file has int32)")

    def _skip(self, name: str, state: str, reason: str) -> None:
        self.result.skipped.append(Skipped(name, state, reason))
