"""Stable import path: the code lives in :mod:`automodel.distributed.sp.padding`; this module only re-exports it."""

from automodel.distributed.sp import padding as _home
from automodel.distributed.sp.padding import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
