"""Stable import path: THD attention lives in :mod:`automodel.distributed.cp.thd.attention` and the shared
gathered-K/V kernel in :mod:`automodel.distributed.cp.gathered_attention` (re-exported here)."""

from automodel.distributed.cp.gathered_attention import (
    THD_CP_COMM_TYPES,
    THD_KERNELS,
    THDPlan,
    check_thd_kernel,
    thd_attention,
)
from automodel.distributed.cp.thd.attention import (
    THD_ATTN_NAME,
    current_thd_plan,
    make_thd_batch_and_ctx,
    register_thd_attention,
    set_thd_attention,
    thd_attention_forward,
    thd_context,
)

__all__ = [
    "THD_ATTN_NAME", "THD_KERNELS", "THD_CP_COMM_TYPES", "THDPlan", "check_thd_kernel", "current_thd_plan",
    "thd_context", "thd_attention_forward", "thd_attention", "register_thd_attention", "set_thd_attention",
    "make_thd_batch_and_ctx"
]
