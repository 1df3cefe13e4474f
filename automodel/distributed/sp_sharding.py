"""Stable import path: the code lives in :mod:`automodel.distributed.sp.sharding` (re-exported here)."""

from automodel.distributed.sp.sharding import (
    AllGatherFunction,
    ShardingEvent,
    ShardingValidator,
    chunk_sizes,
    get_sharding_validator,
    sp_gather,
    sp_gather_with_grad,
    sp_gather_with_padding,
    sp_shard,
    sp_shard_with_padding,
)

__all__ = [
    "AllGatherFunction",
    "ShardingEvent",
    "ShardingValidator",
    "chunk_sizes",
    "get_sharding_validator",
    "sp_gather",
    "sp_gather_with_grad",
    "sp_gather_with_padding",
    "sp_shard",
    "sp_shard_with_padding",
]
