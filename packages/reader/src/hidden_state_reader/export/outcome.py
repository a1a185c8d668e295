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
    """

    source: str
    target: str
    default_mask: str
    rows: list[Row] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    geometry: Geometry | None = None

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
            "skipped": [asdict(s) for s in self.skipped],
        }
