"""Stable import path: the code lives in :mod:`automodel.distributed.sp.hybrid`; this module only re-exports it."""

from automodel.distributed.sp import hybrid as _home
from automodel.distributed.sp.hybrid import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
