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


def wait_for_a_peer_that_never_comes(rank: int, world_size: int) -> None:
    """Rank 0 waits in a collective that rank 1 never joins (it sleeps): a hang, for the launcher's time-out."""
    import time

    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))
