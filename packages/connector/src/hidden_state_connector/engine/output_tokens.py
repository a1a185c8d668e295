"""Whether an engine stores its generated tokens' hidden states right (``include_output_tokens``).

Two engine set-ups capture the prompt right but not the generated tokens, so a sample
with generated tokens is refused there rather than published wrong:

- a model with a recurrent state (``architecture.recurrent_state_refusal``), with the
  extract engine;
- vLLM's async scheduling (on by default for ``extract_hidden_states`` on the GPU; the
  CPU build turns it off). Measured on an H100 with vLLM 0.26: at ``request_finished``
  the rows of the last step's tokens are not in the request's cache blocks (zeros in a
  fresh block, other values in a reused one), also after a full device synchronize and
  in the steps after (docs/connector.md, "Generated tokens need synchronous scheduling").
"""

from __future__ import annotations

from typing import Any

from hidden_state_connector.engine.architecture import recurrent_state_refusal

NO_ASYNC_FLAG = "--no-async-scheduling"


def async_scheduling(vllm_config: Any) -> bool:
    """Whether the engine schedules a step before the previous step's output is known."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(scheduler, "async_scheduling", False))


def output_tokens_refusal(vllm_config: Any, *, forward: bool = False) -> str | None:
    """Why this engine cannot store generated tokens right, or None if it can.

    ``forward``: forward capture, which takes no speculative slot, so a recurrent state
    is advanced only by the model's own tokens (checked on Nemotron-H); and it takes each
    step's rows as they are computed, not from cache blocks at the end, so async
    scheduling does not concern it (checked on an H100 with vLLM 0.26).
    """
    recurrent = None if forward else recurrent_state_refusal(vllm_config)
    if recurrent is not None:
        return recurrent
    if async_scheduling(vllm_config) and not forward:
        return (
            "vLLM's async scheduling does not keep the hidden states of a request's last "
            "generated tokens in its cache blocks, so include_output_tokens is refused; "
            f"start vLLM with {NO_ASYNC_FLAG} (LLM(async_scheduling=False)) to store "
            "generated tokens"
        )
    return None


def check_output_tokens_default(vllm_config: Any, include_output_tokens: bool) -> None:
    """Refuse to start when every request would store generated tokens that come out wrong.

    Raises:
        ValueError: ``include_output_tokens`` is the connector's default and the engine
            schedules asynchronously (the recurrent-state case is refused by
            ``architecture.check_engine_model``).
    """
    if include_output_tokens and async_scheduling(vllm_config):
        raise ValueError(
            "HiddenStateConnector: kv_connector_extra_config.include_output_tokens is true, "
            f"but {output_tokens_refusal(vllm_config)}"
        )
