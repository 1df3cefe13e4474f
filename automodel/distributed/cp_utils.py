"""The public context-parallel (CP) API, NeMo AutoModel's ``cp_utils`` names (re-exports only).

The code lives in :mod:`automodel.distributed.cp.ring.batch` (ring CP's batch path) and
:mod:`automodel.distributed.cp.te_batch` (the THD path, ``use_te=True``).
"""

from automodel.distributed.cp.ring import batch as _home
from automodel.distributed.cp.ring.batch import *  # noqa: F403  (every name of its __all__)

__all__ = _home.__all__
