"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.cp` (re-exported here)."""

from automodel.distributed.multimodal.cp import (
    DynamicResSplit,
    GatherFromContextParallelRanks,
    PackedSeqParams,
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    gather_from_context_parallel_ranks,
    gather_from_context_parallel_ranks_dynamic_res,
    get_packed_seq_params,
    get_padding,
    resolve_group,
    split_to_context_parallel_ranks,
    split_to_context_parallel_ranks_dynamic_res,
)

__all__ = [
    "DynamicResSplit",
    "GatherFromContextParallelRanks",
    "PackedSeqParams",
    "_compute_tubelet_aware_split_points",
    "_split_num_frames",
    "gather_from_context_parallel_ranks",
    "gather_from_context_parallel_ranks_dynamic_res",
    "get_packed_seq_params",
    "get_padding",
    "resolve_group",
    "split_to_context_parallel_ranks",
    "split_to_context_parallel_ranks_dynamic_res",
]
