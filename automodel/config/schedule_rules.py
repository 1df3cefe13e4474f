"""Checks of the learning-rate schedule against the step count (called by ``check_rules``)."""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["schedule_problems"]


def schedule_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.lr_scheduler`` against ``cfg.step_scheduler`` (empty list: fine).

    A ``warmup_steps`` longer than the run (any ``_target_`` with that argument) would end the run
    inside the warmup: the learning rate would never reach ``optimizer.lr`` and the decay never run.
    """
    warmup = cfg.lr_scheduler.get("warmup_steps")
    max_steps = cfg.step_scheduler.max_steps
    if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup > max_steps:
        return [
            f"lr_scheduler.warmup_steps={warmup} is more than step_scheduler.max_steps={max_steps}: the run "
            f"would end inside the warmup, before the learning rate reaches optimizer.lr; set "
            f"lr_scheduler.warmup_steps to at most {max_steps} (e.g. {max_steps // 10}) or raise step_scheduler.max_steps"
        ]
    return []
