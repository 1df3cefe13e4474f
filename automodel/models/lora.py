"""PEFT LoRA adapters on a stock Hugging Face causal LM, for training under any CP method and FSDP2.

The recipe's ``peft:`` section (``{method: lora, r, alpha, dropout, target_modules}``) becomes a
``peft.LoraConfig``; :func:`apply_lora` injects the adapters **in place** with
``peft.inject_adapter_in_model``: the model keeps its own class (``LlamaForCausalLM``, ...), its
forward and its attention, so every CP method (which switches attention or shards the batch),
activation checkpointing and FSDP2 see the model they already handle. Targeted ``nn.Linear``
modules become ``peft`` LoRA layers (the frozen weight moves to ``<name>.base_layer.weight``; the
adapters are ``<name>.lora_A.default.weight`` ``[r, in]`` and ``<name>.lora_B.default.weight``
``[out, r]``), and every other parameter gets ``requires_grad=False``. FSDP2 allows frozen and
trainable parameters in one ``fully_shard`` group; gradients, the optimizer (built from the
trainable parameters) and checkpoints (``Checkpointer(trainable_only=True)``) then hold the
adapters only.

Exactness under CP: the adapters are initialised from ``recipe.seed`` on every rank (PEFT draws
``lora_A`` from torch's global RNG, which the trainer seeds per rank), so cp=N starts from the
very weights of cp=1. ``dropout > 0`` draws its masks per rank and per token shard: training is
correct, but not bitwise comparable across cp sizes (parity is stated for ``dropout: 0``).

:func:`check_lora_targets` validates ``target_modules`` against a meta-device model (no weights
read) before training; :func:`export_lora` writes the adapter in PEFT's own format and, optionally,
the merged model (``merge_and_unload``), which loads with ``from_pretrained``.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from automodel.errors import UserInputError
from automodel.models.hf_save import original_model_class, save_hf_state

__all__ = [
    "ADAPTER_NAME",
    "lora_config",
    "check_lora_targets",
    "check_lora_for_model_config",
    "apply_lora",
    "adapter_parameter_names",
    "export_lora",
]

logger = logging.getLogger(__name__)

ADAPTER_NAME = "default"  # PEFT's default adapter name (its key segment in parameter names)
_PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the wrapped model's parameters
# LoRA's parameters in PEFT's names: lora_A / lora_B (Linear), lora_embedding_A / _B (Embedding)
_ADAPTER_PARAM = re.compile(r"\.lora_(A|B|embedding_A|embedding_B)\.")


def lora_config(section: Any) -> Any:
    """The ``peft.LoraConfig`` of a validated ``peft:`` section (``automodel.config.schema.PeftSection``)."""
    from peft import LoraConfig

    targets = section.target_modules
    return LoraConfig(
        r=section.r,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(targets) if isinstance(targets, (list, tuple)) else targets,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _linear_suffixes(model: nn.Module) -> list[str]:
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names)


def check_lora_targets(model: nn.Module, section: Any) -> None:
    """Check that ``peft.target_modules`` selects modules of ``model`` that LoRA can adapt.

    ``model`` may live on the meta device (nothing is read or allocated). Stricter than PEFT, which
    accepts a list as long as *one* entry matches: here *every* listed name must match a module
    (a typo in one entry would otherwise silently train fewer adapters). A string is PEFT's regular
    expression, matched against full module names (``"all-linear"``: every linear layer but the
    output head). ``model`` is not modified.

    Raises:
        UserInputError: an entry matches no module, or a matched module type is not supported by
            PEFT LoRA; the message lists the model's linear layer names.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = section.target_modules
    names = [name for name, _ in model.named_modules() if name]
    cls = type(model).__name__
    hint = (
        f"{cls}'s linear layers are named {', '.join(_linear_suffixes(model))}; a list entry matches a module "
        f"name or its last dotted parts (e.g. q_proj, self_attn.q_proj), a string is a regular expression "
        f"matched against the full module name (e.g. '.*\\.(q_proj|v_proj)'), and 'all-linear' selects every "
        f"linear layer but the output head"
    )
    if isinstance(targets, str):
        regex = LoraConfig(target_modules=targets)
        if targets != "all-linear" and not any(check_target_module_exists(regex, n) for n in names):
            raise UserInputError(
                f"peft.target_modules={targets!r} matches no module of {cls}; fix peft.target_modules ({hint})"
            )
    else:
        one_each = {t: LoraConfig(target_modules=[t]) for t in targets}
        missing = [t for t in targets if not any(check_target_module_exists(one_each[t], n) for n in names)]
        if missing:
            raise UserInputError(
                f"peft.target_modules: {missing} match no module of {cls}; fix or remove "
                f"{'it' if len(missing) == 1 else 'them'} ({hint})"
            )
    _check_tied_head(model, section)
    if _is_meta(model):  # what PEFT itself refuses (a module type LoRA cannot adapt), on a weightless copy
        _inject(copy.deepcopy(model), section)


def _check_tied_head(model: nn.Module, section: Any) -> None:
    """Refuse LoRA on an output head whose weight is the input embedding (tie_word_embeddings):
    merging ``B @ A`` into the shared weight would change the input embeddings too."""
    from peft.tuners.tuners_utils import check_target_module_exists

    from automodel.distributed.cp.guard import cached_profile

    get_head = getattr(model, "get_output_embeddings", None)
    if getattr(model, "config", None) is None or get_head is None or not cached_profile(model).tie_word_embeddings:
        return
    head = get_head()
    if head is None or section.target_modules == "all-linear":  # all-linear leaves the head out
        return
    name = next((n for n, m in model.named_modules() if m is head), None)
    if name is not None and check_target_module_exists(lora_config(section), name):
        raise UserInputError(
            f"peft.target_modules={section.target_modules!r} selects the output head {name!r}, whose weight is "
            f"tied to the input embeddings (tie_word_embeddings=true): the merged model would change the input "
            f"embeddings too. Remove {name} from peft.target_modules"
        )


def _inject(model: nn.Module, section: Any) -> None:
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(section), model, adapter_name=ADAPTER_NAME)
    except ValueError as e:
        raise UserInputError(
            f"peft.target_modules={section.target_modules!r}: PEFT cannot put LoRA on what it selects in "
            f"{type(model).__name__} ({str(e).splitlines()[0]}); target linear layers only"
        ) from None


def _is_meta(model: nn.Module) -> bool:
    return all(p.device.type == "meta" for p in model.parameters())


def apply_lora(model: nn.Module, section: Any, *, seed: int) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze everything else; return ``model``.

    Call it on the built model (after the CP method's one-time switch, before activation
    checkpointing and FSDP2). The adapters are drawn from ``seed`` in a forked RNG (the same on
    every rank; the global RNG is left as it was). ``lora_B`` starts at zero, so the model's output
    is unchanged until the first optimizer step.

    Raises:
        UserInputError: see :func:`check_lora_targets`.
    """
    check_lora_targets(model, section)
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        _inject(model, section)
    trainable = adapter_parameter_names(model)
    n_train = sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    n_all = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d alpha=%s dropout=%s on %d modules: %d trainable of %d parameters (%.3f%%)",
        section.r,
        section.alpha,
        section.dropout,
        len(trainable) // 2,
        n_train,
        n_all,
        100.0 * n_train / max(n_all, 1),
    )
    return model


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """Names of the trainable (adapter) parameters of a model that :func:`apply_lora` prepared.

    Raises:
        RuntimeError: a trainable parameter is not a LoRA adapter, or there is none.
    """
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    stray = sorted(n for n in names if not _ADAPTER_PARAM.search(n))
    if stray or not names:
        raise RuntimeError(f"expected only LoRA adapters to be trainable; trainable: {sorted(names)[:8]}")
    return names


def _hf_name(name: str) -> str:
    """Parameter name of the plain model: ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``."""
    return name.replace(".base_layer.", ".")


def export_lora(
    model: nn.Module,
    section: Any,
    out_dir: str | Path,
    *,
    base_model_name_or_path: str | None,
    merge: bool = False,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    save_tokenizer: bool = True,
) -> Path | None:
    """Write the trained adapter (and optionally the merged model) under ``out_dir``. Collective.

    Layout (rank 0 writes; every rank must call):

    - ``adapter/``: ``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's format
      (``PeftModel.from_pretrained(base, out_dir / "adapter")``). Its ``base_model_name_or_path``
      is ``base_model_name_or_path``, or ``base/`` when the model was built from a config.
    - ``base/``: only when ``base_model_name_or_path`` is None (a model built from a config has no
      other copy of its frozen weights): the base model, ``from_pretrained``-loadable.
    - ``merged/`` when ``merge``: the model with ``W + (alpha/r) * B @ A`` folded into each adapted
      weight (PEFT's ``merge_and_unload``), a plain HF directory that ``from_pretrained`` loads.

    Args:
        model: the (FSDP2-sharded or plain) model :func:`apply_lora` prepared.
        section: its ``peft:`` section.
        dtype: cast floating-point weights of ``base/`` and ``merged/`` to this dtype after the merge
            (which runs in the training dtype); the adapter stays in the training dtype. None: as trained.
        tokenizer: gives the special-token ids of ``base/`` and ``merged/``; saved into each written
            directory when given and ``save_tokenizer``.

    Returns:
        ``out_dir`` on rank 0, None on the others.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    need_base = merge or base_model_name_or_path is None
    # every rank takes part in gathering; only adapters unless the base is written or merged
    state = get_model_state_dict(
        model,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=not need_base),
    )
    adapters = adapter_parameter_names(model)
    out: Path | None = None
    if rank == 0:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cls = original_model_class(model)
        config = copy.deepcopy(model.config)
        base_ref = base_model_name_or_path
        if base_ref is not None and Path(base_ref).expanduser().is_dir():  # a local directory: absolute
            base_ref = str(Path(base_ref).expanduser().resolve())
        if base_model_name_or_path is None:
            base_dir = out / "base"
            base_state = {_hf_name(k): v for k, v in state.items() if k not in adapters}
            save_hf_state(cls, config, base_state, base_dir, dtype=dtype, source_model=model, tokenizer=tokenizer,
                          save_tokenizer=save_tokenizer)  # fmt: skip
            base_ref = str(base_dir.resolve())
        peft_model = _peft_skeleton(cls, config, section)
        result = peft_model.load_state_dict(
            {_PEFT_PREFIX + k: v for k, v in state.items()}, assign=True, strict=False
        )
        missing_adapters = [k for k in result.missing_keys if ".lora_" in k]
        if result.unexpected_keys or missing_adapters:
            raise RuntimeError(
                f"adapter export: state dict does not fit the PEFT model (unexpected {result.unexpected_keys[:4]}, "
                f"missing {missing_adapters[:4]})"
            )
        peft_model.peft_config[ADAPTER_NAME].base_model_name_or_path = base_ref
        peft_model.save_pretrained(out / "adapter")
        if tokenizer is not None and save_tokenizer:
            tokenizer.save_pretrained(out / "adapter")
        if merge:
            with warnings.catch_warnings():  # PEFT says "no longer tied" because assign=True loaded two
                warnings.filterwarnings("ignore", "Input and output embeddings are no longer tied")  # tensors;
                merged_state = peft_model.merge_and_unload().state_dict()  # save_hf_state compares their values
            still_meta = sorted(k for k, v in merged_state.items() if v.device.type == "meta")
            if still_meta:
                raise RuntimeError(f"merged export: weights not gathered: {still_meta[:4]}")
            save_hf_state(
                cls, config, merged_state, out / "merged", dtype=dtype, source_model=model, tokenizer=tokenizer,
                save_tokenizer=save_tokenizer,
            )
        logger.info(
            "exported LoRA adapter to %s%s%s",
            out / "adapter",
            f", base model to {out / 'base'}" if base_model_name_or_path is None else "",
            f", merged model to {out / 'merged'}" if merge else "",
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return out


def _peft_skeleton(cls: type, config: Any, section: Any) -> Any:
    """A weightless ``PeftModel`` of ``cls(config)`` with the run's LoRA layers (meta device)."""
    from peft import get_peft_model

    with torch.device("meta"):
        skeleton = cls(copy.deepcopy(config))
    return get_peft_model(skeleton, lora_config(section), adapter_name=ADAPTER_NAME)


def check_lora_for_model_config(
    model_cfg: Any, resolved: Any, section: Any, *, attn_implementation: str
) -> None:
    """:func:`check_lora_targets` on a meta-device model built from ``resolved`` (no weights read)."""
    from automodel.models.loader import build_model

    meta = build_model(model_cfg, resolved, attn_implementation=attn_implementation, seed=0, meta=True)
    check_lora_targets(meta, section)
