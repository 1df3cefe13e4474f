"""Moved: :mod:`automodel.distributed.cp.exchange.halo` (re-exports only)."""

from automodel.distributed.cp.exchange.halo import HaloPlan, QueryBlock, halo_exchange, lower_bounds

__all__ = ["HaloPlan", "QueryBlock", "halo_exchange", "lower_bounds"]
