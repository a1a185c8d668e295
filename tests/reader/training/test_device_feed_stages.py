"""The device feed's stages (``training/device_feed/``) and the contracts around them.

- Collates declare in-place building with ``build_into`` (``InPlaceCollate``): such a
  collate gets samples as stored (fp8 codes with scales) and a buffer to build in, and
  the device finishes the batch; a collate without it takes the regular path (samples
  the reader finished, ``collate_fn(samples)``, the batch as it is).
- Finishing has one implementation (``sample/finishing.py``): the device finishing
  applies it to a batch, and nothing in ``training/`` dequantizes by itself.
- The loader and the feed reach the dataset through public members and its
  ``LoaderBinding`` only (read from the source with ``ast``).

CI has no GPU: ``device="cpu"`` runs the same stages (no stream, no event).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata
from hidden_state_reader.kernels.fp8 import dequantize
from hidden_state_reader.options import LoadOptions
from hidden_state_reader.sample.finishing import finish_hidden_states
from hidden_state_reader.sample.load import load_sample
from hidden_state_reader.sample.sample import Sample
from hidden_state_reader.training import loader as loader_module
from hidden_state_reader.training.batch_memory import Allocate, InPlaceCollate, allocate_plain
from hidden_state_reader.training.collate import PackCollate, PadCollate, pack_collate, pad_collate
from hidden_state_reader.training.dataset import HiddenStateDataset
from hidden_state_reader.training.device_feed.host_build import HostArenas, HostBuild
from hidden_state_reader.training.loader import HiddenStateLoader

from samples import make_tensors

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

TRAINING = Path(loader_module.__file__).parent
# The modules that drive a dataset they were given: the loader and the device feed.
DRIVERS = [TRAINING / "loader.py", *sorted((TRAINING / "device_feed").glob("*.py"))]


def write(root: Path, count: int, dtype: torch.dtype = torch.bfloat16, start: int = 0) -> None:
    for i in range(start, start + count):
        tokens, hidden = make_tensors(i, tokens=3 + i % 4, layers=2, hidden=8, dtype=dtype)
        meta = sample_metadata(layer_ids=[0, 1])
        write_sample(
            root / f"hs_{i}.safetensors", tokens, hidden, metadata=meta, storage="fp8_e4m3"
        )


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


class RecordingPack:
    """An in-place collate of a user's own (``build_into``): packs, records what it got."""

    def __init__(self) -> None:
        self.seen: list[Sample] = []
        self.allocates: list[Allocate] = []

    def __call__(self, batch: Sequence[Any]) -> dict[str, Any]:
        raise AssertionError("an in-place collate is built through build_into")

    def build_into(self, samples: Sequence[Any], allocate: Allocate) -> dict[str, Any]:
        self.seen.extend(samples)
        self.allocates.append(allocate)
        return pack_collate.build_into(samples, allocate)


def test_the_pad_and_pack_collates_declare_in_place_building_and_a_function_does_not() -> None:
    def mine(samples: list[Any]) -> Any:
        return samples

    assert isinstance(PadCollate(), InPlaceCollate) and isinstance(PackCollate(), InPlaceCollate)
    assert isinstance(RecordingPack(), InPlaceCollate)
    assert not isinstance(mine, InPlaceCollate)


def test_an_in_place_collate_gets_fp8_as_stored_and_the_device_finishes_it(
    hs_dir: Path,
) -> None:
    write(hs_dir, 6)
    collate = RecordingPack()
    ds = HiddenStateDataset(hs_dir)
    got = list(HiddenStateLoader(ds, 3, collate_fn=collate, num_workers=2, device="cpu"))
    assert {s.hidden_states.dtype for s in collate.seen} == {torch.float8_e4m3fn}
    assert all(s.hidden_states_scales is not None for s in collate.seen)
    assert set(collate.allocates) == {allocate_plain}  # off CUDA: fresh memory, kept by the loop
    raw_ds = HiddenStateDataset(hs_dir, raw_fp8=True)
    raw = list(HiddenStateLoader(raw_ds, 3, collate_fn=pack_collate))
    for r, g in zip(raw, got, strict=True):
        assert "hidden_states_scales" not in g
        values = dequantize(r["hidden_states"], r["hidden_states_scales"], torch.bfloat16)
        assert torch.equal(g["hidden_states"], values)


def test_a_collate_without_build_into_gets_finished_samples_and_its_batch_as_is(
    hs_dir: Path,
) -> None:
    write(hs_dir, 6)
    seen: list[Sample] = []

    def stack_hidden(samples: list[Sample]) -> dict[str, Any]:
        seen.extend(samples)
        return {"hidden": torch.cat([s.hidden_states for s in samples]), "n": len(samples)}

    ds = HiddenStateDataset(hs_dir, dtype=torch.float32)
    got = list(HiddenStateLoader(ds, 3, collate_fn=stack_hidden, num_workers=2, device="cpu"))
    assert {s.hidden_states.dtype for s in seen} == {torch.float32}
    assert all(s.hidden_states_scales is None for s in seen)
    as_float = LoadOptions(dtype=torch.float32)
    expected = [load_sample(hs_dir / f"hs_{i}.safetensors", as_float) for i in range(6)]
    assert [b["n"] for b in got] == [3, 3]
    hidden = torch.cat([b["hidden"] for b in got])
    assert torch.equal(hidden, torch.cat([s.hidden_states for s in expected]))


def test_an_in_place_collate_that_returns_no_hidden_states_is_named(hs_dir: Path) -> None:
    write(hs_dir, 2)

    class Broken(RecordingPack):
        def build_into(self, samples: Sequence[Any], allocate: Allocate) -> dict[str, Any]:
            return {"tokens": [s.token_ids for s in samples]}

        def __repr__(self) -> str:
            return "Broken()"

    loader = HiddenStateLoader(HiddenStateDataset(hs_dir), 2, collate_fn=Broken(), device="cpu")
    with pytest.raises(TypeError, match=r"Broken\(\)\.build_into returned a dict without"):
        list(loader)


def test_host_build_builds_an_in_place_batch_in_the_threads_buffers(hs_dir: Path) -> None:
    write(hs_dir, 2)
    samples_of = [load_sample(hs_dir / f"hs_{i}.safetensors") for i in range(2)]
    arenas = HostArenas(2, pin=False)
    build = HostBuild(PadCollate(), arenas)
    first = build.build(samples_of)
    build.copied(None)
    second = build.build(samples_of)
    build.copied(None)
    again = build.build(samples_of)  # buffer 0's turn again
    assert again["hidden_states"].data_ptr() == first["hidden_states"].data_ptr()
    assert again["hidden_states"].data_ptr() != second["hidden_states"].data_ptr()
    assert_same(again, pad_collate(samples_of))


def test_fp8_files_of_different_model_dtypes_need_a_dtype_in_one_device_batch(
    hs_dir: Path,
) -> None:
    write(hs_dir, 2, dtype=torch.bfloat16)
    write(hs_dir, 2, dtype=torch.float16, start=2)
    ds = HiddenStateDataset(hs_dir)
    with pytest.raises(ValueError, match=r"different model dtypes.*pass dtype="):
        list(HiddenStateLoader(ds, 4, collate_fn=pack_collate, device="cpu"))
    ds = HiddenStateDataset(hs_dir, dtype=torch.float32)
    (batch,) = HiddenStateLoader(ds, 4, collate_fn=pack_collate, device="cpu")
    assert batch["hidden_states"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_batch_mixing_fp8_and_bf16_files_is_delivered_as_without_device(
    hs_dir: Path, dtype: torch.dtype | None
) -> None:
    write(hs_dir, 4)
    for i in range(4, 8):  # files of a writer that stored its model dtype
        tokens, hidden = make_tensors(i, tokens=3 + i % 4, layers=2, hidden=8)
        meta = sample_metadata(layer_ids=[0, 1])
        write_sample(hs_dir / f"hs_{i}.safetensors", tokens, hidden, metadata=meta)

    def batches(**kw: Any) -> list[dict[str, Any]]:
        ds = HiddenStateDataset(hs_dir, shuffle=True, seed=3, dtype=dtype)
        return list(HiddenStateLoader(ds, 3, collate_fn=pack_collate, **kw))

    got, plain = batches(num_workers=2, device="cpu"), batches()
    fp8_files = {f"hs_{i}.safetensors" for i in range(4)}
    kinds = [{Path(p).name in fp8_files for p in b["paths"]} for b in got]
    assert {True, False} in kinds  # some batch mixes both (seed 3)
    assert len(got) == len(plain) == 3
    for g, p in zip(got, plain, strict=True):
        assert_same(g, p)


def test_finishing_a_batch_equals_finishing_its_samples(hs_dir: Path) -> None:
    write(hs_dir, 3)
    raw = [load_sample(hs_dir / f"hs_{i}.safetensors", LoadOptions(raw_fp8=True)) for i in range(3)]
    batch = pack_collate(raw)
    writers = [(s.metadata, s.path) for s in raw]
    hidden, scales = finish_hidden_states(
        batch["hidden_states"], batch["hidden_states_scales"], raw_fp8=False, dtype=None,
        writers=writers,
    )  # fmt: skip
    finished = [load_sample(hs_dir / f"hs_{i}.safetensors") for i in range(3)]
    assert scales is None
    assert torch.equal(hidden[0], torch.cat([s.hidden_states for s in finished]))


def private_reaches(source: str) -> list[str]:
    """Each private attribute read on anything but ``self`` (``dataset._x``), as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # dunders are public protocol
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            continue  # the module's own state
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_reach_check_sees_reaches() -> None:
    source = "def f(dataset, self):\n    dataset._cursor.x = self._ok + self.dataset._mode\n"
    assert sorted(private_reaches(source)) == ["2: dataset._cursor", "2: self.dataset._mode"]


def test_the_loader_and_the_feed_reach_no_private_member_of_the_dataset() -> None:
    assert len(DRIVERS) >= 5, DRIVERS  # the loader and the feed's modules were found
    reaches = {path.name: private_reaches(path.read_text(encoding="utf-8")) for path in DRIVERS}
    assert {name: found for name, found in reaches.items() if found} == {}


KERNEL = "hidden_state_reader.kernels.fp8"


def test_training_has_one_finishing_and_no_undeclared_in_place_flag() -> None:
    for path in sorted(TRAINING.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        assert "builds_in_place =" not in source and '"builds_in_place"' not in source, path
        for node in ast.walk(ast.parse(source, str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "hidden_state_reader.kernels.fp8"
            ):
                raise AssertionError(f"{path}: dequantizes by itself; use sample.finishing")
            if isinstance(node, ast.Attribute) and node.attr == "model_dtype":
                raise AssertionError(f"{path}:{node.lineno}: picks the fp8 target by itself")
