"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.comm`; this module only re-exports it."""

from automodel.distributed.multimodal import comm as _home
from automodel.distributed.multimodal.comm import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
