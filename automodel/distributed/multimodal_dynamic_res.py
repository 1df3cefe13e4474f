"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.dynamic_res`; this module only re-exports it."""

from automodel.distributed.multimodal import dynamic_res as _home
from automodel.distributed.multimodal.dynamic_res import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
