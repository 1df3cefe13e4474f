"""Chat templates: render a conversation into trained / untrained segments, and find the token that ends
an assistant turn.

A chat SFT run trains the model to end every assistant turn with the template's end-of-turn markup
(ChatML: ``<|im_end|>``), which is not necessarily the tokenizer's EOS (the shipped tokenizer's EOS is
``<|endoftext|>``). So that the exported model stops where the data taught it to stop, a dataset that
renders chats records the end-of-turn token(s) on the tokenizer it was given
(:func:`record_chat_stops`), and the export adds what is recorded there
(:func:`recorded_chat_stop_ids`) to the EOS list of its ``generation_config.json``. A tokenizer that
only ever tokenized plain text records nothing, and its export keeps the EOS alone.

The end-of-turn token is derived from the template itself: a short conversation (or, when the template
rejects it, one of the data's own) is rendered with :func:`render_chat_segments`, and the first special
token after the assistant's content in the assistant segment is the one that ends the turn. Any
template works, whatever its end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``,
``</s>``, a user's own); a template that ends turns with plain text only gives none.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedTokenizerBase

from automodel.errors import UserInputError

__all__ = [
    "render_chat_segments",
    "special_ids",
    "end_of_turn_ids",
    "record_chat_stops",
    "recorded_chat_stop_ids",
    "renders_chats",
]

logger = logging.getLogger(__name__)

# where a tokenizer keeps the end-of-turn ids of the chats it rendered (see record_chat_stops)
_RECORD_ATTR = "_automodel_chat_stop_ids"
_PROBE = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "2 plus 2 is 4."},
]


def render_chat_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str = "conversation"
) -> list[tuple[str, bool]]:
    """Render ``messages`` with the chat template and cut it into ``(text, is_assistant)`` segments.

    The concatenation of the segment texts is exactly ``apply_chat_template(messages, tokenize=False)``.
    Raises ``ValueError`` if the template has no prefix property (see module docstring).
    """

    def render(msgs: list[dict[str, Any]], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    segments: list[tuple[str, bool]] = []
    pos = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[: i + 1], False)
        if not (full.startswith(after) and after.startswith(before) and len(before) >= pos):
            raise UserInputError(
                f"{where}: the chat template of {tokenizer.name_or_path!r} is not prefix-stable (rendering the "
                f"first {i} messages plus the generation prompt is not a prefix of the rendering with assistant "
                f"message {i}, or that is not a prefix of the whole conversation), so the assistant tokens "
                "cannot be located exactly; use format='prompt_response', or a template without "
                "turn-dependent rewriting"
            )
        segments.append((full[pos : len(before)], False))
        segments.append((full[len(before) : len(after)], True))
        pos = len(after)
    segments.append((full[pos:], False))
    return [(t, a) for t, a in segments if t]


def special_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids of ``tokenizer``'s special tokens: its named and extra special tokens, and every added token
    flagged special (some tokenizers list an end-of-turn token only there)."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def _turn_end(tokenizer: PreTrainedTokenizerBase, content: str, segment: str, special: set[int]) -> int | None:
    """The special token that ends one rendered assistant ``segment`` whose message text is ``content``:
    the first special token after the content (the last one of the segment if the content is not in it)."""
    at = segment.rfind(content) if content else -1
    tail = segment[at + len(content) :] if at >= 0 else segment
    ids = [int(i) for i in tokenizer(tail, add_special_tokens=False)["input_ids"] if int(i) in special]
    if not ids:
        return None
    return ids[0] if at >= 0 else ids[-1]


def end_of_turn_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]] | None = None
) -> list[int]:
    """The special token ids that end an assistant turn in ``tokenizer``'s chat template, in order.

    A two-message probe conversation is rendered first; if the template refuses it (e.g. it needs a
    system message), ``messages`` (one of the data's conversations) is rendered instead. Empty when the
    template ends assistant turns without a special token, or renders neither conversation.
    """
    special = special_ids(tokenizer)
    for conv in (_PROBE, messages):
        if not conv:
            continue
        try:
            segments = render_chat_segments(tokenizer, conv)
        except Exception:  # noqa: BLE001 - a template that rejects this conversation: try the next one
            continue
        answers = [m["content"] for m in conv if m.get("role") == "assistant"]
        spans = [text for text, trained in segments if trained]
        found: list[int] = []
        for content, span in zip(answers, spans, strict=False):
            end = _turn_end(tokenizer, content, span, special)
            if end is not None and end not in found:
                found.append(end)
        return found
    return []


def record_chat_stops(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]] | None = None, where: str = "chat data"
) -> list[int]:
    """Record on ``tokenizer`` that chats rendered with its template are trained: the template's
    end-of-turn ids (:func:`end_of_turn_ids`) join those already recorded. Mutates ``tokenizer`` (one
    private attribute; nothing it saves or tokenizes changes). Returns the ids found for this template.

    Called by every dataset that renders chats (``format="messages"``); the export reads the record
    back with :func:`recorded_chat_stop_ids`. A template without a special end-of-turn token logs a
    warning (the exported model then stops at EOS only).
    """
    found = end_of_turn_ids(tokenizer, messages)
    if not found:
        logger.warning(
            "%s: the chat template of %r ends assistant turns without a special token, so the exported "
            "generation config stops at EOS (id %s) only; end each assistant turn with a special token in "
            "the template for the model to learn where to stop",
            where, tokenizer.name_or_path, tokenizer.eos_token_id,
        )  # fmt: skip
    recorded = list(getattr(tokenizer, _RECORD_ATTR, ()))
    setattr(tokenizer, _RECORD_ATTR, tuple(recorded + [i for i in found if i not in recorded]))
    return found


def recorded_chat_stop_ids(tokenizer: Any) -> list[int]:
    """The end-of-turn ids :func:`record_chat_stops` recorded on ``tokenizer`` ([] for one that rendered
    no chat: a plain-text run keeps its EOS alone)."""
    return [int(i) for i in getattr(tokenizer, _RECORD_ATTR, ())]


def renders_chats(tokenizer: Any) -> bool:
    """Whether a dataset rendered chats with ``tokenizer``'s template (:func:`record_chat_stops` was called,
    whether or not it found an end-of-turn token): the run trains a chat model."""
    return hasattr(tokenizer, _RECORD_ATTR)
