"""``hidden-state tiny-model`` / ``hidden_state_connector.apps.tiny_model``: a local model to try.

The command runs as a subprocess, as a user types it; the folder it writes is loaded
with Hugging Face the way vLLM loads a local model (config, tokenizer, weights).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_connector.apps.cli import tiny_model as command
from hidden_state_reader.apps.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "hidden_state_connector.apps.cli.tiny_model"]
CLI = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]


DOC = ROOT / "docs" / "connector.md"


def tiny_model(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def doc_commands() -> list[list[str]]:
    """The commands of docs/connector.md's "try it without downloading a model" block."""
    text = DOC.read_text()
    section = text.split("## How do I try it without downloading a model?\n", 1)[1]
    [block] = [chunk.partition("\n")[2] for chunk in section.split("\n## ")[0].split("```")[1::2]]
    return [shlex.split(line.split("#", 1)[0]) for line in block.splitlines() if line.strip()]


def test_the_documented_quick_try_builds_a_model_hugging_face_and_serve_take(
    tmp_path: Path,
) -> None:
    build, serve, extract = doc_commands()
    assert build[:2] == ["hidden-state", "tiny-model"]
    proc = tiny_model(*build[2:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / build[2]
    assert "tiny random Llama, 4 layers, hidden 128, 2 heads, bfloat16 (built in" in proc.stdout
    assert "next: hidden-state serve tiny-llama --out /tmp/hs --layers 1,2,4" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"]) == (4, 128)
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|user|>\nhi\n"  # the chat template extract's chat inputs need
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    model = LlamaForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    # The next two commands as written: serve's dry run prints the vLLM command for it ...
    hs = str(tmp_path / "hs")
    dry = subprocess.run([*CLI, *[hs if a == "/tmp/hs" else a for a in serve[1:]]], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "tiny-llama" in dry.stdout and "[1, 2, 4]" in dry.stdout
    # ... and extract takes its options (running it starts vLLM: tests/connector does that)
    assert cli_main.build_parser().parse_args(extract[1:]).model == build[2]
    weights = out / "model.safetensors"
    built = weights.stat().st_mtime_ns
    again = tiny_model(*build[2:], cwd=tmp_path)
    assert again.returncode == 0 and "(already there)" in again.stdout
    assert weights.stat().st_mtime_ns == built


def test_refuses_a_folder_in_use_and_an_unusable_head_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert command.main([str(used)]) == 2
    err = capsys.readouterr().err
    assert f"{used} is not empty and holds no tiny model" in err and "nothing was written" in err
    assert os.listdir(used) == ["notes.txt"]
    assert command.main([str(tmp_path / "new"), "--hidden", "128", "--heads", "8"]) == 2
    assert "--hidden 128 / --heads 8 = 16: the head size must be one of 32, 64" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "new").exists()


def test_help_has_examples_and_the_entry_point_registers_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        command.main(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text and "hidden-state tiny-model ./tiny-llama" in help_text
    # The connector's hidden_state.cli entry points as declared (pyproject.toml), each
    # registering into a parser the way the hidden-state CLI loads plugins.
    text = (ROOT / "packages/connector/pyproject.toml").read_text()
    section = text.split('[project.entry-points."hidden_state.cli"]\n', 1)[1].split("\n[")[0]
    declared = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', section, re.MULTILINE))
    parser = argparse.ArgumentParser(prog="hidden-state")
    subparsers = parser.add_subparsers(dest="command")
    for target in declared.values():
        module, _, attr = target.partition(":")
        getattr(importlib.import_module(module), attr)(subparsers)
    assert declared["tiny-model"] == "hidden_state_connector.apps.cli.tiny_model:register"
    args = parser.parse_args(["tiny-model", "./m", "--layers", "3"])
    assert (args.handler, args.layers, args.hidden) == (command.run, 3, 128)


def test_other_architectures_get_the_same_tokenizer(tmp_path: Path) -> None:
    # Whether vLLM can capture each: tests/connector/test_architectures.py.
    from transformers import AutoConfig, AutoTokenizer

    for arch, model_class in [("qwen3", "Qwen3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM")]:
        out = tmp_path / arch
        assert command.main([str(out), "--arch", arch, "--layers", "2"]) == 0
        assert AutoConfig.from_pretrained(out).architectures == [model_class]
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert tokenizer.decode(tokenizer("hi")["input_ids"]) == "hi" and tokenizer.chat_template


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "deepseek_v2"])
def test_the_printed_next_command_does_what_the_line_says(tmp_path: Path, arch: str) -> None:
    """``next:`` names a serve command that takes the model: with forward capture, serve's
    default, that is every architecture tiny-model builds (the extract engine refuses
    Gemma 3 and MLA: tests/connector_unit/test_architecture.py)."""
    proc = tiny_model(str(tmp_path / arch), "--arch", arch, "--layers", "2")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    label, _, rest = last.partition(": ")
    assert label == "next"
    argv = shlex.split(rest)
    assert argv[:2] == ["hidden-state", "serve"]
    argv = [str(tmp_path / "hs") if a == "/tmp/hs" else a for a in argv[1:]]
    ran = subprocess.run([*CLI, *argv, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert '"capture": "forward"' in ran.stdout
