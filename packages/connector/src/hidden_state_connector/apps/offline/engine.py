"""Offline vLLM for extraction: ``start_engine`` and the ``VllmEngine`` request feed.

``start_engine`` builds the ``vllm.LLM`` (speculative and kv-transfer configs from
``settings``) with sampling parameters that ask the connector for ``hs_{index}`` files
(and hand it the sample's loss mask, when it has one).
``VllmEngine`` takes one request at a time and hands each output back as it finishes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from hidden_state_connector.apps.offline.errors import first_line
from hidden_state_connector.apps.offline.manifest import sample_name
from hidden_state_connector.apps.offline.settings import (
    ExtractOptions,
    engine_settings,
    import_vllm,
)

log = logging.getLogger(__name__)

Finished = tuple[int, Any, "str | None"]
"""``(index, RequestOutput or None, error or None)`` from an engine step."""


class VllmEngine:
    """A ``vllm.LLM`` fed one request at a time; outputs come back as requests finish.

    Uses ``LLM.enqueue`` plus ``LLMEngine.step`` when available (continuous batching with
    a refilled queue); otherwise falls back to ``LLM.generate`` on buffered batches.

    Args:
        llm: The engine.
        sampling_params: ``(index, loss_mask or None) -> SamplingParams``.
    """

    def __init__(self, llm: Any, sampling_params: Any) -> None:
        self.llm = llm
        self._params = sampling_params
        self._streaming = hasattr(llm, "enqueue") and hasattr(llm, "llm_engine")
        self._ids: dict[str, int] = {}
        self._aliases: dict[str, str] = {}
        self._buffer: list[tuple[int, list[int], list[int] | None]] = []

    def _model_config(self) -> Any:
        return getattr(self.llm, "model_config", None) or getattr(
            getattr(self.llm, "llm_engine", None), "model_config", None
        )

    @property
    def max_model_len(self) -> int | None:
        """The engine's ``max_model_len``."""
        value = getattr(self._model_config(), "max_model_len", None)
        return int(value) if value else None

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids must be below it)."""
        config = self._model_config()
        try:
            return int(config.get_vocab_size())
        except Exception:
            return None

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet returned."""
        return len(self._ids) if self._streaming else len(self._buffer)

    def submit(
        self, index: int, token_ids: list[int], loss_mask: list[int] | None = None
    ) -> str | None:
        """Add a request; returns the reason when vLLM rejects it at once."""
        if not self._streaming:
            self._buffer.append((index, token_ids, loss_mask))
            return None
        try:
            [req_id] = self.llm.enqueue(
                [{"prompt_token_ids": token_ids}], self._params(index, loss_mask), use_tqdm=False
            )
        except Exception as exc:
            return f"vLLM rejected the prompt: {first_line(exc)}"
        self._ids[req_id] = index
        # vLLM >= 0.30 returns "<id>-<random>" but reports outputs under "<id>".
        head, sep, _ = req_id.rpartition("-")
        if sep and head:
            self._aliases[head] = req_id
        return None

    def step(self) -> list[Finished]:
        """Run the engine until at least one request finished (or nothing is in flight)."""
        if not self._streaming:
            return self._run_buffer()
        finished: list[Finished] = []
        engine = self.llm.llm_engine
        while self._ids and not finished:
            if not engine.has_unfinished_requests():
                lost = sorted(self._ids.values())
                self._ids.clear()
                return [(i, None, "vLLM dropped the request") for i in lost]
            for output in engine.step():
                if not getattr(output, "finished", True):
                    continue
                req_id = output.request_id
                key = req_id if req_id in self._ids else self._aliases.pop(req_id, None)
                if key is None or key not in self._ids:
                    log.warning("output for unknown request %s ignored", req_id)
                    continue
                self._aliases.pop(key.rpartition("-")[0], None)
                finished.append((self._ids.pop(key), output, None))
        return finished

    def _run_buffer(self) -> list[Finished]:
        batch, self._buffer = self._buffer, []
        if not batch:
            return []
        try:
            outputs = self._generate(batch)
            return [(i, o, None) for (i, _, _), o in zip(batch, outputs, strict=True)]
        except Exception:
            if len(batch) == 1:
                raise
        results: list[Finished] = []
        for item in batch:  # one bad prompt must not fail the batch: find it
            try:
                [output] = self._generate([item])
                results.append((item[0], output, None))
            except Exception as exc:
                results.append((item[0], None, f"vLLM rejected the prompt: {first_line(exc)}"))
        return results

    def _generate(self, batch: list[tuple[int, list[int], list[int] | None]]) -> list[Any]:
        prompts = [{"prompt_token_ids": ids} for _, ids, _ in batch]
        params = [self._params(i, mask) for i, _, mask in batch]
        return list(self.llm.generate(prompts, params, use_tqdm=False))

    def shutdown(self) -> None:
        """Stop the engine core (best effort; the files are already final)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        with contextlib.suppress(Exception):
            if core is not None:
                core.shutdown()


def start_engine(
    options: ExtractOptions, out_dir: str, *, announce: Callable[[], None] | None = None
) -> VllmEngine:
    """Load the model in vLLM with the connector writing to ``out_dir``.

    Args:
        options: The run's options (model, layers, engine arguments, tokens to generate).
        out_dir: The output directory (absolute).
        announce: Called once the settings are checked and vLLM is imported, right before
            the model loads.

    Raises:
        UsageError: ``options.engine_args`` sets something extract controls.
        RuntimeError: vLLM cannot be imported or started.
    """
    import torch

    on_cpu = not torch.cuda.is_available()
    kwargs = engine_settings(options, out_dir, on_cpu=on_cpu)
    vllm = import_vllm()
    LLM, SamplingParams = vllm.LLM, vllm.SamplingParams  # noqa: N806 - class names
    if announce is not None:
        announce()
    try:
        llm = LLM(model=options.model, **kwargs)
    except Exception as exc:
        raise RuntimeError(f"cannot start vLLM: {first_line(exc)}") from exc

    def params(index: int, loss_mask: list[int] | None) -> Any:
        transfer: dict[str, Any] = {
            "hidden_states_path": sample_name(index),
            "include_output_tokens": options.include_output_tokens,
        }
        if loss_mask is not None:  # the connector stores it (generated tokens get 1)
            transfer["loss_mask"] = loss_mask
        return SamplingParams(
            max_tokens=options.max_tokens,
            temperature=0.0,
            detokenize=False,
            extra_args={"kv_transfer_params": transfer},
        )

    return VllmEngine(llm, params)
