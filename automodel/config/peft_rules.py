"""Rules of the ``peft:`` section (and ``export.merge_lora``), from the typed config alone.

Which modules ``peft.target_modules`` selects depends on the model: that is checked against a
meta-device model before training (:func:`automodel.models.lora.check_lora_targets`).
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["peft_problems"]


def peft_problems(cfg: RecipeConfig) -> list[str]:
    """Every problem of ``cfg.peft`` / ``cfg.export.merge_lora`` (empty list: fine)."""
    problems: list[str] = []
    peft = cfg.peft
    if peft is None:
        if cfg.export.merge_lora:
            problems.append(
                "export.merge_lora=true but there is no peft section: there are no adapters to merge; "
                "add peft: {method: lora, ...} or set export.merge_lora=false"
            )
        return problems
    if peft.r < 1:
        problems.append(f"peft.r={peft.r} must be >= 1 (the LoRA rank; e.g. peft.r=8)")
    if peft.alpha <= 0:
        problems.append(
            f"peft.alpha={peft.alpha} must be > 0 (the update is scaled by alpha / r; e.g. peft.alpha=16)"
        )
    if not 0.0 <= peft.dropout < 1.0:
        problems.append(f"peft.dropout={peft.dropout} must be in [0, 1) (0 turns LoRA dropout off)")
    targets = peft.target_modules
    if isinstance(targets, str):
        if not targets.strip():
            problems.append(
                "peft.target_modules is an empty string; give module names (e.g. [q_proj, v_proj]), a regular "
                "expression, or all-linear"
            )
    elif not targets or any(not t.strip() for t in targets):
        problems.append(
            f"peft.target_modules={targets} must list at least one module name and no empty ones "
            f"(e.g. [q_proj, k_proj, v_proj, o_proj]), or be all-linear"
        )
    return problems
