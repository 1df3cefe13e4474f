"""Prepare a model for a CP method and get the batch function: what the recipe calls once.

``bind_cp_method(method, model, mesh, cp_size)`` returns ``(cp_fn, prepared)``: ``cp_fn(device_mesh,
batch) -> (ctx_factory, local_batch)`` for every micro-batch (training and validation), and the
:class:`~automodel.distributed.cp.method.PreparedModel` that undoes the preparation for the CP
self-check. At ``cp_size == 1`` the model keeps its own attention and transformers' own masks, except on
packed rows where its own forward does not keep the documents apart
(:func:`~automodel.distributed.cp.separation.document_separation`, a probe of the model): there a
method's document-aware attention runs on the one rank, so every cp=1 run computes each document as if
alone, the reference its cp>1 runs are tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from automodel.distributed.cp.method import BatchFn, CPMethod, PreparedModel
from automodel.distributed.cp.registry import get_cp_method
from automodel.errors import CPUnsupportedError

__all__ = ["bind_cp_method", "no_cp_batch_and_ctx"]


def no_cp_batch_and_ctx(device_mesh: Any, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The ``cp_size == 1`` batch function of every method: ``(contextlib.nullcontext, batch)``, untouched."""
    return contextlib.nullcontext, batch


def bind_cp_method(
    method: str | CPMethod,
    model: Any,
    device_mesh: Any,
    cp_size: int,
    *,
    packed: bool | None = False,
    trust_own_forward: bool = True,
    **batch_options: Any,
) -> tuple[BatchFn, PreparedModel]:
    """Prepare ``model`` for ``method`` (once; mutates it, e.g. switches its attention) and return
    ``(cp_fn, prepared)``; ``batch_options`` (e.g. thd's ``kernel=``) are bound to the batch function.

    At ``cp_size == 1`` Gated DeltaNet and the other mixers with a kernel restart their state at every packed
    document, as under CP (transformers' torch kernels carry it from one document into the next). Then:

    - ``packed=False`` (rows hold one document): :func:`no_cp_batch_and_ctx`, an empty :class:`PreparedModel`;
    - ``packed=True`` (the recipe with packing, the self-check's reference) or ``None`` (not known: the own
      loop): the model's own forward where it keeps the documents apart
      (:func:`~automodel.distributed.cp.separation.document_separation`; with ``trust_own_forward=False``,
      never: the self-check's reference is exact by construction); else the document-aware attention of
      ``method``, or with ``packed=True`` of the first method that runs the model on packed rows
      (:func:`~automodel.distributed.cp.separation.packed_method_at_one`), on the one rank.
      ``prepared.single_rank`` says which and why; with ``packed=None`` and a ``method`` that attends across
      the row, ``prepared.packed_refusal`` is the reason packed batches are refused. The model's cache is
      turned off (``config.use_cache``): with one, transformers builds no per-document mask.

    Raises:
        CPUnsupportedError: ``packed=True`` at ``cp_size == 1``, a model whose own forward mixes the documents
            and no method that runs it on packed rows.
    """
    m = get_cp_method(method)
    if cp_size <= 1:
        if not (hasattr(model, "config") and hasattr(model, "set_attn_implementation")):
            return no_cp_batch_and_ctx, PreparedModel()
        from automodel.distributed.cp.guard import cached_profile
        from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
        from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention

        profile = cached_profile(model)
        install_linear_mixers(model, profile)
        install_sparse_attention(model, profile)  # DSA: top-k per packed document
        if packed is False:
            return no_cp_batch_and_ctx, PreparedModel()
        return _bind_single_rank(m, model, device_mesh, profile, packed, trust_own_forward, batch_options)
    prepared = m.prepare_model(model, device_mesh)
    return m.batch_function(prepared, **batch_options), prepared


def _bind_single_rank(
    m: CPMethod,
    model: Any,
    device_mesh: Any,
    profile: Any,
    packed: bool | None,
    trust_own_forward: bool,
    batch_options: dict[str, Any],
) -> tuple[BatchFn, PreparedModel]:
    """``cp_size == 1`` on rows that may be packed: see :func:`bind_cp_method`."""
    from automodel.distributed.cp.separation import (
        Separation,
        cache_off,
        document_separation,
        packed_method_at_one,
        packed_refusal,
    )

    cache_off(model)  # as probed; with a cache transformers masks no documents (and the CP kernels refuse one)
    if trust_own_forward:
        separation = document_separation(model)
        if separation.separates:
            return no_cp_batch_and_ctx, PreparedModel(single_rank=f"the model's own forward {separation.reason}")
    else:
        separation = Separation(False, "is not trusted with packed rows here (the reference must be exact by construction)")
    chosen = packed_method_at_one(profile, m)
    if chosen is None:
        how = "train it with one document per row (data.dataset.pack: false)" if packed else "give it one document per row"
        reason = packed_refusal(profile, separation, how)
        if packed is None:  # the own loop: refused at the first packed batch
            return no_cp_batch_and_ctx, PreparedModel(packed_refusal=reason)
        raise CPUnsupportedError(reason)
    if packed is None and chosen is not m:  # the own loop named a method that attends across the row
        reason = (
            f"packed rows at CP size 1: {profile.architecture} (model_type={profile.model_type}) {separation.reason}, "
            f"and method={m.name} has no document-aware attention to run instead; context_parallel(model, mesh, "
            f"method={chosen.name!r}) computes each document alone at any CP size"
        )
        return no_cp_batch_and_ctx, PreparedModel(packed_refusal=reason)
    prepared = chosen.prepare_model(model, None)  # one rank: no CP group
    prepared.single_rank = (
        f"the model's own forward {separation.reason}, so {chosen.name}'s document-aware attention computes "
        "each document on the one rank"
    )
    options = batch_options if chosen is m else {}
    fn = chosen.batch_function(prepared, **options)

    def one_rank(device_mesh: Any, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        return fn(None, batch)  # CP size 1 whatever the mesh (the self-check's reference runs on a CP mesh)

    return one_rank, prepared
