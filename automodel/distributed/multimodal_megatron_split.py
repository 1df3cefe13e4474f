"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.megatron_split`; this module only re-exports it."""

from automodel.distributed.multimodal import megatron_split as _home
from automodel.distributed.multimodal.megatron_split import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
