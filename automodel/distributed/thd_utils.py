"""Stable import path (NeMo AutoModel's ``thd_utils``): the THD batch format lives in
:mod:`automodel.distributed.cp.thd_format`; this module only re-exports it."""

from automodel.distributed.cp import thd_format as _home
from automodel.distributed.cp.thd_format import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
