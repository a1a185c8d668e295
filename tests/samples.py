"""Helpers that make real sample files for tests (through the product's own writer)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import encode_header, sample_metadata


def make_tensors(
    index: int,
    tokens: int = 8,
    layers: int = 3,
    hidden: int = 16,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tensors for sample ``index``: token ids encode the index."""
    gen = torch.Generator().manual_seed(index)
    token_ids = torch.arange(tokens, dtype=torch.int64) + 1000 * index
    hidden_states = torch.randn(tokens, layers, hidden, generator=gen).to(dtype)
    return token_ids, hidden_states


def write_samples(
    root: str | os.PathLike[str],
    count: int,
    *,
    prefix: str = "hs_",
    tokens: int | list[int] = 8,
    layers: int = 3,
    hidden: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    start: int = 0,
    layer_ids: list[int] | None = None,
    checksum: bool = True,
) -> list[Path]:
    """Write ``count`` complete samples named ``{prefix}{i}.safetensors``.

    ``checksum=False`` writes them without a CRC32, as writers before CRC-by-default did.
    """
    paths = []
    for i in range(start, start + count):
        n = tokens[i - start] if isinstance(tokens, list) else tokens
        token_ids, hidden_states = make_tensors(i, n, layers, hidden, dtype)
        meta = sample_metadata(layer_ids=layer_ids or list(range(layers)), request_id=f"req-{i}")
        path = Path(root) / f"{prefix}{i}.safetensors"
        write_sample(path, token_ids, hidden_states, metadata=meta, checksum=checksum)
        paths.append(path)
    return paths


def write_vllm_style(
    path: str | os.PathLike[str], index: int, tokens: int = 8, layers: int = 3
) -> Path:
    """A file exactly as vLLM's ExampleHiddenStatesConnector writes it (safetensors.save_file)."""
    token_ids, hidden_states = make_tensors(index, tokens, layers)
    save_file({"hidden_states": hidden_states, "token_ids": token_ids}, os.fspath(path))
    return Path(path)


def write_raw(path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """A file with a well-formed safetensors header for ``tensors`` and zeroed data."""
    layout = encode_header(tensors)
    with open(path, "wb") as f:
        f.write(layout.header)
        f.write(b"\0" * (layout.file_size - layout.data_start))
