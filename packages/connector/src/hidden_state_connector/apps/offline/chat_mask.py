"""Loss masks of chat records: which tokens of a rendered conversation are the assistant's.

The rule: a token counts (1) when it holds text of an assistant turn as the chat
template renders it -- the reply and whatever the template closes it with (an
end-of-turn token such as ``<|im_end|>`` or ``<|eot_id|>``), but not the whitespace the
template puts after that, nor the role header before the reply. Every other token is 0.
A chat that ends with a generation prompt thus has only its earlier replies marked; with
``--include-output-tokens`` the generated reply is marked too (by the connector).

Two ways to find those tokens, the first that applies:

1. The template marks replies itself with ``{% generation %}``: transformers'
   ``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the mask.
2. Otherwise the conversation is rendered up to each assistant turn twice, with a
   generation prompt before the reply and with the reply: what the second adds to the
   first is the turn's text, found in the whole rendering in order, and the tokens
   overlapping it (by the fast tokenizer's character offsets) are marked.

A chat whose replies cannot be located that way (a template that renders a turn
differently once later turns follow, a tokenizer without offsets) is a failed record,
never a sample that silently trains on every token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatMasker:
    """Computes assistant-token masks for one tokenizer and its chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        try:
            template = tokenizer.get_chat_template()
        except Exception:  # no template: rendering fails first, with its own message
            template = ""
        self.uses_generation_tags = bool(GENERATION_TAG.search(str(template or "")))

    @property
    def needs_offsets(self) -> bool:
        """Whether ``mask`` needs the character offsets of the tokens (method 2)."""
        return not self.uses_generation_tags

    def render(self, messages: Sequence[dict[str, Any]], *, generation_prompt: bool) -> str:
        """The chat template's text for ``messages``."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise ValueError("the chat template did not render to text")
        return text

    def mask(
        self,
        messages: Sequence[dict[str, Any]],
        rendered: str,
        token_ids: Sequence[int],
        offsets: Sequence[tuple[int, int]] | None,
    ) -> list[int]:
        """The 0/1 mask of ``token_ids``, the tokenization of ``rendered``.

        Raises:
            ValueError: The assistant tokens cannot be located; the message says why.
        """
        if self.uses_generation_tags:
            return self._tagged_mask(messages, token_ids)
        if offsets is None:
            raise ValueError(
                "cannot mark assistant tokens: the tokenizer gives no character offsets "
                "(not a fast tokenizer) and its chat template has no {% generation %} tags"
            )
        spans = self.assistant_spans(messages, rendered)
        return [int(any(s < end and e > start for start, end in spans)) for s, e in offsets]

    def assistant_spans(
        self, messages: Sequence[dict[str, Any]], rendered: str
    ) -> list[tuple[int, int]]:
        """Character ranges of the assistant turns in ``rendered`` (method 2).

        Raises:
            ValueError: A turn's text is not found where the whole rendering has it.
        """
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            before = self._before(messages, i)
            upto = self.render(messages[: i + 1], generation_prompt=False)
            if not upto.startswith(before):
                raise ValueError(
                    f"cannot mark assistant tokens: the chat template renders the messages "
                    f"before turn {i} differently once turn {i} follows"
                )
            turn = upto[len(before) :].rstrip()
            if not turn:
                continue
            start = rendered.find(turn, cursor)
            if start < 0:
                raise ValueError(
                    f"cannot mark assistant tokens: the chat template renders assistant "
                    f"turn {i} differently when later messages follow"
                )
            cursor = start + len(turn)
            spans.append((start, cursor))
        return spans

    def _before(self, messages: Sequence[dict[str, Any]], i: int) -> str:
        """The rendering up to turn ``i``'s reply: the messages before it, a generation prompt."""
        if i:
            return self.render(messages[:i], generation_prompt=True)
        try:  # a chat opening with a reply: templates may refuse an empty list
            return self.render([], generation_prompt=True)
        except Exception:
            return ""

    def _tagged_mask(
        self, messages: Sequence[dict[str, Any]], token_ids: Sequence[int]
    ) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=messages[-1].get("role") != "assistant",
        )
        if list(encoded["input_ids"]) != list(token_ids):
            raise ValueError(
                "cannot mark assistant tokens: the template's own tokenization differs "
                "from the prompt's"
            )
        return [int(bool(v)) for v in encoded["assistant_masks"]]


def record_mask(value: Any, num_tokens: int, name: str = "loss_mask") -> list[int]:
    """A pre-tokenized record's ``loss_mask``: one 0/1 (or ``true``/``false``) per token id.

    Raises:
        ValueError: Not a list of 0/1 of the token ids' length.
    """
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"'{name}' must be a list of 0/1")
    bad = next((i for i, v in enumerate(value) if not (isinstance(v, int) and v in (0, 1))), None)
    if bad is not None:
        raise ValueError(f"'{name}[{bad}]' is {value[bad]!r}; every entry must be 0 or 1")
    if len(value) != num_tokens:
        raise ValueError(f"'{name}' has {len(value)} entries for {num_tokens} token ids")
    return [int(v) for v in value]
