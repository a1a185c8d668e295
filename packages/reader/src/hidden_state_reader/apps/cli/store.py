"""``hidden-state store-master`` and ``store-host``: a local Mooncake Store in two commands.

Both run the binaries of the installed Mooncake wheel (``mooncake_master``,
``mooncake_client``) in the foreground with the flags this project's store backend
expects. The command *becomes* the binary (``exec``), so its pid is the binary's: Ctrl-C,
``kill PID`` (SIGTERM) or a supervisor's stop reach it directly and nothing is left
behind holding the port. For production, run the binaries under your supervisor
(``docs/scale-out.md``); ``--dry-run`` prints the command to copy.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from typing import Any

from hidden_state_reader.apps.cli.toolkit import EXIT_OK, CliError, add_command


def register(subparsers: Any) -> None:
    """Add ``store-master`` and ``store-host``."""
    p = add_command(
        subparsers,
        "store-master",
        summary="run a Mooncake Store master (scale-out without a shared filesystem)",
        description="Run mooncake_master in the foreground: the directory of a Mooncake "
        "Store. Producers (vLLM\nwith storage_backend=mooncake) and readers "
        "(mooncake://HOST:PORT/PREFIX) connect to it.\nIt holds no sample data: "
        "segment hosts (`hidden-state store-host`) or readers with ?segment= do.\n"
        "The command becomes mooncake_master (same pid): stop it with Ctrl-C or "
        "`kill PID` (SIGTERM).",
        examples="""
hidden-state store-master --host 127.0.0.1 --port 50051
hidden-state store-master --host 0.0.0.0 --port 50051 --dry-run""",
        handler=run_master,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="RPC port")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    h = add_command(
        subparsers,
        "store-host",
        summary="host Mooncake Store memory next to the trainers",
        description="Run mooncake_client in the foreground: contributes SIZE of memory to "
        "the store, so samples\nsurvive restarts of vLLM and of the trainers (neither needs "
        "to host any).\nThe command becomes mooncake_client (same pid): stop it with "
        "Ctrl-C or `kill PID` (SIGTERM);\nthe samples in its memory are gone then.",
        examples="""
hidden-state store-host --master 127.0.0.1:50051 --size 8GB
hidden-state store-host --master 10.0.0.5:50051 --hostname 10.0.0.7 --size 64GB""",
        handler=run_host,
    )
    h.add_argument("--master", default="127.0.0.1:50051", help="host:port of the master")
    h.add_argument("--size", default="4GB", help="memory to host (e.g. 512MB, 8GB)")
    h.add_argument("--hostname", default="127.0.0.1", help="address other clients reach")
    h.add_argument("--port", type=int, default=50060, help="this client's service port")
    h.add_argument("--metadata", default="P2PHANDSHAKE", help="transfer metadata server")
    h.add_argument("--dry-run", action="store_true", help="print the command, run nothing")


def _binary(name: str) -> str:
    beside = os.path.join(os.path.dirname(sys.executable), name)
    found = beside if os.path.exists(beside) else shutil.which(name)
    if not found:
        raise CliError(
            f"{name} not found: pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "(and apt-get install -y libibverbs1)"
        )
    return found


def _run(argv: list[str], dry_run: bool) -> int:
    """Print ``argv`` (dry run), or replace this process with it.

    A child process would outlive a launcher stopped by SIGTERM (and keep the port);
    as the same process there is no launcher to outlive.
    """
    if dry_run:
        print(shlex.join(argv))
        return EXIT_OK
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
    return EXIT_OK  # not reached


def run_master(args: argparse.Namespace) -> int:
    """Run (or print) ``mooncake_master``."""
    argv = [_binary("mooncake_master"), f"--rpc_address={args.host}", f"--rpc_port={args.port}"]
    return _run(argv, args.dry_run)


def run_host(args: argparse.Namespace) -> int:
    """Run (or print) ``mooncake_client`` hosting ``--size`` of store memory."""
    argv = [
        _binary("mooncake_client"),
        f"--global_segment_size={args.size}",
        f"--master_server_address={args.master}",
        f"--metadata_server={args.metadata}",
        f"--host={args.hostname}",
        f"--port={args.port}",
    ]
    return _run(argv, args.dry_run)
