"""Stable import path: the code lives in :mod:`automodel.distributed.sp.all_to_all` (re-exported here)."""

from automodel.distributed.sp.all_to_all import (
    adjust_tensor_dimensions,
    all_to_all,
    all_to_all_SBH,
    cal_split_sizes,
    cal_split_sizes_multi,
    even_split_sizes,
    unadjust_tensor_dimensions,
)

__all__ = [
    "adjust_tensor_dimensions",
    "all_to_all",
    "all_to_all_SBH",
    "cal_split_sizes",
    "cal_split_sizes_multi",
    "even_split_sizes",
    "unadjust_tensor_dimensions",
]
