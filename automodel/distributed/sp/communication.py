"""MindSpeed-MM's communication module under one import.

Code written against MindSpeed-MM's ``mindspeed_mm/fsdp/distributed/context_parallel/communication.py``
(and the older ``mindspeed_mm/models/common/communications.py``, whose extra names are here too) ports
by changing its import to this module. The functions live in :mod:`automodel.distributed.sp.all_to_all`,
:mod:`automodel.distributed.sp.split_gather` and :mod:`automodel.distributed.sp.hybrid`; the two
small helpers of the older module are below. Differences from the reference: docs/seed_api.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.distributed.sp.all_to_all import (
    adjust_tensor_dimensions,
    all_to_all,
    all_to_all_SBH,
    cal_split_sizes,
    cal_split_sizes_multi,
    unadjust_tensor_dimensions,
)
from automodel.distributed.sp.hybrid import (
    HybridCPGroups,
    gather_forward_split_backward_with_cp,
    get_hybrid_cp_groups,
    new_hybrid_cp_groups,
    packed_data_gather_forward_split_backward,
    packed_data_gather_forward_split_backward_with_cp,
    packed_data_split_forward_gather_backward,
    packed_data_split_forward_gather_backward_with_cp,
    set_hybrid_cp_groups,
    split_forward_gather_backward_with_cp,
)
from automodel.distributed.sp.split_gather import (
    gather_forward_split_backward,
    load_balanced_gather_forward_split_backward,
    load_balanced_split_forward_gather_backward,
    split_forward_gather_backward,
)
from automodel.distributed.torch_internals import all_gather_single

#: MindSpeed-MM's permutations that move a gathered leading world dim into place (4-D and 5-D tensors)
PERMUTE_DIMS1 = {4: (1, 2, 3, 0), 5: (1, 2, 3, 0, 4)}
PERMUTE_DIMS2 = {4: (1, 2, 0, 3), 5: (1, 2, 0, 3, 4)}

#: the older module's names for the packed-data split and gather
split_each_sequence_in_packed_tensor = packed_data_split_forward_gather_backward
gather_sequence_chunks_to_packed_tensor = packed_data_gather_forward_split_backward


def collect_tensors_across_ranks(
    tensor: torch.Tensor | list | tuple, group: ProcessGroup | None = None, dynamic_shape: bool = True
) -> list:
    """Every rank's ``tensor`` (no autograd): a list in rank order, or for a list input one such list per entry.

    ``dynamic_shape``: shapes may differ between ranks (exchanged first); ``False``: all equal to ours.
    ``None`` entries of a list input stay lists of ``None``.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return [tensor]

    def one(t: torch.Tensor) -> list[torch.Tensor]:
        if dynamic_shape:
            shapes: list = [None] * world
            dist.all_gather_object(shapes, tuple(t.shape), group=group)
        else:
            shapes = [tuple(t.shape)] * world
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        flat = t.contiguous().reshape(-1)
        flat = torch.cat([flat, flat.new_zeros(max(sizes) - flat.numel())])
        out = flat.new_empty(world * max(sizes))
        # torch_internals.all_gather_single: all_gather_into_tensor on torch < 2.13
        all_gather_single(out, flat, group=group)
        return [out[r * max(sizes) : r * max(sizes) + sizes[r]].reshape(shapes[r]) for r in range(world)]

    if isinstance(tensor, (list, tuple)):
        return [[None] * world if t is None else one(t) for t in tensor]
    return one(tensor)


def split_tensor(
    tensor: torch.Tensor, group: ProcessGroup | None, rank: int, dim: int = 2, first_padding: int = 0
) -> torch.Tensor:
    """This rank's frames along ``dim`` when rank 0's share is shortened by ``first_padding`` (no autograd link).

    Every rank holds ``(n + first_padding) / W`` frames except rank 0, which holds ``first_padding`` fewer
    (the padding it would carry is implicit). ``ValueError`` if ``n + first_padding`` is not divisible by ``W``.
    """
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return tensor
    total = tensor.shape[dim] + first_padding
    if total % world:
        raise ValueError(f"split_tensor: {tensor.shape[dim]} frames + first_padding {first_padding} = {total} is not divisible by {world}")
    per = total // world
    start = 0 if rank == 0 else per - first_padding + (rank - 1) * per
    stop = per - first_padding if rank == 0 else start + per
    return tensor.narrow(dim, start, stop - start).contiguous()


__all__ = [
    "PERMUTE_DIMS1",
    "PERMUTE_DIMS2",
    "all_to_all_SBH",
    "collect_tensors_across_ranks",
    "gather_sequence_chunks_to_packed_tensor",
    "split_each_sequence_in_packed_tensor",
    "split_tensor",
    "HybridCPGroups",
    "adjust_tensor_dimensions",
    "all_to_all",
    "cal_split_sizes",
    "cal_split_sizes_multi",
    "gather_forward_split_backward",
    "gather_forward_split_backward_with_cp",
    "get_hybrid_cp_groups",
    "load_balanced_gather_forward_split_backward",
    "load_balanced_split_forward_gather_backward",
    "new_hybrid_cp_groups",
    "packed_data_gather_forward_split_backward",
    "packed_data_gather_forward_split_backward_with_cp",
    "packed_data_split_forward_gather_backward",
    "packed_data_split_forward_gather_backward_with_cp",
    "set_hybrid_cp_groups",
    "split_forward_gather_backward",
    "split_forward_gather_backward_with_cp",
    "unadjust_tensor_dimensions",
]
