"""Stable import path: the code lives in :mod:`automodel.distributed.sp.split_gather` (re-exported here)."""

from automodel.distributed.sp.split_gather import (
    gather_forward_split_backward,
    gather_forward_split_backward_by_indices,
    gather_forward_split_backward_load_balanced,
    gather_forward_split_backward_per_sequence,
    load_balanced_gather_forward_split_backward,
    load_balanced_indices,
    load_balanced_split_forward_gather_backward,
    per_sequence_indices,
    split_forward_gather_backward,
    split_forward_gather_backward_by_indices,
    split_forward_gather_backward_load_balanced,
    split_forward_gather_backward_per_sequence,
)

__all__ = [
    "gather_forward_split_backward",
    "gather_forward_split_backward_by_indices",
    "gather_forward_split_backward_load_balanced",
    "gather_forward_split_backward_per_sequence",
    "load_balanced_gather_forward_split_backward",
    "load_balanced_indices",
    "load_balanced_split_forward_gather_backward",
    "per_sequence_indices",
    "split_forward_gather_backward",
    "split_forward_gather_backward_by_indices",
    "split_forward_gather_backward_load_balanced",
    "split_forward_gather_backward_per_sequence",
]
