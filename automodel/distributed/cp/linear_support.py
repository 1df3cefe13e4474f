"""Moved: :mod:`automodel.distributed.cp.layers.linear_support` (re-exports only; no torch import)."""

from automodel.distributed.cp.layers.linear_support import (
    GATED_DELTANET_MIXERS,
    LINEAR_METHODS,
    linear_mixer_problem,
)

__all__ = ["GATED_DELTANET_MIXERS", "LINEAR_METHODS", "linear_mixer_problem"]
