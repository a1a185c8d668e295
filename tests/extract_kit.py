"""Helpers of the ``hidden-state extract`` tests (``tests/connector_unit/test_extract_cli.py``
without vLLM, ``tests/connector/test_extract.py`` with it): running the command, inputs,
expected token ids and masks, chat templates.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from hidden_state_connector.apps.cli import extract as extract_cli
from hidden_state_reader import HiddenStateReader
from hidden_state_reader.files.publish import write_sample
from hidden_state_reader.format import sample_metadata

# The CLI framework's stand-in: exactly what `hidden-state extract ...` does.
RUNNER = (
    "import argparse,sys; from hidden_state_connector.apps.cli import extract; "
    "p=argparse.ArgumentParser(); s=p.add_subparsers(); extract.register(s); "
    "a=p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
)
LAYERS = [1, 3]
# Records of the kill-and-resume run: enough that a kill after the third sample is
# mid-run (the run is frozen then), few enough that the resumed run is short.
RESUME_RECORDS = 40


def extract_argv(*args: str, module: bool = False) -> list[str]:
    """Command line of ``hidden-state extract ARGS`` through the runner (or ``-m``)."""
    if module:
        return [sys.executable, "-m", "hidden_state_connector.apps.cli.extract", *args]
    return [sys.executable, "-c", RUNNER, "extract", *args]


def run_extract(
    *args: str, module: bool = False, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        extract_argv(*args, module=module),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def run_in_process(*args: str) -> tuple[int, str, str]:
    """Parse and run in this process (usage errors, help): (status, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="hidden-state")
    extract_cli.register(parser.add_subparsers())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parsed = parser.parse_args(["extract", *args])
            code = parsed.func(parsed)
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(text) + "\n")
    return path


def poisoned_vllm(tmp_path: Path) -> dict[str, str]:
    """Environment in which importing vllm fails: proves vLLM was never started."""
    pkg = tmp_path / "poison" / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('vllm must not be imported here')\n")
    return {"PYTHONPATH": os.pathsep.join([str(pkg.parent), os.environ.get("PYTHONPATH", "")])}


def temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp." in p.name)


def expected_ids(tok: Any, record: dict[str, Any]) -> list[int]:
    """What the model's tokenizer makes of a record (computed independently of extract)."""
    if "token_ids" in record:
        return list(record["token_ids"])
    if "messages" in record:
        chat = record["messages"]
        text = tok.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=chat[-1]["role"] != "assistant"
        )
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok(record["text"])["input_ids"])


def mask_of(out: Path, index: int) -> list[int]:
    [sample] = HiddenStateReader(out, names=[f"hs_{index}.safetensors"], on_error="raise")
    assert sample.loss_mask is not None
    return sample.loss_mask.int().tolist()


def write_valid_sample(path: Path, token_ids: list[int], layers: list[int] = LAYERS) -> None:
    write_sample(
        path,
        torch.tensor(token_ids),
        torch.randn(len(token_ids), len(layers), 128),
        metadata=sample_metadata(layer_ids=layers, num_prompt_tokens=len(token_ids)),
    )


NL = "{{ '\\n' }}"
PLAIN = (  # the tiny model's own template: no end-of-turn token
    "{% for m in messages %}<|{{ m['role'] }}|>" + NL + "{{ m['content'] }}" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>" + NL + "{% endif %}"
)
PLAIN_TAGGED = (
    "{% for m in messages %}<|{{ m['role'] }}|>" + NL + "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}"
    "{% endif %}" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>" + NL + "{% endif %}"
)
CHATML = (  # an end-of-turn marker after every message
    "{% for m in messages %}<|im_start|>{{ m['role'] }}"
    + NL
    + "{{ m['content'] }}<|im_end|>"
    + NL
    + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
    + NL
    + "{% endif %}"
)
CHATML_TAGGED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}" + NL + "{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
    "{{ m['content'] }}<|im_end|>{% endif %}" + NL + "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant" + NL + "{% endif %}"
)
MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Why is the sky blue?"},
    {"role": "assistant", "content": "Rayleigh scattering."},
    {"role": "user", "content": "And sunsets?"},
    {"role": "assistant", "content": "Longer path, so red light."},
]


def with_template(tok: Any, template: str) -> Any:
    import copy

    twin = copy.deepcopy(tok)
    twin.chat_template = template
    return twin


def oracle_mask(tok: Any, tagged: str, chat: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """``(ids, assistant mask)`` as transformers computes them from a tagged template."""
    encoded = with_template(tok, tagged).apply_chat_template(
        chat,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=chat[-1]["role"] != "assistant",
    )
    return list(encoded["input_ids"]), list(encoded["assistant_masks"])
