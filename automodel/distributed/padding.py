"""Stable import path: the code lives in :mod:`automodel.distributed.sp.padding` (re-exported here)."""

from automodel.distributed.sp.padding import (
    FP8_RECIPES,
    get_padding,
    get_padding_lcm,
    get_padding_multiple,
)

__all__ = [
    "FP8_RECIPES",
    "get_padding",
    "get_padding_lcm",
    "get_padding_multiple",
]
