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

__all__ = ["ModelPositions", "inline_position_problems", "model_positions", "position_problem", "rope_scaling_overrides"]


@dataclass(frozen=True)
class ModelPositions:
    """The positions a model was trained on, read from its config (:func:`model_positions`).

    ``limit``: ``max_position_embeddings`` (``None``: no limit the config states: ALiBi, state-space mixers);
    ``rope``: rotary positions, which a RoPE scaling extends (else a position table of ``limit`` rows);
    ``scaling``: the ``rope_type`` of a RoPE scaling the config sets (``yarn``, ``llama3``, ...; ``None``: none);
    ``rope_parameters``: the config's ``rope_parameters`` (per layer type for Gemma 3's), for the fix's text.
    """

    limit: int | None
    rope: bool
    scaling: str | None = None
    rope_parameters: dict | None = None


def model_positions(config: Any) -> ModelPositions:
    """:class:`ModelPositions` of a transformers config (its text config for a VLM)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if getattr(text, "alibi", False) or not isinstance(limit, int):  # ALiBi (Falcon's option) has no table
        return ModelPositions(None, False)
    params = getattr(text, "rope_parameters", None)
    if not isinstance(params, dict):
        return ModelPositions(limit, False)
    nested = [v for v in params.values() if isinstance(v, dict)]  # per layer type (Gemma 3)
    kinds = {str(p.get("rope_type", "default")) for p in (nested or [params])} - {"default"}
    return ModelPositions(limit, True, ", ".join(sorted(kinds)) or None, dict(params))


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


def position_problem(config: Any, seq_len: int, allow_extrapolation: bool = False) -> str | None:
    """Why a row of ``seq_len`` tokens cannot train ``config``'s model as configured, or ``None``.

    Past ``max_position_embeddings`` a RoPE model sees positions it was never trained on: refused unless the
    config sets a RoPE scaling (``rope_parameters`` with a ``rope_type`` other than ``default``) or the user
    allows it (``model.allow_position_extrapolation=true``). A model whose positions come from a table of
    ``max_position_embeddings`` rows (GPT-2, OPT) cannot run past it at all.
    """
    positions = model_positions(config)
    if positions.limit is None or seq_len <= positions.limit:
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
