"""``hidden-state extract``: turn a prompt dataset into hidden-state files with offline vLLM.

Light at import time (the ``hidden-state`` command imports every plugin to build its
help): vLLM, torch and transformers are imported only when the command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from hidden_state_connector.apps.cli.serve import (
    add_arguments,
    add_storage_argument,
    chosen_capture,
    refuse_uncapturable,
    with_storage,
)
from hidden_state_connector.layers import resolve_layers
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    non_negative_float,
    positive_int,
)

PROG = "hidden-state extract"

DESCRIPTION = """\
Run a prompt dataset through offline vLLM and write the hidden states of the chosen
layers, one file per sample: DIR/hs_{index}.safetensors, where index is the record's
position in the input (EAGLE-3 / speculators naming). The default layers are EAGLE-3's
low/middle/high choice; --include-last adds the last layer (pre-norm).

Input (--input): a JSONL file (.gz allowed), a JSON array file, or a Hugging Face dataset
folder saved with save_to_disk (needs the `datasets` package). Each record has one of:
  {"token_ids": [1, 2, 3]}                      used as they are ("input_ids" too)
  {"input_ids": [...], "loss_mask": [0, 1, ...]}
                                                the same, stored with its loss mask
  {"messages": [{"role": "user", "content": ...}, ...]}
                                                rendered with the model's chat template
                                                (ShareGPT "conversations" also accepted);
                                                its loss mask marks the assistant turns
  {"text": "..."}                               tokenized like a vLLM text prompt
Prompts are tokenized here with the model's tokenizer; empty or invalid records and
prompts longer than max_model_len - 1 are recorded as failed without being sent. The
loss mask is stored in each file (Sample.loss_mask; generated tokens count 1).

Each file records the model, its layer count, revision and dtype, the vLLM version and a
CRC32 of its tensor bytes (--no-checksum: none), so `hidden-state verify DIR --checksums`
detects a changed byte and `hidden-state export` can check the captured layers.

Resumable: DIR/manifest.jsonl gets one line per sample once its file is final and
verified. Rerun the same command after a crash or a kill and it continues where it
stopped (files written but not yet recorded are verified, never trusted blindly);
a finished run prints "nothing to do" without starting vLLM.

Output: progress lines and vLLM's logs on stderr (set VLLM_LOGGING_STREAM to change where
vLLM logs); the summary, last, on stdout.

Exit status: 0 all samples ok, 1 some samples failed (listed at the end) or vLLM failed,
2 bad usage (missing input, bad JSON in --engine-args/--connector-config, ...).
"""

EXAMPLES = """\
examples:
  # prefill-only hidden states of layers 2, 16, 29 for a chat dataset
  hidden-state extract meta-llama/Llama-3.1-8B-Instruct --input chats.jsonl \\
      --out /data/hs --layers 2,16,29

  # local model: default EAGLE-3 layers plus the last one, first 1000 records
  hidden-state extract ./my-model --input data.jsonl --out /data/hs --include-last --limit 1000

  # store hidden states as fp8 (about half the disk of bf16; readers dequantize)
  hidden-state extract ./my-model --input data.jsonl --out /data/hs --storage-dtype fp8_e4m3

  # regenerate responses: keep prompt + 255 generated tokens per sample
  hidden-state extract ./my-model --input prompts.jsonl --out /data/hs \\
      --max-tokens 256 --include-output-tokens

  # no CRC32 in the files (default: one per file, computed as it is written)
  hidden-state extract ./my-model --input data.jsonl --out /data/hs --no-checksum

  # a Hugging Face dataset folder, two GPUs, durable files
  hidden-state extract ./my-model --input ./sharegpt_ds --split train --out /data/hs \\
      --engine-args '{"tensor_parallel_size": 2, "gpu_memory_utilization": 0.85}' \\
      --connector-config '{"fsync": true}'

  # after a crash: the same command resumes; retry what failed before
  hidden-state extract ./my-model --input data.jsonl --out /data/hs --retry-failed
"""


def add_extract_arguments(parser: argparse.ArgumentParser) -> None:
    """All options of ``extract`` (shared by the subcommand and ``python -m``)."""
    add_arguments(parser)  # model, --out, --layers, --include-last
    _add_input_and_generation_arguments(parser)
    _add_engine_and_run_arguments(parser)


def _add_input_and_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """``extract``'s prompts (``--input``, ``--split``) and what vLLM generates from them."""
    parser.add_argument(
        "--input",
        "-i",
        required=True,
        metavar="FILE",
        help="JSONL / JSON file or Hugging Face save_to_disk folder of prompts",
    )
    parser.add_argument(
        "--split", metavar="NAME", help="split of a DatasetDict folder (default: train)"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=1,
        metavar="N",
        help="tokens to generate per prompt; 1 = prefill only (default 1)",
    )
    parser.add_argument(
        "--include-output-tokens",
        action="store_true",
        help="also store the hidden states of the generated tokens (all but the last)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=256,
        metavar="N",
        help="requests kept in flight in vLLM (default 256)",
    )
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        metavar="N",
        help="vLLM max_model_len; longer prompts are recorded as failed (default: the model's)",
    )


def _add_engine_and_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``extract``'s engine settings, retries, storage and progress / lock-timeout options."""
    parser.add_argument("--dtype", default="auto", help="vLLM dtype (default auto)")
    parser.add_argument(
        "--limit", type=positive_int, metavar="N", help="only the first N input records"
    )
    parser.add_argument(
        "--retry-failed",
        action="store_true",
        help="retry samples the manifest records as failed (default: skip them)",
    )
    parser.add_argument(
        "--engine-args",
        default="{}",
        metavar="JSON",
        help="more vllm.LLM arguments as a JSON object (or @file.json), e.g. "
        "'{\"tensor_parallel_size\": 2}'",
    )
    parser.add_argument(
        "--connector-config",
        default="{}",
        metavar="JSON",
        help="more kv_connector_extra_config keys as a JSON object (or @file.json), e.g. "
        "'{\"fsync\": true}'",
    )
    add_storage_argument(parser)
    parser.add_argument(
        "--progress-interval",
        type=non_negative_float,
        default=1.0,
        metavar="S",
        help="seconds between progress lines on stderr (default 1)",
    )
    parser.add_argument(
        "--lock-timeout",
        type=non_negative_float,
        default=600.0,
        metavar="S",
        help="seconds to wait for one file to be written before failing it (default 600)",
    )


def register(subparsers: Any) -> None:
    """Add the ``extract`` subcommand."""
    parser = subparsers.add_parser(
        "extract",
        help="write hidden states of a prompt dataset with offline vLLM (resumable)",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_extract_arguments(parser)
    parser.set_defaults(func=run, handler=run)


def parse_json_object(option: str, text: str) -> dict[str, Any]:
    """Parse ``--engine-args`` / ``--connector-config``: a JSON object or ``@file``.

    Raises:
        hidden_state_connector.apps.offline.UsageError: Naming the option (and file).
    """
    from hidden_state_connector.apps.offline.errors import UsageError

    where = option
    if text.startswith("@"):
        path = text[1:]
        where = f"{option} {path}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UsageError(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{where}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def run(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Run ``extract``; returns the exit status (0 ok, 1 failed samples, 2 bad usage)."""
    from hidden_state_connector.apps.offline.errors import UsageError

    err = stream or sys.stderr
    _vllm_logs_to_stderr()
    try:
        options = _options(args)
        from hidden_state_connector.apps.offline.extract import run_extract

        result = run_extract(options, err)
    except (UsageError, CliError) as exc:  # CliError: from resolve_layers
        print(f"{PROG}: error: {exc}", file=err, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; run the same command again to resume", file=err)
        return EXIT_INTERRUPTED
    except Exception as exc:  # vLLM would not start, the disk failed, ...
        print(f"{PROG}: error: {exc}", file=err, flush=True)
        return EXIT_FAILED
    _print_summary(result, sys.stdout)
    if result.error is not None:
        print(
            f"{PROG}: error: {result.error}\n  (samples in flight were not recorded; run the "
            "same command again to redo them)",
            file=err,
            flush=True,
        )
        return EXIT_FAILED
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if result.failures else EXIT_OK


def _vllm_logs_to_stderr() -> None:
    """Send vLLM's logs to stderr (its default is stdout), where the progress lines go.

    stdout is for the summary, which must be the last thing there. The variable reaches
    vLLM's engine processes too; a user who set ``VLLM_LOGGING_STREAM`` keeps it. If vLLM
    was already imported in this process, its handlers are moved as well.
    """
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if os.environ["VLLM_LOGGING_STREAM"] != "ext://sys.stderr" or "vllm" not in sys.modules:
        return
    import logging

    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def _options(args: argparse.Namespace) -> Any:
    from hidden_state_connector.apps.offline.errors import UsageError
    from hidden_state_connector.apps.offline.settings import ExtractOptions

    if not os.path.exists(args.input):
        raise UsageError(f"--input {args.input}: no such file or directory")
    engine_args = parse_json_object("--engine-args", args.engine_args)
    connector_config = with_storage(
        parse_json_object("--connector-config", args.connector_config),
        args.storage_dtype,
        checksum=args.checksum,
    )
    capture = chosen_capture(args.capture, connector_config)
    layers = resolve_layers(args.model, args.layers, args.include_last)
    refuse_uncapturable(args.model, "hidden-state extract", capture)
    return ExtractOptions(
        capture=capture,
        model=args.model,
        input=args.input,
        out_dir=args.out,
        layers=layers,
        max_tokens=args.max_tokens,
        include_output_tokens=args.include_output_tokens,
        batch_size=args.batch_size,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        limit=args.limit,
        split=args.split,
        retry_failed=args.retry_failed,
        engine_args=engine_args,
        connector_config=connector_config,
        lock_timeout=args.lock_timeout,
        progress_interval=args.progress_interval,
    )


def _print_summary(result: Any, out: TextIO) -> None:
    from hidden_state_connector.apps.offline.progress import format_duration
    from hidden_state_reader.apps.cli.toolkit import format_bytes, format_si

    skipped = result.skipped_ok + result.skipped_failed
    if result.nothing_to_do:
        print(
            f"nothing to do: all {result.total:,} samples of {result.input_description} are "
            f"recorded in {result.manifest_path} ({result.skipped_ok:,} ok, "
            f"{result.skipped_failed:,} failed)",
            file=out,
        )
        if result.skipped_failed:
            print("  (rerun with --retry-failed to retry the failed ones)", file=out)
        out.flush()
        return
    seconds = result.engine_seconds
    heading = "interrupted" if result.interrupted else "stopped" if result.error else "done"
    lines = [
        f"{heading}: {result.ok:,} ok "
        f"({result.computed:,} written, {result.recovered:,} already on disk), "
        f"{len(result.failures):,} failed, {skipped:,} skipped "
        f"(of {result.total:,} records in {result.input_description})",
        f"  tokens {result.tokens:,}, bytes {format_bytes(result.bytes)} in {result.out_dir}",
    ]
    if seconds > 0 and result.computed:
        lines.append(
            f"  throughput {result.computed / seconds:.1f} samples/s, "
            f"{format_si(result.tokens / seconds)} tok/s, {result.bytes / seconds / 1e6:.1f} MB/s "
            f"over {format_duration(seconds)} (wall {format_duration(result.wall_seconds)})"
        )
    if result.redone:
        lines.append(f"  {result.redone:,} file(s) on disk did not check out and were redone")
    if result.skipped_failed:
        lines.append(
            f"  {result.skipped_failed:,} sample(s) failed in earlier runs were skipped "
            "(--retry-failed retries them)"
        )
    if result.failures:
        lines.append(f"failed samples ({len(result.failures):,}):")
        lines += [f"  #{index}: {reason}" for index, reason in sorted(result.failures)]
    lines.append(f"manifest: {result.manifest_path}")
    print("\n".join(lines), file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hidden_state_connector.apps.cli.extract [extract] MODEL --input ... --out``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["extract"]:
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_extract_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
