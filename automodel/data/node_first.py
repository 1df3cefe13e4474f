"""Run a preparation step once per node: local rank 0 first, the other ranks after it, errors shared.

Used to build on-disk caches (``datasets`` arrow files, tokenized data): local rank 0 does the work
while the other ranks of its node wait; then they run the same step, which finds the cache and only
opens it. If any local rank 0 fails, every rank raises (a ``UserInputError`` keeps its message), so
no rank is left waiting at a collective.

The wait is a collective on the default process group, so it is bounded by the group's timeout
(``init_process_group(timeout=...)``): raise it when preparing a large dataset cold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from automodel.errors import UserInputError

__all__ = ["local_rank", "run_local_rank0_first"]

T = TypeVar("T")


def local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (set by torchrun), else the global rank."""
    import torch.distributed as dist

    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _describe(err: BaseException | None) -> tuple[bool, str] | None:
    return None if err is None else (isinstance(err, UserInputError), f"{type(err).__name__}: {err}")


def _raise_first(reports: list, mine: BaseException | None, what: str) -> None:
    failed = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    if not failed:
        return
    if mine is not None:
        raise mine
    rank, (is_user, msg) = failed[0]
    if is_user:
        raise UserInputError(msg.split(": ", 1)[1])
    raise RuntimeError(f"{what} failed on rank {rank} ({msg}); see that rank's log")


def run_local_rank0_first(fn: Callable[[], T], what: str = "data preparation") -> T:
    """Call ``fn()`` on local rank 0 of every node, then on the other ranks; return its result.

    Without an initialised process group (or with one rank) this is just ``fn()``. Every rank of the
    default group must call it (it is a collective).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    world = dist.get_world_size()
    first = local_rank() == 0
    result, err = None, None
    if first:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - shared with every rank below
            err = e
    reports: list = [None] * world
    dist.all_gather_object(reports, _describe(err))
    _raise_first(reports, err, what)
    if not first:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001
            err = e
    reports = [None] * world
    dist.all_gather_object(reports, _describe(err))
    _raise_first(reports, err, what)
    return result  # type: ignore[return-value]
