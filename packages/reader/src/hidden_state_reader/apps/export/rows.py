"""The rows speculators' ``ArrowDataset`` indexes: ``input_ids``, ``loss_mask``, ``seq_len``.

speculators' ``prepare-data`` saves them with Hugging Face ``datasets``
(``Dataset.save_to_disk``) after ``set_format("torch")``; ``ArrowDataset`` reads them with
``load_from_disk`` and compares row *i*'s ``input_ids`` with ``hs_{i}.safetensors``'s
``token_ids`` (``torch.equal``: both int64). This module writes the same columns with the
same types (lists of int64 and an int64 length), through ``datasets`` itself, so the
layout is exactly what it loads. Rows are streamed to an Arrow file while the export runs
(memory stays flat however many there are), then ``datasets`` turns that file into the
saved dataset. It also counts the supervised tokens into ``token_freq.pt`` as
prepare-data does (``{token_id: count}`` over tokens whose mask is 1), which speculators'
trainer reads to build a reduced draft vocabulary (``--draft-vocab-size``).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

COLUMNS = ("input_ids", "loss_mask", "seq_len")
TOKEN_FREQ = "token_freq.pt"
SCRATCH = os.path.join(".rows", "rows.arrow")  # not beside the dataset: see RowWriter
ROWS_PER_BATCH = 1024

_MISSING = (
    "`hidden-state export --format speculators` saves its rows with Hugging Face `datasets`, "
    "which speculators reads them with; it is not installed here: pip install 'datasets>=4' "
    "(installing speculators brings it)"
)


class MissingDependencyError(ImportError):
    """A package the export needs is not installed; the message says which and how."""


def require_datasets() -> Any:
    """Import ``datasets`` (and pyarrow), or raise ``MissingDependencyError`` saying how."""
    try:
        import datasets
        import pyarrow  # noqa: F401  (datasets' own dependency, used directly here)
    except ImportError as exc:
        raise MissingDependencyError(f"{_MISSING} ({exc})") from exc
    return datasets


class RowWriter:
    """Collects rows in order and saves them as a ``datasets`` dataset directory.

    Args:
        directory: Where the dataset is saved (``data-*.arrow``, ``state.json``,
            ``dataset_info.json``, ``token_freq.pt``). The scratch file stays in a
            sub-folder of it until ``finish``: ``save_to_disk`` refuses to write into
            the folder of a file its dataset is mapped from.
    """

    def __init__(self, directory: str) -> None:
        require_datasets()
        import pyarrow as pa

        self.directory = directory
        self._scratch = os.path.join(directory, SCRATCH)
        os.makedirs(os.path.dirname(self._scratch), exist_ok=True)
        self._schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int64())),
                ("loss_mask", pa.list_(pa.int64())),
                ("seq_len", pa.int64()),
            ]
        )
        self._sink = pa.OSFile(self._scratch, "wb")
        self._writer = pa.ipc.new_stream(self._sink, self._schema)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self.rows = 0
        self.token_freq: Counter[int] = Counter()

    def add(self, input_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append one row (int64 token ids and their 0/1 mask, of equal length)."""
        import numpy as np

        supervised = input_ids[loss_mask.astype(bool)]
        ids, counts = np.unique(supervised, return_counts=True)
        self.token_freq.update(dict(zip(ids.tolist(), counts.tolist(), strict=True)))
        self._pending.append((input_ids, loss_mask))
        self.rows += 1
        if len(self._pending) >= ROWS_PER_BATCH:
            self._flush()

    def _flush(self) -> None:
        import numpy as np
        import pyarrow as pa

        if not self._pending:
            return
        lengths = np.array([len(ids) for ids, _ in self._pending], dtype=np.int64)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        columns = [
            pa.ListArray.from_arrays(
                pa.array(offsets), pa.array(np.concatenate([row[i] for row in self._pending]))
            )
            for i in (0, 1)
        ]
        batch = pa.record_batch([*columns, pa.array(lengths)], schema=self._schema)
        self._writer.write_batch(batch)
        self._pending.clear()

    def finish(self) -> None:
        """Save the dataset and ``token_freq.pt``; remove the scratch file."""
        import torch

        datasets = require_datasets()
        self._flush()
        self._writer.close()
        self._sink.close()
        try:
            rows = datasets.Dataset.from_file(self._scratch)
            rows.set_format("torch")  # as prepare-data leaves it: ArrowDataset expects tensors
            with _quiet(datasets):
                rows.save_to_disk(self.directory)
            del rows  # release the scratch file's mapping before removing it
        finally:
            self._remove_scratch()
        torch.save(dict(self.token_freq), os.path.join(self.directory, TOKEN_FREQ))

    def abort(self) -> None:
        """Close and remove the scratch file (after a failure)."""
        with contextlib.suppress(Exception):
            self._writer.close()
        with contextlib.suppress(Exception):
            self._sink.close()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._scratch)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self._scratch))


@contextlib.contextmanager
def _quiet(datasets: Any) -> Any:
    """No ``datasets`` progress bar on stderr (the export prints its own progress)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
