"""Stable import path: USP attention lives in :mod:`automodel.distributed.cp.usp.attention` (re-exported here)."""

from automodel.distributed.cp.usp.attention import (
    USP_ATTN_NAME,
    UspContext,
    current_usp_context,
    make_usp_batch_and_ctx,
    register_usp_attention,
    set_usp_attention,
    usp_attention_forward,
    usp_context,
)

__all__ = [
    "USP_ATTN_NAME", "UspContext", "usp_context", "current_usp_context", "usp_attention_forward",
    "register_usp_attention", "set_usp_attention", "make_usp_batch_and_ctx"
]
