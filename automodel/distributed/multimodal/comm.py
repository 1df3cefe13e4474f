"""The collectives of multimodal CP: which group a helper runs on, and the gather with its backward.

Used by :mod:`automodel.distributed.multimodal.cp` (fixed-size samples) and
:mod:`automodel.distributed.multimodal.dynamic_res` (dynamic resolution); it lives apart so that
neither of those imports the other's internals (``cp`` re-exports the dynamic-resolution API, so
``dynamic_res`` must not import ``cp``). The public import path of :func:`resolve_group` and
:class:`GatherFromContextParallelRanks` stays :mod:`automodel.distributed.multimodal_cp`, which
re-exports them from :mod:`automodel.distributed.multimodal.cp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.torch_internals import all_gather_single

__all__ = ["resolve_group", "GatherFromContextParallelRanks", "PackedSeqParams"]


# ---------------------------------------------------------------------------------------------------------
# packed sequence parameters


@dataclass
class PackedSeqParams:
    """Sequence boundaries for a THD / padded attention kernel (Megatron's field names).

    Attributes:
        cu_seqlens_q, cu_seqlens_kv: ``[B+1]`` int32 offsets of the REAL tokens of every row.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: ``[B+1]`` int32 offsets of the padded rows, or
            ``None`` when no padding needs describing.
        max_seqlen_q, max_seqlen_kv: the padded row length.
        qkv_format: ``"sbhd"`` (plain rows) or ``"thd"`` (needed when CP meets padding or packing).
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor | None
    cu_seqlens_kv_padded: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_kv: int
    qkv_format: str


# ---------------------------------------------------------------------------------------------------------
# groups


def resolve_group(group: Any = None) -> tuple[ProcessGroup | None, int, int]:
    """``(group, world_size, rank)`` of a ProcessGroup, a DeviceMesh (its ``"cp"`` dim, or any 1-D mesh) or
    ``None`` (the default group when ``torch.distributed`` is initialised, else a group of one).
    :func:`automodel.distributed.cp.group.resolve_cp_group` with the multimodal primitives' conventions."""
    return resolve_cp_group(group, default_world=True, keep_single=True, any_1d_mesh=True)


# ---------------------------------------------------------------------------------------------------------
# gather


def _reduce_scatter_dim(grad: torch.Tensor, dim: int, group: ProcessGroup | None, world: int, rank: int):
    front = grad.movedim(dim, 0).contiguous()
    n = front.size(0) // world
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: all-reduce then keep our block
        dist.all_reduce(front, group=group)
        out = front.narrow(0, rank * n, n).clone()
    else:
        out = front.new_empty((n, *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim)


class GatherFromContextParallelRanks(torch.autograd.Function):
    """All-gather along ``dim`` in the forward; reduce-scatter (sum) in the backward.

    ``apply(local_t, group=None, dim=1)``: Megatron's ``apply(local_t)`` gathers along the second dim
    (its vision embeddings are ``[tokens, images, H]``), hence ``dim=1`` by default. Every rank gives an equally shaped ``local_t``; the result is the
    rank-ordered concatenation along ``dim``. The backward sums the incoming gradients over the group
    and returns each rank its own block: exact when each rank's loss uses the gathered tensor only
    through its own tokens and the objective is the sum of the ranks' losses (the CP objective).
    """

    @staticmethod
    def forward(ctx, local_t: torch.Tensor, group: ProcessGroup | None = None, dim: int = 1):  # type: ignore[override]
        world = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.world, ctx.rank = group, dim, world, dist.get_rank(group)
        if world == 1:
            return local_t.clone()
        front = local_t.movedim(dim, 0).contiguous()
        out = front.new_empty((world * front.size(0), *front.shape[1:]))
        # torch_internals.all_gather_single: all_gather_into_tensor on torch < 2.13
        all_gather_single(out, front, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if ctx.world == 1:
            return grad, None, None
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group, ctx.world, ctx.rank), None, None
