"""The LR schedules beside cosine: the exact lr of every optimizer step, through the scheduler."""

from __future__ import annotations

import math

import pytest
import torch

from automodel.training import lr_schedule


def _lrs(factory, steps: int, base: float = 2.0, **kw) -> list[float]:
    """lr used by optimizer steps 0..steps-1 (read before each step, as the trainer does)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = factory(opt, total_steps=steps, **kw)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_linear_warmup_then_straight_line_to_the_floor():
    # warmup 2: 1.0, 2.0; then 2.0 -> 0.5 over steps 2..5 in 3 equal drops of 0.5
    assert _lrs(lr_schedule.warmup_linear, 6, warmup_steps=2, min_lr_ratio=0.25) == pytest.approx(
        [1.0, 2.0, 2.0, 1.5, 1.0, 0.5]
    )
    assert _lrs(lr_schedule.warmup_linear, 3) == pytest.approx([2.0, 1.0, 0.0])


def test_constant_after_warmup():
    assert _lrs(lr_schedule.warmup_constant, 5, warmup_steps=4) == pytest.approx([0.5, 1.0, 1.5, 2.0, 2.0])
    assert _lrs(lr_schedule.warmup_constant, 3) == pytest.approx([2.0, 2.0, 2.0])


def test_warmup_stable_decay_each_shape():
    kw = dict(warmup_steps=2, decay_steps=3, min_lr_ratio=0.0)
    # steps 0,1 warmup; 2..6 stable; 7,8,9 decay from 2.0 (step 7) to 0.0 (step 9)
    assert _lrs(lr_schedule.warmup_stable_decay, 10, **kw) == pytest.approx(
        [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.0, 0.0]
    )
    cos = _lrs(lr_schedule.warmup_stable_decay, 10, decay_shape="cosine", **kw)
    assert cos[7:] == pytest.approx([2.0, 1.0, 0.0])  # cos(pi/2) = 0: the midpoint equals linear
    sqrt = _lrs(lr_schedule.warmup_stable_decay, 10, decay_shape="1-sqrt", **kw)
    assert sqrt[7:] == pytest.approx([2.0, 2.0 * (1 - math.sqrt(0.5)), 0.0])
    # default decay: the last 10% (ceil), floor min_lr_ratio
    default = _lrs(lr_schedule.warmup_stable_decay, 20, min_lr_ratio=0.5)
    assert default[:18] == pytest.approx([2.0] * 18) and default[18:] == pytest.approx([2.0, 1.0])


def test_bad_schedule_arguments_are_refused():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"warmup_steps \+ decay_steps = 5 \+ 6 exceeds step_scheduler.max_steps=10"):
        lr_schedule.warmup_stable_decay(opt, 10, warmup_steps=5, decay_steps=6)
    with pytest.raises(ValueError, match="decay_shape='exp'"):
        lr_schedule.warmup_stable_decay(opt, 10, decay_shape="exp")
    with pytest.raises(ValueError, match="min_lr_ratio=-1"):
        lr_schedule.warmup_linear(opt, 10, min_lr_ratio=-1)
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        lr_schedule.warmup_constant(opt, 10, warmup_steps=-1)


def test_every_schedule_builds_from_the_config_node():
    from automodel.training.optim import build_lr_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    for name in ("warmup_cosine", "warmup_linear", "warmup_constant", "warmup_stable_decay"):
        node = {"_target_": f"automodel.training.lr_schedule.{name}", "warmup_steps": 1}
        sched = build_lr_scheduler(node, opt, total_steps=10)
        assert sched.lr_lambdas[0](0) == pytest.approx(1.0)
