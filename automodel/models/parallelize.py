"""Activation checkpointing and FSDP2 (``fully_shard``) for Hugging Face decoder models.

FSDP2 shards every decoder layer (one all-gather / reduce-scatter group each) and then the root
(embeddings, final norm, LM head) over ``mesh["dp_shard_cp"]`` — the ranks of one CP group hold
different tokens of the same rows, so their gradients are summed like data-parallel ones. With
``dp_replicate > 1`` the 2-D mesh ``("dp_replicate", "dp_shard_cp")`` gives HSDP.

Gradient reduction is a plain **sum** (divide factor 1, sum-only collectives), not FSDP's default
average: the training loop divides each rank's loss by the number of label tokens in the whole
global batch, so summing the per-rank gradients gives exactly the single-device gradient,
whatever dp and cp are.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel.distributed.mesh import get_submesh
from automodel.errors import UserInputError

__all__ = ["decoder_layers", "apply_activation_checkpointing", "fsdp_mesh", "apply_fsdp2"]

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of ``model`` (by ``_no_split_modules`` class names).

    Raises:
        ValueError: no such modules are found (the model does not name its blocks).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder block classes (_no_split_modules={sorted(names)}); "
            f"cannot wrap it layer by layer"
        )
    return layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant). Mutates ``model``.

    Uses transformers' own per-layer checkpointing, so parameter names and the model class are
    unchanged (checkpoints and the HF export see the same keys).
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserInputError(
            f"{type(model).__name__} does not support gradient checkpointing; set model.activation_checkpointing=false"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def fsdp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
    if device_mesh["dp_replicate"].size() > 1:
        return get_submesh(device_mesh, "dp_replicate", "dp_shard_cp")
    return get_submesh(device_mesh, "dp_shard_cp")


def apply_fsdp2(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: each decoder layer, then the root.

    Args:
        model: an HF causal LM on its compute device, identical on every rank.
        device_mesh: the full mesh from ``ParallelDims.build_mesh`` (``dp_shard_cp`` etc.).
        param_dtype: dtype of the all-gathered parameters in forward/backward (None: as stored).
        reduce_dtype: dtype gradients are reduced in.
        reshard_after_forward: free gathered layer parameters after forward (re-gather in backward).

    Returns:
        ``model`` (now an ``FSDPModule``); parameters are ``DTensor`` shards, gradients are summed
        (not averaged) over the FSDP mesh.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = fsdp_mesh(device_mesh)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    from automodel.models.vlm_cp import vlm_fsdp_units

    for unit in vlm_fsdp_units(model):  # VLMs: vision tower and embedding run outside the root forward
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the loss is already normalised globally
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model
