"""The optional ``loss_mask`` tensor of a sample: which tokens a trainer learns from.

``loss_mask`` is ``[tokens]``, one byte per token id, 1 for a token the loss counts
(an assistant token, a generated token), 0 for one it ignores (system and user turns,
chat-template markup). Writers store it as ``U8``; readers also accept ``BOOL`` (what
``safetensors.torch.save_file`` writes for a ``torch.bool`` tensor). Files without it
stay valid: their readers see ``None``.

The header can only prove the shape and dtype (``check_loss_mask``); that every byte is
0 or 1 is ``check_mask_values``, which the loader and every count apply through
``sample/content.py`` (it reads one byte per token), and which writers meet in
``as_mask_tensor``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hidden_state_reader.errors import CorruptSampleError

if TYPE_CHECKING:
    import torch

    from hidden_state_reader.format.tensors import TensorInfo

LOSS_MASK = "loss_mask"
MASK_DTYPES = frozenset({"U8", "BOOL"})


def check_loss_mask(path: str, tensors: Mapping[str, TensorInfo], num_tokens: int) -> None:
    """When the header has a ``loss_mask``, it is 1-D U8/BOOL with one entry per token id.

    Raises:
        CorruptSampleError: It is not; the message names the file and what is wrong.
    """
    mask = tensors.get(LOSS_MASK)
    if mask is None:
        return
    if mask.dtype not in MASK_DTYPES:
        raise CorruptSampleError(
            path, f"loss_mask has dtype {mask.dtype}; it must be U8 or BOOL (0/1 per token)"
        )
    if len(mask.shape) != 1 or mask.shape[0] != num_tokens:
        raise CorruptSampleError(
            path,
            f"loss_mask has shape {list(mask.shape)}; it must be [{num_tokens}] "
            "(one entry per token id)",
        )


def check_mask_values(raw: bytes | memoryview, path: str) -> None:
    """Every stored mask byte is 0 or 1 (torch-free; one pass over one byte per token).

    Args:
        raw: The ``loss_mask`` bytes.
        path: The file, for the error message.

    Raises:
        CorruptSampleError: A byte is neither 0 nor 1 (viewing it as bool would be
            undefined behaviour in torch); the message names the first such entry.
    """
    data = bytes(raw)
    bad = data.translate(None, b"\x00\x01")
    if bad:
        index = data.index(bad[:1])  # the first bad byte's value first occurs there
        raise CorruptSampleError(
            path, f"loss_mask[{index}] is {data[index]}; every entry must be 0 or 1"
        )


def loss_mask_view(raw: torch.Tensor) -> torch.Tensor:
    """The stored mask bytes as a ``torch.bool`` view (no copy).

    Args:
        raw: The ``loss_mask`` bytes as a 1-D ``torch.uint8`` tensor, already checked by
            ``check_mask_values`` (the loader's ``check_content`` does).
    """
    import torch

    return raw.view(torch.bool)


def as_mask_tensor(
    values: torch.Tensor | Sequence[Any], num_tokens: int, where: str
) -> torch.Tensor:
    """A writer's loss mask as the ``[num_tokens]`` ``torch.uint8`` tensor that is stored.

    Args:
        values: A 1-D tensor (bool or integer) or a sequence of 0/1 (``True``/``False``).
        num_tokens: Number of token ids of the sample.
        where: The file being written, for error messages.

    Raises:
        ValueError: Not 1-D, wrong length, or a value other than 0/1.
    """
    import torch

    if isinstance(values, torch.Tensor):
        tensor = values.detach().to("cpu")
        if tensor.is_floating_point() or tensor.is_complex():
            raise ValueError(f"{where}: loss_mask must be bool or integer, got {tensor.dtype}")
    else:
        if not all(isinstance(v, int) for v in values):
            raise ValueError(f"{where}: loss_mask must hold only 0 and 1")
        tensor = torch.tensor(list(values), dtype=torch.int64)
    if tensor.dim() != 1 or tensor.shape[0] != num_tokens:
        raise ValueError(
            f"{where}: loss_mask has shape {list(tensor.shape)}, expected [{num_tokens}] "
            "(one entry per token id)"
        )
    if tensor.dtype != torch.bool and tensor.numel() and (tensor.min() < 0 or tensor.max() > 1):
        raise ValueError(f"{where}: loss_mask must hold only 0 and 1")
    return tensor.to(torch.uint8).contiguous()
