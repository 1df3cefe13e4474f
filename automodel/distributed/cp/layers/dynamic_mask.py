"""Doge's dynamic mask attention under CP: queries local, K and V all-gathered, the top-k per document.

``DogeAttention`` (transformers ``models/doge``) adds to every score of KV head ``h`` a bias computed from the key's
own value, ``bias[h, j] = exp(A_h * softplus(dt_proj(v_j))_h)`` (``A`` and ``dt_proj`` learned), handed to the
attention function as its mask; when the row has more than ``keep_window_size`` keys, each query keeps only the
``keep_window_size`` keys of largest value in its mask row (the bias where it sees the key, the dtype's lowest value
elsewhere), ``torch.topk`` over the whole row, and masks the others.

Under CP (every method: the placement of :func:`~.sparse_attention.placement_of`) the model's own forward runs with
three things changed for the call, as DSA's (:mod:`~.sparse_attention`):

- its ``cache`` gathers K and V (``update``: all-gathered over the CP group in global order, their gradient
  reduce-scattered back to the ranks that own the tokens), so ``dt_proj`` computes the bias of every key of the row
  on every rank (``[B, Hkv, T]``; a rank's share of ``A``'s and ``dt_proj``'s gradient comes from its own queries, and
  the ranks' shares add up as every replicated weight's do);
- its ``prepare_dynamic_mask`` is :func:`dynamic_mask`: for each local query the mask row of its document alone (its
  real length ``L``, the keys it sees: causal, real, in its document, within ``config.sliding_window``), ``torch.topk``
  over that row exactly as transformers calls it when ``L > keep_window_size``: the same values in the same order, so
  ties (``A = 0`` at initialisation gives every key the bias 1) resolve as in the document alone;
- its attention function is :func:`dynamic_mask_attention`: scores plus that mask, softmax (fp32 for 16-bit inputs,
  else the input's dtype), blocks of :data:`QUERY_BLOCK` queries recomputed in the backward.

Cost per rank and layer: K and V of the whole row (``2 * T * Hkv * D`` elements, as thd's all-gather) and the mask
``[B, Hkv, n, T]`` of its ``n`` queries over the row (the reference's own ``[B, Hkv, S, S]`` divided by ``cp``), plus
transiently one block's ``[B, Hq, 256, T]`` scores. Packed rows at CP size 1 run the same kernel on one rank.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["QUERY_BLOCK", "dynamic_mask", "dynamic_mask_attention", "drop_beyond_top_k"]

#: queries per block of the attention (recomputed in the backward: one block's scores at a time)
QUERY_BLOCK = 256


def drop_beyond_top_k(mask: torch.Tensor, place: Any, keep: int) -> torch.Tensor:
    """``[B, Hkv, n, T]`` bool: True where a visible key is not among its query's top ``keep``.

    ``mask`` ``[B, Hkv, n, T]``: the bias where the query sees the key, the dtype's lowest value elsewhere (no
    gradient needed). Query ``i`` at global id ``g`` of a document ``[d, e)`` (``e`` its real end) takes
    ``torch.topk(row, keep, sorted=False)`` of its row ``mask[..., d:e]`` (the row the document alone has) when
    ``e - d > keep``; nothing is dropped in a shorter document (transformers takes no top-k there)."""
    B, H, n, _ = mask.shape
    drop = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    ids = place.ids
    for b in range(B):
        r = place.row(b)
        start, end = place.doc_start[r][ids], place.doc_end[r][ids]
        real = ids < end
        length = torch.where(real, end - start, ids + 1 - start)  # padding queries: their padded prefix
        for d, L in torch.stack([start, length], 1).unique(dim=0).tolist():
            if L <= keep:
                continue
            rows = ((start == d) & (length == L)).nonzero().flatten().to(mask.device)
            for sel in rows.split(QUERY_BLOCK):
                row = mask[b][:, sel, d : d + L]  # [H, m, L]
                top = torch.topk(row, keep, dim=-1, largest=True, sorted=False).indices
                kept = torch.zeros_like(row, dtype=torch.bool).scatter_(-1, top, True)
                drop[b, :, sel, d : d + L] = ~kept
    return drop


def dynamic_mask(
    module: torch.nn.Module,
    place: Any,
    hidden_states: torch.Tensor,
    dt_states: torch.Tensor,
    keep_window_size: int = 2048,
    attention_mask: Any = None,
) -> torch.Tensor:
    """Doge's ``prepare_dynamic_mask`` for this rank's queries over the gathered row.

    Args:
        module: the ``DogeAttention`` (its ``config.sliding_window``, if any, limits what a query sees).
        place: the step's placement (:class:`~.sparse_attention.Placement`).
        hidden_states: ``[B, n, C]`` the rank's inputs (their dtype is the mask's).
        dt_states: ``[B, Hkv, T]`` the bias of every key of the row, in global order.
        keep_window_size: the top-k size; attention_mask: ignored (the placement's documents replace it).

    Returns:
        ``[B, Hkv, n, T]`` in ``hidden_states``' dtype: the bias of the keys each query keeps, the dtype's lowest
        value elsewhere; differentiable w.r.t. ``dt_states``.
    """
    B, n = hidden_states.shape[:2]
    dtype, device = hidden_states.dtype, hidden_states.device
    lowest = torch.finfo(dtype).min
    visible = place.mask(B, device)  # [B, 1, n, T]: same document, not after the query, real
    window = getattr(getattr(module, "config", None), "sliding_window", None)
    if window:
        keys = torch.arange(place.total, device=device)
        visible = visible & (keys[None, :] > place.ids.to(device)[:, None] - int(window))[None, None]
    mask = dt_states.to(dtype)[:, :, None, :].expand(-1, -1, n, -1).masked_fill(~visible, lowest)
    with torch.no_grad():
        drop = drop_beyond_top_k(mask.detach(), place, int(keep_window_size))
    return mask.masked_fill(drop, lowest)


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float):
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale + mask
    softmax_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)
    return torch.matmul(probs, value)


def dynamic_mask_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``softmax(q k^T * scaling + mask) v`` of the local queries over the gathered row: ``query`` ``[B, Hq, n, D]``,
    ``key`` / ``value`` ``[B, Hkv, T, D]``, ``attention_mask`` ``[B, Hq, n, T]`` (:func:`dynamic_mask`, repeated to
    the query heads by the model). Plain math, not SDPA (inside ring's context torch takes SDPA for its ring).
    Returns ``([B, n, Hq, D], None)``."""
    if dropout:
        raise ValueError(
            f"{type(module).__name__}: attention dropout ({dropout}) is not implemented by the CP dynamic mask kernel; "
            "set the model's attention_dropout to 0"
        )
    Hq, n = query.shape[1], query.shape[2]
    if key.shape[1] != Hq:  # transformers' repeat_kv: each KV head serves Hq / Hkv consecutive query heads
        key = key.repeat_interleave(Hq // key.shape[1], dim=1)
        value = value.repeat_interleave(Hq // value.shape[1], dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if n <= QUERY_BLOCK or not torch.is_grad_enabled():
        out = _block(query, key, value, attention_mask, scale)
    else:
        from torch.utils.checkpoint import checkpoint

        # split, not a slice per block: the mask's gradient (it learns through A and dt_proj) is then made once, from
        # the blocks' gradients, where each slice's backward made a whole [B, Hq, n, T] of zeros around its block and
        # the sum of those took two more (a live-tensor snapshot of Doge at ring cp 2: four mask-sized tensors at the
        # backward's peak, the kept mask among them; two now, the kept mask and its gradient's blocks)
        blocks = zip(query.split(QUERY_BLOCK, dim=2), attention_mask.split(QUERY_BLOCK, dim=2))
        out = torch.cat([checkpoint(_block, q, key, value, m, scale, use_reentrant=False) for q, m in blocks], dim=2)
    return out.transpose(1, 2).contiguous(), None
