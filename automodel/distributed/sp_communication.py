"""MindSpeed-MM's communication module under one import (``mindspeed_mm/.../context_parallel/communication.py``).

Code written against MindSpeed-MM ports by changing its import to this module. The functions live in
:mod:`automodel.distributed.all_to_all`, :mod:`automodel.distributed.sp_split_gather` and
:mod:`automodel.distributed.sp_hybrid`; differences from the reference are listed in docs/seed_api.md.
"""

from __future__ import annotations

from automodel.distributed.all_to_all import (
    adjust_tensor_dimensions,
    all_to_all,
    cal_split_sizes,
    cal_split_sizes_multi,
    unadjust_tensor_dimensions,
)
from automodel.distributed.sp_hybrid import (
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
from automodel.distributed.sp_split_gather import (
    gather_forward_split_backward,
    load_balanced_gather_forward_split_backward,
    load_balanced_split_forward_gather_backward,
    split_forward_gather_backward,
)

__all__ = [
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
