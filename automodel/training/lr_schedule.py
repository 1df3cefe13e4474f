"""Learning-rate schedules, built from ``lr_scheduler: {_target_: ..., ...}``.

The recipe calls the target with ``optimizer=`` and ``total_steps=`` (``step_scheduler.max_steps``)
and calls ``scheduler.step()`` once after every optimizer step; optimizer step ``k`` (0-based)
uses ``base_lr * factor(k)``. Every schedule starts with the same linear warmup
``(k + 1) / warmup_steps`` (the first step does not waste its update on lr 0) and then:

- :func:`warmup_cosine`: a cosine from 1 down to ``min_lr_ratio`` at the last step;
- :func:`warmup_linear`: a straight line from 1 down to ``min_lr_ratio`` at the last step;
- :func:`warmup_constant`: 1 to the end;
- :func:`warmup_stable_decay` (WSD): 1 until the last ``decay_steps`` steps, which fall (linear,
  cosine or ``1-sqrt``) to ``min_lr_ratio`` at the last step.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from automodel.config.schedule_rules import DECAY_SHAPES

__all__ = [
    "DECAY_SHAPES",
    "warmup_cosine",
    "warmup_cosine_factor",
    "warmup_linear",
    "warmup_linear_factor",
    "warmup_constant",
    "warmup_stable_decay",
    "warmup_stable_decay_factor",
]



def _decay(progress: float, shape: str) -> float:
    """1 at ``progress`` 0 down to 0 at ``progress`` 1."""
    progress = min(1.0, max(0.0, progress))
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - math.sqrt(progress)  # 1-sqrt


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


def warmup_linear_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """As :func:`warmup_cosine_factor`, with a straight line from 1 to ``min_lr_ratio`` after the warmup."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)
    return min_lr_ratio + (1.0 - min_lr_ratio) * _decay(progress, "linear")


def warmup_stable_decay_factor(
    step: int, total_steps: int, warmup_steps: int, decay_steps: int, min_lr_ratio: float, decay_shape: str
) -> float:
    """LR multiplier of 0-based step ``step``: warmup, 1 until step ``total_steps - decay_steps``, then
    ``decay_shape`` from 1 (that step) down to ``min_lr_ratio`` (step ``total_steps - 1``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    start = total_steps - decay_steps
    if step < start:
        return 1.0
    progress = (step - start) / max(1, decay_steps - 1)
    return min_lr_ratio + (1.0 - min_lr_ratio) * _decay(progress, decay_shape)


def _check(total_steps: int, warmup_steps: int, min_lr_ratio: float = 0.0) -> None:
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1 (step_scheduler.max_steps)")
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_ratio={min_lr_ratio} must be in [0, 1]")


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio * base_lr`` over ``total_steps`` steps.

    Raises:
        ValueError: ``total_steps < 1``, ``warmup_steps < 0``, or ``min_lr_ratio`` outside [0, 1].
    """
    _check(total_steps, warmup_steps, min_lr_ratio)
    return LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, total_steps, warmup_steps, min_lr_ratio)
    )


def warmup_linear(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup then linear decay to ``min_lr_ratio * base_lr`` at the last step (same checks as
    :func:`warmup_cosine`)."""
    _check(total_steps, warmup_steps, min_lr_ratio)
    return LambdaLR(
        optimizer, lambda step: warmup_linear_factor(step, total_steps, warmup_steps, min_lr_ratio)
    )


def warmup_constant(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Linear warmup then the base lr to the end."""
    _check(total_steps, warmup_steps)
    return LambdaLR(optimizer, lambda step: (step + 1) / warmup_steps if step < warmup_steps else 1.0)


def warmup_stable_decay(
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    warmup_steps: int = 0,
    decay_steps: int | None = None,
    min_lr_ratio: float = 0.0,
    decay_shape: str = "linear",
) -> LambdaLR:
    """Warmup-stable-decay: linear warmup, the base lr, then the last ``decay_steps`` steps decay
    (``decay_shape``: linear | cosine | 1-sqrt) to ``min_lr_ratio * base_lr`` at the last step.

    ``decay_steps=None``: the last 10% of ``total_steps`` (at least 1).

    Raises:
        ValueError: the checks of :func:`warmup_cosine`, ``decay_steps < 1``, ``warmup_steps + decay_steps
            > total_steps``, or an unknown ``decay_shape``.
    """
    _check(total_steps, warmup_steps, min_lr_ratio)
    if decay_steps is None:
        decay_steps = max(1, math.ceil(0.1 * total_steps))
    if decay_steps < 1:
        raise ValueError(f"lr_scheduler.decay_steps={decay_steps} must be >= 1 (or null: the last 10%)")
    if warmup_steps + decay_steps > total_steps:
        raise ValueError(
            f"lr_scheduler.warmup_steps + decay_steps = {warmup_steps} + {decay_steps} exceeds "
            f"step_scheduler.max_steps={total_steps}; lower them or raise step_scheduler.max_steps"
        )
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"lr_scheduler.decay_shape={decay_shape!r} is not one of {DECAY_SHAPES}")
    return LambdaLR(
        optimizer,
        lambda step: warmup_stable_decay_factor(
            step, total_steps, warmup_steps, decay_steps, min_lr_ratio, decay_shape
        ),
    )
