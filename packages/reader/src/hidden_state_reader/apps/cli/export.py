"""``hidden-state export``: turn a hidden-state directory into another trainer's layout.

Start-up stays light: the export (torch, ``datasets``) is imported when the command runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from hidden_state_reader.apps.cli.common import (
    PROG,
    add_grace_argument,
    add_progress_argument,
    print_json,
    progress_for_args,
)
from hidden_state_reader.apps.cli.toolkit import (
    EXIT_FAILED,
    EXIT_OK,
    CliError,
    add_command,
    non_negative_float,
)
from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:
    from hidden_state_reader.apps.export.outcome import ExportResult

log = logging.getLogger(__name__)

FORMATS = ("speculators",)
MASK_RULES = ("generated", "all")

_DESCRIPTION = """\
Export the complete samples of SRC into DST, in the layout a trainer reads.

--format speculators: what vLLM speculators' trainer reads with
`speculators train --data-path DST` (its ArrowDataset):
  DST/hidden_states/hs_{i}.safetensors   sample i, a hard link to the SRC file
                                         (a copy where SRC and DST are on different
                                         filesystems; the summary says so)
  DST/data-*.arrow, state.json, ...      rows input_ids, loss_mask, seq_len
                                         (Hugging Face datasets, as prepare-data saves)
  DST/token_freq.pt                      supervised-token counts (--draft-vocab-size)
  DST/export.jsonl                       row -> source file, loss-mask source, placement
  DST/export.json                        summary, every skipped sample and why

Samples are taken in natural name order (hs_2 before hs_10) and read under the
reader's shared lock, so only complete ones are exported; those still being written
are waited for up to --wait seconds, then skipped (a snapshot: export again later for
more). Failed, corrupt, truncated and empty samples are skipped and reported. SRC is
never modified; DST must be new or empty and appears only when the export is complete.

Loss mask: a sample's own loss_mask tensor when it has one; otherwise --default-mask:
  generated  1 for the tokens after the prompt (metadata num_prompt_tokens: the target
             model's response, as speculators' prepare-data masks assistant turns),
             all ones for samples without generated tokens
  all        1 for every token
Rows whose mask has no 1s are skipped (prepare-data drops them too).

Verifier layer: speculators reads the last captured layer as the verifier's last hidden
state, which must be the model's last layer (id num_hidden_layers: the last decoder
layer's output, before the final norm). Files record the model's layer count; a capture
without its last layer is refused (exit 1, nothing written) unless
--allow-missing-last-layer is given (then exported with a warning). Files that do not
record the layer count (older writers, vLLM's own connector) are exported with a warning
that this cannot be checked.

Needs Hugging Face `datasets` (speculators depends on it).
exit status: 0 exported, 1 nothing could be exported, the capture lacks the model's last
layer, or writing failed, 2 bad usage"""

_EXAMPLES = """
hidden-state export --format speculators /data/hs /data/spec
hidden-state export --format speculators /data/hs /data/spec --default-mask all --wait 60
speculators train --data-path /data/spec --verifier-name-or-path MODEL --on-missing raise
"""


def register(subparsers: Any) -> None:
    """Add ``export``."""
    p = add_command(
        subparsers,
        "export",
        summary="export complete samples for another trainer (speculators)",
        description=_DESCRIPTION,
        examples=_EXAMPLES,
        handler=run_export,
    )
    p.add_argument("source", metavar="SRC", help="the hidden-state directory")
    p.add_argument("target", metavar="DST", help="the new directory to create")
    p.add_argument(
        "--format", required=True, choices=FORMATS, help="the layout to write (required)"
    )
    p.add_argument(
        "--default-mask",
        choices=MASK_RULES,
        default="generated",
        help="loss mask of samples that have none of their own",
    )
    p.add_argument(
        "--wait",
        type=non_negative_float,
        default=0.0,
        metavar="S",
        help="seconds to wait, all together, for samples still being written",
    )
    p.add_argument(
        "--copy", action="store_true", help="copy the files instead of hard-linking them"
    )
    p.add_argument(
        "--allow-missing-last-layer",
        action="store_true",
        help="export even when the last captured layer is not the model's last (speculators "
        "then reads another layer as the verifier's last hidden state); warns",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_grace_argument(p, GRACE)
    add_progress_argument(p)


def run_export(args: argparse.Namespace) -> int:
    """``hidden-state export``."""
    from hidden_state_reader.apps.export.rows import MissingDependencyError
    from hidden_state_reader.apps.export.speculators import (
        ExportError,
        MissingLastLayerError,
        NothingToExportError,
        export_speculators,
    )

    progress = progress_for_args(args, f"exporting {args.source}")
    try:
        result = export_speculators(
            args.source,
            args.target,
            default_mask=args.default_mask,
            copy=args.copy,
            wait=args.wait,
            grace=args.grace,
            progress=progress,
            allow_missing_last_layer=args.allow_missing_last_layer,
        )
    except MissingDependencyError as exc:
        raise CliError(str(exc)) from None
    except (NothingToExportError, MissingLastLayerError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ExportError as exc:
        raise CliError(str(exc)) from None
    for skipped in result.skipped:
        log.warning("skipped %s: %s (%s)", skipped.name, skipped.state, skipped.reason)
    for warning in result.warnings:
        log.warning("%s", warning)
    if args.json:
        print_json(result.as_dict())
    else:
        print(report(result))
    return EXIT_OK


def report(result: ExportResult) -> str:
    """The summary ``export`` prints: what was exported, how, and how to train on it."""
    from hidden_state_reader.apps.export.speculators import skipped_summary

    placed, masks = result.placed(), result.mask_sources()
    lines = [
        f"exported {len(result.rows)} samples from {result.source} to {result.target} "
        f"(speculators), {skipped_summary(result)}",
        f"files: {placed['link']} hard-linked, {placed['copy']} copied"
        + "".join(f"; {n} copied because {why}" for why, n in result.copy_reasons().items()),
        f"loss masks: {masks['file']} from the files, {masks['generated']} generated tokens "
        f"only, {masks['all']} all tokens (--default-mask {result.default_mask})",
        f"row -> source file: {result.target}/export.jsonl",
    ]
    if result.geometry is not None:
        g = result.geometry
        lines.append(f"layers: {g.describe()}")
        if g.layer_ids is not None:
            aux = " ".join(str(i) for i in g.layer_ids[:-1])
            lines.append(
                f"speculators reads layer {g.layer_ids[-1]} as the verifier's last hidden "
                f"state ({_last_layer_note(result)}) and {aux} as --target-layer-ids {aux}"
            )
    lines.append(f"train: speculators train --data-path {result.target} --on-missing raise ...")
    return "\n".join(lines)


def _last_layer_note(result: ExportResult) -> str:
    """Whether the verifier layer is the model's last: checked, wrong, or unknown."""
    check = result.last_layer
    n = check.num_hidden_layers
    if check.missing:
        return f"NOT the model's last layer {n}"
    if check.unchecked:
        return f"unchecked for {check.unchecked} samples"
    return f"the model's last of {n} layers"
