"""Ring CP's per-layer kernels: transformers' ``sdpa`` attention function, routed per layer.

torch's ring attention (``context_parallel``) replaces SDPA and computes plain causal attention over
the whole row. :func:`install_ring_router` puts a router in front of whatever transformers' ``sdpa``
entry resolves to (its global registration, or a wrapper a compiled model or compiled autograd put in
the local mapping). Inside :func:`ring_layer_kernels` every layer call goes through
:func:`~automodel.distributed.cp.layers.strategy.run_layer` with the wrapped function (torch's ring)
as the native kernel, so sliding-window, chunked and sink layers run the halo kernel on the rank's
head-tail shard and MLA layers run the ring on zero-padded value heads; outside it the router passes
every call through unchanged. The model's attention implementation stays ``sdpa``.

The router is installed once and stays (idempotent): a wrapper installed later around ``sdpa``
(``models/compile.py``'s graph break, compiled autograd's eager backward) wraps the router and keeps
it in the chain; should a second router end up in the chain, the inner one passes calls through. It
runs outside compiled graphs (``torch._dynamo.disable``), like every CP attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from automodel.distributed.cp.active import activate, current
from automodel.distributed.cp.hf_attention import AttentionCall, hf_attention_function
from automodel.distributed.cp.layers.strategy import run_layer
from automodel.distributed.cp.layout import ring_layout

__all__ = ["install_ring_router", "ring_layer_kernels"]

_MARK = "_automodel_ring_router"
_ROUTING: list[bool] = []  # a routed call is in progress: a second router further in passes through
_INSTALLED: list[bool] = []


def _router(inner: Callable) -> Callable:
    def sdpa_per_layer(call: AttentionCall) -> tuple[torch.Tensor, Any]:
        layout = current("ring")
        if layout is None or _ROUTING:
            return call.run(inner)

        def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return call.run(inner, query=q, key=k, value=v, scaling=scale)[0]

        _ROUTING.append(True)
        try:
            out = run_layer(
                call.module, call.query, call.key, call.value, dict(call.kwargs), layout=layout, native=native,
                method="ring", scaling=call.scaling, dropout=call.dropout,
            )
        finally:
            _ROUTING.pop()
        return out, None

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
def ring_layer_kernels(cp_mesh: Any, seq_len: int) -> Iterator[None]:
    """Inside the block, transformers' ``sdpa`` attention runs each layer's kernel for ring CP over
    ``cp_mesh`` (rows of ``seq_len`` tokens, head-tail). Installs the router if needed (see the module
    docstring) if it never was. Re-entrant. The ring's
    :class:`~automodel.distributed.cp.layout.TokenLayout` is the active ``"ring"`` context
    (:mod:`automodel.distributed.cp.active`): the router and the linear mixers' state chain read it."""
    if not _INSTALLED:
        install_ring_router()
    layout = ring_layout(seq_len, cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    with activate("ring", layout, require_attention=False):
        yield
