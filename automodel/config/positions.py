"""The positions a model was trained on, and the rule for rows past them (``model.allow_position_extrapolation``).

A RoPE model past ``max_position_embeddings`` sees positions it was never trained on: :func:`position_problem`
refuses such a ``data.seq_len`` unless the config sets a RoPE scaling or the user allows it, and names the YaRN keys
(:func:`rope_scaling_overrides`) that cover the row. Read from a transformers config alone: the config rules check
an inline ``model.config`` before any rank starts (:func:`inline_position_problems`), the model checks
(:func:`automodel.models.loader.check_model_for_run`) the resolved one before weights load; ``automodel plan``
marks its rows past the positions with the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ModelPositions", "has_position_table", "inline_position_problems", "model_positions", "past_positions",
           "position_problem", "rope_scaling_overrides", "stated_limit"]


@dataclass(frozen=True)
class ModelPositions:
    """The positions a model was trained on, read from its config (:func:`model_positions`).

    ``limit``: ``max_position_embeddings`` (``None``: no limit: ALiBi, state-space mixers, and a model without RoPE
    that has no table of its positions, :func:`has_position_table`);
    ``rope``: rotary positions, which a RoPE scaling extends (else a position table of ``limit`` rows);
    ``scaling``: the ``rope_type`` of a RoPE scaling the config sets (``yarn``, ``llama3``, ...; ``None``: none);
    ``rope_parameters``: the config's ``rope_parameters`` (per layer type for Gemma 3's), for the fix's text.
    """

    limit: int | None
    rope: bool
    scaling: str | None = None
    rope_parameters: dict | None = None


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def stated_limit(config: Any) -> int | None:
    """``max_position_embeddings`` of a transformers config (its text config for a VLM); ``None`` where it states
    none or runs ALiBi (Falcon's option: no table). A row of at most this many tokens is never past the model's
    positions, so the callers that only ask that need not build the model (:func:`has_position_table`)."""
    text = _text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    return None if getattr(text, "alibi", False) or not isinstance(limit, int) else limit


def model_positions(config: Any) -> ModelPositions:
    """:class:`ModelPositions` of a transformers config (its text config for a VLM). Without RoPE parameters a
    limit stands only where the model has a table of its positions (:func:`has_position_table`): Jamba,
    Nemotron-H, RWKV, Kimi Linear have none (no positional encoding in their attention, or no attention)."""
    text = _text_config(config)
    limit = stated_limit(config)
    if limit is None:
        return ModelPositions(None, False)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        return ModelPositions(limit if has_position_table(text, limit) else None, False)
    nested = [v for v in params.values() if isinstance(v, dict)]  # per layer type (Gemma 3)
    kinds = {str(p.get("rope_type", "default")) for p in (nested or [params])} - {"default"}
    return ModelPositions(limit, True, ", ".join(sorted(kinds)) or None, dict(params))


_TABLES: dict[tuple[str, str], bool] = {}  # (config class, config JSON) -> has_position_table


def has_position_table(config: Any, limit: int) -> bool:
    """Whether the model of ``config`` (a text config without RoPE parameters) looks its positions up in a table of
    about ``limit`` rows, so that no row can be longer: a learned embedding (GPT-2's ``wpe``, OPT's and BioGPT's
    ``embed_positions`` of ``limit + 2``, OpenAI GPT's ``positions_embed``) or a precomputed buffer (CTRL's
    sinusoids, GPT-J's and CodeGen's rotary sin/cos, XGLM's sinusoids), i.e. an ``nn.Embedding`` or a buffer of
    ``limit`` to ``limit + 2`` rows other than the token embedding. Found on the model built from ``config`` on the
    meta device (no weights; cached per config); a model that cannot be built that way is taken to have one (the
    refusal stands, as before this check)."""
    try:
        key = (type(config).__name__, config.to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - a config that does not serialise: not cached
        key = (type(config).__name__, str(id(config)))
    if key in _TABLES:
        return _TABLES[key]
    try:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - not buildable here: keep the limit
        _TABLES[key] = True
        return True
    vocab = getattr(config, "vocab_size", None)
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.num_embeddings != vocab]
    rows += [b.shape[0] for b in model.buffers() if b.dim() >= 1]
    found = any(limit <= n <= limit + 2 for n in rows)
    _TABLES[key] = found
    return found


def _hydra_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def rope_scaling_overrides(positions: ModelPositions, seq_len: int) -> list[str]:
    """The overrides that set a YaRN RoPE scaling covering ``seq_len`` positions: factor ``ceil(seq_len /
    limit)`` over the model's ``limit`` positions (each layer type's, keeping its ``rope_theta``), and
    ``max_position_embeddings`` = factor x limit. Through ``model.config_overrides`` (a pretrained or an
    inline config alike). ``[]`` for a model that is not RoPE or needs none."""
    if not positions.rope or positions.limit is None or seq_len <= positions.limit:
        return []
    factor = -(-seq_len // positions.limit)
    params = positions.rope_parameters or {}

    def yarn(p: dict) -> dict:
        extra = {k: v for k, v in p.items() if k in ("rope_theta", "partial_rotary_factor", "mrope_section")}
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": positions.limit,
                **extra}  # fmt: skip

    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    value = {k: yarn(v) for k, v in nested.items()} if nested else yarn(params)
    return [f"++model.config_overrides.max_position_embeddings={factor * positions.limit}",
            f"++model.config_overrides.rope_parameters={_hydra_value(value)}"]  # fmt: skip


def past_positions(config: Any, seq_len: int) -> ModelPositions | None:
    """``config``'s :class:`ModelPositions` where a row of ``seq_len`` tokens is past a limit that stands (a RoPE
    model's trained positions, or a table of them), else ``None``. A row within ``max_position_embeddings``
    (:func:`stated_limit`) is answered without building the model that :func:`has_position_table` looks into."""
    stated = stated_limit(config)
    if stated is None or seq_len <= stated:
        return None
    positions = model_positions(config)
    return positions if positions.limit is not None else None


def position_problem(config: Any, seq_len: int, allow_extrapolation: bool = False) -> str | None:
    """Why a row of ``seq_len`` tokens cannot train ``config``'s model as configured, or ``None``.

    Past ``max_position_embeddings`` a RoPE model sees positions it was never trained on: refused unless the
    config sets a RoPE scaling (``rope_parameters`` with a ``rope_type`` other than ``default``) or the user
    allows it (``model.allow_position_extrapolation=true``). A model whose positions come from a table of
    ``max_position_embeddings`` rows (GPT-2, OPT) cannot run past it at all.
    """
    positions = past_positions(config, seq_len)
    if positions is None:
        return None
    name = type(config).__name__
    past = f"data.seq_len={seq_len} is past {name}.max_position_embeddings={positions.limit}"
    if not positions.rope:
        return (f"{past}, the rows of its position table; lower data.seq_len to at most {positions.limit}, or (a "
                f"model built from model.config, without pretrained weights) raise model.config.max_position_embeddings")  # fmt: skip
    if positions.scaling or allow_extrapolation:
        return None
    return (f"{past}: the model was never trained on the positions past it and would train with extrapolated "
            f"ones; set a RoPE scaling that covers them, e.g. YaRN: "
            f"{' '.join(rope_scaling_overrides(positions, seq_len))}; or set model.allow_position_extrapolation=true "
            f"to train past them as they are (docs/long_context.md)")  # fmt: skip


def inline_position_problems(cfg: Any) -> list[str]:
    """:func:`position_problem` for an inline ``model.config`` (with ``model.config_overrides``) and no pretrained
    model (whose config is read later, by the model checks): ``[]`` or the one problem. Builds the transformers
    config only (no model)."""
    m = cfg.model
    node = m.config
    if m.pretrained_model_name_or_path is not None or not isinstance(node, dict) or "_target_" not in node:
        return []
    try:
        from hydra.utils import instantiate

        config = instantiate({**node, **dict(m.config_overrides or {})}, _convert_="all")
    except Exception:  # noqa: BLE001 - a config that does not build is named by the model checks, with its reason
        return []
    problem = position_problem(config, cfg.data.seq_len, m.allow_position_extrapolation)
    return [problem] if problem else []
