"""Exit statuses of the connector's commands (``hidden-state extract``, ``demo``), defined once.

The values match the reader CLI's (``hidden_state_reader.cli.common``) and the shell
convention for Ctrl-C (128 + SIGINT).
"""

EXIT_OK = 0
"""Everything asked for was done."""
EXIT_FAILED = 1
"""The command ran, but something failed (a sample, the engine, the disk)."""
EXIT_USAGE = 2
"""Bad arguments or inputs: nothing was started."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C (SIGINT); the same command resumes."""
