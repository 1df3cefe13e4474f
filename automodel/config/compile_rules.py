"""Which ``model.compile`` / ``distributed.enable_compiled_autograd`` combinations run exactly on torch 2.13.

Checked before any model loads (called by :func:`automodel.config.rules.check_rules`). Each rejection
names the combination, why it cannot work, and what to use instead.
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["compile_problems"]


def compile_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg``'s compile settings (empty list: fine)."""
    d, problems = cfg.distributed, []
    if d.enable_compiled_autograd and cfg.fsdp.enabled:
        problems.append(
            "distributed.enable_compiled_autograd=true with fsdp.enabled=true: on torch 2.13 FSDP2's gradient "
            "hooks are excluded from compilation (torch._dynamo.disable), so under compiled autograd the "
            "backward either fails on them or, without fullgraph, skips FSDP2's reduce-scatter and trains on "
            "unsynchronised gradients; set fsdp.enabled=false (replicated parameters, gradients summed over "
            "dp x cp after the backward; the model must fit on one device) or "
            "distributed.enable_compiled_autograd=false"
        )
    if d.enable_compiled_autograd and cfg.model.activation_checkpointing:
        problems.append(
            "distributed.enable_compiled_autograd=true with model.activation_checkpointing=true: the non-reentrant "
            "recomputation runs inside compiled autograd's capture of the backward, and on torch 2.13 (CPU) a "
            "3-step tiny run did not finish in minutes (with ring CP at cp_size=2 it never completed); set "
            "model.activation_checkpointing=false, or distributed.enable_compiled_autograd=false and use "
            "model.compile=true (which composes with activation checkpointing)"
        )
    return problems
