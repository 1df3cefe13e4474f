"""Ring CP's per-layer kernels: transformers' ``sdpa`` attention function, routed per layer.

torch's ring attention (``context_parallel``) replaces SDPA and computes plain causal attention over
the whole row. Inside :func:`ring_layer_kernels` the ``sdpa`` entry of transformers'
``AttentionInterface`` is wrapped: every layer call goes through
:func:`~automodel.distributed.cp.kernels.strategy.run_layer` with torch's ring as the native kernel,
so sliding-window, chunked and sink layers run the halo kernel on the rank's head-tail shard and MLA
layers run the ring on zero-padded value heads. The model's attention implementation stays ``sdpa``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from automodel.distributed.cp.kernels.strategy import run_layer
from automodel.distributed.cp.kernels.token_layout import ring_layout

__all__ = ["ring_layer_kernels"]


@contextlib.contextmanager
def ring_layer_kernels(cp_mesh: Any, seq_len: int) -> Iterator[None]:
    """Inside the block, transformers' ``sdpa`` attention runs each layer's kernel for ring CP over
    ``cp_mesh`` (rows of ``seq_len`` tokens, head-tail). Mutates the global ``AttentionInterface``
    mapping's ``"sdpa"`` entry and restores it on exit. Re-entrant."""
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]
    layout = ring_layout(seq_len, cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())

    def sdpa_per_layer(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            extra = dict(kwargs)
            if is_causal is not None:
                extra["is_causal"] = is_causal
            return original(module, q, k, v, attention_mask, dropout=dropout, scaling=scale, **extra)[0]

        out = run_layer(
            module, query, key, value, kwargs, layout=layout, native=native, method="ring", scaling=scaling,
            dropout=dropout,
        )
        return out, None

    mapping["sdpa"] = sdpa_per_layer
    try:
        yield
    finally:
        mapping["sdpa"] = original
