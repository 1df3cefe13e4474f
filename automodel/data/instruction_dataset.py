"""Instruction (supervised fine-tuning) data: one example per row, loss only on the response.

Two record formats in ``.jsonl`` files:

- ``format="prompt_response"``: ``{"prompt": str, "response": str}``. Tokens are
  ``[BOS] + tok(prompt) + tok(response) + [EOS]`` (BOS only if ``add_bos`` and the tokenizer has
  one, EOS if ``add_eos``); prompt and response are tokenized separately, so the boundary is exact.
  No separator is inserted: put one in your data, preferably as a leading space of the response
  (the shipped examples are ``"...\\nAnswer:"`` / ``" 42"``): byte-level BPE tokenizers attach a
  space to the following word, so a trailing space on the prompt would tokenize differently than
  in running text. Trainable targets: the response tokens and the EOS.
- ``format="messages"``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` rendered with the
  tokenizer's chat template. Trainable targets: the text of every assistant turn as the template
  renders it (content plus the template's end-of-turn markup, e.g. ``"...<|im_end|>\\n"``), found
  by rendering prefixes: for assistant message ``i`` the span is
  ``render(messages[:i], add_generation_prompt=True)`` .. ``render(messages[:i+1])``. This needs a
  template where rendering a prefix of a conversation gives a prefix of the full rendering; a
  template that rewrites earlier turns raises ``ValueError`` (use ``prompt_response`` then). The
  rendered text is tokenized in segments (prompt / assistant) so the mask boundary is exact;
  special tokens written in the template text are recognised by the tokenizer.

Each example is truncated to its first ``seq_len + 1`` tokens and shifted once (``examples.py``):
``input_ids`` ``[n]`` and ``labels`` ``[n]`` int64 with ``n <= seq_len``; the collator pads. With
``pack=True`` examples are packed into rows as in ``packing.py``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from automodel.data.chat_template import record_chat_stops, render_chat_segments
from automodel.data.dataset_common import RowsDataset
from automodel.data.examples import shift_example
from automodel.data.file_readers import detect_format, read_jsonl, resolve_files
from automodel.data.packing import pack_examples
from automodel.data.splits import select_split
from automodel.data.tokenizer import assets_dir
from automodel.errors import UserInputError

__all__ = [
    "InstructionDataset",
    "INSTRUCTION_FORMATS",
    "default_instructions_path",
    "join_segments",
    "render_chat_segments",
]

logger = logging.getLogger(__name__)

INSTRUCTION_FORMATS = ("prompt_response", "messages")


def default_instructions_path() -> str:
    """Path of the shipped synthetic instruction set (``prompt``, ``response`` and ``messages`` fields)."""
    return str(assets_dir() / "corpus" / "default_instructions.jsonl.gz")


def join_segments(
    segments: Sequence[tuple[Any, bool]],
    token_ids: Sequence[list[int]],
    start: int,
    *,
    bos: int | None,
    eos: int,
    add_bos: bool,
    add_eos: bool,
) -> tuple[list[int], list[bool], int]:
    """One example's tokens and trainable flags from its tokenized segments.

    Args:
        segments: ``(text, trainable)`` per segment of the example, in order.
        token_ids: the token ids of ALL segments of a batch, flat; this example's start at ``start``.
        bos, eos: the tokenizer's ids; ``add_bos`` puts ``bos`` (not trained) first when it exists,
            ``add_eos`` puts ``eos`` (trained) last.

    Returns:
        ``(tokens, trainable, next_start)``: ``len(tokens) == len(trainable)``; nothing is mutated.
    """
    toks: list[int] = []
    train: list[bool] = []
    if add_bos and bos is not None:
        toks.append(int(bos))
        train.append(False)
    k = start
    for _, trainable in segments:
        toks += token_ids[k]
        train += [trainable] * len(token_ids[k])
        k += 1
    if add_eos:
        toks.append(int(eos))
        train.append(True)
    return toks, train, k


def _check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise UserInputError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserInputError(
                f"{where}: message {j} is {m!r}; every message must be an object with string 'role' and 'content'"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise UserInputError(
            f"{where}: no message has role 'assistant', so there is nothing to train on; every conversation "
            "needs at least one assistant turn"
        )
    return messages


class InstructionDataset(RowsDataset, Dataset):
    """Prompt/response or chat examples with the loss masked on everything but the responses.

    Args:
        path: ``.jsonl`` file(s) or a directory (optionally ``.gz``); None = the shipped synthetic
            instruction set (it has fields for both formats).
        tokenizer: a tokenizer, or a name/path/None passed to ``load_tokenizer``.
        seq_len: maximum input positions per example (>= 2); longer examples are truncated.
        format: ``"prompt_response"`` or ``"messages"``.
        split, val_fraction: as in ``TextDataset`` (records chosen by content hash).
        prompt_field, response_field, messages_field: jsonl field names.
        add_bos: ``prompt_response`` only: start with the tokenizer's BOS token (if it has one).
        add_eos: ``prompt_response`` only: end with EOS (a trained target, so the model learns to stop).
        pack, seq_pad_multiple: pack examples per row (see ``packing.py``).

    Items: ``input_ids``/``labels`` ``[n]`` int64 (n <= seq_len), or packed rows. Attributes:
    ``pad_token_id``, ``seq_pad_multiple``, ``packed``, ``num_examples``, ``num_truncated``,
    ``num_without_labels`` (examples whose response was truncated away entirely; a warning is logged),
    ``chat_stop_ids`` (``messages``: the template's end-of-turn token ids, also recorded on the tokenizer
    for the export, see :mod:`automodel.data.chat_template`; else empty).
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        seq_len: int = 1024,
        format: str = "prompt_response",
        split: str = "train",
        val_fraction: float = 0.05,
        prompt_field: str = "prompt",
        response_field: str = "response",
        messages_field: str = "messages",
        add_bos: bool = True,
        add_eos: bool = True,
        pack: bool = False,
        seq_pad_multiple: int = 1,
    ) -> None:
        self._init_rows(tokenizer, seq_len, split, val_fraction, pack, seq_pad_multiple)
        if format not in INSTRUCTION_FORMATS:
            raise UserInputError(
                f"format={format!r} is not one of {INSTRUCTION_FORMATS}; use 'prompt_response' for "
                "{prompt, response} records or 'messages' for chat {messages: [{role, content}, ...]} records"
            )
        self.format = format
        if format == "messages" and not getattr(self.tokenizer, "chat_template", None):
            raise UserInputError(
                f"format='messages' needs a chat template but tokenizer {self.tokenizer.name_or_path!r} has none; "
                "use a tokenizer with a chat_template (the shipped default has one) or format='prompt_response'"
            )
        where = "the default instruction set" if path is None else repr(path)

        read = self._read(path, format, prompt_field, response_field, messages_field)
        # The split key is the part of the record this format trains on, so exact duplicates (as
        # trained) always land on the same side: nothing in validation is also a training example.
        records = select_split([(w, r) for w, r, _ in read], [k for _, _, k in read], split, val_fraction)
        if not records:
            raise UserInputError(
                f"split {split!r} of {where} has no records (val_fraction={val_fraction}); add data, raise "
                "val_fraction, or use split='all' with a separate validation file"
            )

        # Segments of every record: (text, trainable); tokenized in one batch call.
        seg_lists: list[list[tuple[str, bool]]] = []
        for where_rec, rec in records:
            if format == "prompt_response":
                seg_lists.append([(rec[prompt_field], False), (rec[response_field], True)])
            else:
                seg_lists.append(render_chat_segments(self.tokenizer, rec[messages_field], where_rec))
        flat = [t for segs in seg_lists for t, _ in segs]
        flat_ids = self.tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
        # the template's end-of-turn token(s), recorded on the tokenizer for the export (chat_template.py)
        self.chat_stop_ids = (
            record_chat_stops(self.tokenizer, records[0][1][messages_field], where) if format == "messages" else []
        )

        bos, eos = self.tokenizer.bos_token_id, int(self.tokenizer.eos_token_id)
        examples, k = [], 0
        self.num_truncated = self.num_without_labels = 0
        wrap = format == "prompt_response"  # chat templates bring their own special tokens
        for segs in seg_lists:
            toks, train, k = join_segments(
                segs, flat_ids, k, bos=bos, eos=eos, add_bos=wrap and add_bos, add_eos=wrap and add_eos
            )
            if len(toks) > self.seq_len + 1:
                self.num_truncated += 1
                toks, train = toks[: self.seq_len + 1], train[: self.seq_len + 1]
            if len(toks) < 2:
                raise UserInputError(
                    f"an example of {where} has {len(toks)} token(s); with add_bos=False and add_eos=False an "
                    "empty prompt and response give nothing to train on. Remove empty records or enable add_eos"
                )
            if not any(train[1:]):
                self.num_without_labels += 1
            examples.append(shift_example(np.asarray(toks), np.asarray(train)))
        self.num_examples = len(examples)
        if self.num_truncated:  # as HFDataset says it: the end of a long example is not trained on
            logger.info(
                "%d of %d examples of %s truncated to seq_len+1=%d tokens",
                self.num_truncated, len(examples), where, self.seq_len + 1,
            )  # fmt: skip
        if self.num_without_labels:
            logger.warning(
                "%d of %d examples of %s have no trainable token after truncation to seq_len=%d (prompt too "
                "long); they contribute nothing to the loss. Raise data.seq_len or shorten the prompts.",
                self.num_without_labels, len(examples), where, self.seq_len,
            )  # fmt: skip
        if pack:
            self._items = pack_examples(
                examples,
                seq_len=self.seq_len,
                seq_pad_multiple=self.seq_pad_multiple,
                pad_token_id=self.pad_token_id,
            )
        else:
            self._items = examples

    @staticmethod
    def _read(
        path: Any, fmt: str, prompt_field: str, response_field: str, messages_field: str
    ) -> list[tuple[str, dict[str, Any], str]]:
        """Return ``(where, record reduced to the used fields, split key)`` for every record."""
        files = resolve_files(default_instructions_path() if path is None else path)
        out: list[tuple[str, dict[str, Any], str]] = []
        for f in files:
            if detect_format(f) != "jsonl":
                raise UserInputError(
                    f"instruction data must be .jsonl (one JSON object per line), got {str(f)!r}; convert it to "
                    "JSON lines with prompt/response or messages fields"
                )
            for lineno, rec in read_jsonl(f):
                where = f"{f}:{lineno}"
                if fmt == "prompt_response":
                    for field in (prompt_field, response_field):
                        if not isinstance(rec.get(field), str):
                            raise UserInputError(
                                f"{where}: field {field!r} is missing or not a string (fields: {sorted(rec)}); "
                                "format='prompt_response' needs string prompt/response fields: set "
                                "data.prompt_field/data.response_field, or use format='messages' for chat records"
                            )
                    rec = {prompt_field: rec[prompt_field], response_field: rec[response_field]}
                else:
                    if messages_field not in rec:
                        raise UserInputError(
                            f"{where}: no field {messages_field!r} (fields: {sorted(rec)}); format='messages' "
                            "needs a list of {role, content}: set data.messages_field, or use "
                            "format='prompt_response'"
                        )
                    rec = {messages_field: _check_messages(rec[messages_field], where)}
                out.append((where, rec, json.dumps(rec, sort_keys=True, ensure_ascii=False)))
        return out

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._items[index].items()}
