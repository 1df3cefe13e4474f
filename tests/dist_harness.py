"""Test-side access to the local gloo launcher (:mod:`automodel.distributed.launch`).

Starting a process that imports torch and transformers costs seconds on CI's 2 cores, so a test
module launches ONE group for all of its checks (a module-scoped fixture calling
:func:`run_distributed` once) and the individual tests assert on the returned results. Targets
live in ``tests/workers/`` and are named ``"tests.workers.<module>:<function>"``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from automodel.distributed.launch import free_port, run_on_ranks

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the spawned workers inherit sys.path and import tests.workers.*
    sys.path.insert(0, str(REPO_ROOT))

run_distributed = run_on_ranks

__all__ = ["REPO_ROOT", "free_port", "run_distributed"]
