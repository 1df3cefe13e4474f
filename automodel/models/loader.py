"""Hugging Face causal LMs: resolve the config, check it against the run, build the model.

Two sources, chosen by the ``model`` config group:

- ``pretrained_model_name_or_path``: a local directory or a hub id; weights via
  ``AutoModelForCausalLM.from_pretrained``, from local files and the hub cache only unless
  ``model.allow_download=true`` (:mod:`automodel.data.hub_offline`): a model that is neither local
  nor cached fails at once with the download command).
- ``config``: a ``_target_`` node (e.g. ``transformers.LlamaConfig`` with its fields), built with
  ``AutoModelForCausalLM.from_config`` and initialised from ``recipe.seed`` (identical on every
  rank, which FSDP2's sharding of the local full tensors relies on).

When both are given, the inline config describes the pretrained one: a dry run without the
weights uses it, and a real run checks that the fields written inline match the downloaded config.

The attention implementation defaults to ``sdpa`` (what ring CP replaces with ring attention) and
``use_cache`` is always off for training. :func:`check_model_for_run` runs on the config alone,
before any weight is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from automodel.config.positions import (
    ModelPositions,
    model_positions,
    past_positions,
    position_problem,
    rope_scaling_overrides,
)
from automodel.config.schema import ModelSection
from automodel.data.hub_offline import (
    env_offline,
    local_files_only,
    looks_like_path,
    missing_path_message,
    not_cached_hint,
)
from automodel.errors import UserInputError

__all__ = [
    "ResolvedModelConfig",
    "resolve_model_config",
    "check_attn_supported",
    "check_model_for_run",
    "build_model",
    "ModelPositions",
    "model_positions",
    "position_problem",
    "rope_scaling_overrides",
    "torch_dtype",
    "causal_lm_class",
]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (only the names in the schema)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}") from None


@dataclass
class ResolvedModelConfig:
    """The HF config of the model to train and where it came from (``source``, for the logs)."""

    config: Any  # transformers.PretrainedConfig
    source: str
    pretrained: bool  # weights come from pretrained_model_name_or_path


def _check_override_keys(cls: type, overrides: dict) -> None:
    from automodel.config.typecheck import _accepted_keys

    accepted, _, _ = _accepted_keys(cls)
    if accepted is None:
        return
    unknown = sorted(k for k in overrides if k not in accepted)
    if unknown:
        raise UserInputError(
            f"model.config_overrides: {unknown} are not fields of {cls.__name__}; fix the spelling "
            f"(fields: {', '.join(sorted(accepted))})"
        )


def _instantiate_inline(node: dict, overrides: dict | None = None) -> Any:
    from hydra.utils import get_object, instantiate
    from transformers import PretrainedConfig

    if overrides:
        _check_override_keys(get_object(node["_target_"]), overrides)
        node = {**node, **overrides}
    config = instantiate(node, _convert_="all")
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"model.config._target_={node.get('_target_')!r} built a {type(config).__name__}, not a "
            f"transformers PretrainedConfig; use e.g. transformers.LlamaConfig"
        )
    return config


def _offline(model_cfg: ModelSection) -> bool:
    """Local files and the hub cache only (the default; automodel.data.hub_offline)."""
    return local_files_only(model_cfg.allow_download)


def resolve_model_config(model_cfg: ModelSection, *, dry_run: bool = False) -> ResolvedModelConfig:
    """Build (inline) or load (pretrained) the HF config, without any weights.

    In a dry run the pretrained config is looked up in local files only; if it is absent the
    inline ``model.config`` stands in (and the source says so). ``use_cache`` is set to False.

    Raises:
        ValueError: the pretrained config cannot be found (offline, not cached, no such directory)
            and no inline config can stand in; or the inline config contradicts the pretrained one.
    """
    from transformers import AutoConfig

    name = model_cfg.pretrained_model_name_or_path
    overrides = dict(model_cfg.config_overrides or {})
    inline = _instantiate_inline(model_cfg.config, overrides) if model_cfg.config is not None else None
    if name is None:
        if inline is None:
            raise UserInputError("set model.pretrained_model_name_or_path or model.config")
        inline.use_cache = False
        return ResolvedModelConfig(inline, f"model.config ({type(inline).__name__})", pretrained=False)

    is_path = looks_like_path(name)
    if is_path and not Path(name).expanduser().is_dir() and not (dry_run and inline is not None):
        raise UserInputError(
            f"model.pretrained_model_name_or_path={name!r}: no config found: "
            + missing_path_message(name, "config.json and the weights")
        )
    try:
        loaded = AutoConfig.from_pretrained(
            name,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=dry_run or _offline(model_cfg),
        )
    except (OSError, ValueError) as e:
        if dry_run and inline is not None:
            inline.use_cache = False
            return ResolvedModelConfig(
                inline,
                f"model.config (stands in for {name!r}, whose config is not available locally)",
                pretrained=True,
            )
        offline = dry_run or _offline(model_cfg)
        where = "local files and the hub cache" if offline else "local files and the hub"
        if is_path:
            fix = "give a directory holding config.json (as written by save_pretrained)"
        elif dry_run and not env_offline():
            fix = f"a dry run reads local files only: download the model first (`hf download {name}`)"
        else:
            fix = not_cached_hint(name, model_cfg.allow_download)
        # offline, transformers' "couldn't connect to huggingface.co" is not what happened: leave it out
        why = "" if offline and not is_path else f" ({str(e).splitlines()[0].rstrip('.')})"
        raise UserInputError(
            f"model.pretrained_model_name_or_path={name!r}: no config found in {where}{why}; {fix}; "
            f"for a dry run without weights add the architecture as model.config"
        ) from None
    if inline is not None:
        _check_inline_matches(model_cfg.config, inline, loaded, name)
    if overrides:
        _check_override_keys(type(loaded), overrides)
        loaded = AutoConfig.from_pretrained(
            name,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            local_files_only=dry_run or _offline(model_cfg),
            **overrides,
        )
    loaded.use_cache = False
    return ResolvedModelConfig(loaded, f"{name} (config.json)", pretrained=True)


def _check_inline_matches(node: dict, inline: Any, loaded: Any, name: str) -> None:
    mismatched = []
    for key in node:
        if key.startswith("_") or key in ("use_cache", "dtype", "torch_dtype"):
            continue
        want, got = getattr(inline, key, None), getattr(loaded, key, None)
        if want != got:
            mismatched.append(f"{key}: model.config has {want!r}, {name} has {got!r}")
    if type(inline) is not type(loaded):
        mismatched.append(
            f"class: model.config is {type(inline).__name__}, {name} is {type(loaded).__name__}"
        )
    if mismatched:
        raise UserInputError(
            f"model.config does not describe {name}: "
            + "; ".join(mismatched)
            + ". Fix model.config to match "
            "the pretrained config.json, or remove model.config"
        )


def causal_lm_class(config: Any) -> type | None:
    """The ``AutoModelForCausalLM`` class for ``config`` (None for remote code / unknown)."""
    from automodel.distributed.torch_internals import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        from automodel.models.vlm_cp import vlm_model_class  # a VLM trained as a causal LM (Qwen2-VL)

        return vlm_model_class(config)


def check_attn_supported(config: Any, attn_implementation: str, cp_method: str | None = None) -> None:
    """Refuse ``attn_implementation="sdpa"`` for a model class without SDPA support (gpt-oss ...) or whose
    config soft-caps the attention logits (Gemma 2: SDPA would drop the cap on transformers < 5.25;
    :func:`~automodel.distributed.torch_internals.sdpa_problem`), naming ``model.attn_implementation=eager``,
    the one fix that works: every built-in CP method runs eager models.

    ``cp_method``: the run's (``None``: no CP); said to run eager models when it does.
    """
    from automodel.distributed.torch_internals import sdpa_problem

    cls = causal_lm_class(config)
    if cls is None or attn_implementation != "sdpa":
        return
    problem = sdpa_problem(cls, config)
    if problem is None:
        return
    runs_eager = ""
    if cp_method is not None:
        from automodel.distributed.cp import AUTO, cp_methods

        method = cp_methods().get(cp_method)
        if cp_method == AUTO:
            runs_eager = " (distributed.cp_method=auto then picks among the methods that run eager models)"
        elif method is not None and (method.attn_implementations is None or "eager" in method.attn_implementations):
            runs_eager = f" (distributed.cp_method={cp_method} runs eager models)"
    why = "" if problem.endswith("has no SDPA path") else f": {problem}"
    raise UserInputError(
        f"{cls.__name__} cannot run attn_implementation='sdpa'; set "
        f"model.attn_implementation=eager{runs_eager}{why}"
    )


def check_model_for_run(
    config: Any,
    *,
    attn_implementation: str,
    cp_size: int,
    cp_method: str,
    seq_len: int,
    vocab_needed: int | None = None,
    trust_remote_code: bool = False,
    allow_position_extrapolation: bool = False,
) -> None:
    """Check that a model with ``config`` can train this run; raise ``ValueError`` naming the fix.

    Checks: the config is a causal LM; the model supports ``attn_implementation``; the tokenizer's
    ``vocab_needed`` ids fit the embedding; ``seq_len`` is within the model's positions
    (:func:`position_problem`: past them only with a RoPE scaling or ``allow_position_extrapolation``).
    Whether the CP method computes every layer kind exactly
    (windows, chunks, sinks, linear mixers ...) is :func:`automodel.models.cp_check.check_model_for_cp_run`.
    """
    cls = causal_lm_class(config)
    if cls is None and not trust_remote_code:
        raise UserInputError(
            f"{type(config).__name__} (model_type={getattr(config, 'model_type', '?')!r}) is not a causal LM "
            f"transformers knows; use a causal LM config, or model.trust_remote_code=true for custom code"
        )
    check_attn_supported(config, attn_implementation, cp_method if cp_size > 1 else None)
    if vocab_needed is not None and vocab_needed > int(getattr(config, "vocab_size", vocab_needed)):
        raise UserInputError(
            f"the tokenizer has {vocab_needed} token ids but the model's vocab_size is {config.vocab_size}; "
            f"use the model's own tokenizer (data.tokenizer) or raise model.config.vocab_size to >= {vocab_needed}"
        )
    problem = position_problem(config, seq_len, allow_position_extrapolation)
    if problem is not None:
        raise UserInputError(problem)
    positions = past_positions(config, seq_len)
    if positions is not None:  # past it, allowed: by a RoPE scaling or the user's flag
        how = (f"the {positions.scaling} RoPE scaling the config sets" if positions.scaling
               else "model.allow_position_extrapolation=true")  # fmt: skip
        logger.warning(
            "data.seq_len=%d is past %s.max_position_embeddings=%d: positions past it are extrapolated (%s)",
            seq_len, type(config).__name__, positions.limit, how,
        )  # fmt: skip


def build_model(
    model_cfg: ModelSection,
    resolved: ResolvedModelConfig,
    *,
    attn_implementation: str,
    seed: int,
    device: torch.device | str = "cpu",
    meta: bool = False,
) -> torch.nn.Module:
    """Build the model: from pretrained weights, or from the config initialised with ``seed``.

    ``meta=True`` builds on the meta device (no memory, no weights read; for shape math).
    The model is returned in ``model.dtype`` on ``device``, in train mode, with ``use_cache=False``.
    """
    from automodel.models.vlm_cp import auto_model_class

    dtype = torch_dtype(model_cfg.dtype)
    config = resolved.config
    AutoModelForCausalLM = auto_model_class(config)  # noqa: N806 - AutoModelForImageTextToText for VLMs
    config.use_cache = False
    kwargs: dict[str, Any] = {
        "attn_implementation": attn_implementation,
        "trust_remote_code": model_cfg.trust_remote_code,
    }
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        return model
    if resolved.pretrained and model_cfg.pretrained_model_name_or_path is not None:
        name = model_cfg.pretrained_model_name_or_path
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name,
                config=config,
                dtype=dtype,
                revision=model_cfg.revision,
                local_files_only=_offline(model_cfg),
                **kwargs,
            )
        except OSError as e:  # no weight files (or unreadable ones) where the config was found
            raise UserInputError(
                f"model.pretrained_model_name_or_path={name!r}: the weights cannot be loaded "
                f"({str(e).strip().splitlines()[0]}). Put the model's *.safetensors (or pytorch_model.bin) "
                f"next to its config.json{'' if looks_like_path(name) else f', download the model first (hf download {name})'}, or use "
                f"model.config without pretrained_model_name_or_path to train from scratch"
            ) from e
    else:
        # CPU init from a fixed seed: the same weights on every rank and every device type.
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.config.use_cache = False
    model.to(device)
    model.train()
    return model
