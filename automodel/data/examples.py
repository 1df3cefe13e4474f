"""Turn a token sequence into one training example with labels shifted exactly once.

The one rule every dataset here follows: an example is a token sequence ``x`` of length ``n``
(``2 <= n <= seq_len + 1``) and a boolean ``trainable`` mask over it, and becomes

    input_ids[t] = x[t]                                   for t in 0 .. n-2
    labels[t]    = x[t+1] if trainable[t+1] else -100     for t in 0 .. n-2

so ``labels[t]`` is the target for position ``t`` (the model must NOT shift again), and the last
token of ``x`` appears only as a target. Fixed-length text rows are the case ``n = seq_len + 1``
with every token trainable; an instruction example marks its prompt tokens untrainable.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "shift_example", "split_long_sequence"]

IGNORE_INDEX = -100


def shift_example(
    tokens: Sequence[int] | np.ndarray, trainable: Sequence[bool] | np.ndarray | None = None
) -> dict:
    """Build ``{"input_ids": [n-1] int64, "labels": [n-1] int64}`` from ``tokens`` (``[n]``, n >= 2).

    ``trainable`` (``[n]`` bool, default all True) says which tokens are targets; ``trainable[0]``
    is never used (the first token is never a target). Inputs are not mutated.
    """
    x = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    if x.ndim != 1 or x.numel() < 2:
        raise ValueError(
            f"an example needs at least 2 tokens (one input and one target), got shape {tuple(x.shape)}"
        )
    labels = x[1:].clone()
    if trainable is not None:
        mask = torch.as_tensor(np.asarray(trainable, dtype=bool))
        if mask.shape != x.shape:
            raise ValueError(f"trainable mask shape {tuple(mask.shape)} != tokens shape {tuple(x.shape)}")
        labels[~mask[1:]] = IGNORE_INDEX
    return {"input_ids": x[:-1].clone(), "labels": labels}


def split_long_sequence(n: int, max_inputs: int) -> list[tuple[int, int]]:
    """Cut a sequence of ``n`` tokens into pieces of at most ``max_inputs`` input positions.

    Returns ``[(start, end), ...]`` token ranges ``x[start:end]`` to feed to :func:`shift_example`.
    Consecutive pieces overlap by one token (the last target of a piece is the first input of the
    next), so every token after the first is a target exactly once. Pieces shorter than 2 tokens
    are not produced.
    """
    if max_inputs < 1:
        raise ValueError(f"max_inputs={max_inputs} must be >= 1")
    return [(s, min(s + max_inputs + 1, n)) for s in range(0, max(n - 1, 0), max_inputs)]
