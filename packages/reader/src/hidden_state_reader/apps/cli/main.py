"""Entry point of the ``hidden-state`` command: argument parsing, plugins, exit codes.

Built-in subcommands: ``ls``, ``stats`` (``cli.listing``), ``inspect`` (``cli.inspect``),
``verify``, ``clean`` (``cli.verify``), ``tail`` (``cli.tail``), ``export``
(``cli.export``), ``store-master`` and ``store-host`` (``cli.store``).

Plugins: another installed distribution adds subcommands through the entry-point group
``hidden_state.cli`` (the contract: ``load_plugins``); a broken plugin is skipped, never
breaking the built-in commands (``hidden-state -v ...`` says why).

Exit status: 0 success, 1 problems found (``verify``) or a runtime failure, 2 bad usage
or bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any

from hidden_state_reader import __version__
from hidden_state_reader.apps.cli import export, inspect, listing, store, tail, verify
from hidden_state_reader.apps.cli.common import EXIT_PROBLEMS, PROG
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    CliError,
    HelpFormatter,
)
from hidden_state_reader.errors import HiddenStateError
from hidden_state_reader.files.flockwait import install_wake_handler

PLUGIN_GROUP = "hidden_state.cli"
"""Entry-point group through which other packages add subcommands."""

BUILTIN_COMMANDS: tuple[Callable[[Any], None], ...] = (
    listing.register,
    inspect.register,
    verify.register,
    tail.register,
    export.register,
    store.register,
)

log = logging.getLogger("hidden_state_reader.apps.cli")

_DESCRIPTION = """\
Inspect, verify, follow and export directories of LLM hidden-state samples
(NAME.safetensors + NAME.safetensors.lock, format v1).
"""

_EPILOG = """\
examples:
  hidden-state ls /data/hs
  hidden-state stats /data/hs --json
  hidden-state inspect /data/hs/hs_0.safetensors --verify
  hidden-state verify /data/hs --checksums
  hidden-state clean /data/hs --dry-run
  hidden-state tail /data/hs --idle-timeout 60
  hidden-state export --format speculators /data/hs /data/spec

Run `hidden-state COMMAND --help` for the options of each command.
exit status: 0 ok, 1 problems found or runtime failure, 2 bad usage or input.
"""


def load_plugins(subparsers: Any, group: str = PLUGIN_GROUP) -> list[str]:
    """Let every installed ``hidden_state.cli`` plugin add its subcommands.

    Each entry point of ``group`` names a callable ``register(subparsers) -> None``
    that adds its subcommand(s) to the ``argparse`` subparsers object and sets the handler::

        # pyproject.toml
        [project.entry-points."hidden_state.cli"]
        serve = "my_package.cli:register"

        # my_package/cli.py
        def register(subparsers):
            p = subparsers.add_parser("serve", help="...", description="...")
            p.add_argument("--port", type=int, default=8000)
            p.set_defaults(handler=run)  # run(args: argparse.Namespace) -> int | None

    ``hidden_state_reader.apps.cli.toolkit.add_command`` does the same with the house style
    (description, examples epilog, handler). A handler returns the exit status (None means
    0) and raises ``hidden_state_reader.apps.cli.toolkit.CliError`` for bad input (one line, exit
    status 2). A plugin that fails to import or register is skipped, so a broken plugin
    never breaks the built-in commands; run ``hidden-state -v ...`` to see why.

    Args:
        subparsers: The ``argparse`` subparsers object to add to.
        group: The entry-point group.

    Returns:
        Names of the entry points that registered successfully.
    """
    loaded: list[str] = []
    try:
        eps = sorted(entry_points(group=group), key=lambda ep: ep.name)
    except Exception as exc:  # a broken installation must not break the CLI
        log.debug("cannot list %s entry points: %s", group, exc)
        return loaded
    for ep in eps:
        try:
            register = ep.load()
        except Exception as exc:
            log.debug("skipping CLI plugin %s (%s): cannot import: %r", ep.name, ep.value, exc)
            continue
        try:
            register(subparsers)
        except Exception as exc:
            log.debug("skipping CLI plugin %s (%s): register failed: %r", ep.name, ep.value, exc)
            continue
        loaded.append(ep.name)
    return loaded


def version_text(plugin_dists: Sequence[tuple[str, str]] = ()) -> str:
    """What ``hidden-state --version`` prints: this package's version, then each plugin's.

    Args:
        plugin_dists: ``(distribution name, version)`` of the packages whose
            ``hidden_state.cli`` plugins registered (e.g. ``hidden-state-connector``).

    Returns:
        One ``NAME VERSION`` line per package, the reader first.
    """
    lines = [f"hidden-state-reader {__version__}"]
    lines += [f"{name} {ver}" for name, ver in plugin_dists if name != "hidden-state-reader"]
    return "\n".join(lines)


def _plugin_dists(loaded: Sequence[str], group: str = PLUGIN_GROUP) -> list[tuple[str, str]]:
    """The distributions (name, version) behind the plugins that registered, deduplicated."""
    found: dict[str, str] = {}
    try:
        eps = entry_points(group=group)
    except Exception:  # a broken installation must not break --version
        return []
    for ep in eps:
        dist = getattr(ep, "dist", None)
        if ep.name in loaded and dist is not None:
            found.setdefault(dist.metadata["Name"], dist.version)
    return sorted(found.items())


def build_parser(*, plugins: bool = True) -> argparse.ArgumentParser:
    """The full argument parser: global options, built-in commands, plugins.

    Args:
        plugins: Also load ``hidden_state.cli`` plugins.

    Returns:
        The parser; parsed arguments carry ``handler`` for the chosen subcommand.
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=HelpFormatter,
    )
    # The text is filled in once the plugins are known, so it names their packages too.
    version = parser.add_argument("--version", action="version", version=version_text())
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="debug logging on stderr (also shows why a plugin was skipped)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for register in BUILTIN_COMMANDS:
        register(subparsers)
    if plugins:
        loaded = load_plugins(subparsers)
        version.version = version_text(_plugin_dists(loaded))  # type: ignore[attr-defined]
    return parser


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"{PROG}: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_hidden_state_cli", False)]:
        root.removeHandler(old)
    handler._hidden_state_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)


def _early_verbose(argv: Sequence[str]) -> bool:
    """``-v`` before the subcommand, seen before plugins load (their errors are logged)."""
    for token in argv:
        if not token.startswith("-"):
            return False
        if token in ("-v", "--verbose"):
            return True
    return False


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``hidden-state`` command.

    Args:
        argv: Arguments without the program name; default ``sys.argv[1:]``.

    Returns:
        The exit status.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    _setup_logging(_early_verbose(args_list))
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, usage errors (status 2)
        return _exit_code(exc.code)
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:
        print(
            f"{PROG}: error: command {args.command!r} is not available "
            "(its plugin did not register a handler; run with -v for details)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # Run here, on the main thread, so that lock waits on a command's helper threads (the
    # connector's extract verifies on a thread pool) can sleep in flock with deadlines.
    install_wake_handler()
    try:
        rc = handler(args)
    except CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as exc:  # a handler's sys.exit(...) / parser.error(...)
        return _exit_code(exc.code)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of our output went away (`hidden-state ls DIR | head`).
        _silence_stdout()
        return EXIT_PROBLEMS
    except (HiddenStateError, OSError) as exc:
        log.debug("%s failed", args.command, exc_info=True)
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        path_problem = isinstance(
            exc, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
        )
        return EXIT_USAGE if path_problem else EXIT_PROBLEMS
    return 0 if rc is None else int(rc)


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
