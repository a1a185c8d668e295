"""Bad sample files built byte by byte: the corrupt-input cases the suites share.

``CASES`` maps a case name to ``(make, expected)``: ``make()`` returns the file's bytes,
``expected`` the error ``load_sample`` raises (None: it loads, and a reader skips it as
empty). Used by ``tests/reliability/test_corrupt_inputs.py`` (each case alone) and
``tests/reader/test_counts_agree.py`` (all of them in one directory, every count).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hidden_state_reader import CorruptSampleError, IncompleteSampleError, SampleError, write_sample

TOKENS, LAYERS, HIDDEN = 4, 2, 8


def spec(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def valid_header(tokens: int = TOKENS, hdtype: str = "BF16") -> tuple[dict[str, Any], int]:
    """A correct header for [tokens] I64 + [tokens, LAYERS, HIDDEN] hdtype; data size."""
    tok = 8 * tokens
    size = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}[hdtype]
    hid = tokens * LAYERS * HIDDEN * size
    header = {
        "token_ids": spec("I64", [tokens], 0, tok),
        "hidden_states": spec(hdtype, [tokens, LAYERS, HIDDEN], tok, tok + hid),
    }
    return header, tok + hid


def file_bytes(header: dict[str, Any] | bytes, data_len: int, *, extra: int = 0) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body + bytes(data_len + extra)


def good_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.safetensors")
        token_ids = torch.arange(TOKENS)
        write_sample(path, token_ids, torch.randn(TOKENS, LAYERS, HIDDEN).to(torch.bfloat16))
        return Path(path).read_bytes()


def foreign_good_bytes() -> bytes:
    """A complete sample as vLLM's example connector writes it: ``safetensors``'
    ``save_file``, no ``format_version``. Readers always go through its lock (a file of
    ours, published by rename, they may read without it: docs/format.md)."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.safetensors")
        hidden = torch.randn(TOKENS, LAYERS, HIDDEN).to(torch.bfloat16)
        save_file({"hidden_states": hidden, "token_ids": torch.arange(TOKENS)}, path)
        return Path(path).read_bytes()


def _mutated(change: Callable[[dict[str, Any]], object], data_len: int | None = None) -> bytes:
    header, size = valid_header()
    change(header)
    return file_bytes(header, size if data_len is None else data_len)


def _case_table() -> dict[str, tuple[Callable[[], bytes], type[SampleError] | None]]:
    """name -> (file bytes, expected error of load_sample; None = loads, reader skips)."""
    good = good_bytes
    h, size = valid_header()
    tok = 8 * TOKENS
    return {
        "zero-length": (lambda: b"", IncompleteSampleError),
        "truncated-in-prefix": (lambda: good()[:5], IncompleteSampleError),
        "truncated-in-header": (lambda: good()[:24], IncompleteSampleError),
        "truncated-in-data": (lambda: good()[:-7], IncompleteSampleError),
        "trailing-bytes": (lambda: good() + bytes(8), CorruptSampleError),
        "garbage": (lambda: bytes(range(256)) * 8, CorruptSampleError),
        "garbage-json": (
            lambda: struct.pack("<Q", 16) + b"\xff" * 16 + bytes(64),
            CorruptSampleError,
        ),
        "header-is-a-list": (lambda: file_bytes(b"[1, 2, 3]", 0), CorruptSampleError),
        "hidden-dtype-int64": (
            lambda: file_bytes(valid_header(hdtype="I64")[0], valid_header(hdtype="I64")[1]),
            CorruptSampleError,
        ),
        "unknown-dtype": (
            lambda: _mutated(lambda x: x["hidden_states"].update(dtype="F8_E4M3")),
            CorruptSampleError,
        ),
        "token-ids-float": (
            lambda: _mutated(lambda x: x["token_ids"].update(dtype="F64")),
            CorruptSampleError,
        ),
        "hidden-2d": (
            lambda: _mutated(lambda x: x["hidden_states"].update(shape=[TOKENS, LAYERS * HIDDEN])),
            CorruptSampleError,
        ),
        "missing-token-ids": (
            lambda: file_bytes(
                {"hidden_states": spec("BF16", [TOKENS, LAYERS, HIDDEN], 0, size - tok)},
                size - tok,
            ),
            CorruptSampleError,
        ),
        "missing-hidden-states": (
            lambda: file_bytes({"token_ids": spec("I64", [TOKENS], 0, tok)}, tok),
            CorruptSampleError,
        ),
        "token-hidden-length-mismatch": (
            lambda: file_bytes(
                {
                    "token_ids": spec("I64", [TOKENS + 1], 0, tok + 8),
                    "hidden_states": spec("BF16", [TOKENS, LAYERS, HIDDEN], tok + 8, size + 8),
                },
                size + 8,
            ),
            CorruptSampleError,
        ),
        "offsets-overlap": (
            lambda: _mutated(lambda x: x["hidden_states"].update(data_offsets=[0, size - tok])),
            CorruptSampleError,
        ),
        "offsets-past-end-of-file": (lambda: file_bytes(h, size - 16), IncompleteSampleError),
        "negative-dimension": (
            lambda: _mutated(lambda x: x["hidden_states"].update(shape=[-TOKENS, LAYERS, HIDDEN])),
            CorruptSampleError,
        ),
        "metadata-not-strings": (
            lambda: _mutated(lambda x: x.update(__metadata__={"layer_ids": [1, 2]})),
            CorruptSampleError,
        ),
        "layer-ids-not-json": (
            lambda: _mutated(lambda x: x.update(__metadata__={"layer_ids": "[1, 2"})),
            CorruptSampleError,
        ),
        "zero-tokens": (lambda: file_bytes(valid_header(0)[0], 0), None),
        # Found by this suite (see docs/reliability.md): non-SampleError exceptions.
        "dtype-is-a-list": (
            lambda: _mutated(lambda x: x["hidden_states"].update(dtype=["BF16"])),
            CorruptSampleError,
        ),
        "deeply-nested-header": (
            lambda: file_bytes(b"[" * 100_000 + b"]" * 100_000, 0),
            CorruptSampleError,
        ),
        "dimension-beyond-int64": (
            lambda: _mutated(
                lambda x: x["hidden_states"].update(
                    shape=[TOKENS, 2**70, 0], data_offsets=[tok, tok]
                ),
                data_len=tok,
            ),
            CorruptSampleError,
        ),
    }


CASES = _case_table()
