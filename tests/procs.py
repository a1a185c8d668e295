"""Helpers for tests that run several processes at once."""

from __future__ import annotations

import subprocess
from collections.abc import Callable


def start_together(
    procs: list[tuple[subprocess.Popen[str], str]],
    before_go: Callable[[], object] | None = None,
) -> None:
    """Wait until each process has printed its line, then send every one "go".

    Starting a Python process that imports torch takes seconds on a loaded machine;
    tests whose processes must run at the same time (or whose readers have idle
    timeouts) start them with a line on stdin instead of relying on start-up times.

    Args:
        procs: Each process (started with stdin and stdout pipes, text mode) and the line
            it prints once it is loaded.
        before_go: Called once all are loaded, just before "go" is sent.
    """
    try:
        for proc, line in procs:
            assert proc.stdout is not None
            said = proc.stdout.readline().strip()
            if said != line:
                proc.kill()
                _, err = proc.communicate()
                raise AssertionError(f"expected {line!r}, got {said!r}; stderr:\n{err}")
        if before_go is not None:
            before_go()
        for proc, _ in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
    except BaseException:
        for proc, _ in procs:
            proc.kill()
        raise
