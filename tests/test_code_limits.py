"""The developers' guide's size and style limits on the package sources, kept true.

Read from the source (``ast``, ``tokenize``) of every module under ``packages/*/src``: no
function or method over 60 lines, no class over 250 (decorators excluded, docstrings
included), no module docstring over 25 lines, and at most a handful of measured figures
(GB/s, MB/s, "measured", H200, times in ms or µs) in docstrings and comments: those go
in docs/benchmarks.md or the docs' prose, where they can be kept current. Strings the
code prints (a progress line's "MB/s") are not docstrings and do not count.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))

MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250
MAX_MODULE_DOCSTRING_LINES = 25
MAX_MEASURED_FIGURES = 5
MEASURED_FIGURE = re.compile(r"GB/s|MB/s|GiB/s|\bmeasured\b|\bH200\b|\d ?(?:ms|µs)\b", re.I)


def checked_sources() -> list[tuple[str, str]]:
    """``(path relative to the repository, source)`` of every module held to the limits."""
    return [(str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")) for path in SOURCES]


def lines_of(node: ast.stmt | ast.expr) -> int:
    """Source lines a definition or expression spans."""
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def docstring_of(node: ast.AST) -> ast.Constant | None:
    """The docstring of a module, class or function, else None."""
    if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    first = node.body[0] if node.body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return first.value
    return None


def docstrings(tree: ast.Module) -> Iterator[ast.Constant]:
    """Every module, class and function docstring of ``tree``."""
    for node in ast.walk(tree):
        docstring = docstring_of(node)
        if docstring is not None:
            yield docstring


def comments(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of every comment of ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_the_sources_are_found() -> None:
    assert len(checked_sources()) > 100, SOURCES[:3]


def test_no_function_or_class_over_its_limit() -> None:
    too_long = []
    for name, source in checked_sources():
        for node in ast.walk(ast.parse(source, name)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_FUNCTION_LINES
            elif isinstance(node, ast.ClassDef):
                limit = MAX_CLASS_LINES
            else:
                continue
            if lines_of(node) > limit:
                too_long.append(f"{name}:{node.lineno} {node.name}: {lines_of(node)} > {limit}")
    assert not too_long, "\n".join(too_long)


def test_no_module_docstring_over_its_limit() -> None:
    too_long = []
    for name, source in checked_sources():
        docstring = docstring_of(ast.parse(source, name))
        if docstring is not None and lines_of(docstring) > MAX_MODULE_DOCSTRING_LINES:
            too_long.append(f"{name}: {lines_of(docstring)} lines")
    assert not too_long, "\n".join(too_long)


def test_at_most_a_handful_of_measured_figures_in_docstrings_and_comments() -> None:
    found = []
    for name, source in checked_sources():
        for docstring in docstrings(ast.parse(source, name)):
            for offset, line in enumerate(str(docstring.value).splitlines()):
                if MEASURED_FIGURE.search(line):
                    found.append(f"{name}:{docstring.lineno + offset}: {line.strip()}")
        for line_number, text in comments(source):
            if MEASURED_FIGURE.search(text):
                found.append(f"{name}:{line_number}: {text.strip()}")
    assert len(found) <= MAX_MEASURED_FIGURES, "move these into docs/*.md:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for() -> None:
    """Each check finds its target in a sample source (so a passing run means something)."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f'"""Doc\n{"line" + chr(10)}"""\n\ndef f() -> None:\n{long_body}\n')
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert lines_of(function) == MAX_FUNCTION_LINES + 1
    module_docstring = docstring_of(tree)
    assert module_docstring is not None and lines_of(module_docstring) == 3
    assert MEASURED_FIGURE.search("runs at 13 GB/s")
    assert MEASURED_FIGURE.search("took 30 ms per slab")
    assert MEASURED_FIGURE.search("Measured on the benchmark machine")
    assert not MEASURED_FIGURE.search("the items of the batch")
    assert list(comments("x = 1  # measured 4 GB/s\n")) == [(1, "# measured 4 GB/s")]
