"""Rules of the offload keys: ``model.activation_offload``, ``model.checkpoint_group_layers`` and ``fsdp.offload``.

Checked before any model loads (called by :func:`automodel.config.rules.check_rules`). Each refusal names
the keys, the rule and the fix.
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["checkpoint_group_problems", "offload_problems"]


def offload_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg``'s offload settings (empty list: fine)."""
    problems = []
    if cfg.model.activation_offload and not cfg.model.activation_checkpointing:
        problems.append(
            "model.activation_offload=true with model.activation_checkpointing=false: activation offload moves "
            "to host memory the layer inputs that activation checkpointing keeps for the backward, so it needs "
            "checkpointing; set model.activation_checkpointing=true, or model.activation_offload=false"
        )
    problems += checkpoint_group_problems(cfg)
    if cfg.fsdp.offload == "all" and not cfg.fsdp.enabled:
        problems.append(
            "fsdp.offload=all with fsdp.enabled=false: parameter offload is FSDP2's CPUOffloadPolicy (each unit's "
            "parameters come to the device for its all-gather only), which the replicated mode does not have; "
            "set fsdp.enabled=true, or fsdp.offload=optimizer (optimizer state and step on the host, which runs "
            "without FSDP2)"
        )
    return problems


def checkpoint_group_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``model.checkpoint_group_layers`` (automodel.models.checkpoint_groups): an int >= 1 or ``auto``;
    above 1 it needs activation checkpointing, and it is not proven with tensor parallelism or ``model.compile``."""
    value = cfg.model.checkpoint_group_layers
    if value == "auto":
        grouped = True
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [
            f"model.checkpoint_group_layers={value!r} must be an int >= 1 (decoder layers per checkpoint group: only "
            "each group's first layer keeps its input; 1 keeps every layer's) or auto; set e.g. "
            "model.checkpoint_group_layers=2, or 1"
        ]
    else:
        grouped = value > 1
    if not grouped:
        return []
    problems = []
    if not cfg.model.activation_checkpointing:
        problems.append(
            f"model.checkpoint_group_layers={value} with model.activation_checkpointing=false: a group keeps its first "
            "layer's input and rebuilds the others' from it, which only means something when checkpointing keeps the "
            "layer inputs; set model.activation_checkpointing=true, or model.checkpoint_group_layers=1"
        )
    if cfg.distributed.tp_size > 1:
        problems.append(
            f"model.checkpoint_group_layers={value} with distributed.tp_size={cfg.distributed.tp_size}: the groups' "
            "rebuild of a layer's input is not proven under tensor parallelism; set model.checkpoint_group_layers=1, "
            "or distributed.tp_size=1"
        )
    if cfg.model.compile:
        problems.append(
            f"model.checkpoint_group_layers={value} with model.compile=true: the groups' rebuild of a layer's input is "
            "not proven with compiled blocks; set model.checkpoint_group_layers=1, or model.compile=false"
        )
    return problems
