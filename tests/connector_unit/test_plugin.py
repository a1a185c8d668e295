"""The plugin (``plugin.py``) as installed: declared under ``vllm.general_plugins``."""

from __future__ import annotations


def test_the_plugin_is_declared_as_a_vllm_entry_point() -> None:
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "hidden_state_connector.plugin:register" in names
