"""Stable import path: the ulysses x ring rank arithmetic lives in :mod:`automodel.distributed.cp.subgroups`
and usp's process groups in :mod:`automodel.distributed.cp.usp.groups` (re-exported here)."""

from automodel.distributed.cp.subgroups import ulysses_ring_groups as usp_rank_groups
from automodel.distributed.cp.subgroups import ulysses_size_problem
from automodel.distributed.cp.usp.groups import UspGroups, usp_process_groups

__all__ = ["UspGroups", "usp_rank_groups", "usp_process_groups", "ulysses_size_problem"]
