"""Moved: :mod:`automodel.distributed.cp.ring.cpu_ring` (re-exports only): torch's ring attention on CPU."""

from automodel.distributed.cp.ring.cpu_ring import (
    check_cpu_ring_support,
    cpu_ring_attention,
    cpu_ring_supported,
)

__all__ = ["check_cpu_ring_support", "cpu_ring_attention", "cpu_ring_supported"]
