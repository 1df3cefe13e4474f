"""Stable import path: the code lives in :mod:`automodel.distributed.pipeline.multimodule`; this module only re-exports it."""

from automodel.distributed.pipeline import multimodule as _home
from automodel.distributed.pipeline.multimodule import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
