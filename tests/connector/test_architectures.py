"""The architecture matrix: every model family drafters are trained for, on the CPU build.

Each architecture is a tiny random model built here from ``transformers``' config classes
(``hidden-state tiny-model --arch``), run by one real vLLM engine with the connector, and
its captured layers (first, middle, last pre-norm) are compared with Hugging Face's
residual stream in float32; with chunked prefill, a prefix-cache hit and the generated
tokens included. Architectures vLLM cannot capture are refused at start-up, quickly.

``SUPPORT`` is the support matrix of docs/connector.md for vLLM 0.32 on CPU; a test keeps
the two equal. The core set runs in ``make test``; the rest with ``--long``.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hf_reference import Reference, read_one

from hidden_state_connector.apps.server import kv_transfer_config, speculative_config
from hidden_state_connector.apps.tiny_model import build_tiny_model
from hidden_state_connector.engine.compat import vllm_version

from procs import IN_PROCESS_ENGINE

pytestmark = pytest.mark.vllm

CAPTURED = "captured, checked"
REFUSED = "refused at start-up"
NOT_RUN = "not run"
PROMPT_ONLY = "prompt captured, checked, prefix caching off; otherwise refused at start-up"

SUPPORT = {  # architecture -> what vLLM 0.32's CPU build does with it here
    "Llama": CAPTURED,
    "Qwen3": CAPTURED,
    "Qwen3-MoE": CAPTURED,
    "gpt-oss": CAPTURED,
    "DeepSeek-V2/V3, Kimi (MLA)": REFUSED,
    "Gemma 3": REFUSED,
    "Nemotron-H (hybrid)": PROMPT_ONLY,
    "Qwen2.5-VL, Qwen3-VL (text path)": NOT_RUN,
}
ARCH = {  # matrix row -> tiny-model --arch
    "Llama": "llama",
    "Qwen3": "qwen3",
    "Qwen3-MoE": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "DeepSeek-V2/V3, Kimi (MLA)": "deepseek_v2",
    "Gemma 3": "gemma3",
    "Nemotron-H (hybrid)": "nemotron_h",
}
CORE = {"Qwen3", "Qwen3-MoE", "gpt-oss", "DeepSeek-V2/V3, Kimi (MLA)"}
NUM_LAYERS = 4
LAYERS = [1, NUM_LAYERS // 2, NUM_LAYERS]  # first, middle, last (pre-norm)
RTOL = 1e-4
REFUSAL_S = 60  # "within a minute"


def _marks(row: str) -> list[pytest.MarkDecorator]:
    return [] if row in CORE else [pytest.mark.long]


def _rows(kind: str) -> list[object]:
    return [pytest.param(r, marks=_marks(r), id=ARCH[r]) for r, v in SUPPORT.items() if v == kind]


@pytest.fixture
def in_process() -> Iterator[None]:
    """The engine in this process (see procs.IN_PROCESS_ENGINE)."""
    env = pytest.MonkeyPatch()
    for key, value in IN_PROCESS_ENGINE.items():
        env.setenv(key, value)
    yield
    env.undo()


def _engine(model: Path, out: Path, *, prefix_caching: bool = True, outputs: bool = True) -> object:
    from vllm import LLM

    return LLM(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        max_num_batched_tokens=64,  # the 150-token prompts take chunked prefill
        enable_prefix_caching=prefix_caching,
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 1024**2,
        skip_tokenizer_init=True,
        seed=0,
        speculative_config=speculative_config(LAYERS),
        kv_transfer_config=kv_transfer_config(
            str(out), {"include_output_tokens": outputs, "stats_interval": 0}
        ),
    )


def _generate(llm: object, prompts: list[list[int]], params: dict | None = None) -> list[object]:
    from vllm import SamplingParams

    sampling = SamplingParams(
        max_tokens=3,
        temperature=0.0,
        detokenize=False,
        extra_args={"kv_transfer_params": params} if params else None,
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)  # type: ignore[attr-defined]


def _prompts() -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(0)
    first = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (1, 17, 150)]
    # Shares the 150-token prompt's first 128 tokens: a prefix-cache hit.
    cached = first[2][:128] + torch.randint(0, 250, (21,), generator=gen).tolist()
    return first, cached


@pytest.mark.parametrize("row", _rows(CAPTURED))
def test_captured_layers_equal_hugging_face(
    row: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp(ARCH[row])
    model = build_tiny_model(base / "model", arch=ARCH[row], dtype="float32", num_layers=NUM_LAYERS)
    llm = _engine(model, base / "hs")
    try:
        first, cached = _prompts()
        outputs = _generate(llm, first) + _generate(llm, [cached])
    finally:
        del llm
        gc.collect()
    assert outputs[-1].num_cached_tokens >= 64, "the last prompt must hit the prefix cache"  # type: ignore[attr-defined]
    reference = Reference(model, NUM_LAYERS)
    worst = 0.0
    for output in outputs:
        sample = read_one(output.kv_transfer_params["hidden_states_path"])  # type: ignore[attr-defined]
        prompt = list(output.prompt_token_ids)  # type: ignore[attr-defined]
        generated = list(output.outputs[0].token_ids)  # type: ignore[attr-defined]
        # Generated tokens included, but the last one (never fed back: no hidden state).
        assert sample.token_ids.tolist() == prompt + generated[:-1]
        assert sample.layer_ids == LAYERS
        errors = reference.layer_errors(sample)
        assert max(errors.values()) < RTOL, f"{row}: relative errors {errors}"
        worst = max(worst, *errors.values())
    print(f"{row}: worst relative error {worst:.1e} (vLLM {vllm_version()})")


@pytest.mark.parametrize("row", _rows(REFUSED) + _rows(PROMPT_ONLY))
def test_refused_at_start_up_within_a_minute_naming_the_architecture(
    row: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp(ARCH[row])
    model = build_tiny_model(base / "model", arch=ARCH[row], dtype="float32", num_layers=NUM_LAYERS)
    started = time.monotonic()
    with pytest.raises(Exception) as info:  # vLLM wraps what the engine raised
        _engine(model, base / "hs")
    seconds = time.monotonic() - started
    gc.collect()
    message = "".join(str(e) for e in _chain(info.value))
    assert seconds < REFUSAL_S
    if ARCH[row] == "deepseek_v2":  # refused by the connector, before the weights load
        assert "HiddenStateConnector: DeepseekV2ForCausalLM uses multi-head latent" in message
        # The same on a CPU with AMX tiles (injected): vLLM's AMX MLA backend would fail
        # on the float32 weights after loading them, before any refusal after that point.
        with pytest.MonkeyPatch.context() as patch, pytest.raises(Exception) as amx:
            patch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
            _engine(model, base / "hs-amx")
        gc.collect()
        amx_message = "".join(str(e) for e in _chain(amx.value))
        assert "HiddenStateConnector: DeepseekV2ForCausalLM uses multi-head latent" in amx_message
    elif ARCH[row] == "nemotron_h":
        assert "HiddenStateConnector: NemotronHForCausalLM keeps a recurrent" in message
        assert "--no-enable-prefix-caching" in message
    else:  # vLLM fails first (it loads the model before the connector starts); the
        # launchers refuse it with their own message (tests/connector_unit/test_architecture.py)
        assert "does not support EAGLE3" in message


@pytest.mark.parametrize("row", _rows(PROMPT_ONLY))
def test_prompt_only_capture_of_recurrent_models(
    row: str, tmp_path_factory: pytest.TempPathFactory, in_process: None
) -> None:
    base = tmp_path_factory.mktemp(ARCH[row])
    model = build_tiny_model(base / "model", arch=ARCH[row], dtype="float32", num_layers=NUM_LAYERS)
    with pytest.raises(Exception) as info:  # generated tokens by default: refused
        _engine(model, base / "refused", prefix_caching=False)
    assert "include_output_tokens is refused" in "".join(str(e) for e in _chain(info.value))
    gc.collect()
    llm = _engine(model, base / "hs", prefix_caching=False, outputs=False)
    try:
        first, cached = _prompts()
        outputs = _generate(llm, [*first, cached])
        [asked] = _generate(llm, [first[1]], {"include_output_tokens": True})
    finally:
        del llm
        gc.collect()
    assert "include_output_tokens is refused" in asked.kv_transfer_params["hidden_states_error"]  # type: ignore[attr-defined]
    reference = Reference(model, NUM_LAYERS)
    worst = 0.0
    for output in outputs:
        sample = read_one(output.kv_transfer_params["hidden_states_path"])  # type: ignore[attr-defined]
        assert sample.token_ids.tolist() == list(output.prompt_token_ids)  # type: ignore[attr-defined]
        errors = reference.layer_errors(sample)
        assert max(errors.values()) < RTOL, f"{row}: relative errors {errors}"
        worst = max(worst, *errors.values())
    print(f"{row}: worst relative error {worst:.1e} (prompt only; vLLM {vllm_version()})")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def test_the_docs_support_matrix_is_what_these_tests_run() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    section = doc.split("## Support matrix", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not re.match(r"^-+$", cells[1] or "-"):
            rows[cells[0]] = cells[1]
    rows.pop("Architecture", None)
    assert rows == SUPPORT
