"""Replicated data parallelism: every rank holds the whole model; gradients are summed after backward.

The alternative to FSDP2 (``fsdp.enabled: false``) for models that fit on one device. It exists
because FSDP2's gradient reduce-scatter runs in autograd hooks that compiled autograd does not run
on torch 2.13 (see :mod:`automodel.distributed.compiled_autograd`); here the reduction is an
explicit all-reduce after the last backward of a step, outside any compiled region, so it runs
whatever computed the gradients.

The loss of every rank is already divided by the global number of label tokens, so the
gradients are **summed** (not averaged) over the data-parallel x context-parallel ranks: the
result is exactly the single-device gradient, like FSDP2 with a divide factor of 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["broadcast_parameters", "all_reduce_gradients"]


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Copy rank 0's (of ``group``) parameters and buffers to every rank of ``group``, in place."""
    if group is None or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every parameter's ``.grad`` over ``group`` in place (one flat all-reduce per dtype).

    A parameter without a gradient on this rank but with one on another (a CP rank whose tokens or heads do not
    reach it: an expert none of its tokens chose, a head shard that reads none of a weight's rows) gets a zero
    gradient first, so every rank all-reduces the same tensors: the ranks agree on which parameters have one with a
    small all-reduce of flags. A parameter without a gradient on every rank keeps none (as one process leaves it).
    Mutates every ``p.grad`` (``None`` -> zeros where another rank has one).

    Raises:
        TypeError: a gradient is a ``DTensor`` (the model is sharded: FSDP2 reduces it itself).
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    from torch.distributed.tensor import DTensor

    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return
    # on the parameters' device (NCCL takes no host tensors): 1 per parameter with a gradient here, summed
    flags = torch.tensor([float(p.grad is not None) for _, p in params], device=params[0][1].device)
    dist.all_reduce(flags, group=group)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for (name, p), flag in zip(params, flags.tolist()):
        if flag == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if isinstance(p.grad, DTensor):
            raise TypeError(
                f"parameter {name} has a DTensor gradient: the model is sharded (FSDP2/TP), whose hooks reduce "
                f"gradients; all_reduce_gradients is for replicated models (fsdp.enabled=false)"
            )
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
