"""Turn rows of a Hugging Face dataset into training examples: column mapping, chat rendering, masks.

One function, :func:`tokenize_rows`, used both by ``Dataset.map`` (batched, in worker processes)
and by the streaming path, so both give the same examples. Formats (``fmt``):

- ``text``: column ``text_column`` holds a document. Output per non-blank document: ``ids`` (its
  tokens + EOS, for the concatenated rows of :class:`~automodel.data.hf_dataset.HFDataset`), or, with
  ``pieces=True``, one example per piece of at most ``seq_len`` inputs (as ``TextDataset(pack=True)``).
- ``prompt_completion``: columns ``prompt_column`` and ``completion_column``; tokens
  ``[BOS] + prompt + completion + [EOS]`` with the loss on the completion and EOS (exactly
  ``InstructionDataset(format="prompt_response")``).
- ``messages``: column ``messages_column``, a list of ``{role, content}``, rendered with the tokenizer's
  chat template; the loss is on the assistant turns only (exactly ``InstructionDataset(format="messages")``).

Examples are ``input_ids``/``labels`` lists of ``n <= seq_len`` ints (shifted once, see
``examples.py``), plus ``n`` and ``truncated``. Bad rows raise :class:`~automodel.errors.UserInputError`
naming the row index.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from automodel.data.chat_template import render_chat_segments
from automodel.data.examples import IGNORE_INDEX, split_long_sequence
from automodel.data.instruction_dataset import join_segments
from automodel.data.splits import is_validation, split_fraction
from automodel.errors import UserInputError

__all__ = [
    "HF_FORMATS",
    "TOKENIZE_CALLS",
    "tokenize_rows",
    "clean_messages",
    "first_conversation",
    "required_columns",
]

HF_FORMATS = ("text", "prompt_completion", "messages")

# Rows tokenized by tokenize_rows in this process (tests read it to prove a warm cache does no work).
TOKENIZE_CALLS = {"rows": 0}


def required_columns(fmt: str, columns: dict[str, str]) -> list[str]:
    """The dataset columns ``fmt`` reads, from the ``columns`` mapping (``text``/``prompt``/...)."""
    if fmt == "text":
        return [columns["text"]]
    if fmt == "prompt_completion":
        return [columns["prompt"], columns["completion"]]
    return [columns["messages"]]


def clean_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Check a chat row and drop ``None`` fields (arrow gives every message every key any message has).

    Raises ``UserInputError`` for a row that is not a non-empty list of ``{role: str, content: str}``, or
    that has no ``assistant`` turn.
    """
    if not isinstance(messages, list) or not messages:
        raise UserInputError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.120}"
        )
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserInputError(f"{where}: message {j} is {m!r:.120}, not a {{'role', 'content'}} object")
        m = {k: v for k, v in m.items() if v is not None}
        if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise UserInputError(
                f"{where}: message {j} is {m!r:.120}; every message needs string 'role' and 'content'"
            )
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise UserInputError(
            f"{where}: no message has role 'assistant', so there is nothing to train on; every conversation "
            "needs at least one assistant turn (remove the row or fix its roles)"
        )
    return out


def first_conversation(rows: Any, fmt: str, columns: dict[str, str]) -> list[dict[str, Any]] | None:
    """The first row's conversation of ``rows`` (a ``datasets`` table, or a list of row dicts) when ``fmt``
    is ``messages`` and it is well formed, else None: what :func:`~automodel.data.chat_template.end_of_turn_ids`
    renders when a template refuses its own probe conversation."""
    if fmt != "messages" or len(rows) == 0:
        return None
    try:
        return clean_messages(rows[0][columns["messages"]], "row 1")
    except UserInputError:
        return None


def _split_key(fmt: str, row: dict[str, Any], columns: dict[str, str]) -> str:
    # The same keys as TextDataset / InstructionDataset, so a record lands on the same side everywhere.
    if fmt == "text":
        return row[columns["text"]]
    if fmt == "prompt_completion":
        rec = {columns["prompt"]: row[columns["prompt"]], columns["completion"]: row[columns["completion"]]}
    else:
        rec = {columns["messages"]: row[columns["messages"]]}
    return json.dumps(rec, sort_keys=True, ensure_ascii=False)


def _shifted(tokens: list[int], train: list[bool], seq_len: int) -> tuple[list[int], list[int], bool]:
    truncated = len(tokens) > seq_len + 1
    if truncated:
        tokens, train = tokens[: seq_len + 1], train[: seq_len + 1]
    labels = [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], train[1:], strict=True)]
    return tokens[:-1], labels, truncated


def tokenize_rows(
    batch: dict[str, list[Any]],
    indices: list[int],
    *,
    tokenizer: Any,
    fmt: str,
    columns: dict[str, str],
    seq_len: int,
    split: str,
    val_fraction: float,
    pieces: bool = False,
    add_bos: bool = True,
    add_eos: bool = True,
    split_column: bool = False,
) -> dict[str, list[Any]]:
    """Tokenize a batch of rows (``{column: [values]}``) into examples (``{field: [values]}``).

    ``indices`` are the rows' indices in the source (for error messages). Rows of the other split
    (``split`` = ``train``/``validation`` by content hash, or ``all``) and blank documents are dropped,
    so the output may have fewer (``text`` pieces: more) rows than the input. ``split_column`` (with
    ``split="all"``): every output row also gets ``split_u``, its record's
    :func:`~automodel.data.splits.split_fraction` (float64), so one tokenized file serves both splits.
    """
    n_rows = len(indices)
    TOKENIZE_CALLS["rows"] += n_rows
    rows = [{c: batch[c][i] for c in batch} for i in range(n_rows)]
    keep = []
    for i, row in enumerate(rows):
        where = f"row {indices[i] + 1}"  # counted from 1, as TextDataset counts lines
        for c in required_columns(fmt, columns):
            if fmt != "messages" and not isinstance(row[c], str):
                raise UserInputError(
                    f"{where}: column {c!r} is {type(row[c]).__name__} ({row[c]!r:.80}), not a string; every "
                    f"row needs a string in {c!r}"
                )
        if fmt == "messages":
            row[columns["messages"]] = clean_messages(row[columns["messages"]], where)
        if fmt == "text" and not row[columns["text"]].strip():
            continue
        if split != "all" and is_validation(_split_key(fmt, row, columns), val_fraction) != (
            split == "validation"
        ):
            continue
        keep.append((where, row))
    fractions = [split_fraction(_split_key(fmt, r, columns)) for _, r in keep] if split_column else None

    eos = int(tokenizer.eos_token_id)
    if fmt == "text":
        texts = [r[columns["text"]] for _, r in keep]
        enc = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []
        docs = [[*ids, eos] for ids in enc]
        if not pieces:
            out = {"ids": docs, "n": [len(d) for d in docs]}
            return out if fractions is None else {**out, "split_u": fractions}
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "n": [], "truncated": []}
        piece_fractions = []
        for j, d in enumerate(docs):
            for s, t in split_long_sequence(len(d), seq_len):
                x = d[s:t]
                out["input_ids"].append(x[:-1])
                out["labels"].append(x[1:])
                out["n"].append(len(x) - 1)
                out["truncated"].append(False)
                if fractions is not None:
                    piece_fractions.append(fractions[j])
        return out if fractions is None else {**out, "split_u": piece_fractions}

    seg_lists: list[list[tuple[str, bool]]] = []
    for where, row in keep:
        if fmt == "prompt_completion":
            seg_lists.append([(row[columns["prompt"]], False), (row[columns["completion"]], True)])
        else:
            try:
                seg_lists.append(render_chat_segments(tokenizer, row[columns["messages"]], where))
            except UserInputError:
                raise
            except ValueError as exc:
                raise UserInputError(str(exc)) from exc
    flat = [t for segs in seg_lists for t, _ in segs]
    flat_ids = tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
    bos = tokenizer.bos_token_id
    out = {"input_ids": [], "labels": [], "n": [], "truncated": []}
    k = 0
    for (where, _), segs in zip(keep, seg_lists, strict=True):
        wrap = fmt == "prompt_completion"  # chat templates bring their own special tokens
        toks, train, k = join_segments(
            segs, flat_ids, k, bos=bos, eos=eos, add_bos=wrap and add_bos, add_eos=wrap and add_eos
        )
        if len(toks) < 2:
            raise UserInputError(
                f"{where}: the example has {len(toks)} token(s); an empty prompt and completion give nothing "
                "to train on. Remove empty rows or enable add_eos"
            )
        ids, labels, truncated = _shifted(toks, train, seq_len)
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["n"].append(len(ids))
        out["truncated"].append(truncated)
    return out if fractions is None else {**out, "split_u": fractions}


def example_arrays(ex: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, labels)`` of one tokenized example as int64 arrays."""
    return np.asarray(ex["input_ids"], dtype=np.int64), np.asarray(ex["labels"], dtype=np.int64)
