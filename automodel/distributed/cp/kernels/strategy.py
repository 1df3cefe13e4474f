"""Moved: :mod:`automodel.distributed.cp.layers.strategy` (re-exports only)."""

from automodel.distributed.cp.layers.strategy import (
    HALO,
    NATIVE,
    PAD_V,
    call_spec,
    choose_kernel,
    config_chunk,
    correct_query_temperature,
    pad_value_heads,
    run_layer,
)

__all__ = [
    "HALO",
    "NATIVE",
    "PAD_V",
    "call_spec",
    "choose_kernel",
    "config_chunk",
    "correct_query_temperature",
    "pad_value_heads",
    "run_layer",
]
