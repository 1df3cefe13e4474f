"""Collate examples into a ``[B, S]`` batch, right-padded to a multiple that context parallelism needs.

Batch (all int64, CPU):

- ``input_ids`` ``[B, S]``: tokens, ``pad_token_id`` after each row's real tokens.
- ``labels`` ``[B, S]``: already shifted (``labels[b, t]`` is the target of position ``t``), ``-100``
  on padding and on every other ignored position. The model must not shift again.
- packed rows only: ``position_ids`` ``[B, S]`` (restarting per document, counting on through
  padding), ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` with ``-1000`` after each row's last document;
  the row padding added here is counted in the row's last ``seq_lens_padded`` entry.
- ``attention_mask`` ``[B, S]`` (1 = real, 0 = padding) only if ``emit_attention_mask=True`` AND some
  row of the batch has padding. Never for packed rows.

``S`` is the longest row rounded up to ``pad_to_multiple_of`` (at least 1 position).

Why right padding with ``labels=-100`` and no attention mask is exact for causal attention:
padding sits after every real token of its row, and a causal query at position ``t`` only
attends to keys ``<= t``. So no real token ever attends to a padding token: every real position's
hidden states, logits and loss term are bit-for-bit what they would be without the padding.
The padding positions' own outputs are garbage but carry label -100, so they add nothing to the
loss and, since no real position reads them, nothing to any gradient. This is what lets ring
context parallelism (which only takes plain causal attention, no mask) train on padded rows.
(It assumes the model mixes positions only through causal attention, as decoder-only LMs do; a
loss averaged per token must divide by the number of labels != -100, see
:func:`count_label_tokens`, not by ``B * S``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from automodel.data.examples import IGNORE_INDEX
from automodel.data.packing import SEQ_LENS_PAD, round_up

__all__ = ["Collator", "collate", "count_label_tokens", "empty_example", "label_token_count", "PACKED_KEYS"]

PACKED_KEYS = ("input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded")
PLAIN_KEYS = ("input_ids", "labels")


def empty_example(packed: bool) -> dict[str, torch.Tensor]:
    """A zero-length example: the collator turns it into a row of padding with every label -100.

    The sampler uses it to fill the last global batch when ``drop_last=False`` so every rank gets
    the same number of rows; it contributes nothing to a loss summed over labels.
    """
    keys = PACKED_KEYS if packed else PLAIN_KEYS
    return {k: torch.zeros(0, dtype=torch.int64) for k in keys}


def label_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Number of label tokens (``labels != -100``) as a 0-dim int64 tensor on ``labels.device`` (no sync)."""
    return (labels != IGNORE_INDEX).sum()


def count_label_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    """Number of positions that contribute to the loss: ``(batch["labels"] != -100).sum()`` as an int."""
    return int(label_token_count(batch["labels"]).item())


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}")
    return value


def collate(
    examples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int = 1,
    emit_attention_mask: bool = False,
) -> dict[str, torch.Tensor]:
    """Stack ``examples`` (dicts of 1-D int64 tensors, see module docstring) into a right-padded batch.

    Args:
        examples: non-empty list; all plain (``input_ids``, ``labels``) or all packed (plus
            ``position_ids``, ``seq_lens``, ``seq_lens_padded``). Not mutated.
        pad_token_id: token written into padding positions (never read by a real position).
        pad_to_multiple_of: ``S`` is rounded up to this (e.g. ``2 * cp_size`` for ring CP).
        emit_attention_mask: also return ``attention_mask`` when some row is padded (plain rows only).

    Returns:
        dict of ``[B, S]`` int64 tensors (``[B, P]`` for ``seq_lens``/``seq_lens_padded``).
    """
    _check_int("pad_token_id", pad_token_id, 0)
    _check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
    if not examples:
        raise ValueError("cannot collate an empty list of examples")
    packed = "seq_lens" in examples[0]
    keys = PACKED_KEYS if packed else PLAIN_KEYS
    for i, ex in enumerate(examples):
        if set(ex) != set(keys):
            raise ValueError(
                f"example {i} has keys {sorted(ex)}, expected {sorted(keys)}; do not mix packed and unpacked "
                "examples in one batch"
            )
        n = ex["input_ids"].numel()
        if ex["labels"].numel() != n or (packed and ex["position_ids"].numel() != n):
            raise ValueError(f"example {i}: input_ids/labels/position_ids lengths differ")
    if packed and emit_attention_mask:
        raise ValueError(
            "emit_attention_mask=True is not supported for packed rows: documents are separated by "
            "seq_lens/seq_lens_padded, not by a padding mask; set emit_attention_mask=False"
        )

    lengths = [ex["input_ids"].numel() for ex in examples]
    seq = round_up(max(max(lengths), 1), pad_to_multiple_of)
    bsz = len(examples)
    input_ids = torch.full((bsz, seq), pad_token_id, dtype=torch.int64)
    labels = torch.full((bsz, seq), IGNORE_INDEX, dtype=torch.int64)
    for b, (ex, n) in enumerate(zip(examples, lengths)):
        input_ids[b, :n] = ex["input_ids"]
        labels[b, :n] = ex["labels"]
    batch = {"input_ids": input_ids, "labels": labels}

    if packed:
        position_ids = torch.zeros((bsz, seq), dtype=torch.int64)
        n_docs = max(max(ex["seq_lens"].numel() for ex in examples), 1)
        seq_lens = torch.full((bsz, n_docs), SEQ_LENS_PAD, dtype=torch.int64)
        seq_lens_padded = torch.full((bsz, n_docs), SEQ_LENS_PAD, dtype=torch.int64)
        for b, (ex, n) in enumerate(zip(examples, lengths)):
            p = ex["seq_lens"].numel()
            if p == 0:  # empty filler row: one all-padding "document" whose labels are all -100
                position_ids[b] = torch.arange(seq)
                seq_lens[b, 0] = seq_lens_padded[b, 0] = seq
                continue
            if int(ex["seq_lens_padded"].sum()) != n:
                raise ValueError(f"example {b}: sum(seq_lens_padded) != number of tokens ({n})")
            position_ids[b, :n] = ex["position_ids"]
            last_pos = int(ex["position_ids"][-1])
            position_ids[b, n:] = torch.arange(last_pos + 1, last_pos + 1 + seq - n)
            seq_lens[b, :p] = ex["seq_lens"]
            seq_lens_padded[b, :p] = ex["seq_lens_padded"]
            seq_lens_padded[b, p - 1] += seq - n
        batch.update(position_ids=position_ids, seq_lens=seq_lens, seq_lens_padded=seq_lens_padded)
    elif emit_attention_mask and any(n < seq for n in lengths):
        positions = torch.arange(seq).unsqueeze(0)
        batch["attention_mask"] = (positions < torch.tensor(lengths).unsqueeze(1)).to(torch.int64)
    return batch


class Collator:
    """Callable wrapper of :func:`collate` with fixed settings (usable as ``collate_fn``)."""

    def __init__(
        self, pad_token_id: int, pad_to_multiple_of: int = 1, emit_attention_mask: bool = False
    ) -> None:
        self.pad_token_id = _check_int("pad_token_id", pad_token_id, 0)
        self.pad_to_multiple_of = _check_int("pad_to_multiple_of", pad_to_multiple_of, 1)
        self.emit_attention_mask = bool(emit_attention_mask)

    def __call__(self, examples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return collate(
            examples,
            pad_token_id=self.pad_token_id,
            pad_to_multiple_of=self.pad_to_multiple_of,
            emit_attention_mask=self.emit_attention_mask,
        )
