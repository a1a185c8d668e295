"""Every module run in the engine imports without vLLM, except the two that must import it.

Each check runs in a fresh interpreter whose ``sys.meta_path`` refuses ``vllm`` and
every ``vllm.*`` module, so an installed vLLM cannot hide a top-level import.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap

import hidden_state_connector.engine as engine

# The facade subclasses vLLM's connector base, and ``metrics`` its stats type: both only
# ever run inside vLLM.
FACADE = "hidden_state_connector.connector"
NEEDS_VLLM = {FACADE, "hidden_state_connector.engine.metrics"}
ENGINE_MODULES = sorted(
    m.name for m in pkgutil.walk_packages(engine.__path__, prefix=f"{engine.__name__}.")
)
# Launchers, clients and the plugin entry point import vLLM lazily too.
OTHER_MODULES = [
    "hidden_state_connector",
    "hidden_state_connector.plugin",
    "hidden_state_connector.apps.server",
    "hidden_state_connector.layers",
    "hidden_state_connector.client",
    "hidden_state_connector.apps.tiny_model",
    "hidden_state_connector.apps.cli.serve",
    "hidden_state_connector.apps.cli.tiny_model",
    "hidden_state_connector.apps.cli.extract",
    "hidden_state_connector.apps.offline.extract",
]

_PROBE = textwrap.dedent(
    """
    import importlib, json, os, sys

    class NoVllm:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm" or name.startswith("vllm."):
                raise ImportError(f"vLLM is blocked in this test: {name}")
            return None

    if os.environ.get("BLOCK_VLLM") == "1":
        sys.meta_path.insert(0, NoVllm())
    result = {}
    for name in json.loads(sys.argv[1]):
        try:
            importlib.import_module(name)
            result[name] = None
        except ImportError as exc:
            result[name] = str(exc)
    result["vllm loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "vllm")
    print(json.dumps(result))
    """
)


def _import_without_vllm(names: list[str], *, block: bool = True) -> dict[str, object]:
    env = os.environ.copy()  # PYTHONPATH decides which checkout is imported
    env["BLOCK_VLLM"] = "1" if block else "0"
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(names)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_every_in_engine_module_but_the_facade_imports_without_vllm() -> None:
    assert set(ENGINE_MODULES) >= NEEDS_VLLM - {FACADE}  # the list tracks real modules
    assert "hidden_state_connector.engine.write.pipeline" in ENGINE_MODULES  # sub-folders too
    free = [m for m in ENGINE_MODULES if m not in NEEDS_VLLM]
    result = _import_without_vllm(free + OTHER_MODULES)
    failed = {m: why for m, why in result.items() if m != "vllm loaded" and why is not None}
    assert failed == {}
    assert result["vllm loaded"] == []


def test_the_facade_and_its_stats_type_do_need_vllm() -> None:
    result = _import_without_vllm(sorted(NEEDS_VLLM))
    assert all(result[m] is not None and "blocked" in str(result[m]) for m in NEEDS_VLLM)


def test_no_module_but_the_facade_loads_an_installed_vllm() -> None:
    # Importing vLLM's connector base costs about 10 CPU-s: unit tests, benchmarks and the
    # CLIs that import these modules never pay it.
    free = [m for m in ENGINE_MODULES if m not in NEEDS_VLLM]
    result = _import_without_vllm(free, block=False)
    assert all(result[m] is None for m in free)
    assert result["vllm loaded"] == []
