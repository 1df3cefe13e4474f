"""One micro-batch: prepare the batch, CP-shard it, forward + loss + backward inside the train context.

The contract with :mod:`automodel.distributed.cp_utils` (and every other CP method of
:mod:`automodel.training.cp_dispatch`):

1. the label tokens are counted on the whole, unsharded batch (the caller does this for all
   micro-batches of a step and all-reduces over dp, giving ``num_label_tokens``);
2. ``cp_fn(device_mesh, batch)`` returns ``(train_ctx_factory, batch)``; entering the context
   shards the batch tensors in place (ring CP), so ``labels`` are taken out of the dict *after*
   the call but used *inside* the context;
3. forward, loss and backward all run inside
   ``get_train_context(enable_loss_parallel, enable_compiled_autograd, train_ctx_factory())``;
4. ``labels`` are already shifted, so they are not passed to the model (it would shift again):
   the model returns logits and :func:`token_cross_entropy_sum` computes the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from automodel.training.loss import IGNORE_INDEX, token_cross_entropy_sum

__all__ = ["MODEL_INPUT_KEYS", "prepare_batch", "run_micro_batch"]

# What the model sees. seq_lens / seq_lens_padded (packed rows) are metadata for the CP method;
# at cp_size=1 transformers reads document boundaries from the restarting position_ids.
MODEL_INPUT_KEYS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask")


def prepare_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move ``batch`` to ``device``; fold ``loss_mask`` into ``labels``; drop a right-padding mask.

    A ``[B, S]`` ``attention_mask`` that only marks right padding whose labels are all -100 is
    dropped: under causal attention no real token attends to later padding, so every real
    position's output and loss are unchanged, and ring CP (which takes no mask) and cp_size=1 run
    the very same computation. Returns a new dict; ``batch`` is not modified.

    Raises:
        ValueError: an attention mask with left padding or holes, or padding with real labels.
    """
    out = {
        k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
    }
    loss_mask = out.pop("loss_mask", None)
    if loss_mask is not None:
        out["labels"] = out["labels"].masked_fill(loss_mask == 0, IGNORE_INDEX)
    mask = out.get("attention_mask")
    if mask is not None:
        if not bool((mask != 0).all()):
            m = mask != 0
            right_padded = bool((m[:, 1:] <= m[:, :-1]).all())
            if not right_padded:
                raise ValueError(
                    "attention_mask has left padding or holes; this recipe trains causal LMs on right-padded "
                    "rows (padding after the real tokens, labels -100); fix the collator"
                )
            if bool((out["labels"][~m] != IGNORE_INDEX).any()):
                raise ValueError(
                    "padding positions (attention_mask == 0) have labels != -100; set them to -100"
                )
        out.pop("attention_mask")
    return out


def run_micro_batch(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    device_mesh: Any,
    cp_fn: Callable,
    train_context: Callable[[Any], Callable[[], Any]],
    num_label_tokens: torch.Tensor | float,
    backward: bool = True,
) -> torch.Tensor:
    """Forward (and backward) one prepared micro-batch; return this rank's CE sum (detached, fp32).

    Args:
        model: the (FSDP2) causal LM.
        batch: from :func:`prepare_batch`: ``input_ids``/``labels`` ``[B, S]`` int64, optional
            ``position_ids``, packed-row metadata. Consumed (the CP method may shard it in place).
        device_mesh: the full mesh (the CP method uses its ``cp`` dim).
        cp_fn: the method's batch/context function (:func:`automodel.training.cp_dispatch.get_cp_batch_fn`).
        train_context: ``cp_ctx -> factory`` (``get_train_context`` with the run's flags bound).
        num_label_tokens: label tokens of the whole global batch (all micro-batches, all dp ranks).
        backward: back-propagate ``CE sum / num_label_tokens`` (False for validation: no graph).

    Returns:
        0-dim fp32: sum of CE over this rank's label tokens (its CP shard of the rows).
    """
    ctx_factory, batch = cp_fn(device_mesh, batch)
    labels = batch.pop("labels")  # the same tensor object the CP context shards in place
    grad = torch.enable_grad() if backward else torch.no_grad()
    with grad, train_context(ctx_factory())():
        inputs = {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}  # after the shard
        logits = model(**inputs).logits
        ce_sum = token_cross_entropy_sum(logits, labels)
        if backward:
            (ce_sum / num_label_tokens).backward()
    return ce_sum.detach()
