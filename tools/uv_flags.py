"""Print the ``uv pip install`` flags that carry over this machine's pip configuration.

    python tools/uv_flags.py            # e.g. --find-links /opt/wheels --constraint ...

``make install`` installs with uv (vLLM's ~150 packages in about a third of pip's time),
but uv reads no pip configuration. Machines often keep local wheels, mirrors or version
caps there (``pip config list``: this project's CI machine keeps its CPU torch wheel in a
``find-links`` folder), so the Makefile hands them to uv with these flags. Keys read, from
``PIP_*`` variables and pip's config files alike: ``index-url``, ``extra-index-url``,
``find-links``, ``constraint``, ``no-index`` and ``cert`` (uv then trusts the system's
certificate store, ``--native-tls``). Several indexes are merged the way pip merges
them (``--index-strategy unsafe-best-match``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

# pip config key -> uv flag; values may hold several space-separated entries.
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings(python: str) -> dict[str, str]:
    """The values pip is configured with, by key (``PIP_*`` variables win over files, as in pip)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                         text=True, check=False).stdout  # fmt: skip
    settings: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        scope, _, key = name.rpartition(".")
        target = env if scope == ":env:" else settings
        target[key] = value.strip().strip("'\"")
    settings.update(env)
    return settings


def uv_flags(settings: dict[str, str]) -> list[str]:
    """The uv flags for pip's ``settings``."""
    flags: list[str] = []
    for key, flag in FLAGS.items():
        for value in settings.get(key, "").split():
            flags += [flag, value]
    if settings.get("no-index", "").lower() in {"1", "true", "yes", "on"}:
        flags.append("--no-index")
    if settings.get("cert"):
        flags.append("--native-tls")
    if "--extra-index-url" in flags or "--find-links" in flags:
        flags += ["--index-strategy", "unsafe-best-match"]
    return flags


def main() -> None:
    """Print the flags for the pip of ``--python`` (default: this interpreter)."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example: python tools/uv_flags.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter whose pip to ask")
    args = parser.parse_args()
    print(" ".join(uv_flags(pip_settings(args.python))))


if __name__ == "__main__":
    main()
