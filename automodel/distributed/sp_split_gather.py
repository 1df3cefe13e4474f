"""Stable import path: the code lives in :mod:`automodel.distributed.sp.split_gather`; this module only re-exports it."""

from automodel.distributed.sp import split_gather as _home
from automodel.distributed.sp.split_gather import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
