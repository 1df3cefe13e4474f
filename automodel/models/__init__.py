"""Hugging Face causal LMs for the recipe: config resolution and checks (``loader``), TP and FSDP2
(``parallelize``), the decoder blocks and their one wrapper for activation checkpointing, compile and offload
(``block_call``); the sequence-tiled MLP is :mod:`automodel.models.tiled_mlp`."""

from automodel.models.loader import (
    ResolvedModelConfig,
    build_model,
    check_model_for_run,
    resolve_model_config,
    torch_dtype,
)
from automodel.models.parallelize import (
    apply_activation_checkpointing,
    apply_fsdp2,
    decoder_layers,
    fsdp_mesh,
)

__all__ = [
    "ResolvedModelConfig",
    "apply_activation_checkpointing",
    "apply_fsdp2",
    "build_model",
    "check_model_for_run",
    "decoder_layers",
    "fsdp_mesh",
    "resolve_model_config",
    "torch_dtype",
]
