"""Ulysses context parallelism for Hugging Face models (re-exports only).

The code lives in :mod:`automodel.distributed.cp.ulysses.attention` (the attention function, its
context, the batch function) and :mod:`automodel.distributed.cp.ulysses.method` (the strategy).
"""

from automodel.distributed.cp.ulysses import attention as _home
from automodel.distributed.cp.ulysses.attention import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
