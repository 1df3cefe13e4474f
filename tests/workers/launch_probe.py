"""What a launched rank sees (tests/test_launch.py)."""

from __future__ import annotations

import os
import sys


def probe(rank: int, world_size: int, key: str) -> dict:
    """The rank's view: ``key`` in its environment, its parent process, and whether the launcher's preloaded
    modules were imported before this function ran (a rank forked from the forkserver)."""
    from automodel.distributed.launch import PRELOAD

    return {
        "value": os.environ.get(key),
        "parent": os.getppid(),
        "preloaded": all(m in sys.modules for m in PRELOAD),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]),
    }
