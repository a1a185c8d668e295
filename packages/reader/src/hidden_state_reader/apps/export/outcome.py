"""What an export did: one record per exported row, one per skipped sample, a summary."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Row:
    """One exported sample: row ``row`` of the dataset, ``hidden_states/hs_{row}``.

    Attributes:
        row: Its row (and file) index.
        file: The exported file, relative to DST.
        source: The sample file it came from.
        tokens: Its token count (``seq_len``).
        supervised: Tokens whose loss mask is 1.
        loss_mask: Where the mask came from: ``file``, ``generated`` or ``all``.
        placed: ``link`` or ``copy``.
        why_copy: Why it is a copy (empty for a link).
    """

    row: int
    file: str
    source: str
    tokens: int
    supervised: int
    loss_mask: str
    placed: str
    why_copy: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The ``export.jsonl`` line of this row."""
        out = asdict(self)
        if not self.why_copy:
            del out["why_copy"]
        return out


@dataclass(frozen=True)
class Skipped:
    """A sample left out, and why (``state`` is a reader state or ``unsupervised``...)."""

    name: str
    state: str
    reason: str


@dataclass(frozen=True)
class Geometry:
    """The layer axis every exported sample shares (speculators trains one shape)."""

    num_layers: int
    hidden_size: int
    dtype: str
    layer_ids: tuple[int, ...] | None

    def describe(self) -> str:
        """E.g. ``4 layers [2, 16, 29, 32] x 4096 BF16``."""
        ids = f" {list(self.layer_ids)}" if self.layer_ids is not None else ""
        return f"{self.num_layers} layers{ids} x {self.hidden_size} {self.dtype}"


ALLOW_FLAG = "--allow-missing-last-layer"


@dataclass
class LastLayerCheck:
    """Whether the exported rows hold the model's last layer (speculators' verifier state).

    Attributes:
        present: Rows whose files record the model's layer count, last layer captured.
        missing: Rows exported without it (``allow_missing_last_layer``).
        unchecked: Rows whose files do not record the model's layer count.
        num_hidden_layers: The model's layer count, when a file recorded it.
        layer_ids: The captured layer ids of the rows counted.
    """

    present: int = 0
    missing: int = 0
    unchecked: int = 0
    num_hidden_layers: int | None = None
    layer_ids: tuple[int, ...] | None = None

    def count(
        self, verdict: bool | None, layer_ids: list[int] | None, num_hidden_layers: int | None
    ) -> None:
        """Count one exported row (``verdict``: ``SampleHeader.captures_last_layer``)."""
        if verdict is None:
            self.unchecked += 1
        elif verdict:
            self.present += 1
        else:
            self.missing += 1
        if num_hidden_layers is not None:
            self.num_hidden_layers = num_hidden_layers
        if layer_ids is not None:
            self.layer_ids = tuple(layer_ids)

    def warnings(self) -> list[str]:
        """One line per problem, for everything not proved to hold the last layer."""
        total = self.present + self.missing + self.unchecked
        ids = list(self.layer_ids) if self.layer_ids else None
        last = f"({ids[-1]}) " if ids else ""
        out = []
        if self.missing:
            out.append(
                f"{self.missing} of {total} exported samples lack the model's last layer "
                f"(exported with {ALLOW_FLAG}): layers {ids} of a {self.num_hidden_layers}-"
                f"layer model; speculators reads layer {ids[-1] if ids else '?'} as the "
                f"verifier's last hidden state, not layer {self.num_hidden_layers}"
            )
        if self.unchecked:
            out.append(
                f"{self.unchecked} of {total} exported samples do not record the model's "
                "layer count (files of an older writer or of vLLM's own connector): cannot "
                f"check that their last layer {last}is the model's last layer, which "
                "speculators reads as the verifier's last hidden state"
            )
        return out


@dataclass
class ExportResult:
    """The outcome of one export.

    Attributes:
        source: SRC.
        target: DST.
        default_mask: The rule used for samples without their own loss mask.
        rows: The exported rows, in row order.
        skipped: The samples left out, in name order.
        geometry: The shared layer axis (None when nothing was exported).
        last_layer: Whether the rows hold the model's last layer.
        warnings: What the user must know about the exported data.
    """

    source: str
    target: str
    default_mask: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    geometry: Geometry | None = None
    last_layer: LastLayerCheck = field(default_factory=LastLayerCheck)
    warnings: list[str] = field(default_factory=list)

    def placed(self) -> Counter[str]:
        """Rows per placement (``link`` / ``copy``)."""
        return Counter(r.placed for r in self.rows)

    def mask_sources(self) -> Counter[str]:
        """Rows per loss-mask source (``file`` / ``generated`` / ``all``)."""
        return Counter(r.loss_mask for r in self.rows)

    def copy_reasons(self) -> Counter[str]:
        """Why files were copied rather than linked, with counts."""
        return Counter(r.why_copy for r in self.rows if r.placed == "copy")

    def as_dict(self) -> dict[str, Any]:
        """The ``export.json`` summary."""
        g = self.geometry
        return {
            "format": "speculators",
            "source": self.source,
            "target": self.target,
            "rows": len(self.rows),
            "tokens": sum(r.tokens for r in self.rows),
            "supervised_tokens": sum(r.supervised for r in self.rows),
            "placed": dict(self.placed()),
            "copy_reasons": dict(self.copy_reasons()),
            "default_mask": self.default_mask,
            "loss_mask": dict(self.mask_sources()),
            "layers": None if g is None else asdict(g),
            "last_layer": {
                "num_hidden_layers": self.last_layer.num_hidden_layers,
                "present": self.last_layer.present,
                "missing": self.last_layer.missing,
                "unchecked": self.last_layer.unchecked,
            },
            "warnings": list(self.warnings),
            "skipped": [asdict(s) for s in self.skipped],
        }
