"""Every Python block of docs/*.md and README.md runs as written, or is name-checked.

Each block runs in a fresh interpreter, in an empty working directory, on a copy of a
prepared sample directory that stands for the docs' ``/data/hs`` (bf16 and fp8 files, a
loss mask, tags, the file names the docs use). A block marked ``names-only`` (it needs a
live server, a GPU, a store, torchrun or a hub model) is compiled and its names are
checked: every name it reads is bound by it, the blocks it continues, or builtins. The
markers are HTML comments on the lines right above a block (docs/contributing.md).
"""

from __future__ import annotations

import builtins
import os
import re
import shutil
import subprocess
import symtable
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
MARKER = re.compile(r"^\s*<!--\s*([a-z-]+):\s*(.*?)\s*-->\s*$")
KEYS = {"block", "continues", "names-only", "given"}
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
SAMPLE_DIRS = ("/data/hs", "/mnt/hs")  # what the docs call a directory of samples
GIVEN = {"path": "the path of a complete sample file (a response's hidden_states_path)"}
RUN_TIMEOUT_S = 120


@dataclass
class Block:
    """One fenced Python block and its markers."""

    doc: str
    line: int
    code: str
    markers: dict[str, str] = field(default_factory=dict)
    chain: list[Block] = field(default_factory=list)  # the blocks it continues, first first

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def names_only(self) -> str | None:
        """Why the block is only name-checked (its own marker or a continued block's)."""
        if "names-only" in self.markers:
            return self.markers["names-only"]
        if "given" in self.markers:
            return None  # runs alone, the given names standing for the continued blocks
        return next((b.names_only for b in self.chain if b.names_only), None)

    def program(self) -> str:
        """The continued blocks' code, then this block's."""
        return "\n".join(b.code for b in [*self.chain, self])

    def given(self) -> list[str]:
        return [n.strip() for n in self.markers.get("given", "").split(",") if n.strip()]


def parse(doc: Path) -> list[Block]:
    """The doc's Python blocks, with their markers and continued blocks resolved."""
    lines = doc.read_text().splitlines()
    name = os.path.relpath(doc, ROOT)
    blocks: list[Block] = []
    named: dict[str, Block] = {}
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if fence.group(2) == "python":
            block = Block(name, i + 1, textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n")
            block.markers = markers_above(lines, i, block.id)
            if "continues" in block.markers:
                parent = named.get(block.markers["continues"])
                assert parent is not None, f"{block.id}: continues an unknown or later block"
                block.chain = [*parent.chain, parent]
            if "block" in block.markers:
                assert block.markers["block"] not in named, f"{block.id}: block name used twice"
                named[block.markers["block"]] = block
            blocks.append(block)
        i = end + 1
    return blocks


def markers_above(lines: list[str], fence: int, where: str) -> dict[str, str]:
    """The ``<!-- key: value -->`` comments on the lines right above a fence."""
    found: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and lines[i].strip().startswith("<!--"):
        marker = MARKER.match(lines[i])
        if marker:  # other comments (anchors such as <!-- fp8-example -->) are left alone
            assert marker.group(1) in KEYS, f"{where}: unknown marker {marker.group(1)!r}"
            found[marker.group(1)] = marker.group(2)
        i -= 1
    return found


BLOCKS = [b for doc in DOCS for b in parse(doc)]


def unbound_names(code: str) -> set[str]:
    """Names the code reads at module level or as globals that it never binds."""
    top = symtable.symtable(code, "<block>", "exec")
    bound = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    bound |= {s.get_name() for s in top.get_symbols() if s.is_namespace()}

    def read(table: symtable.SymbolTable) -> Iterator[str]:
        for s in table.get_symbols():
            if s.is_referenced() and (table is top or s.is_global()):
                yield s.get_name()
        for child in table.get_children():
            yield from read(child)

    return set(read(top)) - bound - set(dir(builtins))


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_compiles_and_binds_every_name_it_reads(block: Block) -> None:
    code = block.program()
    compile(code, block.id, "exec")
    missing = unbound_names(code)
    assert not missing, f"{block.id}: reads {sorted(missing)} that nothing binds"
    for name in block.given():
        assert name in GIVEN, f"{block.id}: given {name!r}: the test supplies only {list(GIVEN)}"
        assert "continues" in block.markers, f"{block.id}: given without continues"
        assert name not in unbound_names("\n".join(b.code for b in block.chain) + f"\n{name}\n")


def prepare_samples(root: Path) -> None:
    """Small complete samples as the docs' blocks expect them (same layers, width)."""
    root.mkdir()
    names = ["hs_0", "hs_1", "hs_2", "hs_3", "hs_4", "cmpl-1.ab12cd34"]
    for i, name in enumerate(names):
        tokens = 6 + 3 * i
        gen = torch.Generator().manual_seed(i)
        hidden = torch.randn(tokens, 3, 16, generator=gen).to(torch.bfloat16)
        meta = sample_metadata(layer_ids=[2, 16, 29], request_id=f"req-{i}")
        meta["policy_version"] = f"step-{i}"  # a client's tag
        write_sample(
            root / f"{name}.safetensors",
            torch.arange(tokens) + 100 * i,
            hidden,
            metadata=meta,
            loss_mask=[0, 0] + [1] * (tokens - 2) if i % 2 == 0 else None,
            storage="fp8_e4m3" if name == "hs_4" else "model",
        )


def stand_ins(name: str, samples: Path) -> str:
    """Source binding a ``given`` name to its stand-in."""
    assert name == "path"
    return f"path = {str(samples / 'hs_1.safetensors')!r}\n"


def run_block(block: Block, base: Path, prepared: Path) -> subprocess.CompletedProcess[str]:
    """Run the block (or its chain) in a fresh interpreter on a copy of the samples."""
    work = base / re.sub(r"\W", "_", block.id)
    samples = work / "hs"
    shutil.copytree(prepared, samples)
    code = "".join(stand_ins(n, samples) for n in block.given())
    code += block.code if block.given() else block.program()
    for placeholder in SAMPLE_DIRS:
        code = code.replace(placeholder, str(samples))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


RUNNABLE = [b for b in BLOCKS if b.names_only is None]


Runs = dict[str, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every runnable block's run, two at a time (most of each is interpreter start-up)."""
    base = tmp_path_factory.mktemp("docs")
    prepared = base / "prepared"
    prepare_samples(prepared)
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda b: run_block(b, base, prepared), RUNNABLE)
        return {b.id: run for b, run in zip(RUNNABLE, runs, strict=True)}


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_block_runs_as_written(block: Block, results: Runs) -> None:
    run = results[block.id]
    assert run.returncode == 0, f"{block.id} failed:\n{run.stderr[-3000:]}"


def test_every_doc_block_is_seen_and_most_run() -> None:
    """The parser finds the blocks (a changed fence style would silently skip them)."""
    expected = sum(doc.read_text().count("```python") for doc in DOCS)
    assert len(BLOCKS) == expected
    assert len(RUNNABLE) > len(BLOCKS) // 2, [b.id for b in BLOCKS if b.names_only]


def test_names_check_finds_what_a_fragment_lacks() -> None:
    """The check is not vacuous: the fragments the docs once had fail it."""
    assert unbound_names("root, name = os.path.split(path)\n") == {"os", "path"}
    assert unbound_names("def f():\n    return [x for x in y]\n") == {"y"}
    assert unbound_names("import os\nfor p in os.listdir('.'):\n    print(p)\n") == set()
    assert unbound_names("class A:\n    b = c\n") == {"c"}


def test_vllm_flag_values_in_the_docs_are_what_vllm_takes() -> None:
    """Every ``--kv-cache-memory-bytes VALUE`` written in the docs parses with vLLM's own
    type for it (``2GiB`` does not: vLLM takes ``2G``)."""
    from vllm.utils.argparse_utils import human_readable_int

    found = []
    for doc in DOCS:
        for value in re.findall(r"--kv-cache-memory-bytes[ =]`?([^\s`|)]+)", doc.read_text()):
            found.append(value)
            assert human_readable_int(value) > 0, f"{doc.name}: {value}"
    assert found  # the troubleshooting row's fix at least
