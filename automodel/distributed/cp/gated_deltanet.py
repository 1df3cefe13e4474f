"""Moved: :mod:`automodel.distributed.cp.layers.gated_deltanet` (re-exports only)."""

from automodel.distributed.cp.layers.gated_deltanet import (
    GATED_DELTANET_MIXERS,
    CoreParams,
    core_params,
    finish,
    project,
    recurrent_gated_delta_rule,
    rule_override,
    run_core,
)

__all__ = [
    "GATED_DELTANET_MIXERS",
    "CoreParams",
    "core_params",
    "finish",
    "project",
    "recurrent_gated_delta_rule",
    "rule_override",
    "run_core",
]
