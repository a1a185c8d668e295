"""Models vLLM cannot capture are refused at start-up, naming the architecture.

``engine/architecture.py`` reads the installed vLLM's sources; these tests hold its answer
against vLLM's own ``supports_eagle3`` on the real model classes, and run the launchers
(as subprocesses) on model folders whose ``config.json`` says what they are: the check
happens before vLLM starts, so the folders need no weights.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hidden_state_connector.engine.architecture import (
    UnsupportedArchitectureError,
    capturing_architectures,
    check_capturable,
    check_model_before_start,
)

from procs import VLLM_MISSING

# Architectures of the support matrix (docs/connector.md), and a few reached only
# through a base class (Mistral: Llama's; DeepSeek-V3: V2's) or without the interface.
SAMPLE = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "NemotronHForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3NextForCausalLM",
    "Gemma2ForCausalLM",
    "GraniteMoeHybridForCausalLM",
]


@pytest.mark.vllm
@pytest.mark.skipif(VLLM_MISSING, reason="vLLM is not installed")
@pytest.mark.parametrize("arch", SAMPLE)
def test_the_source_reading_agrees_with_vllms_own_interface_check(arch: str) -> None:
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import _MULTIMODAL_MODELS, _TEXT_GENERATION_MODELS

    module, name = {**_TEXT_GENERATION_MODELS, **_MULTIMODAL_MODELS}[arch]
    model_class = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    known = capturing_architectures()
    assert known is not None
    assert (arch in known) == supports_eagle3(model_class)


def test_an_architecture_without_the_interface_is_refused_with_what_works() -> None:
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_capturable(
            ["Gemma3ForCausalLM"], mla=False, vllm_version="0.32.0", where="HiddenStateConnector"
        )
    message = str(info.value)
    assert message.startswith("HiddenStateConnector: vLLM 0.32.0 cannot capture")
    assert "Gemma3ForCausalLM" in message and "SupportsEagle3" in message
    assert "Llama, " in message and "Qwen3Moe, " in message and "GptOss, " in message
    check_capturable(["Qwen3MoeForCausalLM"], mla=False, vllm_version="0.32.0", where="x")


def test_the_families_listed_as_capturable_are_not_refused_as_mla(tmp_path: Path) -> None:
    """The refusal's list names the MLA families apart: serve refuses DeepSeek-V2/V3 with
    ``kv_lora_rank``, so they are not among those it lists as capturable outright."""
    with pytest.raises(UnsupportedArchitectureError) as info:
        check_capturable(["Gemma3ForCausalLM"], mla=False, vllm_version="0.32.0", where="x")
    plain, _, latent = str(info.value).partition("; and, when their config has no kv_lora_rank")
    families = plain.split("can capture: ", 1)[1].split(", ")
    assert "Llama" in families and "DeepseekV2" not in families and "DeepseekV3" not in families
    assert "DeepseekV2, DeepseekV3" in latent and "VLLM_MLA_DISABLE=1" in latent
    assert "Llama" not in latent.split(", ")
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        folder = _model_folder(tmp_path, arch, {"architectures": [arch], "kv_lora_rank": 512})
        with pytest.raises(UnsupportedArchitectureError, match="multi-head latent"):
            check_model_before_start(str(folder), "hidden-state serve")


def _model_folder(root: Path, name: str, config: dict[str, object]) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 4, **config}))
    return folder


def _hidden_state(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hidden_state_reader.apps.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 512}


@pytest.mark.parametrize("command", ["serve", "extract"])
def test_launchers_refuse_before_starting_vllm(tmp_path: Path, command: str) -> None:
    """The extract engine refuses Gemma 3 and MLA; forward capture (the default) refuses a
    family it does not know, naming the extract route."""
    gemma = _model_folder(tmp_path, "gemma", {"architectures": ["Gemma3ForCausalLM"]})
    deepseek = _model_folder(tmp_path, "deepseek", DEEPSEEK)
    falcon = _model_folder(tmp_path, "falcon", {"architectures": ["FalconForCausalLM"]})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    extra = ["--dry-run"] if command == "serve" else ["--input", str(prompts)]
    extract = ["--capture", "extract"]
    for model, engine, words in [
        (gemma, extract, "Gemma3ForCausalLM"),
        (deepseek, extract, "multi-head latent"),
        (falcon, [], "FalconForCausalLM yet"),
    ]:
        out = tmp_path / f"hs-{model.name}"
        proc = _hidden_state(command, str(model), "--out", str(out), *engine, *extra)
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert f"hidden-state {command} --capture " in proc.stderr and words in proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists()
    assert "--capture extract" in proc.stderr  # forward's refusal names the other engine


def test_forward_capture_takes_what_the_extract_engine_refuses(tmp_path: Path) -> None:
    for name, config in [("gemma", {"architectures": ["Gemma3ForCausalLM"]}), ("ds", DEEPSEEK)]:
        model = _model_folder(tmp_path, name, config)
        proc = _hidden_state("serve", str(model), "--out", str(tmp_path / "hs"), "--dry-run")
        assert proc.returncode == 0, proc.stderr
        assert '"capture": "forward"' in proc.stdout and "--speculative-config" not in proc.stdout


def test_mla_turned_off_in_vllm_is_not_refused(tmp_path: Path) -> None:
    deepseek = _model_folder(tmp_path, "deepseek", DEEPSEEK)
    out = str(tmp_path / "hs")
    extract = ("--capture", "extract")
    proc = _hidden_state("serve", str(deepseek), "--out", out, *extract, "--dry-run")
    assert proc.returncode == 2 and "multi-head latent" in proc.stderr
    proc = _hidden_state(
        "serve", str(deepseek), "--out", out, *extract, "--dry-run", VLLM_MLA_DISABLE="1"
    )
    assert proc.returncode == 0, proc.stderr
    assert str(deepseek) in proc.stdout  # the command printed (vllm serve, or its module)
