"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.dynamic_res` (re-exported here)."""

from automodel.distributed.multimodal.dynamic_res import (
    DynamicResSplit,
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    balanced_split_points,
    check_grid,
    gather_from_context_parallel_ranks_dynamic_res,
    split_to_context_parallel_ranks_dynamic_res,
    tubelet_balanced_split_points,
)

__all__ = [
    "DynamicResSplit",
    "_compute_tubelet_aware_split_points",
    "_split_num_frames",
    "balanced_split_points",
    "check_grid",
    "gather_from_context_parallel_ranks_dynamic_res",
    "split_to_context_parallel_ranks_dynamic_res",
    "tubelet_balanced_split_points",
]
