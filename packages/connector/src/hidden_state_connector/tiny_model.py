"""Compatibility alias: the tiny test model lives in ``hidden_state_connector.apps.tiny_model``.

Kept so the documented ``from hidden_state_connector.tiny_model import build_tiny_model``
keeps working; it re-exports only (an application module, like everything under ``apps``).
"""

from hidden_state_connector.apps.tiny_model import build_tiny_model

__all__ = ["build_tiny_model"]
