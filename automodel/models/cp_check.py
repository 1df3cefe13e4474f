"""The recipe's exactness check of a model against its CP method, before any weight loads.

The model is built on the meta device (no memory, no weights read), profiled
(:func:`automodel.distributed.cp.profile_model`: every decoder layer's mixer kind, sinks, MLA head
sizes, heads) and checked against ``distributed.cp_method`` for rows of ``data.seq_len`` tokens. The
trainer and the dry run both call :func:`check_model_for_cp_run`.
"""

from __future__ import annotations

from typing import Any

from automodel.config.cp_auto import packed_rows
from automodel.distributed.cp import ModelProfile, check_model_config_for_cp, get_cp_method, profile_model

__all__ = ["check_model_for_cp_run", "profile_for_run"]


def profile_for_run(cfg: Any, resolved: Any, attn_implementation: str, model: Any = None) -> ModelProfile:
    """The :class:`~automodel.distributed.cp.ModelProfile` of the run's model.

    ``cfg``: a RecipeConfig; ``resolved``: :func:`automodel.models.loader.resolve_model_config`'s result;
    ``model``: the run's model already built on the meta device (the dry run's), else one is built here
    (after :func:`~automodel.models.loader.check_attn_supported`: ``cp_method: auto`` profiles the model
    before the run's other model checks, and transformers' own refusal names no config key).
    """
    if model is None:
        from automodel.models.loader import build_model, check_attn_supported

        check_attn_supported(resolved.config, attn_implementation, cfg.distributed.cp_method)

        model = build_model(
            cfg.model, resolved, attn_implementation=attn_implementation, seed=cfg.recipe.seed, meta=True
        )
    return profile_model(model, attn_implementation=attn_implementation)


def check_model_for_cp_run(
    cfg: Any, resolved: Any, attn_implementation: str, model: Any = None
) -> ModelProfile | None:
    """Refuse a model the run's CP method does not compute exactly; return its profile (``None`` at cp_size 1).

    ``model``: as for :func:`profile_for_run`.

    Raises:
        automodel.errors.CPUnsupportedError: a layer kind the method does not compute exactly on rows of
            ``data.seq_len`` tokens; the message names the layers, the method and the methods that would.
        automodel.errors.UserInputError: heads the method cannot split over ``cp_size``; a VLM with a
            method that takes no merged embeddings.
    """
    d = cfg.distributed
    if d.cp_size <= 1:
        return None
    profile = profile_for_run(cfg, resolved, attn_implementation, model)
    method = get_cp_method(d.cp_method).configured(cfg)  # its options bound (usp: the heads over ulysses_size)
    check_model_config_for_cp(method, profile, d.cp_size, d.tp_size, seq_len=cfg.data.seq_len, packed=packed_rows(cfg))
    _check_head_chunks(cfg, method, profile)
    return profile


def _check_head_chunks(cfg: Any, method: Any, profile: ModelProfile) -> None:
    """``distributed.ulysses_head_chunks`` against the model's heads (a pretrained config too), before weights load.

    Raises:
        automodel.errors.UserInputError: the count does not divide the KV heads a rank holds after the all-to-all.
    """
    from automodel.distributed.cp.head_chunks import head_chunks_problem
    from automodel.errors import UserInputError

    d = cfg.distributed
    chunks, ranks = d.ulysses_head_chunks, method.head_chunk_ranks(d.cp_size)
    heads = profile.num_attention_heads
    if not isinstance(chunks, int) or chunks <= 1 or not ranks or not heads:
        return
    tp = max(1, d.tp_size)
    kv = profile.num_key_value_heads or heads
    where = f"cp_size={d.cp_size}" if ranks == d.cp_size else f"distributed.ulysses_size={ranks}"
    problem = head_chunks_problem(chunks, heads // tp, max(1, kv // tp), ranks, where + (f", tp_size={tp}" if tp > 1 else ""))
    if problem is not None:
        raise UserInputError(problem)
