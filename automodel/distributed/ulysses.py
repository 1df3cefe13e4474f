"""Ulysses context parallelism for Hugging Face models (re-exports only).

The code lives in :mod:`automodel.distributed.cp.ulysses.attention` (the attention function, its
context, the batch function) and :mod:`automodel.distributed.cp.ulysses.method` (the strategy).
"""

from automodel.distributed.cp.ulysses.attention import (
    INNER_ATTN_IMPLEMENTATIONS,
    ULYSSES_ATTN_NAME,
    UlyssesContext,
    current_ulysses_context,
    document_ids_from_cu_seqlens,
    document_ids_from_seq_lens,
    make_ulysses_batch_and_ctx,
    register_ulysses_attention,
    set_ulysses_attention,
    ulysses_attention_forward,
    ulysses_context,
)

__all__ = [
    "ULYSSES_ATTN_NAME",
    "INNER_ATTN_IMPLEMENTATIONS",
    "UlyssesContext",
    "ulysses_context",
    "current_ulysses_context",
    "ulysses_attention_forward",
    "register_ulysses_attention",
    "set_ulysses_attention",
    "make_ulysses_batch_and_ctx",
    "document_ids_from_seq_lens",
    "document_ids_from_cu_seqlens",
]
