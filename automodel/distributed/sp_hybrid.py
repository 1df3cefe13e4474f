"""Stable import path: the code lives in :mod:`automodel.distributed.sp.hybrid` (re-exported here)."""

from automodel.distributed.sp.hybrid import (
    HybridCPGroups,
    gather_forward_split_backward_with_cp,
    get_hybrid_cp_groups,
    new_hybrid_cp_groups,
    packed_data_gather_forward_split_backward,
    packed_data_gather_forward_split_backward_with_cp,
    packed_data_split_forward_gather_backward,
    packed_data_split_forward_gather_backward_with_cp,
    packed_split_indices,
    set_hybrid_cp_groups,
    split_forward_gather_backward_with_cp,
)

__all__ = [
    "HybridCPGroups",
    "gather_forward_split_backward_with_cp",
    "get_hybrid_cp_groups",
    "new_hybrid_cp_groups",
    "packed_data_gather_forward_split_backward",
    "packed_data_gather_forward_split_backward_with_cp",
    "packed_data_split_forward_gather_backward",
    "packed_data_split_forward_gather_backward_with_cp",
    "packed_split_indices",
    "set_hybrid_cp_groups",
    "split_forward_gather_backward_with_cp",
]
