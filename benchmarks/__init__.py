"""Benchmarks of the hidden-state connector and reader: ``python -m benchmarks --help``.

Each benchmark is one module with ``NAME``, ``TITLE``, ``run(ctx) -> dict`` and
``render(result) -> str``; ``benchmarks.__main__`` runs them and writes
``docs/benchmarks.md`` and ``docs/benchmarks.json``. Importing this package is cheap
(no torch, no vLLM): vLLM's engine processes import it again when they load the
benchmark's null-sink connectors.
"""

BENCHMARKS = (
    "server",
    "write",
    "reader",
    "latency",
    "scale",
    "dataloader",
    "completion_order",
    "release",
    "fp8",
    "store",
    "cli_startup",
    "watchers",
    "loaders",
    "locks",
    "consume",
    "claims",
    "loader_feed",
)
"""Benchmark names, in run order (each is the module ``benchmarks.<name>``)."""
