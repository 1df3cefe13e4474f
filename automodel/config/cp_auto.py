"""``distributed.cp_method: auto`` resolved once the model's profile is known.

The config rules accept ``auto`` before any model exists (:func:`automodel.config.rules.auto_config_problems`:
some method's configuration must pass them). Once the model is profiled (on the meta device, before any
weight loads), :func:`resolve_cp_method` picks the method with
:func:`automodel.distributed.cp.choose_cp_method` (each method's own checks, plus the config rules with
that method selected) and writes it into the config, so that everything after it (the exactness check,
the data, the batch functions, the dry run's plan) runs the chosen method as if it had been named.
"""

from __future__ import annotations

from typing import Any

from automodel.config.rules import method_rules, ranks_per_node
from automodel.config.schema import RecipeConfig
from automodel.distributed.cp import AUTO, Choice, ModelProfile, choose_cp_method

__all__ = ["auto_choice", "packed_rows", "resolve_cp_method"]


def packed_rows(cfg: RecipeConfig) -> bool:
    """Whether the run's rows hold several documents (``data.dataset.pack`` or ``data.validation_dataset.pack``)."""
    nodes = (cfg.data.dataset, cfg.data.validation_dataset)
    return any(node is not None and node.get("pack") is True for node in nodes)


def auto_choice(
    cfg: RecipeConfig, profile: ModelProfile, world_size: int, cuda_available: bool | None = None
) -> Choice:
    """What ``distributed.cp_method: auto`` picks for ``profile`` under ``cfg`` (whatever ``cfg`` names; nothing
    is mutated): the run's row length, packing, TP, ranks per node and the config rules of each method.

    Raises:
        automodel.errors.CPUnsupportedError: no method computes the model exactly under this config.
    """
    d: Any = cfg.distributed
    return choose_cp_method(
        profile,
        d.cp_size,
        seq_len=cfg.data.seq_len,
        packed=packed_rows(cfg),
        tp_size=d.tp_size,
        ranks_per_node=ranks_per_node(cfg),
        extra_problems=method_rules(cfg, world_size, cuda_available),
    )


def resolve_cp_method(
    cfg: RecipeConfig, profile: ModelProfile, world_size: int, cuda_available: bool | None = None
) -> Choice | None:
    """Replace ``distributed.cp_method: auto`` in ``cfg`` by the method chosen for ``profile`` (mutates
    ``cfg.distributed``: ``cp_method`` and the keys the choice sets, e.g. ``ulysses_size``); ``None`` when
    ``cfg`` names a method.

    Raises:
        automodel.errors.CPUnsupportedError: no method computes the model exactly under this config (every
            method's reasons).
    """
    d: Any = cfg.distributed
    if d.cp_method != AUTO:
        return None
    choice = auto_choice(cfg, profile, world_size, cuda_available)
    d.cp_method = choice.name
    for key, value in choice.options.items():
        setattr(d, key, value)
    return choice
