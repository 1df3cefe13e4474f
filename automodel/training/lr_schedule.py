"""Learning-rate schedules, built from ``lr_scheduler: {_target_: ..., ...}``.

The recipe calls the target with ``optimizer=`` and ``total_steps=`` (``step_scheduler.max_steps``)
and calls ``scheduler.step()`` once after every optimizer step; optimizer step ``k`` (0-based)
uses ``base_lr * factor(k)``.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_cosine", "warmup_cosine_factor"]


def warmup_cosine_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier of 0-based optimizer step ``step``.

    Linear warmup ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps (the first step
    does not waste its update on lr 0), then a cosine from 1 down to ``min_lr_ratio`` at the last step.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio * base_lr`` over ``total_steps`` steps.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps < 0``, or ``min_lr_ratio`` outside [0, 1].
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (step_scheduler.max_steps)")
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    return LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, total_steps, warmup_steps, min_lr_ratio)
    )
