"""Moved: :mod:`automodel.distributed.cp.ulysses.doc_blocks` (re-exports only)."""

from automodel.distributed.cp.ulysses.doc_blocks import Segment, document_block_attention, document_segments

__all__ = ["Segment", "document_segments", "document_block_attention"]
