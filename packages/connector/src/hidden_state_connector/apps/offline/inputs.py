"""Read a prompt dataset and tokenize it with the model's own tokenizer.

Inputs:

* JSONL (optionally ``.gz``): one JSON value per line. Line ``i`` (0-based) is sample
  ``i``; an empty or unparsable line is a failed sample, never a fatal error.
* A JSON file holding one array of records (detected by its first character ``[``).
* A Hugging Face ``datasets`` folder written by ``save_to_disk`` (``datasets`` is
  imported only then).

A record is an object with one of these fields (checked in this order):

* ``token_ids`` (or ``input_ids``): the token ids, used as they are, with an optional
  ``loss_mask`` of one 0/1 per id (speculators' prepared-data layout), stored with them.
* ``messages`` (or ShareGPT-style ``conversations`` with ``from``/``value``): a chat,
  rendered with the tokenizer's chat template (a generation prompt is added unless the
  last message is the assistant's) and tokenized without extra special tokens. Its
  loss mask marks the assistant turns (``chat_mask``).
* ``text`` (or ``prompt``): plain text, tokenized the way vLLM tokenizes text prompts
  (with the tokenizer's special tokens). No loss mask.

A bare JSON string counts as ``text`` and a bare list of integers as ``token_ids``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from hidden_state_connector.apps.offline.chat_mask import ChatMasker, record_mask
from hidden_state_connector.apps.offline.errors import UsageError, first_line

TOKEN_FIELDS = ("token_ids", "input_ids")
MASK_FIELD = "loss_mask"
CHAT_FIELDS = ("messages", "conversations")
TEXT_FIELDS = ("text", "prompt")
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")

RawItem = tuple[int, Any, "str | None"]
"""``(index, parsed record or None, error or None)`` as read from the input."""


@dataclass(frozen=True)
class Prompt:
    """One sample, tokenized (``token_ids``) or failed before reaching vLLM (``error``).

    Attributes:
        index: Position in the input (0-based); names the output file.
        token_ids: The prompt's token ids.
        error: Why the sample cannot be sent (invalid line, empty prompt, ...).
        kind: ``"token_ids"``, ``"messages"`` or ``"text"`` (empty when unknown).
        loss_mask: One 0/1 per token id (None: the record has none, as plain text).
    """

    index: int
    token_ids: list[int] | None
    error: str | None = None
    kind: str = ""
    loss_mask: list[int] | None = None


class InputSource:
    """Records of one input, addressed by index.

    Attributes:
        path: The input as given.
        total: Number of records considered (after ``limit``).
        description: What the input is, for messages.
    """

    path: str
    total: int
    description: str

    def items(self, wanted: Callable[[int], bool]) -> Iterator[RawItem]:
        """Yield ``(index, record, error)`` for every index ``< total`` that is ``wanted``."""
        raise NotImplementedError


def _open_binary(path: str) -> IO[bytes]:
    if path.endswith(".gz"):
        return gzip.GzipFile(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def _first_char(path: str) -> bytes:
    with _open_binary(path) as f:
        while True:
            block = f.read(4096)
            if not block:
                return b""
            stripped = block.lstrip(b" \t\r\n\xef\xbb\xbf")
            if stripped:
                return stripped[:1]


def _count_lines(path: str) -> int:
    count = 0
    last = b"\n"
    with _open_binary(path) as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class JsonlSource(InputSource):
    """A JSONL file (``.gz`` allowed): line ``i`` is record ``i``."""

    def __init__(self, path: str, limit: int | None) -> None:
        self.path = path
        lines = _count_lines(path)
        self.total = lines if limit is None else min(lines, limit)
        self.description = f"{path} (JSONL, {lines:,} lines)"

    def items(self, wanted: Callable[[int], bool]) -> Iterator[RawItem]:
        """Parse the wanted lines; a bad line becomes an error item, not an exception."""
        with _open_binary(self.path) as f:
            for index, raw in enumerate(f):
                if index >= self.total:
                    return
                if not wanted(index):
                    continue
                yield (index, *parse_line(raw, first=index == 0))


def parse_line(raw: bytes, *, first: bool = False) -> tuple[Any, str | None]:
    """Decode one JSONL line into ``(record, None)`` or ``(None, reason)``."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        return None, f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})"
    text = text.rstrip("\r\n")
    if not text.strip():
        return None, "empty line"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"


class JsonArraySource(InputSource):
    """A JSON file holding one array of records."""

    def __init__(self, path: str, limit: int | None) -> None:
        self.path = path
        try:
            with _open_binary(path) as f:
                doc = json.load(io.TextIOWrapper(f, encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise UsageError(f"--input {path}: not valid JSON ({exc})") from None
        if not isinstance(doc, list):
            raise UsageError(f"--input {path}: expected a JSON array of records")
        self._records: list[Any] = doc
        self.total = len(doc) if limit is None else min(len(doc), limit)
        self.description = f"{path} (JSON array, {len(doc):,} records)"

    def items(self, wanted: Callable[[int], bool]) -> Iterator[RawItem]:
        """Yield the wanted records."""
        for index in range(self.total):
            if wanted(index):
                yield index, self._records[index], None


class HFDatasetSource(InputSource):
    """A Hugging Face dataset folder written by ``Dataset.save_to_disk``."""

    def __init__(self, path: str, limit: int | None, split: str | None) -> None:
        self.path = path
        try:
            import datasets
        except ImportError:
            raise UsageError(
                f"--input {path}: reading a Hugging Face dataset folder needs the 'datasets' "
                "package (pip install datasets), or convert it to JSONL"
            ) from None
        try:
            loaded = datasets.load_from_disk(path)
        except Exception as exc:
            raise UsageError(f"--input {path}: cannot load the dataset: {exc}") from None
        if isinstance(loaded, Mapping):  # a DatasetDict
            splits = sorted(loaded)
            if split is None:
                if len(splits) == 1:
                    split = splits[0]
                elif "train" in loaded:
                    split = "train"
                else:
                    raise UsageError(
                        f"--input {path}: holds splits {', '.join(splits)}; choose one with --split"
                    )
            if split not in loaded:
                raise UsageError(f"--split {split}: not in {path} (splits: {', '.join(splits)})")
            dataset = loaded[split]
            label = f"split {split!r}, "
        else:
            if split is not None:
                raise UsageError(f"--split {split}: {path} holds a single dataset, not splits")
            dataset = loaded
            label = ""
        self._dataset = dataset
        size = len(dataset)
        self.total = size if limit is None else min(size, limit)
        self.description = f"{path} (Hugging Face dataset, {label}{size:,} rows)"

    def items(self, wanted: Callable[[int], bool]) -> Iterator[RawItem]:
        """Yield the wanted rows as dicts."""
        for index in range(self.total):
            if wanted(index):
                try:
                    yield index, self._dataset[index], None
                except Exception as exc:  # a broken row must not stop the run
                    yield index, None, f"cannot read row: {exc}"


def open_input(path: str, *, limit: int | None = None, split: str | None = None) -> InputSource:
    """Open a JSONL file, a JSON array file or a ``save_to_disk`` folder.

    Args:
        path: The input.
        limit: Only the first ``limit`` records.
        split: Split of a ``DatasetDict`` folder (default: the only one, or ``train``).

    Raises:
        UsageError: The input is missing, unreadable or of an unknown kind.
    """
    if not os.path.exists(path):
        raise UsageError(f"--input {path}: no such file or directory")
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, m)) for m in HF_MARKERS):
            raise UsageError(
                f"--input {path}: a directory, but not a Hugging Face dataset saved with "
                "save_to_disk (no dataset_info.json or dataset_dict.json)"
            )
        return HFDatasetSource(path, limit, split)
    if split is not None:
        raise UsageError(f"--split {split}: only applies to a Hugging Face dataset folder")
    try:
        first = _first_char(path)
    except (OSError, EOFError) as exc:
        raise UsageError(f"--input {path}: cannot read: {exc}") from None
    if first == b"[":
        return JsonArraySource(path, limit)
    return JsonlSource(path, limit)


# -- records -> token ids ---------------------------------------------------------------


def _field(record: Mapping[str, Any], names: Sequence[str]) -> tuple[str, Any] | None:
    for name in names:
        if name in record and record[name] is not None:
            return name, record[name]
    return None


def _check_token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError(f"'{name}' must be a list of integers")
    if not value:
        raise ValueError(f"'{name}' is empty")
    if any(t < 0 for t in value):
        raise ValueError(f"'{name}' holds a negative token id")
    return list(value)


def _check_messages(value: Any, name: str) -> list[dict[str, Any]]:
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"'{name}' must be a non-empty list of messages")
    messages = []
    for pos, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(f"'{name}[{pos}]' is not an object")
        if "role" in message:
            role, content = message["role"], message.get("content")
        elif "from" in message:  # ShareGPT
            role = SHAREGPT_ROLES.get(str(message["from"]).lower(), message["from"])
            content = message.get("value")
        else:
            raise ValueError(f"'{name}[{pos}]' has no 'role' (or ShareGPT 'from')")
        if not isinstance(role, str):
            raise ValueError(f"'{name}[{pos}]': role must be a string")
        if content is None:
            raise ValueError(f"'{name}[{pos}]' has no content")
        messages.append(
            {
                **{k: v for k, v in message.items() if k not in ("from", "value")},
                "role": role,
                "content": content,
            }
        )
    return messages


def interpret(record: Any) -> tuple[str, Any]:
    """Classify a record: ``("token_ids", ids)``, ``("messages", chat)`` or ``("text", str)``.

    Raises:
        ValueError: The record holds no usable prompt; the message says why.
    """
    if isinstance(record, str):
        if not record:
            raise ValueError("empty text")
        return "text", record
    if isinstance(record, list):
        return "token_ids", _check_token_ids(record, "token_ids")
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if found := _field(record, TOKEN_FIELDS):
        return "token_ids", _check_token_ids(found[1], found[0])
    if found := _field(record, CHAT_FIELDS):
        return "messages", _check_messages(found[1], found[0])
    if found := _field(record, TEXT_FIELDS):
        name, text = found
        if not isinstance(text, str):
            raise ValueError(f"'{name}' must be a string")
        if not text:
            raise ValueError(f"'{name}' is empty")
        return "text", text
    keys = ", ".join(sorted(map(str, record))) or "none"
    raise ValueError(f"no 'text', 'messages' or 'token_ids' field (keys: {keys})")


def load_tokenizer(model: str, engine_args: Mapping[str, Any]) -> Any:
    """The tokenizer vLLM will use: ``engine_args["tokenizer"]`` or the model's own.

    Raises:
        UsageError: It cannot be loaded.
    """
    from transformers import AutoTokenizer

    name = str(engine_args.get("tokenizer") or model)
    kwargs: dict[str, Any] = {"trust_remote_code": bool(engine_args.get("trust_remote_code"))}
    revision = engine_args.get("tokenizer_revision") or engine_args.get("revision")
    if revision:
        kwargs["revision"] = revision
    try:
        return AutoTokenizer.from_pretrained(name, **kwargs)
    except Exception as exc:
        raise UsageError(f"cannot load the tokenizer of {name}: {exc}") from None


class PromptEncoder:
    """Turns raw records into ``Prompt``s, tokenizing texts in batches.

    Args:
        tokenizer: A Hugging Face tokenizer (``transformers``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.masker = ChatMasker(tokenizer)
        # Offsets locate the assistant turns; slow tokenizers have none (ChatMasker says so).
        self._offsets = self.masker.needs_offsets and bool(getattr(tokenizer, "is_fast", False))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The chat as the model sees it (a generation prompt unless it ends with a reply)."""
        return self.masker.render(
            messages, generation_prompt=messages[-1].get("role") != "assistant"
        )

    def encode(self, items: Sequence[RawItem]) -> list[Prompt]:
        """Tokenize a batch of raw items; every item gives exactly one ``Prompt``."""
        out: dict[int, Prompt] = {}
        texts: list[tuple[int, str, str, Any]] = []  # (position, kind, text, messages)
        for pos, (index, record, error) in enumerate(items):
            if error is not None:
                out[pos] = Prompt(index, None, error)
                continue
            try:
                kind, payload = interpret(record)
                if kind == "token_ids":
                    mask = record.get(MASK_FIELD) if isinstance(record, Mapping) else None
                    if mask is not None:
                        mask = record_mask(mask, len(payload), MASK_FIELD)
                    out[pos] = Prompt(index, payload, None, kind, mask)
                elif kind == "messages":
                    texts.append((pos, kind, self.render_chat(payload), payload))
                else:
                    texts.append((pos, kind, payload, None))
            except Exception as exc:
                out[pos] = Prompt(index, None, first_line(exc))
        for special in (True, False):  # plain text with special tokens, chats without
            group = [t for t in texts if (t[1] == "text") == special]
            if group:
                offsets = self._offsets and not special
                results = self._tokenize([t[2] for t in group], special, offsets)
                for (pos, kind, text, chat), result in zip(group, results, strict=True):
                    out[pos] = self._prompt(items[pos][0], kind, text, chat, result)
        return [out[pos] for pos in range(len(items))]

    def _prompt(self, index: int, kind: str, text: str, chat: Any, result: Any) -> Prompt:
        """The ``Prompt`` of one tokenized text (a chat gets its assistant mask here)."""
        if isinstance(result, str):
            return Prompt(index, None, result, kind)
        ids, offsets = result
        if not ids:
            return Prompt(index, None, "prompt is empty after tokenization", kind)
        if chat is None:
            return Prompt(index, ids, None, kind)
        try:
            mask = self.masker.mask(chat, text, ids, offsets)
        except Exception as exc:
            return Prompt(index, None, first_line(exc), kind)
        return Prompt(index, ids, None, kind, mask)

    def _tokenize(
        self, texts: list[str], special: bool, offsets: bool
    ) -> list[tuple[list[int], Any] | str]:
        """``(ids, offsets or None)`` per text, or an error string for one that fails."""
        options = {"add_special_tokens": special, "return_offsets_mapping": offsets}
        try:
            encoded = self.tokenizer(texts, **options)
            spans = encoded["offset_mapping"] if offsets else [None] * len(texts)
            return [(list(ids), s) for ids, s in zip(encoded["input_ids"], spans, strict=True)]
        except Exception:
            results: list[tuple[list[int], Any] | str] = []
            for text in texts:  # find the culprit(s); keep the rest
                try:
                    one = self.tokenizer(text, **options)
                    results.append((list(one["input_ids"]), one.get("offset_mapping")))
                except Exception as exc:
                    results.append(f"cannot tokenize: {first_line(exc)}")
            return results
