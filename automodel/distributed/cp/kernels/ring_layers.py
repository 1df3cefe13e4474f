"""Moved: :mod:`automodel.distributed.cp.ring.router` (re-exports only)."""

from automodel.distributed.cp.ring.router import install_ring_router, ring_layer_kernels

__all__ = ["install_ring_router", "ring_layer_kernels"]
