"""Helpers of the speculative forward-capture tests: drafter settings and prompts.

The tiny EAGLE-3 drafter is ``hidden_state_connector.apps.tiny_drafter.build_tiny_eagle3``
(the GPU sweep, ``benchmarks/gpu/verify.py``, builds it too).
"""

from __future__ import annotations

from typing import Any

NGRAM_TOKENS = 3


def ngram(k: int = NGRAM_TOKENS) -> dict[str, Any]:
    """vLLM's ``speculative_config`` of prompt-lookup (ngram) drafting of ``k`` tokens."""
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations repeat them, so ngram drafts get accepted."""
    return [list(range(10, 18)) * 12, [40, 41, 42] * 20 + [7], [5, 9] * 30]
