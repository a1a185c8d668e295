"""The safetensors header of a v1 sample: encode, decode, and prove completeness.

A sample holds two tensors, ``hidden_states`` ``[tokens, layers, hidden]`` (model
dtype) and ``token_ids`` ``[tokens]`` (int64), optionally a ``loss_mask`` ``[tokens]``
(``format/loss_mask.py``), plus an optional ``__metadata__`` string map. fp8 storage
(``fp8.py``) stores ``hidden_states`` as ``F8_E4M3`` and adds its
``hidden_states_scales``. The file layout is plain safetensors: an 8-byte little-endian
header length, the JSON header (space-padded), then the tensor bytes, which must cover
the rest of the file exactly. That last rule is what tells a complete file from a
truncated one.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from hidden_state_reader.errors import CorruptSampleError, IncompleteSampleError
from hidden_state_reader.format import fp8
from hidden_state_reader.format.loss_mask import LOSS_MASK, check_loss_mask
from hidden_state_reader.format.tensors import (
    DTYPE_SIZES,
    HIDDEN_DTYPES,
    TOKEN_DTYPES,
    TensorInfo,
    dtype_tables,
)

FORMAT_VERSION = "1"
HIDDEN_STATES = "hidden_states"
TOKEN_IDS = "token_ids"

# A header larger than this is not something a writer of this format produces.
MAX_HEADER_BYTES = 16 * 1024 * 1024
# No real dimension comes near this; larger ones (even of empty tensors) are rejected so
# they can never reach torch as a shape.
MAX_DIM = 2**40
HEADER_ALIGN = 8
_LENGTH = struct.Struct("<Q")
# Valid ``layer_ids`` metadata strings already parsed, and their ids (bounded).
_LAYER_IDS: dict[str, tuple[int, ...]] = {}


class Meta:
    """Keys of the ``__metadata__`` map written by this project's writers.

    All values are strings (a safetensors rule); structured values are JSON.
    """

    FORMAT = "format_version"
    LAYER_IDS = "layer_ids"  # JSON list, the captured order of the layer axis
    MODEL = "model"
    REQUEST_ID = "request_id"
    NUM_PROMPT_TOKENS = "num_prompt_tokens"
    CREATED = "created_unix"
    PRODUCER = "producer"  # "name/version"
    NONFINITE = "nonfinite"  # "0" or "1": any NaN/inf in hidden_states
    CRC32 = "crc32"  # 8 hex digits over the tensor bytes, in file order
    # The model's dtype (e.g. "BF16"): what hidden_states had before storage; fp8 files
    # are dequantized to it (fp8.py).
    MODEL_DTYPE = "model_dtype"
    # What the capture is (recorded by the connector and extract; absent in older files):
    NUM_HIDDEN_LAYERS = "num_hidden_layers"  # decimal; layer id N = the last layer's output
    MODEL_REVISION = "model_revision"  # commit hash (or revision) of the model's weights
    VLLM_VERSION = "vllm_version"  # the vLLM that computed the hidden states
    # JSON list of the entries that are a client's tags (``tags.py``), each under its key.
    TAG_KEYS = "tag_keys"
    # The client's idempotency key of a sample it names (``idempotency.py``): a consumer
    # that removes the sample records the key as consumed (``consumed.py``).
    IDEMPOTENCY_KEY = "idempotency_key"
    # Speculative decoding (``speculation.py``): draft tokens the target model verified
    # for the sample's generated tokens, and how many of them it accepted (decimal).
    NUM_DRAFT_TOKENS = "num_draft_tokens"
    NUM_ACCEPTED_TOKENS = "num_accepted_tokens"


@dataclass(frozen=True)
class SampleHeader:
    """A validated header: shapes, dtypes, offsets and metadata of one sample file."""

    path: str
    data_start: int
    file_size: int
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def hidden(self) -> TensorInfo:
        """The ``hidden_states`` tensor."""
        return self.tensors[HIDDEN_STATES]

    @property
    def tokens(self) -> TensorInfo:
        """The ``token_ids`` tensor."""
        return self.tensors[TOKEN_IDS]

    @property
    def loss_mask(self) -> TensorInfo | None:
        """The optional ``loss_mask`` tensor."""
        return self.tensors.get(LOSS_MASK)

    @property
    def num_tokens(self) -> int:
        """Sequence length."""
        return self.hidden.shape[0]

    @property
    def num_layers(self) -> int:
        """Number of captured layers (size of the layer axis)."""
        return self.hidden.shape[1]

    @property
    def hidden_size(self) -> int:
        """Width of one hidden state."""
        return self.hidden.shape[2]

    @property
    def hidden_dtype(self) -> torch.dtype:
        """Dtype of ``hidden_states``."""
        return self.hidden.torch_dtype

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data (file size minus header)."""
        return self.file_size - self.data_start

    @property
    def layer_ids(self) -> list[int] | None:
        """Captured layer ids in layer-axis order, when the writer recorded them."""
        raw = self.metadata.get(Meta.LAYER_IDS)
        if raw is None:
            return None
        known = _LAYER_IDS.get(raw)  # one writer records the same ids in every file
        if known is not None:
            return list(known)
        try:
            ids = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise CorruptSampleError(self.path, f"metadata layer_ids is not JSON: {raw!r}") from exc
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise CorruptSampleError(
                self.path, f"metadata layer_ids is not a list of ints: {raw!r}"
            )
        if len(_LAYER_IDS) >= 64:
            _LAYER_IDS.clear()
        _LAYER_IDS[raw] = tuple(ids)
        return ids

    @property
    def num_hidden_layers(self) -> int | None:
        """The model's number of decoder layers, when the writer recorded it.

        Layer id ``num_hidden_layers`` is the last decoder layer's output (before the
        final norm): a capture holds the model's last layer when its last id is this.
        """
        raw = self.metadata.get(Meta.NUM_HIDDEN_LAYERS)
        if raw is None:
            return None
        if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
            raise CorruptSampleError(
                self.path, f"metadata num_hidden_layers is not a positive integer: {raw!r}"
            )
        return int(raw)

    @property
    def captures_last_layer(self) -> bool | None:
        """Whether the last captured layer is the model's last (None: not recorded)."""
        ids, n = self.layer_ids, self.num_hidden_layers
        if not ids or n is None:
            return None
        return ids[-1] == n

    @property
    def model(self) -> str | None:
        """The model's name or path, when recorded."""
        return self.metadata.get(Meta.MODEL)

    @property
    def model_revision(self) -> str | None:
        """The model's commit hash (or the revision asked for), when recorded."""
        return self.metadata.get(Meta.MODEL_REVISION)

    @property
    def model_dtype(self) -> str | None:
        """The model's dtype as a safetensors name (e.g. ``"BF16"``), when recorded."""
        return self.metadata.get(Meta.MODEL_DTYPE)

    @property
    def vllm_version(self) -> str | None:
        """The version of the vLLM that computed the hidden states, when recorded."""
        return self.metadata.get(Meta.VLLM_VERSION)


_is_str = str.__instancecheck__  # isinstance(x, str), callable from map (no Python frame)


def _shape_bytes(dtype: str, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * DTYPE_SIZES[dtype]


_PREFIX = '{"__metadata__":'
_JSON_SPACE = " \t\n\r"
# The C scanner behind json.loads, positioned at one value: parses just the metadata.
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


def split_metadata(header_bytes: bytes) -> tuple[Any, str] | None:
    """The value of a leading ``__metadata__`` member and the text after it (the tail).

    None when the header does not start exactly with ``{"__metadata__":`` followed by a
    JSON value, or is not strict UTF-8: the full parse then decides. Headers that differ
    only in their metadata share their tail (``kernels/layouts.py`` says why a tail seen
    in a valid header proves the same tensors again).
    """
    try:
        text = header_bytes.decode()
        if not text.startswith(_PREFIX):
            return None
        metadata, end = _scan(text, len(_PREFIX))
    except (ValueError, StopIteration, RecursionError):
        return None
    # Without the padding after the closing brace (JSON whitespace, which every parse
    # skips): headers padded to different lengths share their layout.
    return metadata, text[end:].rstrip(_JSON_SPACE)


class LayoutMemo(Protocol):
    """Tensor layouts already validated, by tail (``kernels.layouts`` is the readers')."""

    def lookup(self, tail: str, /) -> tuple[Mapping[str, TensorInfo], int] | None:
        """The validated tensors of a tail and where their data ends (None: unknown)."""
        ...

    def remember(self, tail: str, tensors: Mapping[str, TensorInfo], data_end: int) -> None:
        """Record the tensors of a header that passed the full rule."""
        ...


def parse_header(
    path: str, header_bytes: bytes, file_size: int, memo: LayoutMemo | None = None
) -> SampleHeader:
    """Validate a header read from ``path`` against the file's size.

    This is the executable rule of what a complete sample file is: a JSON object of
    well-formed tensor entries (``_parse_tensor``) and a string map, holding the two
    tensors of a sample with consistent shapes (``_check_sample_tensors``) and, when
    present, a ``loss_mask`` of one entry per token id (``check_loss_mask``), whose data
    tiles the rest of the file exactly (``_check_data_size``), and, when recorded,
    layer ids matching the layer axis and the model's layer count (``_check_capture``).

    With a ``memo``, a header whose tensor entries were validated before (same entries,
    other metadata: ``split_metadata``) has only its metadata and the file's size checked
    again; anything else takes the full rule.

    Args:
        path: The file, for error messages.
        header_bytes: The JSON header (without the 8-byte length prefix).
        file_size: Size of the whole file in bytes.
        memo: The layouts already validated (the readers pass ``kernels.layouts``).

    Returns:
        The validated header.

    Raises:
        IncompleteSampleError: The tensor data does not reach the end of the header's
            promise (the file is truncated or still being written).
        CorruptSampleError: Anything else that makes the file unusable.
    """
    data_start = 8 + len(header_bytes)
    parts = None if memo is None else split_metadata(header_bytes)
    if memo is not None and parts is not None:
        known = memo.lookup(parts[1])
        metadata = parts[0]
        if (
            known is not None
            and data_start + known[1] == file_size
            and type(metadata) is dict
            and all(map(_is_str, metadata.values()))
        ):
            # Everything the tensors alone decide was proved for this tail before.
            header = _made(path, data_start, file_size, dict(known[0]), metadata)
            if Meta.LAYER_IDS in metadata or Meta.NUM_HIDDEN_LAYERS in metadata:
                _check_capture(header)
            return header
    entries, metadata = _parse_json(path, header_bytes)
    tensors = {name: _parse_tensor(path, name, spec) for name, spec in entries.items()}
    _check_sample_tensors(path, tensors)
    check_loss_mask(path, tensors, tensors[TOKEN_IDS].shape[0])
    _check_data_size(path, tensors, data_start, file_size)
    header = SampleHeader(path, data_start, file_size, tensors, metadata)
    _check_capture(header)
    if memo is not None and parts is not None:
        memo.remember(parts[1], tensors, file_size - data_start)
    return header


def _made(
    path: str,
    data_start: int,
    file_size: int,
    tensors: Mapping[str, TensorInfo],
    metadata: Mapping[str, str],
) -> SampleHeader:
    """``SampleHeader(...)``, made without one ``object.__setattr__`` per field.

    The same object as the dataclass's own ``__init__`` makes (frozen only blocks
    assignment, not the instance dictionary), in a third of the time: a known header is
    parsed once per file read.
    """
    header = object.__new__(SampleHeader)
    header.__dict__.update(
        path=path, data_start=data_start, file_size=file_size, tensors=tensors, metadata=metadata
    )
    return header


def _check_capture(header: SampleHeader) -> None:
    """Recorded layer ids fit the layer axis and the model's recorded layer count."""
    ids = header.layer_ids  # raises CorruptSampleError when malformed
    if ids is not None and len(ids) != header.num_layers:
        raise CorruptSampleError(
            header.path,
            f"metadata layer_ids {ids} do not match {header.num_layers} captured layers",
        )
    n = header.num_hidden_layers  # raises CorruptSampleError when malformed
    if ids and n is not None and not all(0 <= i <= n for i in ids):
        raise CorruptSampleError(
            header.path,
            f"metadata layer_ids {ids} are not layers of a {n}-layer model (ids 0..{n})",
        )


def _parse_json(path: str, header_bytes: bytes) -> tuple[dict[str, Any], dict[str, str]]:
    """The header's tensor entries and its ``__metadata__`` string map."""
    try:
        raw = json.loads(header_bytes)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptSampleError(path, f"header is not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CorruptSampleError(path, "header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptSampleError(path, "__metadata__ is not a string-to-string map")
    return raw, dict(metadata)


def _parse_tensor(path: str, name: str, spec: Any) -> TensorInfo:
    """One tensor entry: a known dtype, a sane shape, offsets spanning exactly its bytes.

    Written for speed (it runs for every tensor of every file): JSON gives exact types,
    so ``type(x) is int`` is ``isinstance(x, int)`` without ``bool``.
    """
    if type(spec) is not dict:
        raise CorruptSampleError(path, f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise CorruptSampleError(path, f"tensor {name!r}: unsupported dtype {dtype!r}")
    nbytes = DTYPE_SIZES[dtype]
    if type(shape) is not list:
        raise CorruptSampleError(path, f"tensor {name!r}: bad shape {shape!r}")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise CorruptSampleError(path, f"tensor {name!r}: bad shape {shape!r}")
        nbytes *= d
    if type(offsets) is not list or len(offsets) != 2:
        raise CorruptSampleError(path, f"tensor {name!r}: bad data_offsets {offsets!r}")
    begin, end = offsets
    if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
        raise CorruptSampleError(path, f"tensor {name!r}: bad data_offsets {offsets!r}")
    if end - begin != nbytes:
        raise CorruptSampleError(
            path, f"tensor {name!r}: {end - begin} bytes for shape {shape} {dtype}"
        )
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_sample_tensors(path: str, tensors: Mapping[str, TensorInfo]) -> None:
    """Both tensors of a sample are there, with consistent shapes and dtypes.

    3-D float hidden states, 1-D integer token ids, one hidden state per token id.
    """
    for required in (HIDDEN_STATES, TOKEN_IDS):
        if required not in tensors:
            raise CorruptSampleError(path, f"missing tensor {required!r}")
    hidden, tokens = tensors[HIDDEN_STATES], tensors[TOKEN_IDS]
    if len(hidden.shape) != 3:
        raise CorruptSampleError(path, f"hidden_states must be 3-D, got shape {hidden.shape}")
    if hidden.dtype not in HIDDEN_DTYPES:
        raise CorruptSampleError(path, f"hidden_states has dtype {hidden.dtype}")
    scales = tensors.get(fp8.SCALES)
    fp8.check_scales(
        path, hidden.dtype, hidden.shape, None if scales is None else (scales.dtype, scales.shape)
    )
    if len(tokens.shape) != 1 or tokens.dtype not in TOKEN_DTYPES:
        raise CorruptSampleError(
            path, f"token_ids must be a 1-D integer tensor, got {tokens.dtype} {tokens.shape}"
        )
    if hidden.shape[0] != tokens.shape[0]:
        raise CorruptSampleError(
            path,
            f"token/hidden length mismatch: {tokens.shape[0]} token ids, "
            f"{hidden.shape[0]} hidden states",
        )


def _check_data_size(
    path: str, tensors: Mapping[str, TensorInfo], data_start: int, file_size: int
) -> None:
    """The tensors tile the data section exactly, and the file ends where the last one does.

    No gap or overlap between tensors; a shorter file is incomplete (truncated or still
    being written), a longer one is corrupt.
    """
    spans = sorted((t.begin, t.end) for t in tensors.values())
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise CorruptSampleError(path, "tensor data offsets leave gaps or overlap")
        cursor = end
    expected_size = data_start + cursor
    if file_size < expected_size:
        raise IncompleteSampleError(
            path, f"truncated: {file_size} of {expected_size} bytes present"
        )
    if file_size > expected_size:
        raise CorruptSampleError(
            path, f"{file_size - expected_size} trailing bytes after the tensor data"
        )


def header_length(path: str, prefix: bytes | memoryview, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against its size.

    Args:
        path: The file, for error messages.
        prefix: The file's first bytes (at least 8 of them unless the file is shorter).
        file_size: Size of the whole file in bytes.

    Raises:
        IncompleteSampleError: The file ends before the prefix or inside the header.
        CorruptSampleError: An implausible header length.
    """
    if len(prefix) >= 8:
        (length,) = _LENGTH.unpack_from(prefix)
        if length <= MAX_HEADER_BYTES and 8 + length <= file_size:
            return int(length)  # a plausible header inside the file: the common case
    if file_size == 0:
        raise IncompleteSampleError(path, "empty file (0 bytes)")
    if len(prefix) < 8:
        raise IncompleteSampleError(path, f"only {file_size} bytes, shorter than the header prefix")
    (length,) = struct.unpack_from("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise CorruptSampleError(path, f"header length {length} is implausible")
    if 8 + length > file_size:
        raise IncompleteSampleError(
            path, f"truncated inside the header ({file_size} of {8 + length} bytes)"
        )
    return int(length)


@dataclass(frozen=True)
class HeaderLayout:
    """An encoded header plus where each tensor's bytes go in the data section."""

    header: bytes  # including the 8-byte length prefix and alignment padding
    offsets: Mapping[str, tuple[int, int]]

    @property
    def data_start(self) -> int:
        """Byte offset of the data section in the file."""
        return len(self.header)

    @property
    def file_size(self) -> int:
        """Total size of the finished file."""
        return self.data_start + max((e for _, e in self.offsets.values()), default=0)


def encode_header(
    tensors: Mapping[str, tuple[torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
    trailing: Sequence[str] = (),
) -> HeaderLayout:
    """Lay out tensors and encode the safetensors header for them.

    Tensors are placed largest element size first (as safetensors itself does), so
    ``token_ids`` (int64) precedes ``hidden_states`` and every tensor stays aligned.

    Args:
        tensors: name -> (dtype, shape) for every tensor in the file.
        metadata: The ``__metadata__`` string map.
        trailing: Names placed after all the others, in this order (fp8 scales follow
            ``hidden_states``, so a writer streaming it can append them last).

    Returns:
        The header bytes and each tensor's data offsets.
    """
    order = sorted(
        (n for n in tensors if n not in trailing), key=lambda n: (-tensors[n][0].itemsize, n)
    )
    order += [n for n in trailing if n in tensors]
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    cursor = 0
    for name in order:
        dtype, shape = tensors[name]
        code = dtype_tables()[1][dtype]
        nbytes = _shape_bytes(code, shape)
        offsets[name] = (cursor, cursor + nbytes)
        doc[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [cursor, cursor + nbytes],
        }
        cursor += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    return HeaderLayout(struct.pack("<Q", len(body)) + body, offsets)


def sample_metadata(
    *,
    layer_ids: Sequence[int] | None = None,
    model: str | None = None,
    request_id: str | None = None,
    num_prompt_tokens: int | None = None,
    producer: str | None = None,
    num_hidden_layers: int | None = None,
    model_revision: str | None = None,
    vllm_version: str | None = None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Build the ``__metadata__`` map that this project's writers record.

    (``model_dtype`` is recorded by the file writer itself, from the hidden states.)

    Args:
        layer_ids: Captured layer ids, in the order of the layer axis.
        model: The target model's name or path.
        request_id: The vLLM request id.
        num_prompt_tokens: Prompt length (the rest of the tokens, if any, were generated).
        producer: ``name/version`` of the writer.
        num_hidden_layers: The model's decoder layer count (layer id N is its last
            layer's output), so a reader can tell whether the last layer was captured.
        model_revision: The model's commit hash, or the revision asked for.
        vllm_version: The version of the vLLM that computed the hidden states.
        extra: Further string pairs to record.

    Returns:
        A string-to-string map.

    Raises:
        ValueError: ``num_hidden_layers`` is not positive, or a layer id is outside
            ``0..num_hidden_layers``.
    """
    meta: dict[str, str] = {Meta.FORMAT: FORMAT_VERSION, Meta.CREATED: f"{time.time():.3f}"}
    if layer_ids is not None:
        meta[Meta.LAYER_IDS] = json.dumps(list(layer_ids))
    if num_hidden_layers is not None:
        n = int(num_hidden_layers)
        if n < 1:
            raise ValueError(f"num_hidden_layers must be positive, got {num_hidden_layers!r}")
        if layer_ids is not None and not all(0 <= i <= n for i in layer_ids):
            raise ValueError(f"layer ids {list(layer_ids)} are not layers 0..{n} of the model")
        meta[Meta.NUM_HIDDEN_LAYERS] = str(n)
    if model is not None:
        meta[Meta.MODEL] = model
    if model_revision is not None:
        meta[Meta.MODEL_REVISION] = model_revision
    if vllm_version is not None:
        meta[Meta.VLLM_VERSION] = vllm_version
    if request_id is not None:
        meta[Meta.REQUEST_ID] = request_id
    if num_prompt_tokens is not None:
        meta[Meta.NUM_PROMPT_TOKENS] = str(num_prompt_tokens)
    if producer is not None:
        meta[Meta.PRODUCER] = producer
    if extra:
        meta.update(extra)
    return meta
