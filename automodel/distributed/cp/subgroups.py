"""The CP group factored into ``ulysses x ring`` sub-groups: the one rank arithmetic.

A CP group of ``W = U * R`` ranks, in CP-rank order, is cut into

- ``R`` **Ulysses** sub-groups of ``U`` *consecutive* CP ranks (CP rank ``c = ring_rank * U + ulysses_rank``):
  the innermost dimension, so with torchrun's consecutive ranks per node (and ``tp`` inside ``cp``) they
  sit on one node and their per-layer all-to-alls stay on NVLink;
- ``U`` **ring** sub-groups of the ``R`` CP ranks ``U`` apart: the outer dimension, the one that crosses
  nodes.

Used by ``cp_method: usp`` (:mod:`automodel.distributed.cp.usp.groups` builds the process groups) and the
dry run's node plan. Pure integers: no process group, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ulysses_ring_groups", "ulysses_size_problem"]


def ulysses_size_problem(ulysses_size: Any, cp_size: int) -> str | None:
    """Why ``ulysses_size`` cannot factor a CP group of ``cp_size`` ranks (``None``: it can)."""
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
        return f"distributed.ulysses_size={ulysses_size!r} must be a positive integer (the Ulysses sub-group size)"
    if cp_size % ulysses_size:
        divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
        return (
            f"distributed.ulysses_size={ulysses_size} does not divide distributed.cp_size={cp_size}: the CP group is "
            f"factored into ulysses_size x ring size; set distributed.ulysses_size to one of {divisors}"
        )
    return None


def ulysses_ring_groups(cp_ranks: Sequence[int], ulysses_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(ulysses_groups, ring_groups)`` of one CP group given as its ranks in CP-rank order.

    ``ulysses_ring_groups([0, 1, 2, 3], 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])``.

    Raises:
        ValueError: ``ulysses_size`` does not divide the group size.
    """
    ranks = list(cp_ranks)
    problem = ulysses_size_problem(ulysses_size, len(ranks))
    if problem is not None:
        raise ValueError(problem)
    u = ulysses_size
    ulysses = [ranks[i : i + u] for i in range(0, len(ranks), u)]
    ring = [ranks[j::u] for j in range(u)]
    return ulysses, ring
