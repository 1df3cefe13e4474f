"""Token cross-entropy for causal LMs whose labels are already shifted.

The recipe's loss for one optimizer step is

    loss = sum over every label token of the global batch of CE(token) / N

where ``N`` is the number of label tokens (``labels != -100``) in the whole global batch: all
gradient-accumulation micro-batches of all data-parallel ranks, counted *before* context-parallel
sharding. Each rank back-propagates ``local CE sum / N``; summing gradients over ranks (FSDP2 with
divide factor 1, see ``automodel.models.parallelize``) then gives the single-device gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel.data.examples import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "loss_dtype_logits", "token_cross_entropy_sum"]


def loss_dtype_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in the dtype the loss is computed in: fp32, or fp64 for fp64 logits (never downcast)."""
    return logits if logits.dtype == torch.float64 else logits.float()


def token_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of per-token cross-entropies, in fp32 (fp64 for fp64 logits).

    Args:
        logits: ``[B, S, V]`` (any float dtype; half types are upcast to fp32).
        labels: ``[B, S]`` int64, already shifted (``labels[b, t]`` is the target of position t),
            ``-100`` = ignored.

    Returns:
        A 0-dim fp32 (fp64) tensor (0 when every label is ignored), differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on [B, S]")
    return F.cross_entropy(
        loss_dtype_logits(logits.reshape(-1, logits.shape[-1])),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
