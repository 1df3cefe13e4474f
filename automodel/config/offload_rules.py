"""Rules of the offload keys: ``model.activation_offload`` and ``fsdp.offload``.

Checked before any model loads (called by :func:`automodel.config.rules.check_rules`). Each refusal names
the keys, the rule and the fix.
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["offload_problems"]


def offload_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg``'s offload settings (empty list: fine)."""
    problems = []
    if cfg.model.activation_offload and not cfg.model.activation_checkpointing:
        problems.append(
            "model.activation_offload=true with model.activation_checkpointing=false: activation offload moves "
            "to host memory the layer inputs that activation checkpointing keeps for the backward, so it needs "
            "checkpointing; set model.activation_checkpointing=true, or model.activation_offload=false"
        )
    if cfg.fsdp.offload == "all" and not cfg.fsdp.enabled:
        problems.append(
            "fsdp.offload=all with fsdp.enabled=false: parameter offload is FSDP2's CPUOffloadPolicy (each unit's "
            "parameters come to the device for its all-gather only), which the replicated mode does not have; "
            "set fsdp.enabled=true, or fsdp.offload=optimizer (optimizer state and step on the host, which runs "
            "without FSDP2)"
        )
    return problems
