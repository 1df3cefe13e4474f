"""Stable import path: the document placement planner lives in
:mod:`automodel.distributed.cp.thd_docs.placement` (re-exported here)."""

from automodel.distributed.cp.thd_docs.placement import (
    CostModel,
    Piece,
    Placement,
    plan_documents,
    sample_lengths,
    split_chunks,
)

__all__ = ["CostModel", "Piece", "Placement", "plan_documents", "sample_lengths", "split_chunks"]
