"""Stable import path: document-placement attention lives in
:mod:`automodel.distributed.cp.thd_docs.attention` (re-exported here)."""

from automodel.distributed.cp.thd_docs.attention import (
    DOC_ATTN_NAME,
    DocPlan,
    batch_documents,
    current_doc_plan,
    doc_attention,
    doc_attention_forward,
    doc_context,
    make_doc_batch_and_ctx,
    register_doc_attention,
    set_doc_attention,
)

__all__ = [
    "DOC_ATTN_NAME", "DocPlan", "batch_documents", "current_doc_plan", "doc_attention",
    "doc_attention_forward", "doc_context", "make_doc_batch_and_ctx", "register_doc_attention",
    "set_doc_attention"
]
