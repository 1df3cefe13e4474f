"""Optimizer, LR scheduler and gradient clipping for an FSDP2 model (DTensor parameters)."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["build_optimizer", "build_lr_scheduler", "clip_grad_norm"]


def build_optimizer(node: dict, model: nn.Module, offload: bool = False) -> torch.optim.Optimizer:
    """``hydra.utils.instantiate(node, params=<trainable parameters>)`` (e.g. ``torch.optim.AdamW``).

    ``offload`` (``fsdp.offload=optimizer``): the optimizer is built on host copies of the parameters and
    wrapped in :class:`automodel.training.optimizer_offload.HostOffloadOptimizer` (state and step on the host).
    """
    from hydra.utils import instantiate

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    if offload:
        from automodel.training.optimizer_offload import HostOffloadOptimizer

        return HostOffloadOptimizer(params, lambda host: instantiate(node, params=host, _convert_="all"))
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

    With tensor parallelism the gradients live on different meshes and placements (2-D
    ``(dp_shard_cp, tp)`` for TP-sharded weights, 1-D ``dp_shard_cp`` for the norms), which one
    foreach norm cannot mix: each (mesh, placements) group is reduced on its own, and the group norms
    are combined (``(sum n_g^p)^(1/p)``, or their max for ``inf``).

    Gradients offloaded to the host by FSDP2 (``fsdp.offload=all``) on an accelerator mesh: each group's
    partial norm is moved to the mesh's device before it is reduced (the collective runs there).
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    groups: dict = {}
    for p in params:
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in members], norm_type=norm_type, foreach=True)
        if isinstance(norm, DTensor):
            local = norm.to_local()
            if local.device.type != norm.device_mesh.device_type:  # host gradients, accelerator collectives
                norm = DTensor.from_local(local.to(norm.device_mesh.device_type), norm.device_mesh, norm.placements)
            norm = norm.full_tensor()
        norms.append(norm)
    total = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type=norm_type)
    if max_norm is not None and math.isfinite(total.item()):
        for members in groups.values():
            torch.nn.utils.clip_grads_with_norm_(members, max_norm, total, foreach=True)
    return float(total.item())
