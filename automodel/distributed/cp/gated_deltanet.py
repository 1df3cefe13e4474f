"""Moved: :mod:`automodel.distributed.cp.layers.gated_deltanet` (re-exports only)."""

from automodel.distributed.cp.layers import gated_deltanet as _home
from automodel.distributed.cp.layers.gated_deltanet import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
