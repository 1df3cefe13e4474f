"""Ring CP's per-layer kernels: transformers' ``sdpa`` attention function, routed per layer.

torch's ring attention (``context_parallel``) replaces SDPA and computes plain causal attention over
the whole row. :func:`install_ring_router` puts a router in front of whatever transformers' ``sdpa``
entry resolves to (its global registration, or a wrapper a compiled model or compiled autograd put in
the local mapping). Inside :func:`ring_layer_kernels` every layer call goes through
:func:`~automodel.distributed.cp.layers.strategy.run_layer` with the wrapped function (torch's ring)
as the native kernel, so sliding-window, chunked and sink layers run the halo kernel on the rank's
head-tail shard and MLA layers run the ring on zero-padded value heads; outside it the router passes
every call through unchanged. A call for torch's ring (a full layer) that comes with a causal mask (a
model that materialises it: Falcon on transformers >= 5.25) runs without it once
:func:`~automodel.distributed.cp.ring.causal_mask.check_plain_causal_mask` has proven it plain causal over
the shard, and is refused otherwise (the halo kernel builds its own window or chunk mask).
An ``sdpa`` model's attention implementation stays ``sdpa``.

The router is installed once and stays (idempotent): a wrapper installed later around ``sdpa``
(``models/compile.py``'s graph break, compiled autograd's eager backward) wraps the router and keeps
it in the chain; should a second router end up in the chain, the inner one passes calls through. It
runs outside compiled graphs (``torch._dynamo.disable``), like every CP attention.

Eager models. transformers calls a model's own ``eager_attention_forward`` directly, never through the
``AttentionInterface``, so nothing can stand in front of it; and torch's ring replaces only SDPA, so an
eager model left alone would attend within each rank's shard. :func:`eager_models_routed` switches an
eager model, for the duration of the ring context, to :data:`RING_EAGER_ATTN_NAME`, which routes every
causal layer call like the ``sdpa`` router does, with eager's semantics: the native kernel is torch's ring
(through transformers' ``sdpa``, exact for plain causal attention), and logit softcapping, which eager
applies and sdpa refuses, is applied by the halo kernel (``apply_softcap=True``), with sinks, windows and
chunks. It is no mask implementation, so transformers builds no local mask (what sdpa gets under ring: none).
Outside a ring context, and for a non-causal call, it runs the model's own eager function. The switch
is undone when the context exits (the model is eager again, e.g. for the self-check's reference run).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from automodel.distributed.cp.active import activate, current
from automodel.distributed.cp.hf_attention import AttentionCall, hf_attention_function
from automodel.distributed.cp.layers.strategy import run_layer
from automodel.distributed.cp.layout import ring_layout
from automodel.distributed.cp.ring.causal_mask import check_plain_causal_mask

__all__ = ["RING_EAGER_ATTN_NAME", "eager_models_routed", "install_ring_router", "ring_layer_kernels"]

#: The attention implementation an eager model runs under inside a ring context (:func:`eager_models_routed`).
RING_EAGER_ATTN_NAME = "ring_eager"

_MARK = "_automodel_ring_router"
_ROUTING: list[bool] = []  # a routed call is in progress: a second router further in passes through
_INSTALLED: list[bool] = []


def _route(call: AttentionCall, layout: Any, native: Callable, apply_softcap: bool) -> tuple[torch.Tensor, None]:
    """``run_layer`` for one call on the ring's ``layout`` (a router further in passes calls through)."""
    _ROUTING.append(True)
    try:
        out = run_layer(
            call.module, call.query, call.key, call.value, dict(call.kwargs), layout=layout, native=native,
            method="ring", scaling=call.scaling, dropout=call.dropout, apply_softcap=apply_softcap,
        )
    finally:
        _ROUTING.pop()
    return out, None


def _router(inner: Callable) -> Callable:
    def sdpa_per_layer(call: AttentionCall) -> tuple[torch.Tensor, Any]:
        layout = current("ring")
        if layout is None or _ROUTING:
            return call.run(inner)
        def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            if call.attention_mask is not None and call.causal():  # a model that materialises its causal mask
                check_plain_causal_mask(call.attention_mask, q, k, call.module_name)
                # what the ring computes already, over the whole row
                return call.run(inner, query=q, key=k, value=v, scaling=scale, attention_mask=None)[0]
            return call.run(inner, query=q, key=k, value=v, scaling=scale)[0]

        return _route(call, layout, native, apply_softcap=False)  # sdpa refuses softcapping: so does its reference

    routed = torch._dynamo.disable(
        hf_attention_function(sdpa_per_layer), reason="automodel: CP attention runs outside the compiled graph"
    )
    setattr(routed, _MARK, True)
    return routed


def install_ring_router() -> None:
    """Put the per-layer router in front of transformers' ``sdpa`` attention (idempotent; mutates the
    ``AttentionInterface`` slot that ``"sdpa"`` resolves to: the local mapping if set, else the global).

    :func:`automodel.distributed.cp.ring.batch.make_cp_batch_and_ctx` calls it when it builds the batch, i.e.
    before the trainer wraps the attention for compiled autograd, so that wrapper (an eager backward)
    encloses the router and the halo kernel's collectives with it.
    """
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    current = ALL_ATTENTION_FUNCTIONS["sdpa"]
    _INSTALLED[:] = [True]
    if getattr(current, _MARK, False):
        return
    if "sdpa" in ALL_ATTENTION_FUNCTIONS._local_mapping:
        ALL_ATTENTION_FUNCTIONS._local_mapping["sdpa"] = _router(current)
    else:
        ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"] = _router(current)


@contextlib.contextmanager
def ring_layer_kernels(cp_mesh: Any, seq_len: int, real_length: int | None = None) -> Iterator[None]:
    """Inside the block, transformers' ``sdpa`` attention runs each layer's kernel for ring CP over
    ``cp_mesh`` (rows of ``seq_len`` tokens, head-tail). Installs the router if needed (see the module
    docstring) if it never was. Re-entrant. The ring's
    :class:`~automodel.distributed.cp.layout.TokenLayout` is the active ``"ring"`` context
    (:mod:`automodel.distributed.cp.active`): the router and the linear mixers' state chain read it;
    ``real_length``: the rows' length before they were right-padded to ``seq_len`` (the DSA kernel reads it)."""
    if not _INSTALLED:
        install_ring_router()
    layout = ring_layout(seq_len, cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    if real_length is not None and real_length < seq_len:  # rows right-padded to split evenly
        layout.real_length = real_length
    with activate("ring", layout, require_attention=False):
        yield


def _own_eager_function(module: Any) -> Callable:
    """The ``eager_attention_forward`` of ``module``'s modeling file (what transformers calls for ``eager``)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from automodel.errors import CPUnsupportedError

        raise CPUnsupportedError(
            f"distributed.cp_method=ring: {type(module).__name__} defines no eager_attention_forward in "
            f"{type(module).__module__}, so ring cannot tell what its eager attention computes; set "
            "model.attn_implementation=sdpa (Ulysses' eager inner kernel reads the same function)"
        )
    return fn


def _eager_per_layer(call: AttentionCall) -> tuple[torch.Tensor, Any]:
    """An eager model's attention under ring (registered as :data:`RING_EAGER_ATTN_NAME`; module docstring)."""
    layout = current("ring")
    if layout is None or _ROUTING or not call.causal():
        return call.run(_own_eager_function(call.module))
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # torch's ring inside the context (the sdpa router passes through)

    def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return call.run(sdpa, query=q, key=k, value=v, scaling=scale, attention_mask=None)[0]

    return _route(call, layout, native, apply_softcap=True)  # eager applies softcapping


_EAGER_ROUTER = torch._dynamo.disable(
    hf_attention_function(_eager_per_layer, "ring_eager_attention_forward"),
    reason="automodel: CP attention runs outside the compiled graph",
)


@contextlib.contextmanager
def eager_models_routed() -> Iterator[Callable[[Any, Any], None]]:
    """Yields ``route(model, profile)``: a text model whose attention implementation is ``eager`` is switched to
    :data:`RING_EAGER_ATTN_NAME` (mutates it); on exit every switched model is switched back to ``eager``.

    Raises (from ``route``):
        CPUnsupportedError: an eager VLM (its vision attention would follow the switch), or a model that
            does not accept the switch (its attention is not dispatched through ``AttentionInterface``).
    """
    from automodel.distributed.cp.hf_attention import register_attention, switch_attention

    switched: list[Any] = []

    def route(model: Any, profile: Any) -> None:
        eager = profile.attn_implementation == "eager"
        if model in switched or not (eager or any(layer.own_code for layer in profile.layers)):
            return  # an sdpa model's own-code layers (Falcon's ALiBi) dispatch as an eager model's do
        if eager and profile.is_vlm:
            from automodel.errors import CPUnsupportedError

            raise CPUnsupportedError(
                f"distributed.cp_method=ring runs eager attention in text-only models, and {type(model).__name__} is "
                "a VLM (its vision attention would be switched too); set model.attn_implementation=sdpa or use "
                "distributed.cp_method=ulysses"
            )
        from automodel.distributed.cp.layers.alibi import dispatch_alibi_layers

        if dispatch_alibi_layers(model, {"ring": RING_EAGER_ATTN_NAME}):
            # BLOOM, MPT: their ALiBi layers hand q, k, v to the eager router inside the ring context (their classes
            # dispatch nothing, so the model keeps `eager`); run_layer gives them the halo kernel with the bias
            register_attention(RING_EAGER_ATTN_NAME, _EAGER_ROUTER)
            return
        if not eager:
            return
        switch_attention(model, RING_EAGER_ATTN_NAME, _EAGER_ROUTER, "ring", alternative=": set model.attn_implementation=sdpa")
        switched.append(model)

    try:
        yield route
    finally:
        for model in switched:
            model.set_attn_implementation("eager")
