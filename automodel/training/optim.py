"""Optimizer, LR scheduler and gradient clipping for an FSDP2 model (DTensor parameters)."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["build_optimizer", "build_lr_scheduler", "clip_grad_norm"]


def build_optimizer(node: dict, model: nn.Module) -> torch.optim.Optimizer:
    """``hydra.utils.instantiate(node, params=<trainable parameters>)`` (e.g. ``torch.optim.AdamW``)."""
    from hydra.utils import instantiate

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return instantiate(node, params=params, _convert_="all")


def build_lr_scheduler(node: dict, optimizer: torch.optim.Optimizer, total_steps: int):  # noqa: ANN201
    """``hydra.utils.instantiate(node, optimizer=optimizer, total_steps=total_steps)``."""
    from hydra.utils import instantiate

    return instantiate(node, optimizer=optimizer, total_steps=total_steps, _convert_="all")


def clip_grad_norm(model: nn.Module, max_norm: float | None, norm_type: float = 2.0) -> float:
    """Total gradient norm over all parameters (all shards); clip to ``max_norm`` unless None.

    Works on FSDP2's ``DTensor`` gradients: the norm is computed from the local shards and
    reduced over the mesh, so every rank gets the same full norm. Returns it as a float (may be
    ``inf``/``nan``; clipping is then skipped, and the caller decides).
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm is not None and math.isfinite(total.item()):
        torch.nn.utils.clip_grads_with_norm_(
            [p for p in model.parameters() if p.grad is not None], max_norm, total, foreach=True
        )
    return float(total.item())
