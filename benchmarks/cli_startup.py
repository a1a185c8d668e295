"""CLI start-up: wall time of ``hidden-state`` commands that must answer at once.

``--help``, ``--version`` and argument errors of every subcommand import nothing heavy
(torch, vLLM, transformers and datasets load lazily, when a command really runs), so
they answer in a fraction of a second. Each command runs as a fresh process, as a user
types it, through the installed ``hidden-state`` entry point's module
(``python -m hidden_state_reader.apps.cli.main``); runs interleaved, median and worst.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

from benchmarks.common import Context, goal, log, median, table

NAME = "cli_startup"
TITLE = "11. CLI start-up (--help, --version, argument errors)"
GOAL_S = 0.5
COMMANDS: dict[str, list[str]] = {
    "hidden-state --help": ["--help"],
    "hidden-state --version": ["--version"],
    "hidden-state serve --help": ["serve", "--help"],
    "hidden-state extract --help": ["extract", "--help"],
    "hidden-state export --help": ["export", "--help"],
    "hidden-state ls (no directory: exit 2)": ["ls"],
    "hidden-state serve --layers x (bad value: exit 2)": ["serve", "m", "--layers", "x"],
}
ENTRY = [sys.executable, "-m", "hidden_state_reader.apps.cli.main"]


def _time_once(args: list[str]) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=120)
    return time.perf_counter() - started, done.returncode


def run(ctx: Context) -> dict[str, Any]:
    rounds = ctx.pick(3, 9)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    codes: dict[str, int] = {}
    _time_once(["--version"])  # page cache warm, as for a user's second command
    for r in range(rounds):
        for name, args in COMMANDS.items():
            seconds, codes[name] = _time_once(args)
            times[name].append(seconds)
        log(f"{NAME}: round {r + 1}/{rounds} done")
    rows = [
        {"command": name, "exit": codes[name], "median_s": median(t), "max_s": max(t)}
        for name, t in times.items()
    ]
    worst = max(r["median_s"] for r in rows)
    return {
        "setup": {"rounds": rounds, "python": sys.version.split()[0]},
        "rows": rows,
        "goals": [
            goal(
                "slowest CLI start-up (median over runs)",
                worst,
                GOAL_S,
                higher_is_better=False,
                unit="s",
            )
        ],
    }


def render(res: dict[str, Any]) -> str:
    s = res["setup"]
    return "\n".join(
        [
            f"Each command a fresh process (Python {s['python']}), {s['rounds']} interleaved "
            "runs, warm page cache:",
            "",
            table(
                ["command", "exit status", "median s", "max s"],
                [[r["command"], r["exit"], r["median_s"], r["max_s"]] for r in res["rows"]],
            ),
        ]
    )
