"""Shared by the CP parity workers: a model with activation offload, and the offloaded optimizer's steps.

- :func:`offloaded`: activation checkpointing (non-reentrant) and activation offload on a model, in place;
- :func:`compare_runs`: loss and gradients of a run with offload against the same run without it;
- :func:`optimizer_steps_equal`: two AdamW steps on given parameters and gradients, with the optimizer
  offloaded to the host and without it: the parameters must come out identical.
"""

from __future__ import annotations

import torch

from automodel.training.activation_offload import OffloadStore, apply_activation_offload
from automodel.training.optimizer_offload import HostOffloadOptimizer


def offloaded(model: torch.nn.Module) -> OffloadStore:
    """Checkpointing and activation offload on ``model`` (train mode); the store."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return apply_activation_offload(model)


def compare_runs(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict:
    """How far a run with offload is from the same run without it (0.0 and ``True``: bit for bit)."""
    assert sorted(grads) == sorted(ref_grads)
    return {
        "loss_diff": abs(loss - ref_loss),
        "grads_equal": all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads),
        "grad_diff": max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads),
    }


def optimizer_steps_equal(params: list[torch.Tensor], grads: list[torch.Tensor], steps: int = 2) -> bool:
    """``steps`` AdamW steps from ``params`` with ``grads``, plain and offloaded (host copies): equal results."""

    def fresh() -> list[torch.nn.Parameter]:
        out = [torch.nn.Parameter(p.detach().clone()) for p in params]
        return out

    def adamw(p: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)

    plain, off = fresh(), fresh()
    optimizers = (adamw(plain), HostOffloadOptimizer(off, adamw))
    for _ in range(steps):
        for group, opt in zip((plain, off), optimizers):
            for p, g in zip(group, grads):
                p.grad = g.detach().clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return all(torch.equal(a, b) for a, b in zip(plain, off))
