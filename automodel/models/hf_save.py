"""Write a Hugging Face model directory from a state dict, without a second copy of the weights.

What is written is fit for generation, not a copy of the training settings:

- the special-token ids (``bos``/``eos``/``pad``) of ``config.json`` and ``generation_config.json`` come
  from the run's tokenizer (a model built from ``LlamaConfig`` otherwise keeps its defaults 1 and 2,
  which need not be the tokenizer's);
- the EOS of ``generation_config.json`` also lists the end-of-turn token(s) of the chat template the
  run's data was rendered with (``eos_token_id: [0, 3]`` for the shipped ChatML template, whose turns end
  with ``<|im_end|>``), as recorded on the tokenizer by the chat datasets
  (:mod:`automodel.data.chat_template`), so that ``generate()`` stops where the data taught the model to
  stop; a plain-text run keeps the EOS alone;
- ``use_cache`` is true in both (training turns it off);
- a tied-embeddings flag is written only when the saved input and output embeddings are equal;
- a VLM's image processor is saved beside the tokenizer (``preprocessor_config.json``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from automodel.data.chat_template import recorded_chat_stop_ids

__all__ = ["original_model_class", "save_hf_state", "special_token_ids", "stop_token_ids", "embeddings_equal"]

logger = logging.getLogger(__name__)

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")


def original_model_class(model: nn.Module) -> type:
    """The HF class of ``model`` before ``fully_shard`` replaced it with ``FSDP<Class>``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(model)
    if isinstance(model, FSDPModule):
        for base in cls.__mro__[1:]:
            if base is not FSDPModule and not issubclass(base, FSDPModule) and issubclass(base, nn.Module):
                return base
    return cls


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """``{bos_token_id, eos_token_id, pad_token_id}`` that ``tokenizer`` defines (None ones left out)."""
    ids = {k: getattr(tokenizer, k, None) for k in _SPECIAL}
    return {k: int(v) for k, v in ids.items() if isinstance(v, int)}


def embeddings_equal(model: nn.Module, state: dict[str, torch.Tensor]) -> bool | None:
    """Whether ``state`` holds equal input and output embeddings of ``model`` (None: not both in it).

    The parameter names come from ``model``'s embedding modules (any device, meta included)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None or get_in() is None or get_out() is None:
        return None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}  # modules stay distinct when
    in_name, out_name = (f"{names.get(id(m))}.weight" for m in (get_in(), get_out()))  # weights are tied
    if in_name not in state or out_name not in state:
        return None
    a, b = state[in_name], state[out_name]
    return a.shape == b.shape and bool(torch.equal(a, b))


def _set_generation_ids(config: Any, ids: dict[str, int]) -> None:
    """Put ``ids`` on a model config (and its text config, for VLMs). Mutates ``config``."""
    targets = [config]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        targets.append(text)
    for c in targets:
        for key, value in ids.items():
            setattr(c, key, value)
        c.use_cache = True


def stop_token_ids(current: Any, eos: int | None, end_of_turn: list[int]) -> int | list[int] | None:
    """The ``eos_token_id`` of a generation config: the tokenizer's ``eos`` (or ``current``, a list that
    already holds it, e.g. a pretrained chat model's), then each ``end_of_turn`` id not in it yet. One id
    is written as an int, several as a list (``[0, 3]``), none as None."""
    if eos is None:
        ids = list(current) if isinstance(current, list) else ([] if current is None else [int(current)])
    else:
        ids = list(current) if isinstance(current, list) and eos in current else [eos]
    ids += [i for i in end_of_turn if i not in ids]
    return None if not ids else (ids[0] if len(ids) == 1 else ids)


def _generation_config(source: Any, config: Any, ids: dict[str, int], end_of_turn: list[int]) -> Any:
    """The generation config to write: ``source``'s (or one from ``config``) with the tokenizer's ids,
    the chat template's ``end_of_turn`` ids added to its EOS (:func:`stop_token_ids`) and
    ``use_cache=True``."""
    from transformers import GenerationConfig

    gen = copy.deepcopy(source) if source is not None else GenerationConfig.from_model_config(config)
    for key, value in ids.items():
        if key != "eos_token_id":
            setattr(gen, key, value)
    gen.eos_token_id = stop_token_ids(getattr(gen, "eos_token_id", None), ids.get("eos_token_id"), end_of_turn)
    gen.use_cache = True
    return gen


def save_hf_state(
    cls: type,
    config: Any,
    state: dict[str, torch.Tensor],
    out: str | Path,
    *,
    dtype: torch.dtype | None = None,
    source_model: nn.Module | None = None,
    tokenizer: Any = None,
    save_tokenizer: bool = True,
    processor: Any = None,
) -> None:
    """``save_pretrained`` of a weightless (meta-device) ``cls(config)`` with ``state`` as its weights.

    Args:
        cls: the ``PreTrainedModel`` class to write (``from_pretrained`` loads it back).
        config: its config (deep-copied; ``config.dtype`` is set to the saved dtype, ``use_cache`` to true,
            the special-token ids to the tokenizer's, ``tie_word_embeddings`` to false when the saved input
            and output embeddings differ).
        state: full (unsharded) tensors by parameter name.
        out: the directory written (safetensors, config, generation config).
        dtype: cast floating-point tensors to this dtype (None: as they are).
        source_model: its ``generation_config`` is the starting point of the one saved, when it has one.
        tokenizer: gives the special-token ids, and the chat template's end-of-turn ids the run's chat
            datasets recorded on it (added to the generation config's EOS); saved alongside
            (``tokenizer.save_pretrained``) when ``save_tokenizer``.
        processor: an image processor (VLMs), saved alongside (``preprocessor_config.json``) when given.
    """
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    config = copy.deepcopy(config)
    ids = special_token_ids(tokenizer) if tokenizer is not None else {}
    _set_generation_ids(config, ids)
    with torch.device("meta"):
        skeleton = cls(config)
    if getattr(config, "tie_word_embeddings", False) and embeddings_equal(skeleton, state) is False:
        logger.info("export: the input and output embeddings differ, so tie_word_embeddings=false is written")
        config.tie_word_embeddings = False
        with torch.device("meta"):
            skeleton = cls(config)
    export_dtype = dtype or next(iter(v.dtype for v in state.values() if v.is_floating_point()), None)
    if export_dtype is not None:
        skeleton.config.dtype = export_dtype
    end_of_turn = recorded_chat_stop_ids(tokenizer) if tokenizer is not None else []
    skeleton.generation_config = _generation_config(
        getattr(source_model, "generation_config", None), skeleton.config, ids, end_of_turn
    )
    with _progress_bars_only_on_a_tty():
        skeleton.save_pretrained(out, state_dict=state)
    if tokenizer is not None and save_tokenizer:
        tokenizer.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)


@contextlib.contextmanager
def _progress_bars_only_on_a_tty() -> Iterator[None]:
    """transformers' own progress bars (``Writing model shards``) off while stderr is not a terminal, so a
    cluster log gets no tqdm frames (as the recipe's own bar); restored afterwards."""
    from transformers.utils import logging as hf_logging

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
