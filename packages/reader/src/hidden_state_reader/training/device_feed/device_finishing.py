"""Stage 3 of the device feed: a batch finished on the device (fp8 dequantized, dtype).

Where the collate builds in place (``batch_memory.InPlaceCollate``), the builder threads
read samples as stored: an fp8 file crosses to the device as fp8 codes plus scales
(half the bytes of bf16) and a bf16 file asked for in float32 crosses as bf16. The batch
is finished after its copy, on the thread's stream, by the sample layer's one finishing
(``sample.finishing.finish_hidden_states``) applied to the whole batch. A batch that
mixes fp8 files with others cannot hold codes and values in one tensor: its samples are
finished on the host first, one by one, by the same function. A batch of any other
collate was made of samples the reader finished on the host: it passes as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hidden_state_reader.format.fp8 import SCALES
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.finishing import finish_hidden_states
from hidden_state_reader.sample.sample import Sample


class DeviceFinishing:
    """Stage 3: finishes batches on the device as the dataset's options ask.

    Args:
        options: The dataset's reader options (``raw_fp8``, ``dtype``).
        on_device: Finish here (the collate builds in place); False: the reader finishes
            each sample on the host and batches pass unchanged.
    """

    def __init__(self, options: LoadOptions, on_device: bool) -> None:
        self.raw_fp8 = options.raw_fp8
        self.dtype = options.dtype
        self.on_device = on_device

    def reading(self) -> dict[str, object]:
        """Reader options the builder threads read with, replacing the dataset's.

        Samples stay in host memory, unpinned (the batch is what is page-locked and
        moved); with finishing on the device, also as stored (raw fp8, stored dtype).
        """
        changes: dict[str, object] = {"pin_memory": False, "device": None}
        if self.on_device:
            changes.update(raw_fp8=True, dtype=None)
        return changes

    def batchable(self, samples: list[Sample]) -> list[Sample]:
        """The samples, finished on the host where fp8 files and others share the batch.

        As the reader would finish them (e.g. a directory whose writers changed their
        storage dtype); then only the finishing left on the device is a no-op.
        """
        if not self.on_device:
            return samples
        stored_fp8 = {sample.hidden_states_scales is not None for sample in samples}
        if len(stored_fp8) == 1:
            return samples
        return [self._on_host(sample) for sample in samples]

    def _on_host(self, sample: Sample) -> Sample:
        hidden, scales = finish_hidden_states(
            sample.hidden_states,
            sample.hidden_states_scales,
            raw_fp8=self.raw_fp8,
            dtype=self.dtype,
            writers=[(sample.metadata, sample.path)],
        )
        return replace(sample, hidden_states=hidden, hidden_states_scales=scales)

    def finish(self, batch: Any, samples: Sequence[Sample]) -> Any:
        """``batch`` (on the device) finished: ``hidden_states`` and their fp8 scales.

        Args:
            batch: The dict an in-place collate built, copied to the device.
            samples: Its samples (their writers' ``model_dtype`` for fp8).

        Raises:
            ValueError: fp8 samples of one batch recorded different model dtypes and no
                ``dtype`` was given.
        """
        if not self.on_device:
            return batch
        hidden, scales = finish_hidden_states(
            batch["hidden_states"],
            batch.get(SCALES),
            raw_fp8=self.raw_fp8,
            dtype=self.dtype,
            writers=[(sample.metadata, sample.path) for sample in samples],
        )
        batch["hidden_states"] = hidden
        if scales is None:
            batch.pop(SCALES, None)
        return batch
