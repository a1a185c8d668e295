"""``hidden-state demo``: a live vLLM server streaming hidden states into a training loop.

Also runnable as ``python -m hidden_state_connector.apps.cli.demo``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from hidden_state_connector.apps.cli.arguments import layers_argument
from hidden_state_connector.apps.server import CAPTURES
from hidden_state_reader.apps.cli.toolkit import positive_float, positive_int

DESCRIPTION = """\
A live vLLM server streaming hidden states into a training loop, in one command.

Starts `vllm serve` with the HiddenStateConnector, sends prompts through the OpenAI
API (a producer thread, bounded concurrency), and at the same time trains a small
EAGLE-style draft head on the hidden states as they are written: a follow-mode,
claiming HiddenStateReader feeds a torch DataLoader, and every file is deleted once
it has been trained on. Progress goes to stderr every second; at the end a summary
table is printed and OUT/summary.json and OUT/loss.png are written.

Without arguments nothing is downloaded: a tiny random bf16 Llama is built once
(under --cache-dir) and 300 bundled English prompts are sent.

Exit status: 0 when every prompt became exactly one trained-on sample and no file
was left behind; 1 on any failure (server start, failed requests, lost or duplicated
samples, files left); 2 for bad options; 130 when interrupted (Ctrl-C stops cleanly,
a second Ctrl-C exits at once).
"""

EXAMPLES = """\
examples:
  hidden-state demo                                   # tiny model, 300 bundled prompts
  hidden-state demo --num-prompts 50 --out /tmp/demo  # a quicker run elsewhere
  hidden-state demo --model ./Llama-3.2-1B --layers 2,8,13 --prompts my.jsonl
  hidden-state demo --keep-files                      # keep the files in OUT/hs
  hidden-state demo --model ./my-model -- --max-num-seqs 16   # extra vllm serve arguments
  make demo DEMO_ARGS="--num-prompts 100"
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    _add_model_and_data_arguments(parser)
    _add_serving_and_training_arguments(parser)


def _add_model_and_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's model, layers, prompts and output folder."""
    from hidden_state_connector.apps.demo.options import DEFAULT_NUM_PROMPTS, DEFAULT_OUT

    parser.add_argument(
        "--model",
        help="local Hugging Face model directory (default: the built-in tiny random Llama)",
    )
    parser.add_argument(
        "--layers",
        type=layers_argument,
        help="layer ids to capture, e.g. 2,16,29 (default: 1,2,4 for the tiny model, else "
        "EAGLE-3's low/middle/high layers from config.json)",
    )
    parser.add_argument(
        "--capture",
        choices=CAPTURES,
        default=CAPTURES[0],
        help="the capture engine: forward (default) or extract (vLLM's extract_hidden_states)",
    )
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        help='JSONL file, one {"text": ...} per line (default: bundled)',
    )
    parser.add_argument(
        "--num-prompts",
        type=positive_int,
        default=DEFAULT_NUM_PROMPTS,
        metavar="N",
        help="prompts to send; the file is repeated if shorter (default: %(default)s)",
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    parser.add_argument(
        "--keep-files",
        action="store_true",
        help="keep the consumed hidden-state files in OUT/hs instead of deleting them "
        "(OUT/hs is emptied when a run starts)",
    )


def _add_serving_and_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's server, training loop and output options, and vLLM's further arguments."""
    from hidden_state_connector.apps.demo.options import DEFAULT_CACHE_DIR, DemoOptions

    d = DemoOptions()
    parser.add_argument("--port", type=positive_int, help="server port (default: a free port)")
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=d.concurrency,
        help="requests in flight at most (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=d.batch_size,
        help="samples per training batch (default: %(default)s)",
    )
    parser.add_argument(
        "--steps-per-batch",
        type=positive_int,
        default=d.steps_per_batch,
        help="optimizer steps on each batch (default: %(default)s)",
    )
    parser.add_argument(
        "--lr", type=positive_float, default=d.lr, help="Adam learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--device", help="torch device of the draft head (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--cache-dir",
        default=DEFAULT_CACHE_DIR,
        help="where the tiny model is built once (default: %(default)s)",
    )
    parser.add_argument(
        "--server-timeout",
        type=positive_float,
        default=d.server_timeout,
        metavar="S",
        help="seconds to wait for the server to start (default: %(default)s)",
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="no progress lines, only the summary"
    )
    parser.add_argument(
        "vllm_args", nargs=argparse.REMAINDER, help="-- then further vllm serve arguments"
    )


def register(subparsers: Any) -> None:
    """Add the ``demo`` subcommand."""
    parser = subparsers.add_parser(
        "demo",
        help="live vLLM server -> hidden-state files -> training loop, in one command",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run, handler=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; print the summary table on stdout.

    Returns:
        0 on success, 1 on any failure, 2 for unusable options, 130 when interrupted.
    """
    from hidden_state_connector.apps.demo.options import DemoError, DemoOptions
    from hidden_state_connector.apps.demo.report import format_table
    from hidden_state_connector.apps.demo.run import run_demo
    from hidden_state_reader.apps.cli.toolkit import EXIT_INTERRUPTED

    options = DemoOptions(
        capture=args.capture,
        model=args.model,
        layers=args.layers,
        prompts=args.prompts,
        num_prompts=args.num_prompts,
        out=args.out,
        keep_files=args.keep_files,
        port=args.port,
        concurrency=args.concurrency,
        batch_size=args.batch_size,
        steps_per_batch=args.steps_per_batch,
        lr=args.lr,
        device=args.device,
        cache_dir=args.cache_dir,
        server_timeout=args.server_timeout,
        progress=not args.quiet,
        vllm_args=[a for a in args.vllm_args if a != "--"],
    )
    try:
        summary = run_demo(options)
    except DemoError as exc:
        print(f"hidden-state demo: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(summary), flush=True)
    if summary.interrupted:
        return EXIT_INTERRUPTED
    return 0 if summary.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hidden_state_connector.apps.cli.demo [options]``."""
    logging.basicConfig(
        level=logging.WARNING, format="hidden-state demo: %(levelname)s: %(message)s"
    )
    parser = argparse.ArgumentParser(
        prog="python -m hidden_state_connector.apps.cli.demo",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
