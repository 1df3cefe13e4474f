"""usp's Ulysses and ring sub-groups of the CP group, as process groups.

The rank arithmetic is :func:`automodel.distributed.cp.subgroups.ulysses_ring_groups` (Ulysses: ``U``
consecutive CP ranks; ring: the ranks ``U`` apart, across nodes: K/V all-gathered / reduce-scattered
across it). :func:`usp_process_groups` builds the two process groups of this rank once per (CP group, ``U``) with
``torch.distributed.new_group(..., use_local_synchronization=True)`` (only the members of a group take
part, so every CP group can build its own whatever the rest of the world does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from automodel.distributed.cp.subgroups import ulysses_ring_groups, ulysses_size_problem

__all__ = ["UspGroups", "usp_process_groups"]


@dataclass(frozen=True)
class UspGroups:
    """This rank's two sub-groups (``None`` where the sub-group has one rank) and its place in them."""

    ulysses_group: Any
    ulysses_size: int
    ulysses_rank: int
    ring_group: Any
    ring_size: int
    ring_rank: int


# (CP ranks, U) -> (the default group they were built under, the groups): rebuilt after a new init_process_group
_CACHE: dict[tuple[tuple[int, ...], int], tuple[Any, UspGroups]] = {}


def usp_process_groups(cp_group: Any, cp_size: int, cp_rank: int, ulysses_size: int) -> UspGroups:
    """This rank's Ulysses and ring sub-groups of ``cp_group`` (built on first use, then cached).

    Args:
        cp_group: the CP ``ProcessGroup`` (``None`` only at ``cp_size == 1``).
        cp_size, cp_rank: its size and this rank's index in it.
        ulysses_size: ``U``, dividing ``cp_size``.

    Every member of ``cp_group`` must call this in the same step (the groups are built collectively by
    their members). At ``U == 1`` the ring sub-group is ``cp_group`` itself, at ``U == cp_size`` the Ulysses
    sub-group is.
    """
    problem = ulysses_size_problem(ulysses_size, cp_size)
    if problem is not None:
        raise ValueError(problem)
    ring_size = cp_size // ulysses_size
    ulysses_rank, ring_rank = cp_rank % ulysses_size, cp_rank // ulysses_size
    if cp_size == 1:
        return UspGroups(None, 1, 0, None, 1, 0)
    ranks = tuple(dist.get_process_group_ranks(cp_group))
    key = (ranks, ulysses_size)
    world_group = dist.group.WORLD
    if key not in _CACHE or _CACHE[key][0] is not world_group:
        ulysses, ring = ulysses_ring_groups(ranks, ulysses_size)
        if ulysses_size == 1:
            u_group, r_group = None, cp_group
        elif ring_size == 1:
            u_group, r_group = cp_group, None
        else:
            u_group = dist.new_group(ulysses[ring_rank], use_local_synchronization=True)
            r_group = dist.new_group(ring[ulysses_rank], use_local_synchronization=True)
        _CACHE[key] = (world_group, UspGroups(u_group, ulysses_size, ulysses_rank, r_group, ring_size, ring_rank))
    return _CACHE[key][1]
