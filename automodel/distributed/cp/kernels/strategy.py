"""Moved: :mod:`automodel.distributed.cp.layers.strategy` (re-exports only)."""

from automodel.distributed.cp.layers import strategy as _home
from automodel.distributed.cp.layers.strategy import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
