"""Moved: :mod:`automodel.distributed.cp.ring.causal_mask` (re-exports only)."""

from automodel.distributed.cp.ring.causal_mask import no_packed_sequence_detection

__all__ = ["no_packed_sequence_detection"]
