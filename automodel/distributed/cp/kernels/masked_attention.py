"""Moved: :mod:`automodel.distributed.cp.layers.masked_attention` (re-exports only)."""

from automodel.distributed.cp.layers.masked_attention import DEFAULT_BLOCK, halo_attention

__all__ = ["DEFAULT_BLOCK", "halo_attention"]
