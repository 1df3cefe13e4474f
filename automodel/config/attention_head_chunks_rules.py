"""``model.attention_head_chunks``: head-grouped attention without CP, checked before any model loads.

The count against a pretrained model's heads and its layer kinds are checked on the meta-device model before any
weight loads: :func:`automodel.models.attention_head_chunks.check_attention_head_chunks_for_model`.
"""

from __future__ import annotations

from typing import Any

from automodel.config.schema import RecipeConfig

__all__ = ["ATTENTION_HEAD_CHUNKS_KEY", "attention_head_chunks_problem", "attention_head_chunks_problems", "config_head_counts"]

#: the config key
ATTENTION_HEAD_CHUNKS_KEY = "model.attention_head_chunks"


def attention_head_chunks_problem(chunks: Any, heads: int | None, kv_heads: int | None) -> str | None:
    """Why ``model.attention_head_chunks=chunks`` cannot group a model's ``heads`` query and ``kv_heads`` KV heads
    (``None``: it can; ``None``/``auto`` and unknown head counts pass)."""
    key = ATTENTION_HEAD_CHUNKS_KEY
    if chunks is None or chunks == "auto":
        return None
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        return (
            f"{key}={chunks!r} must be null, 'auto' or a positive integer (the number of head groups the attention "
            "runs one after another without CP; 1 = all heads at once)"
        )
    if chunks == 1 or not heads or not kv_heads:
        return None
    if kv_heads % chunks or heads % chunks:
        choices = [g for g in range(1, kv_heads + 1) if kv_heads % g == 0]
        return (
            f"{key}={chunks} does not divide the model's {kv_heads} KV head(s) ({heads} query heads): a head group "
            f"is whole KV heads with their query heads; set {key} to one of {choices} (or auto)"
        )
    return None


def attention_head_chunks_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.model.attention_head_chunks`` (empty list: fine): the value; no CP (under a CP method the
    heads are grouped by ``distributed.ulysses_head_chunks``, where the method splits heads); no tensor
    parallelism; the heads of an inline ``model.config``."""
    key, value, d = ATTENTION_HEAD_CHUNKS_KEY, cfg.model.attention_head_chunks, cfg.distributed
    problem = attention_head_chunks_problem(value, None, None)
    if problem is not None:
        return [problem]
    if value is None or value == 1:
        return []
    if d.cp_size > 1:
        return [
            f"{key}={value} groups the attention heads of a run without CP, but distributed.cp_size={d.cp_size} runs "
            f"distributed.cp_method={d.cp_method}: the CP method's attention decides what a call holds; set {key}=null "
            f"(with cp_method ulysses or usp, distributed.ulysses_head_chunks={value} runs the heads in groups)"
        ]
    if d.tp_size > 1:
        return [
            f"{key}={value} with distributed.tp_size={d.tp_size}: head groups are not proven on tensor-parallel "
            f"attention; set distributed.tp_size=1 or {key}=null"
        ]
    counts = config_head_counts(cfg)
    if counts is None or value == "auto":
        return []
    heads, kv = counts
    problem = attention_head_chunks_problem(value, heads, kv)
    return [problem.replace("the model's", "model.config's", 1)] if problem else []


def config_head_counts(cfg: RecipeConfig) -> tuple[int, int] | None:
    """``(attention heads, KV heads)`` of an inline ``model.config`` with its ``model.config_overrides`` (KV heads
    default to the heads); ``None`` when the model is named (its config is read later) or the counts are not
    positive integers."""
    if not isinstance(cfg.model.config, dict):
        return None
    overrides = cfg.model.config_overrides or {}
    heads = overrides.get("num_attention_heads", cfg.model.config.get("num_attention_heads"))
    kv = overrides.get("num_key_value_heads", cfg.model.config.get("num_key_value_heads", heads))
    if not (isinstance(heads, int) and isinstance(kv, int) and heads >= 1 and kv >= 1):
        return None
    return heads, kv
