"""Write a Hugging Face model directory from a state dict, without a second copy of the weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["original_model_class", "save_hf_state"]


def original_model_class(model: nn.Module) -> type:
    """The HF class of ``model`` before ``fully_shard`` replaced it with ``FSDP<Class>``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if isinstance(model, FSDPModule):
        for base in cls.__mro__[1:]:
            if base is not FSDPModule and not issubclass(base, FSDPModule) and issubclass(base, nn.Module):
                return base
    return cls


def save_hf_state(
    cls: type,
    config: Any,
    state: dict[str, torch.Tensor],
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    source_model: nn.Module | None = None,
    tokenizer: Any = None,
) -> None:
    """``save_pretrained`` of a weightless (meta-device) ``cls(config)`` with ``state`` as its weights.

    Args:
        cls: the ``PreTrainedModel`` class to write (``from_pretrained`` loads it back).
        config: its config (deep-copied; ``config.dtype`` is set to the saved dtype).
        state: full (unsharded) tensors by parameter name.
        out: the directory written (safetensors, config, generation config).
        dtype: cast floating-point tensors to this dtype (None: as they are).
        source_model: its ``generation_config`` is saved too, when it has one.
        tokenizer: saved alongside (``tokenizer.save_pretrained``) when given.
    """
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    with torch.device("meta"):
        skeleton = cls(copy.deepcopy(config))
    export_dtype = dtype or next(iter(v.dtype for v in state.values() if v.is_floating_point()), None)
    if export_dtype is not None:
        skeleton.config.dtype = export_dtype
    if getattr(source_model, "generation_config", None) is not None:
        skeleton.generation_config = source_model.generation_config
    skeleton.save_pretrained(out, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
