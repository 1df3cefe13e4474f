"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.megatron_split` (re-exported here)."""

from automodel.distributed.multimodal.megatron_split import (
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    megatron_split_dynamic_res,
)

__all__ = [
    "_compute_tubelet_aware_split_points",
    "_split_num_frames",
    "megatron_split_dynamic_res",
]
