"""The reader's options, defined once: ``LoadOptions`` (file -> tensors) and ``ReaderOptions``.

``ReaderOptions`` is every keyword option of ``HiddenStateReader`` as one typed value:
the reader's signature and the option list in its docstring are built from it
(``takes_reader_options``), ``HiddenStateDataset`` keeps its options as one,
and each backend reads its settings from it. An unknown option fails with a
``TypeError``, a bad value with a ``ValueError`` naming the option, when the options
are made.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

from hidden_state_reader.sample.states import GRACE

if TYPE_CHECKING:
    import torch

OnError = Literal["skip", "raise"]
OnConsumed = Literal["keep", "delete", "move"]
Watch = Literal["auto", "inotify", "poll"]

ON_ERROR: tuple[str, ...] = get_args(OnError)
ON_CONSUMED: tuple[str, ...] = get_args(OnConsumed)
WATCH_MODES: tuple[str, ...] = get_args(Watch)


@dataclass(frozen=True)
class LoadOptions:
    """How samples are turned into tensors.

    Attributes:
        layers: Keep only these positions of the layer axis (e.g. ``[-1]`` for the last).
        layer_ids: Keep only these captured layer ids (needs the writer's ``layer_ids``
            metadata).
        dtype: Convert hidden states to this dtype.
        pin_memory: Read into page-locked memory (faster host-to-GPU copies).
        verify_checksum: Check the writer's CRC32 when the file has one (our writers
            record one by default). Off by default: it is a second pass over every byte
            (docs/reader.md, "Integrity"); ``hidden-state verify --checksums`` checks a
            whole directory on demand.
        mmap: Map files of 1 MiB (``MMAP_MIN_BYTES``) or more instead of copying them
            (faster; the tensors stay valid after the file is deleted). Turn off if your
            writer rewrites published files in place.
        raw_fp8: Give files stored in fp8 as stored (``hidden_states`` float8_e4m3fn plus
            ``Sample.hidden_states_scales``) instead of dequantizing them on the CPU;
            dequantize on the GPU with ``hidden_state_reader.format.fp8.dequantize``.
            ``dtype`` then applies to other files only. By default fp8 files are
            dequantized to ``dtype``, else to the ``model_dtype`` the writer recorded.
        device: Put the sample's tensors on this torch device (``"cuda"``,
            ``"cuda:1"``, ...) as stored, then convert there: fp8 files cross to the
            device as fp8 plus scales (half the bytes of bf16; pinned staging for CUDA)
            and are dequantized on it. None (the default): the CPU.
    """

    layers: Sequence[int] | None = None
    layer_ids: Sequence[int] | None = None
    dtype: torch.dtype | None = None
    pin_memory: bool = False
    verify_checksum: bool = False
    mmap: bool = True
    raw_fp8: bool = False
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        if self.layers is not None and self.layer_ids is not None:
            raise ValueError("pass either layers (positions) or layer_ids, not both")
        if self.device is not None:
            from hidden_state_reader.sample.placement import check_device

            check_device(self.device)


@dataclass(frozen=True)
class ReaderOptions(LoadOptions):
    """The keyword options of ``HiddenStateReader`` (and of ``HiddenStateDataset``).

    The ``LoadOptions`` fields (layers, dtype, memory) are inherited.

    Attributes:
        follow: Keep following the source as new samples appear (like ``tail -f``).
        idle_timeout: In follow mode, stop after this many seconds in which no sample
            became ready (a sample still being written is no news).
        max_samples: Stop after yielding this many samples.
        claim: Coordinate with other readers (processes, ranks, hosts on a shared
            filesystem) so each sample is yielded by exactly one of them.
        claim_group: Independent consumer groups each see every sample once.
        claim_steal_after: Following with ``claim=True``: seconds a sample may stay
            unclaimed by the group member that owns it before another member takes it
            (its owner died, left or is behind). See docs/scale-out.md.
        on_consumed: ``"keep"`` files, ``"delete"`` them after use, or ``"move"`` them to
            ``done_dir``.
        done_dir: Target of ``on_consumed="move"`` (default ``<path>/done``).
        on_error: ``"skip"`` bad samples with one warning each (counted in ``stats``), or
            ``"raise"`` a ``SampleError`` subclass naming the file.
        lock_timeout: Seconds to wait for one sample's writer (it never delays other
            samples); None waits forever.
        names: Read exactly these sample names (no directory scan): complete ones in this
            order, each still being written when it is complete.
        watch: ``"auto"``, ``"inotify"`` or ``"poll"`` (NFS/Lustre with remote writers).
        rescan_interval: Safety rescan period in follow mode, seconds.
        poll_interval: Rescan period with ``watch="poll"``, seconds.
        orphan_grace: How long a released lock without data, or a lock-less file that
            does not parse, may be young and still count as being written, seconds (the
            same grace as the ``hidden-state`` commands, ``states.GRACE``).
    """

    follow: bool = False
    idle_timeout: float | None = None
    max_samples: int | None = None
    claim: bool = False
    claim_group: str = "default"
    claim_steal_after: float = 2.0
    on_consumed: OnConsumed = "keep"
    done_dir: str | os.PathLike[str] | None = None
    on_error: OnError = "skip"
    lock_timeout: float | None = 600.0
    names: Sequence[str] | None = None
    watch: Watch = "auto"
    rescan_interval: float = 30.0
    poll_interval: float = 1.0
    orphan_grace: float = GRACE

    def __post_init__(self) -> None:
        super().__post_init__()
        for option, value, allowed in (
            ("on_consumed", self.on_consumed, ON_CONSUMED),
            ("on_error", self.on_error, ON_ERROR),
            ("watch", self.watch, WATCH_MODES),
        ):
            if value not in allowed:
                raise ValueError(f"{option} must be one of {allowed}, got {value!r}")
        if not self.claim_steal_after > 0:
            raise ValueError(
                f"claim_steal_after must be positive seconds, got {self.claim_steal_after!r}"
            )
        if self.follow and self.names is not None:
            raise ValueError("names= lists a fixed set of samples; it cannot be followed")

    def as_kwargs(self, **changes: Any) -> dict[str, Any]:
        """The options as ``HiddenStateReader`` keyword arguments, with ``changes`` applied."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out.update(changes)
        return out

    def check_consumers(self, count: int, what: str) -> None:
        """Refuse ``count`` consumers that would each get every sample of a followed source.

        Args:
            count: How many consumers read with these options at once.
            what: What they are, for the message (``"ranks"``, ``"DataLoader workers"``).

        Raises:
            ValueError: ``follow`` without ``claim`` for more than one consumer.
        """
        if self.follow and not self.claim and count > 1:
            raise ValueError(
                f"follow mode with claim=False on {count} {what} would deliver every "
                "sample to each of them; use claim=True (the default in follow mode)"
            )


_ENTRY = re.compile(r"^        (\w+): ")


def _attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` entries of ``cls``'s docstring, by name, as written there."""
    docs: dict[str, str] = {}
    section = (cls.__doc__ or "").split("    Attributes:\n", 1)[-1]
    name = None
    for line in section.splitlines():
        match = _ENTRY.match(line)
        if match:
            name = match.group(1)
            docs[name] = line
        elif name is not None and line.startswith("            "):
            docs[name] += "\n" + line
        elif line.strip():
            break
    return docs


def options_doc() -> str:
    """The ``Args:`` entries of every reader option, in signature order (for docstrings)."""
    docs = {**_attribute_docs(LoadOptions), **_attribute_docs(ReaderOptions)}
    return "\n".join(docs[f.name] for f in _ordered_fields())


def _ordered_fields() -> list[Any]:
    """The reader's own options first, then the ``LoadOptions`` ones."""
    loading = {f.name for f in fields(LoadOptions)}
    every = fields(ReaderOptions)
    return [f for f in every if f.name not in loading] + [f for f in every if f.name in loading]


_T = TypeVar("_T", bound=type)


def takes_reader_options(cls: _T) -> _T:
    """Class decorator: ``cls.__init__(self, ..., **options)`` takes every reader option.

    The signature (``inspect.signature``, ``help()``, IDEs that introspect) lists each
    option with its type and default after the explicit parameters, and the line
    ``OPTIONS`` in the class docstring becomes the options' ``Args:`` entries, so the
    list has one home: ``ReaderOptions``.
    """
    init: Any = cls.__dict__["__init__"]
    own = [
        p
        for p in inspect.signature(init).parameters.values()
        if p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    options = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=f.default if f.default is not MISSING else inspect.Parameter.empty,
            annotation=f.type,
        )
        for f in _ordered_fields()
    ]
    init.__signature__ = inspect.Signature([*own, *options])
    cls.__doc__ = (cls.__doc__ or "").replace("    OPTIONS\n", options_doc() + "\n")
    return cls
