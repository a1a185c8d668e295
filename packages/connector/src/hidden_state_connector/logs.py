"""Loggers for code that runs inside vLLM processes.

vLLM configures the ``vllm`` logger (handler, format, ``VLLM_LOGGING_LEVEL``) in every
process it starts; loggers named ``vllm.*`` inherit that, so the connector's INFO lines
(start-up summary, progress, shutdown) appear in the server log like vLLM's own.
"""

from __future__ import annotations

import logging


def get_logger(module: str) -> logging.Logger:
    """Logger for a connector module, under vLLM's logging configuration."""
    return logging.getLogger(f"vllm.{module}")
