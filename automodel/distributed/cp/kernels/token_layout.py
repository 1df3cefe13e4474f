"""Moved: :mod:`automodel.distributed.cp.layout` (re-exports only)."""

from automodel.distributed.cp.layout import TokenLayout, ring_layout, thd_layout

__all__ = ["TokenLayout", "ring_layout", "thd_layout"]
