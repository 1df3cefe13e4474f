"""Stable import path: the code lives in :mod:`automodel.distributed.multimodal.comm` (re-exported here)."""

from automodel.distributed.multimodal.comm import (
    GatherFromContextParallelRanks,
    PackedSeqParams,
    resolve_group,
)

__all__ = [
    "GatherFromContextParallelRanks",
    "PackedSeqParams",
    "resolve_group",
]
