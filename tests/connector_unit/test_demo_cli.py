"""``hidden-state demo`` without vLLM: usage, a server that cannot start, and the parts
(prompts, draft head, progress line). The demo through a real server is
``tests/connector/test_demo.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hidden_state_connector.apps.demo.progress import Snapshot, SnapshotLine
from hidden_state_connector.apps.draft_head import DraftHead, next_token_loss
from hidden_state_connector.apps.prompts import bundled_prompts, load_prompts, parse_jsonl

from procs import DEMO


@pytest.mark.timeout(300)
def test_a_server_that_cannot_start_fails_the_run(tmp_path: Path, demo_cache_dir: Path) -> None:
    # The server process dies at start-up: here vLLM cannot even be imported in it (a
    # broken install; seconds, where a bad vLLM flag costs a whole vLLM import first).
    poison = tmp_path / "poison" / "vllm"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('this vLLM install is broken')\n")
    path = os.pathsep.join([str(poison.parent), os.environ.get("PYTHONPATH", "")])
    out = tmp_path / "demo"
    args = ["--num-prompts", "5", "--out", str(out), "--cache-dir", str(demo_cache_dir)]
    proc = subprocess.run(
        [*DEMO, *args],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "this vLLM install is broken" in proc.stderr  # the end of the server log is shown
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failures"] == ["server failed to start"] and not summary["ok"]


def test_bad_model_directory_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*DEMO, "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "not a local directory" in proc.stderr


def test_help_has_description_and_examples() -> None:
    proc = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert "training loop" in proc.stdout and "examples:" in proc.stdout
    for option in (
        "--model",
        "--layers",
        "--prompts",
        "--num-prompts",
        "--keep-files",
        "--port",
        "--concurrency",
        "--batch-size",
        "--cache-dir",
    ):
        assert option in proc.stdout


def test_demo_is_a_hidden_state_subcommand() -> None:
    from hidden_state_reader.apps.cli.main import build_parser

    args = build_parser().parse_args(["demo", "--num-prompts", "7"])
    assert args.num_prompts == 7 and callable(args.handler)


# -- pieces ----------------------------------------------------------------------------


def test_bundled_prompts_are_a_few_hundred_distinct_texts() -> None:
    prompts = bundled_prompts()
    assert len(prompts) >= 300
    assert len(set(prompts)) == len(prompts)
    assert all(0 < len(p) < 400 for p in prompts)


def test_prompt_files_are_validated_and_repeated(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n')
    assert load_prompts(path) == ["a", "b"]
    assert load_prompts(path, 5) == ["a", "b", "a", "b", "a"]
    with pytest.raises(ValueError, match=r"p\.jsonl:2"):
        parse_jsonl('{"text": "a"}\n{"txt": "b"}\n', "p.jsonl")
    with pytest.raises(ValueError, match="no prompts"):
        parse_jsonl("\n", "empty.jsonl")


def test_draft_head_learns_next_tokens_from_hidden_states() -> None:
    torch.manual_seed(0)
    vocab, layers, hidden = 16, 3, 32
    table = torch.randn(vocab, layers, hidden)
    ids = torch.randint(0, vocab, (4, 12))
    ids[:, 1:] = (ids[:, :-1] * 3 + 1) % vocab  # next token is a function of this one
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 8:] = False  # padding
    states = table[ids].to(torch.bfloat16)
    head = DraftHead(layers, hidden, vocab)
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        loss, count = next_token_loss(head(states), ids, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert count == 4 * 11 - 4
    assert losses[-1] < 0.1 * losses[0]


def test_padding_is_never_a_label() -> None:
    logits = torch.zeros(1, 4, 8, requires_grad=True)
    ids = torch.tensor([[1, 2, 0, 0]])
    mask = torch.tensor([[True, True, False, False]])
    loss, count = next_token_loss(logits, ids, mask)
    assert count == 1
    loss.backward()
    assert logits.grad is not None and logits.grad[0, 1:].abs().sum() == 0


def test_progress_line_is_rate_limited(tmp_path: Path) -> None:
    class Stream:
        def __init__(self) -> None:
            self.text = ""

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

    stream = Stream()
    line = SnapshotLine(stream, interval=1.0)  # type: ignore[arg-type]

    def snap(t: float, n: int) -> Snapshot:
        return Snapshot(t, n, 0, n, n * 10, n * 10, 1e5, n * 1000000, 2.5, 100)

    line.update(snap(0.0, 0))
    line.update(snap(0.5, 5))
    assert stream.text == ""  # baseline, then too soon
    line.update(snap(1.0, 10))
    assert stream.text.count("\n") == 1
    assert "produced 10/100" in stream.text and "10.00 MB/s" in stream.text
    assert "loss 2.500" in stream.text
    line.update(snap(1.0, 10), force=True)
    assert stream.text.count("\n") == 1  # nothing new
