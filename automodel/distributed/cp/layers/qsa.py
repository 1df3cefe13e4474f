"""Qwen4-Exp's query-sparse attention (QSA, ``Qwen4ExpTextAttention``) under CP: queries local; K, V and the
indexer's raw keys all-gathered; the class's own selection run for the local queries over the whole row.

transformers' layer, on a row of tokens (no cache):

1. the indexer (``Qwen4ExpTextQSAIndexer``) projects every token to ``indexer_n_heads`` queries (RMS-normed,
   RoPE at the token's position) and one raw key; for each query it takes the keys its attention mask shows (its
   document, causal, real), cuts them in blocks of ``indexer_compress_ratio`` consecutive keys from the first one,
   pools each complete block (mean, RMS norm, RoPE at the block's first position), scores it
   ``sum_h relu(q_h . k_block) / sqrt(d)`` and keeps the tokens of the best ``indexer_budget / indexer_compress_ratio``
   blocks plus the incomplete last block: a boolean mask ``[B, 1, n, T]`` (no gradient flows through it);
2. ordinary softmax attention (q/k norms, RoPE, grouped KV heads) over the mask AND the selection, gated by
   ``sigmoid(gate)`` per token (token-local).

What a query reads of the other tokens is their K and V (the attention), their raw indexer keys and the RoPE of
their positions (the selection). The layer's forward runs unchanged with its ``cache`` a :class:`QsaStep`, whose
``update`` (where a KV cache returns the cached K and V) all-gathers the rank's K and V over the CP group in global
order, differentiably, and whose ``update_indexer`` all-gathers the raw indexer keys. The indexer's
``_select_tokens`` (the class's own code, unchanged) then gets, instead of the local RoPE, the RoPE of every
token's position (gathered once per layer: :func:`gather_positions`, used by :func:`qsa_select_tokens`), and the mask the method's
layout gives (the query's document, causal, real keys). So every rank selects for its queries exactly the blocks
one process selects, from the same numbers, and attends to the same keys.

This module imports only torch; the dispatch (which method, which placement) is
:mod:`automodel.distributed.cp.layers.sparse_attention`'s.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from automodel.errors import CPUnsupportedError

__all__ = ["POSITIONS_ATTR", "QsaStep", "check_qsa_indexer", "gather_positions", "qsa_select_tokens"]

#: instance attribute holding the gathered ``(cos, sin)`` ``[B, T, d]`` for the duration of one layer call
POSITIONS_ATTR = "_automodel_qsa_positions"


class QsaStep:
    """What a QSA module's forward gets as ``cache`` under CP. ``gather`` is the placement's differentiable
    all-gather ``[B, n, C] -> [B, T, C]`` in global order."""

    def __init__(self, gather: Any) -> None:
        self.gather = gather

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """``key``, ``value`` ``[B, Hkv, n, d]`` (RoPE applied) -> the same for all ``T`` tokens (differentiable: the
        gradient of a gathered token returns to the rank that owns it)."""
        B, h, n, d = key.shape
        both = torch.cat([key, value.to(key.dtype)], dim=-1).transpose(1, 2).reshape(B, n, h * 2 * d)
        full = self.gather(both).view(B, -1, h, 2 * d).transpose(1, 2)
        return full[..., :d], full[..., d:].to(value.dtype)

    def update_indexer(self, raw_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``[B, n, d]`` the rank's raw indexer keys -> ``[B, T, d]`` every token's (no gradient: the selection is a
        boolean mask, transformers' keys get none either)."""
        with torch.no_grad():
            return self.gather(raw_keys.detach())


def gather_positions(position_embeddings: tuple[torch.Tensor, torch.Tensor], batch: int, gather: Any):
    """``(cos, sin)`` ``[B or 1, n, d]`` of the rank's tokens -> ``[B, T, d]`` of every token (no gradient)."""
    with torch.no_grad():
        return tuple(gather(x.detach().expand(batch, -1, -1).contiguous()) for x in position_embeddings)


def qsa_select_tokens(self: torch.nn.Module, hidden_states: torch.Tensor, q: torch.Tensor, raw_keys: torch.Tensor,
                      full_cos: torch.Tensor, full_sin: torch.Tensor, attention_mask: torch.Tensor,
                      **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """The installed ``_select_tokens`` of a QSA indexer: the class's own, with the RoPE of every gathered key's
    position when the layer's CP forward set it (``raw_keys`` ``[B, T, d]``), else unchanged."""
    positions = self.__dict__.get(POSITIONS_ATTR)
    if positions is not None:
        full_cos, full_sin = positions
    return type(self)._select_tokens(self, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs)


def check_qsa_indexer(module: torch.nn.Module, indexer: torch.nn.Module) -> None:
    """Refuse an indexer whose code is not what :class:`QsaStep` and :func:`qsa_select_tokens` rely on (a
    transformers release that changed it): the query RoPE from the local slice, the keys through
    ``cache.update_indexer``, the selection by ``_select_tokens`` over the mask's visible keys."""
    try:
        forward = inspect.getsource(type(indexer).forward)
        select = inspect.getsource(type(indexer)._select_tokens)
    except (OSError, TypeError, AttributeError):
        forward = select = ""
    needed = {"forward": (forward, ("update_indexer(", "_select_tokens(", "[:, -seq_length:")),
              "_select_tokens": (select, ("attention_mask", "nonzero", "compress_ratio", "topk", "group_starts"))}
    missing = [f"{where}: {word}" for where, (src, words) in needed.items() for word in words if word not in src]
    if missing:
        import transformers

        raise CPUnsupportedError(
            f"{type(module).__name__}'s indexer {type(indexer).__name__} (transformers {transformers.__version__}) does "
            f"not compute what the CP QSA kernel expects (missing {', '.join(missing)}); open an issue with the class "
            "name and your transformers version"
        )
