"""Non-finite losses, gradients and weights: found on every rank alike, named in one line, never saved.

Each step, before the optimizer update, :func:`agree_nonfinite_step` all-reduces two flags (the loss,
the gradient norm) over the world, so every rank takes the same decision and none is left waiting in a
collective. A non-finite gradient norm is traced to the first parameter (in ``named_parameters()``
order, the same on every rank) whose gradient holds a NaN or an infinity. The step's update is then
not applied (the gradients are dropped; the LR schedule still advances, so step ``N`` trains at the
same learning rate whatever happened before it), and ``recipe.on_nonfinite`` decides:

- ``stop`` (the default): the run ends with one ``error:`` line from rank 0 naming the step and the
  quantity, and exit code :data:`EXIT_NONFINITE` on every rank;
- ``skip``: the step is counted (``nonfinite_skipped`` in ``metrics.jsonl`` and ``summary.json``) and
  training goes on; ``recipe.max_nonfinite_in_row`` such steps in a row end the run as ``stop`` does.

Before every checkpoint and export, :func:`first_nonfinite_weight` checks the weights (an update from
finite gradients can still overflow them): a non-finite weight ends the run the same way, unsaved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "EXIT_NONFINITE",
    "NonFiniteStop",
    "agree_nonfinite_step",
    "first_nonfinite_weight",
    "nonfinite_message",
    "parameter_name",
]

EXIT_NONFINITE = 3  # distinct from 2 (a mistake in the input) and 1 (a bug)


class NonFiniteStop(Exception):
    """Raised on every rank alike (the decision was all-reduced) to end the run; ``message`` is its one line.

    The trainer turns it into :class:`automodel.training.user_errors.RunAborted` (exit
    :data:`EXIT_NONFINITE`) once it has left the loop and its SIGTERM handler.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def parameter_name(name: str) -> str:
    """``name`` without the wrappers' parts (activation checkpointing, ``torch.compile``)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("_orig_mod.", "")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _first_agreed(model: nn.Module, tensor_of: Any, device: torch.device) -> str | None:
    """The name of the first parameter for which ``tensor_of(p)`` holds a non-finite value on any rank.

    Collective over the world (every rank calls it): each rank's first local index, all-reduced (min).
    """
    named = list(model.named_parameters())
    first = len(named)
    for i, (_, p) in enumerate(named):
        t = tensor_of(p)
        if t is not None and not bool(torch.isfinite(_local(t)).all()):
            first = i
            break
    index = torch.tensor([first], dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(index, op=dist.ReduceOp.MIN)
    i = int(index.item())
    return parameter_name(named[i][0]) if i < len(named) else None


def agree_nonfinite_step(loss: float, grad_norm: float, model: nn.Module, device: torch.device) -> str | None:
    """What of this step is not finite, the same on every rank: None, or a phrase for :func:`nonfinite_message`.

    ``loss`` and ``grad_norm`` are this rank's figures of the step (already reduced; the flags are
    all-reduced again so that no rank can decide alone). The loss is named first (it comes first);
    else the gradient norm and the first parameter whose gradient is not finite. Collective over the
    world; reads the gradients only when the norm is not finite.
    """
    flags = torch.tensor(
        [not math.isfinite(loss), not math.isfinite(grad_norm)], dtype=torch.float32, device=device
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_loss, bad_norm = (bool(f) for f in flags.tolist())
    if bad_loss:
        return f"the loss is {loss}"
    if bad_norm:
        name = _first_agreed(model, lambda p: p.grad, device)
        first = f" (the first parameter with a non-finite gradient: {name})" if name else ""
        return f"the gradient norm is {grad_norm}{first}"
    return None


def first_nonfinite_weight(model: nn.Module, device: torch.device) -> str | None:
    """The first parameter holding a NaN or an infinity on any rank, or None. Collective over the world."""
    return _first_agreed(model, lambda p: p.detach(), device)


def nonfinite_message(step: int, what: str, *, lr: float, last_checkpoint: Any, in_row: int | None = None) -> str:
    """The one ``error:`` line that ends a run on a non-finite number at ``step``.

    ``what``: from :func:`agree_nonfinite_step` (or a weights phrase); ``in_row``: with
    ``recipe.on_nonfinite=skip``, how many steps in a row were skipped (the limit was reached).
    """
    if in_row is None:
        head = f"step {step}: {what}; recipe.on_nonfinite=stop ended the run"
    else:
        head = (
            f"step {step}: {what}; that is {in_row} steps in a row with a non-finite loss or gradient "
            f"(recipe.max_nonfinite_in_row={in_row}), which ended the run"
        )
    saved = (
        f"the last checkpoint, {last_checkpoint}, is from before (checkpoint.resume=auto continues from it)"
        if last_checkpoint
        else "no checkpoint was saved"
    )
    return (
        f"{head} without saving it: {saved}; lower optimizer.lr ({lr:.3g} at this step), set "
        f"clip_grad.max_norm, check the data, or set recipe.on_nonfinite=skip to skip such steps"
    )
