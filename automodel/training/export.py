"""Export the trained model as a Hugging Face directory (``save_pretrained``, safetensors).

The full state dict is gathered from the FSDP2 shards (a collective: every rank calls
:func:`export_hf_model`), offloaded to CPU, and written by rank 0 through ``save_pretrained`` of a
weightless (meta-device) instance of the model's *original* class — FSDP2 swaps the class of a
sharded module to ``FSDP<Name>``, which must not leak into ``config.json``'s ``architectures``.
The result loads with ``AutoModelForCausalLM.from_pretrained(dir)``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.models.hf_save import original_model_class, save_hf_state

# original_model_class lives in automodel.models.hf_save (models/lora.py needs it too); re-exported here
__all__ = ["original_model_class", "export_hf_model"]

logger = logging.getLogger(__name__)


def export_hf_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    save_tokenizer: bool = True,
    processor: Any = None,
) -> Path | None:
    """Gather the full weights and write ``out_dir`` on rank 0. Collective; returns the path on rank 0.

    Args:
        model: the (FSDP2-sharded or plain) HF causal LM.
        out_dir: target directory (created).
        dtype: cast floating-point weights to this dtype (None: as trained); ``config.dtype`` follows.
        tokenizer: gives the special-token ids of the config and generation config (whose EOS also lists
            the end-of-turn token of a chat template the run's data was rendered with: see
            :func:`~automodel.models.hf_save.save_hf_state`); saved alongside (``tokenizer.save_pretrained``)
            when ``save_tokenizer``.
        processor: a VLM's image processor, saved alongside when given.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out: Path | None = None
    if rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_hf_state(
            original_model_class(model), model.config, state, out, dtype=dtype, source_model=model,
            tokenizer=tokenizer, save_tokenizer=save_tokenizer, processor=processor,
        )  # fmt: skip
        logger.info("exported Hugging Face model to %s", out)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out
