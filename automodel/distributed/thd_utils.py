"""Stable import path: the THD batch format lives in :mod:`automodel.distributed.cp.thd_format` (re-exported here)."""

from automodel.distributed.cp.thd_format import (
    THD_TOKEN_KEYS,
    first_not_divisible,
    get_thd_partitioned_indices,
    packed_padding_mask,
    process_input_for_thd,
    split_batch_into_thd_chunks,
    thd_partition_indices,
    validate_thd_partition_args,
)

__all__ = [
    "THD_TOKEN_KEYS", "first_not_divisible", "get_thd_partitioned_indices", "packed_padding_mask",
    "process_input_for_thd", "split_batch_into_thd_chunks", "thd_partition_indices",
    "validate_thd_partition_args"
]
