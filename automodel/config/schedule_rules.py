"""Checks of the learning-rate schedule against the step count (called by ``check_rules``)."""

from __future__ import annotations

import math

from automodel.config.schema import RecipeConfig

__all__ = ["DECAY_SHAPES", "schedule_problems"]

#: the shapes of warmup_stable_decay's final decay (automodel.training.lr_schedule)
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def schedule_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.lr_scheduler`` against ``cfg.step_scheduler`` (empty list: fine).

    A ``warmup_steps`` longer than the run (any ``_target_`` with that argument) would end the run
    inside the warmup: the learning rate would never reach ``optimizer.lr`` and the decay never run.
    A ``decay_steps`` / ``decay_shape`` (warmup-stable-decay) is checked here too, so that the mistake is
    reported before the model loads rather than when the scheduler is built.
    """
    warmup = cfg.lr_scheduler.get("warmup_steps")
    max_steps = cfg.step_scheduler.max_steps
    if _int(warmup) and warmup > max_steps:
        return [
            f"lr_scheduler.warmup_steps={warmup} is more than step_scheduler.max_steps={max_steps}: the run "
            f"would end inside the warmup, before the learning rate reaches optimizer.lr; set "
            f"lr_scheduler.warmup_steps to at most {max_steps} (e.g. {max_steps // 10}) or raise step_scheduler.max_steps"
        ]
    problems = []
    shape = cfg.lr_scheduler.get("decay_shape")
    if shape is not None and shape not in DECAY_SHAPES:
        problems.append(f"lr_scheduler.decay_shape={shape!r} is not one of {' | '.join(DECAY_SHAPES)}")
    if "decay_steps" in cfg.lr_scheduler and _int(max_steps) and max_steps >= 1:
        decay = cfg.lr_scheduler.get("decay_steps")
        if decay is None:
            decay = max(1, math.ceil(0.1 * max_steps))  # warmup_stable_decay's default: the last 10%
        if _int(decay) and decay < 1:
            problems.append(f"lr_scheduler.decay_steps={decay} must be >= 1 (or null: the last 10% of the steps)")
        elif _int(decay) and (warmup if _int(warmup) else 0) + decay > max_steps:
            problems.append(
                f"lr_scheduler.warmup_steps + decay_steps = {warmup or 0} + {decay} is more than "
                f"step_scheduler.max_steps={max_steps}: the decay would start inside the warmup; lower "
                "lr_scheduler.warmup_steps or lr_scheduler.decay_steps, or raise step_scheduler.max_steps"
            )
    return problems
