"""Stable import path: TE/THD batch building lives in :mod:`automodel.distributed.cp.te_batch` (re-exported here)."""

from automodel.distributed.cp.te_batch import (
    SHARDED_KEYS,
    _shard_thd_chunk_for_te,
    make_cp_batch_for_te,
    shard_thd_chunk,
)

__all__ = ["SHARDED_KEYS", "make_cp_batch_for_te", "shard_thd_chunk", "_shard_thd_chunk_for_te"]
