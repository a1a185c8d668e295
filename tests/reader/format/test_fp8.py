"""fp8 storage: round trip within the documented bound, header rules, raw mode, layouts.

The documented bound (docs/format.md): every element of a dequantized sample satisfies
``|x' - x| <= 2**-4 * |x| + 2**-10 * s`` with ``s`` the scale of its row (token, layer),
before the result is rounded to its dtype (bf16 adds ``2**-8 * |x'|``).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hidden_state_reader import (
    CorruptSampleError,
    HiddenStateReader,
    LoadOptions,
    load_sample,
    read_header,
)
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import Meta, sample_metadata
from hidden_state_reader.format.fp8 import SCALES
from hidden_state_reader.kernels.fp8 import dequantize, quantize


def residual_like(tokens: int = 64, layers: int = 4, hidden: int = 256) -> torch.Tensor:
    """States shaped like a residual stream: growing with depth, a few outlier channels."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, layers, hidden, generator=gen)
    x *= torch.logspace(-2, 2, layers).view(1, layers, 1)  # 1e-2 .. 1e2 from layer to layer
    x[:, :, :3] *= 40  # massive activations in three channels
    x[5] = 0  # an all-zero token (e.g. masked out)
    return x.to(torch.bfloat16)


def bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The documented per-element bound for dequantization to float32."""
    return 2**-4 * x.abs() + 2**-10 * scales


def test_round_trip_to_float32_is_within_the_documented_bound(hs_dir: Path) -> None:
    x = residual_like()
    path = write_sample(hs_dir / "a.safetensors", torch.arange(64), x, storage="fp8_e4m3")
    raw = load_file(path)  # plain safetensors: any reader sees the pair
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    scales = raw[SCALES]
    assert scales.dtype == torch.float32 and scales.shape == (64, 4, 1)
    got = load_sample(path, LoadOptions(dtype=torch.float32)).hidden_states
    err = (got - x.float()).abs()
    assert bool((err <= bound(x.float(), scales)).all()), float(
        (err - bound(x.float(), scales)).max()
    )
    assert torch.equal(got[5], torch.zeros_like(got[5]))  # zeros stay exact
    # Per layer relative error (Frobenius), layers 4 decades apart: all well inside 6.25%.
    rel = (got - x.float()).norm(dim=(0, 2)) / x.float().norm(dim=(0, 2))
    assert bool((rel < 2**-4).all()), rel.tolist()


def test_default_read_gives_the_model_dtype_recorded_by_the_writer(hs_dir: Path) -> None:
    x = residual_like().half()
    path = write_sample(hs_dir / "h.safetensors", torch.arange(64), x, storage="fp8_e4m3")
    header = read_header(path)
    assert header.hidden.dtype == "F8_E4M3" and header.metadata[Meta.MODEL_DTYPE] == "F16"
    assert header.data_bytes == 64 * 8 + x.numel() + 64 * 4 * 4  # about half of fp16
    sample = load_sample(path)
    assert sample.hidden_states.dtype == torch.float16 and sample.hidden_states_scales is None
    scales = load_file(path)[SCALES]
    err = (sample.hidden_states.float() - x.float()).abs()
    limit = bound(x.float(), scales) + 2**-11 * sample.hidden_states.float().abs()  # fp16 rounding
    assert bool((err <= limit).all())


def test_bf16_files_without_model_dtype_read_as_bf16_and_raw_mode_gives_the_stored_pair(
    hs_dir: Path,
) -> None:
    x = residual_like()
    q, s = quantize(x)
    # Written the way speculators' hs_connectors does: safetensors.save_file, no metadata,
    # one scale per token for all layers ([T, 1, 1]).
    q_tok, s_tok = _per_token(x)
    path = hs_dir / "spec.safetensors"
    save_file({"hidden_states": q_tok, SCALES: s_tok, "token_ids": torch.arange(64)}, str(path))
    sample = load_sample(path)
    assert sample.hidden_states.dtype == torch.bfloat16
    assert torch.equal(sample.hidden_states, dequantize(q_tok, s_tok))
    err = (sample.hidden_states.float() - x.float()).abs()
    assert bool((err <= bound(x.float(), s_tok) + 2**-8 * sample.hidden_states.float().abs()).all())

    ours = write_sample(hs_dir / "ours.safetensors", torch.arange(64), x, storage="fp8_e4m3")
    raw = load_sample(ours, LoadOptions(raw_fp8=True, layers=[3, 1]))
    assert raw.hidden_states.dtype == torch.float8_e4m3fn
    assert torch.equal(raw.hidden_states.view(torch.uint8), q[:, [3, 1]].view(torch.uint8))
    assert raw.hidden_states_scales is not None and torch.equal(
        raw.hidden_states_scales, s[:, [3, 1]]
    )
    assert raw.nbytes == 64 * 8 + 64 * 2 * 256 + 64 * 2 * 4
    # Raw then dequantized is what the default read gives, bit for bit.
    default = load_sample(ours, LoadOptions(layers=[3, 1])).hidden_states
    assert torch.equal(dequantize(raw.hidden_states, raw.hidden_states_scales), default)


def _per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hs_connectors.fp8_utils.quantize_tensor_to_fp8 (speculators 0.9.0), restated."""
    fp32 = x.float()
    scale = (fp32.abs().amax(dim=(1, 2), keepdim=True) / 448.0).clamp(min=1e-12)
    return (fp32 / scale).to(torch.float8_e4m3fn), scale


def test_per_layer_scales_beat_per_token_scales_on_layers_of_different_size() -> None:
    x = residual_like().float()
    ours = dequantize(*quantize(x), torch.float32)
    theirs = dequantize(*_per_token(x), torch.float32)
    first = slice(0, 1)  # the smallest layer: per-token scales push it into subnormals
    rel_ours = ((ours - x)[:, first].norm() / x[:, first].norm()).item()
    rel_theirs = ((theirs - x)[:, first].norm() / x[:, first].norm()).item()
    assert rel_ours < 2**-4 < rel_theirs, (rel_ours, rel_theirs)


def test_reader_yields_dequantized_or_raw_samples(hs_dir: Path) -> None:
    x = residual_like(tokens=16)
    meta = sample_metadata(layer_ids=[2, 4, 6, 8])
    write_sample(hs_dir / "a.safetensors", torch.arange(16), x, metadata=meta, storage="fp8_e4m3")
    write_sample(hs_dir / "b.safetensors", torch.arange(16), x, metadata=meta)  # bf16 beside it
    plain = {s.path[-13:]: s for s in HiddenStateReader(hs_dir, on_error="raise", layer_ids=[8])}
    assert {s.hidden_states.dtype for s in plain.values()} == {torch.bfloat16}
    fp8_read, bf16_read = plain["a.safetensors"], plain["b.safetensors"]
    assert torch.equal(bf16_read.hidden_states, x[:, 3:])
    rel = (fp8_read.hidden_states.float() - x[:, 3:].float()).norm() / x[:, 3:].float().norm()
    assert rel < 2**-4 and fp8_read.layer_ids == [8]
    raw = {s.path[-13:]: s for s in HiddenStateReader(hs_dir, on_error="raise", raw_fp8=True)}
    assert raw["a.safetensors"].hidden_states.dtype == torch.float8_e4m3fn
    assert raw["b.safetensors"].hidden_states_scales is None  # bf16 files are unchanged


def _rewrite_header(path: Path, edit: object) -> None:
    """Apply ``edit(header_dict)`` to a file's JSON header, keeping the data as it was."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    doc = json.loads(blob[8 : 8 + n])
    edit(doc)  # type: ignore[operator]
    body = json.dumps(doc).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + blob[8 + n :])


def _drop_scales(doc: dict[str, dict[str, object]]) -> None:
    """Remove the scales entry and shrink the file's promise accordingly (data kept)."""
    del doc[SCALES]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_drop_scales, "no 'hidden_states_scales' tensor"),
        (lambda d: d[SCALES].update(shape=[16, 2, 2], dtype="F32"), "must be F32"),
        (lambda d: d[SCALES].update(dtype="BF16", data_offsets=[0, 0], shape=[0]), "must be F32"),
    ],
    ids=["fp8-without-scales", "scales-wrong-shape", "scales-wrong-dtype"],
)
def test_fp8_header_rules_name_the_file(hs_dir: Path, edit: object, message: str) -> None:
    x = residual_like(tokens=16)
    path = Path(write_sample(hs_dir / "c.safetensors", torch.arange(16), x, storage="fp8_e4m3"))
    _rewrite_header(path, edit)
    if message == "no 'hidden_states_scales' tensor":
        path.write_bytes(path.read_bytes()[: -16 * 4 * 4])  # the data ends with the scales
    with pytest.raises(CorruptSampleError) as info:
        read_header(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_scales_beside_bf16_hidden_states_are_corrupt(hs_dir: Path) -> None:
    path = hs_dir / "d.safetensors"
    x = residual_like(tokens=8)
    save_file(
        {"hidden_states": x, SCALES: torch.ones(8, 4, 1), "token_ids": torch.arange(8)}, str(path)
    )
    with pytest.raises(CorruptSampleError, match="only valid with F8_E4M3") as info:
        load_sample(path)
    assert str(path) in str(info.value)


def test_checksummed_fp8_file_verifies_and_a_flipped_scale_is_caught(hs_dir: Path) -> None:
    x = residual_like(tokens=8)
    path = Path(
        write_sample(
            hs_dir / "e.safetensors", torch.arange(8), x, storage="fp8_e4m3", checksum=True
        )
    )
    load_sample(path, LoadOptions(verify_checksum=True))
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 0x01  # the last byte belongs to the last scale
    path.write_bytes(bytes(blob))
    with pytest.raises(CorruptSampleError, match="CRC32 mismatch"):
        load_sample(path, LoadOptions(verify_checksum=True))


def test_nonfinite_rows_are_flagged_and_stay_nonfinite(hs_dir: Path) -> None:
    x = residual_like(tokens=8)
    x[2, 1, 7] = float("nan")
    path = write_sample(hs_dir / "n.safetensors", torch.arange(8), x, storage="fp8_e4m3")
    assert read_header(path).metadata[Meta.NONFINITE] == "1"
    got = load_sample(path).hidden_states
    assert bool(got[2, 1].isnan().all())  # the row's scale is NaN: no silent garbage
    mask = torch.ones(8, 4, dtype=torch.bool)
    mask[2, 1] = False
    assert bool(got[mask].isfinite().all())


def test_writer_rejects_fp8_given_as_the_model_dtype(hs_dir: Path) -> None:
    q, _ = quantize(residual_like(tokens=8))
    with pytest.raises(ValueError, match="storage='fp8_e4m3'"):
        write_sample(hs_dir / "f.safetensors", torch.arange(8), q)
    with pytest.raises(ValueError, match="storage: must be one of model, fp8_e4m3"):
        write_sample(hs_dir / "g.safetensors", torch.arange(8), q.float(), storage="fp8")


def test_format_and_fp8_module_import_no_torch() -> None:
    code = (
        "import sys, hidden_state_reader.format, hidden_state_reader.format.fp8\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_reader_docs_fp8_example_runs_and_matches_the_default_read(hs_dir: Path) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "reader.md").read_text()
    block = doc.split("<!-- fp8-example -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    x = residual_like(tokens=16)
    fp8_path = write_sample(hs_dir / "a.safetensors", torch.arange(16), x, storage="fp8_e4m3")
    write_sample(hs_dir / "b.safetensors", torch.arange(16), x)
    seen = {}
    namespace = {"path": hs_dir, "device": "cpu", "torch": torch}
    exec(compile(block.replace("hidden = ", "hidden = seen[sample.path] = "), "reader.md", "exec"),
         {**namespace, "seen": seen})  # fmt: skip
    assert torch.equal(seen[fp8_path], load_sample(fp8_path).hidden_states)
    assert torch.equal(seen[str(hs_dir / "b.safetensors")], x)


def test_the_reader_docs_device_example_runs_and_both_loops_agree(hs_dir: Path) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "reader.md").read_text()
    block = doc.split("<!-- fp8-device-example -->", 1)[1].split("```python\n", 1)[1]
    block = block.split("```", 1)[0]
    x = residual_like(tokens=16)
    path = write_sample(hs_dir / "a.safetensors", torch.arange(16), x, storage="fp8_e4m3")
    seen: list[torch.Tensor] = []
    code = block.replace("hidden = ", "hidden = seen.append(sample.hidden_states) or ")
    code = code.replace('"/data/hs"', repr(str(hs_dir)))  # the block's own path and device
    exec(compile(code, "reader.md", "exec"), {"seen": seen})
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])
    assert torch.equal(seen[0], load_sample(path).hidden_states)
    assert seen[0].dtype == torch.bfloat16


def test_large_results_dequantize_in_chunks_and_keep_nan_codes() -> None:
    x = residual_like(tokens=300, layers=4, hidden=1024)  # several chunks of the CPU path
    q, s = quantize(x)
    q.view(torch.uint8)[7, 2, 5] = 0x7F  # a NaN code inside a finite row
    got = dequantize(q, s)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert bool(got[7, 2, 5].isnan()) and int(got.isnan().sum()) == 1
    want = (q.float() * s).bfloat16()
    assert torch.equal(got.nan_to_num(0).view(torch.int16), want.nan_to_num(0).view(torch.int16))
