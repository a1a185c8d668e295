"""Finishing hidden states as the reader's options ask: fp8 dequantized, dtype applied.

The one implementation, used for one sample as it is loaded (``sample/load.py``, on the
host or after its move to ``LoadOptions.device``) and for a whole batch on the device
(the device feed's ``device_finishing``, which reads fp8 raw and finishes after the
copy). Finishing is the last step: layer selection and the move to a device come first,
so an fp8 file crosses to the device as fp8 plus scales.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hidden_state_reader.format import fp8
from hidden_state_reader.format.header import Meta
from hidden_state_reader.kernels.fp8 import dequantize

Writer = tuple[Mapping[str, str], str]
"""``(metadata, path)`` of a file whose hidden states are finished (for the fp8 target)."""


def fp8_target(dtype: torch.dtype | None, writers: Sequence[Writer]) -> torch.dtype:
    """The dtype fp8 hidden states dequantize to: ``dtype``, else their writers' ``model_dtype``.

    Args:
        dtype: The reader's ``dtype`` (None: what the writers recorded).
        writers: The files the hidden states come from (one for a sample, several for a
            batch, which must then agree).

    Raises:
        CorruptSampleError: A recorded ``model_dtype`` this format does not know.
        ValueError: The files of one batch recorded different model dtypes.
    """
    if dtype is not None:
        return dtype
    dtypes = {fp8.model_dtype(metadata.get(Meta.MODEL_DTYPE), path) for metadata, path in writers}
    if len(dtypes) > 1:
        raise ValueError(
            f"cannot batch fp8 samples whose writers recorded different model dtypes "
            f"({sorted(str(d) for d in dtypes)}, e.g. {writers[0][1]}); pass dtype=... "
            "to the dataset"
        )
    return dtypes.pop()


def finish_hidden_states(
    hidden: torch.Tensor,
    scales: torch.Tensor | None,
    *,
    raw_fp8: bool,
    dtype: torch.dtype | None,
    writers: Sequence[Writer],
    pin_memory: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(hidden_states, scales)`` finished: fp8 dequantized (unless raw), else ``dtype`` applied.

    Works where the tensors are: on the host, or on a device (there the dequantization
    is queued on the current stream, after the copies that brought the tensors).

    Args:
        hidden: Hidden states as stored (fp8 codes when ``scales`` is given).
        scales: Their fp8 scales, or None for a file not stored in fp8.
        raw_fp8: Keep fp8 codes and scales as they are (the reader's ``raw_fp8``); the
            ``dtype`` then applies to other files only.
        dtype: The reader's ``dtype`` (None: as stored, or the writers' ``model_dtype``
            for fp8).
        writers: The files the hidden states come from (``fp8_target``).
        pin_memory: Dequantize into page-locked memory (host tensors only).

    Returns:
        The hidden states, and the scales still needed to read them (raw fp8 only).
    """
    if scales is not None:
        if raw_fp8:
            return hidden, scales
        target = fp8_target(dtype, writers)
        return dequantize(hidden, scales, target, pin_memory=pin_memory), None
    if dtype is not None and hidden.dtype != dtype:
        hidden = hidden.to(dtype)
    return hidden, None
