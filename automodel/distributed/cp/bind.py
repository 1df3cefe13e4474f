"""Prepare a model for a CP method and get the batch function: what the recipe calls once.

``bind_cp_method(method, model, mesh, cp_size)`` returns ``(cp_fn, prepared)``: ``cp_fn(device_mesh,
batch) -> (ctx_factory, local_batch)`` for every micro-batch (training and validation), and the
:class:`~automodel.distributed.cp.method.PreparedModel` that undoes the preparation for the CP
self-check. At ``cp_size == 1`` no method runs: the model keeps its own attention and transformers'
own masks, so every method's cp=1 run is the plain single-device computation, the reference its cp>1
runs are tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from automodel.distributed.cp.method import BatchFn, CPMethod, PreparedModel
from automodel.distributed.cp.registry import get_cp_method

__all__ = ["bind_cp_method", "no_cp_batch_and_ctx"]


def no_cp_batch_and_ctx(device_mesh: Any, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The ``cp_size == 1`` batch function of every method: ``(contextlib.nullcontext, batch)``, untouched."""
    return contextlib.nullcontext, batch


def bind_cp_method(
    method: str | CPMethod, model: Any, device_mesh: Any, cp_size: int, **batch_options: Any
) -> tuple[BatchFn, PreparedModel]:
    """Prepare ``model`` for ``method`` (once; mutates it, e.g. switches its attention) and return
    ``(cp_fn, prepared)``; ``batch_options`` (e.g. thd's ``kernel=``) are bound to the batch function.

    At ``cp_size == 1``: :func:`no_cp_batch_and_ctx` and an empty :class:`PreparedModel`; the model is
    left as built, except that Gated DeltaNet layers restart their state at every packed document, as
    under CP (transformers' torch kernel would carry it from one document into the next).
    """
    m = get_cp_method(method)
    if cp_size <= 1:
        if hasattr(model, "config") and hasattr(model, "set_attn_implementation"):
            from automodel.distributed.cp.guard import cached_profile
            from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers

            install_linear_mixers(model, cached_profile(model))
        return no_cp_batch_and_ctx, PreparedModel()
    prepared = m.prepare_model(model, device_mesh)
    return m.batch_function(prepared, **batch_options), prepared
