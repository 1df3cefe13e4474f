"""Pack several short examples into one row, with per-document metadata for the THD path.

A packed row is the concatenation of examples (each already shifted, see ``examples.py``), each
example padded to a multiple of ``seq_pad_multiple`` (use ``2 * cp_size`` for THD context
parallelism, whose load-balanced split needs every sequence divisible by ``2 * cp_size``).
Packing is greedy and sequential: examples are taken in dataset order and a new row starts when
the next padded example would not fit in ``seq_len``. Row fields (all int64, ``R <= seq_len``):

- ``input_ids`` ``[R]``: tokens, ``pad_token_id`` in each document's padding.
- ``labels`` ``[R]``: shifted labels, ``-100`` on padding; never a target across documents (each
  document's last position has the label its own example gave it).
- ``position_ids`` ``[R]``: restart at 0 for every document and count on through its padding.
- ``seq_lens`` ``[P]``: real length of each document; ``seq_lens_padded`` ``[P]``: its padded length
  (``sum(seq_lens_padded) == R``). The collator right-pads rows to a common length, adds that
  padding to the row's last ``seq_lens_padded`` entry, and pads ``P`` with ``-1000``.
"""

from __future__ import annotations

import torch

from automodel.data.examples import IGNORE_INDEX

__all__ = ["SEQ_LENS_PAD", "pack_examples", "round_up"]

SEQ_LENS_PAD = -1000


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


def _make_row(docs: list[dict], seq_pad_multiple: int, pad_token_id: int) -> dict:
    ids, labels, pos, lens, padded = [], [], [], [], []
    for d in docs:
        n = d["input_ids"].numel()
        p = round_up(n, seq_pad_multiple)
        ids += [d["input_ids"], torch.full((p - n,), pad_token_id, dtype=torch.int64)]
        labels += [d["labels"], torch.full((p - n,), IGNORE_INDEX, dtype=torch.int64)]
        pos.append(torch.arange(p, dtype=torch.int64))
        lens.append(n)
        padded.append(p)
    return {
        "input_ids": torch.cat(ids),
        "labels": torch.cat(labels),
        "position_ids": torch.cat(pos),
        "seq_lens": torch.tensor(lens, dtype=torch.int64),
        "seq_lens_padded": torch.tensor(padded, dtype=torch.int64),
    }


def pack_examples(
    examples: list[dict], *, seq_len: int, seq_pad_multiple: int, pad_token_id: int
) -> list[dict]:
    """Greedily pack ``examples`` (dicts with ``input_ids``/``labels`` ``[n]`` int64, ``n <= seq_len``)
    into rows of at most ``seq_len`` tokens. Returns the list of packed row dicts described in the
    module docstring. ``examples`` are not mutated."""
    if seq_len % seq_pad_multiple != 0:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by seq_pad_multiple={seq_pad_multiple}; packed rows hold "
            f"documents padded to multiples of {seq_pad_multiple}, so set seq_len to a multiple of it"
        )
    rows, current, used = [], [], 0
    for ex in examples:
        n = ex["input_ids"].numel()
        if n > seq_len:
            raise ValueError(f"example of {n} input tokens does not fit seq_len={seq_len}; truncate it first")
        p = round_up(n, seq_pad_multiple)
        if current and used + p > seq_len:
            rows.append(_make_row(current, seq_pad_multiple, pad_token_id))
            current, used = [], 0
        current.append(ex)
        used += p
    if current:
        rows.append(_make_row(current, seq_pad_multiple, pad_token_id))
    return rows
