"""Tensor parallelism and FSDP2 (``fully_shard``) for Hugging Face decoder models; activation checkpointing
(:func:`apply_activation_checkpointing`) and the decoder blocks (:func:`decoder_layers`) come from
:mod:`automodel.models.block_call`.

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
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel.distributed.mesh import get_submesh
from automodel.errors import UserInputError
from automodel.models.block_call import apply_activation_checkpointing, decoder_layers

__all__ = [
    "decoder_layers",
    "apply_activation_checkpointing",
    "check_model_config_for_tp",
    "apply_tp",
    "fsdp_mesh",
    "apply_fsdp2",
    "fsdp_units",
]

logger = logging.getLogger(__name__)


def check_model_config_for_tp(model_config: Any, tp_size: int, *, sequence_parallel: bool = False) -> None:
    """Check a transformers config against tensor parallelism over ``tp_size`` ranks, before weights load.

    Raises:
        UserInputError: a VLM (its vision tower and projector have no TP plan), an architecture without
            a plan, or a head / KV-head / MLP / vocabulary size not divisible by ``tp_size``.
    """
    if tp_size <= 1:
        return
    from automodel.distributed.tensor_parallel import tp_config_problems
    from automodel.models.vlm_cp import is_vlm

    if is_vlm(model_config):
        raise UserInputError(
            f"distributed.tp_size={tp_size} with a vision-language model ({getattr(model_config, 'model_type', None)}): "
            f"the vision tower and projector have no tensor-parallel plan; set distributed.tp_size=1 (VLMs train "
            f"under ring or ulysses CP with FSDP2)"
        )
    problems = tp_config_problems(model_config, tp_size, sequence_parallel=sequence_parallel)
    if problems:
        raise UserInputError("; ".join(problems))


def apply_tp(model: nn.Module, device_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool) -> None:
    """Tensor-parallel ``model`` in place over ``device_mesh["tp"]`` (no-op at tp size 1).

    Call after the CP method's attention switch and before activation checkpointing and FSDP2 (which
    then shards the TP ``DTensor`` parameters again over ``dp_shard_cp``: 2-D FSDP2 x TP). See
    :mod:`automodel.distributed.tensor_parallel` for the plan.
    """
    if device_mesh["tp"].size() <= 1:
        return
    from automodel.distributed.tensor_parallel import apply_tensor_parallel

    apply_tensor_parallel(
        model, device_mesh["tp"], loss_parallel=loss_parallel, sequence_parallel=sequence_parallel
    )


def fsdp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)`` for HSDP."""
    if device_mesh["dp_replicate"].size() > 1:
        return get_submesh(device_mesh, "dp_replicate", "dp_shard_cp")
    return get_submesh(device_mesh, "dp_shard_cp")


def fsdp_units(layers: list[nn.Module]) -> list[nn.Module | list[nn.Module]]:
    """The ``fully_shard`` units of ``layers``: each layer alone, except layers that share parameters (Zamba's hybrid
    layers share one attention block), which form one unit (a list, one FSDP2 parameter group), in first-use order.
    FSDP2 refuses a parameter that a second group would manage."""
    owner: dict[int, int] = {}  # parameter id -> its unit's index
    units: list[list[nn.Module]] = []
    for layer in layers:
        joined = sorted({owner[id(p)] for p in layer.parameters() if id(p) in owner})
        if joined:  # merge every unit this layer shares a parameter with into the first
            first = joined[0]
            for other in joined[1:]:
                units[first].extend(units[other])
                units[other] = []
            units[first].append(layer)
        else:
            first = len(units)
            units.append([layer])
        for m in units[first]:
            for p in m.parameters():
                owner[id(p)] = first
    return [u[0] if len(u) == 1 else u for u in units if u]


def apply_fsdp2(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: each decoder layer (layers sharing parameters together,
    :func:`fsdp_units`), then the root.

    Args:
        model: an HF causal LM on its compute device, identical on every rank.
        device_mesh: the full mesh from ``ParallelDims.build_mesh`` (``dp_shard_cp`` etc.).
        param_dtype: dtype of the all-gathered parameters in forward/backward (None: as stored).
        reduce_dtype: dtype gradients are reduced in.
        reshard_after_forward: free gathered layer parameters after forward (re-gather in backward).
        offload: ``fsdp.offload=all``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, their gradients and
            so the optimizer state and step on the host, pinned on CUDA; each unit's parameters are copied to
            the device for its all-gather and freed after it).

    Returns:
        ``model`` (now an ``FSDPModule``); parameters are ``DTensor`` shards, gradients are summed
        (not averaged) over the FSDP mesh.
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    mesh = fsdp_mesh(device_mesh)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    for unit in fsdp_units(decoder_layers(model)):
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    from automodel.models.vlm_cp import vlm_fsdp_units

    for unit in vlm_fsdp_units(model):  # VLMs: vision tower and embedding run outside the root forward
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, offload_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, offload_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # sum: the loss is already normalised globally
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model
