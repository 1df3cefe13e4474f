"""Stable import path: the code lives in :mod:`automodel.distributed.sp.all_to_all`; this module only re-exports it."""

from automodel.distributed.sp import all_to_all as _home
from automodel.distributed.sp.all_to_all import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
