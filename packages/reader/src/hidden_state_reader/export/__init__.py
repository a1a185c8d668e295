"""Compatibility alias: the exporters live in ``hidden_state_reader.apps.export``."""
