"""DeepSeek Sparse Attention (DSA) under CP: queries local, the latent KV and the indexer keys all-gathered.

A DSA layer (DeepSeek-V3.2 ``DeepseekV32Attention``, GLM-5 ``GlmMoeDsaAttention``, dots3's ``indexed_attention``
layers, HY-V4 ``HYV4Attention``) is multi-head latent attention whose keys an *indexer* picks per query: light heads score every visible
token, ``score[q, t] = sum_h w[q, h] * relu(q_h . k_t) / sqrt(d)``, and the query attends to the ``index_topk``
best. What a query needs of the other tokens is small: the compressed (latent) KV ``[kv_lora_rank +
qk_rope_head_dim]`` the attention expands into keys and values, and the indexer key ``[index_head_dim]``.

:func:`install_sparse_attention` gives every DSA attention module of the profile a forward that, inside a CP
context of a method with a DSA kernel (:data:`~.sparse_support.SPARSE_METHODS`), runs the model's own forward
with three things changed for the call:

- the ``cache`` it is handed is a :class:`DsaStep`: its ``update`` (where transformers' KV cache would return
  the cached latents) all-gathers the rank's latent KV over the CP group in global order, differentiably (the
  gradient of the gathered latents is reduce-scattered back to the ranks that own the tokens: :class:`_Gather`);
- its indexer (instance forward) scores the rank's queries against the all-gathered indexer keys: per query,
  over the tokens of its own document only (a row of the document's real length, as the document alone has:
  top-k ties resolve as they do there), causal by global position; the RoPE of q and k is the model's, at the
  positions the model passed (global, in-document), in the indexer's own layout (DeepSeek-V3.2: halves;
  GLM-5, dots3: interleaved pairs, :data:`~.sparse_support.DSA_ATTENTION`). Slots past a short prefix (top-k
  larger than the visible tokens) are ``-1``;
- the attention function it looks up is :data:`DSA_ATTN_NAME` (:func:`dsa_attention`): the local queries
  against the whole gathered row, masked to the same document, causal, and the selected keys (``-1`` slots
  select nothing), in the input dtype.

The attention mask the model built (a method's, for local tokens) is replaced by the layout's. GLM-5's and HY-V4's
``shared`` layers reuse the previous layer's indices (global token ids) unchanged. HY-V4's per-head sinks (the
module's ``s_aux``) join each query's softmax over its selected keys; its indexer rotates the last dimensions
(:data:`~.sparse_support.DSA_ROPE_LAST`). Outside a CP context the
module runs its class's forward, except on packed rows (``position_ids`` restart): there the same kernel runs
on one rank, each query's top-k taken over its own document (transformers takes it over the whole row, whose
ties among equal scores resolve differently from the document alone's).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.distributed.cp.active import innermost
from automodel.distributed.cp.layers.dynamic_mask import dynamic_mask, dynamic_mask_attention
from automodel.distributed.cp.layers.kolibri_sparse import check_kolibri_attention
from automodel.distributed.cp.layers.qsa import (
    POSITIONS_ATTR,
    QsaStep,
    check_qsa_indexer,
    gather_positions,
    qsa_select_tokens,
)
from automodel.distributed.cp.layers.sparse_support import (
    DSA_ATTENTION,
    DSA_ROPE_BY_RELEASE,
    DSA_ROPE_LAST,
    DYNAMIC_MASK_ATTENTION,
    KV_GATHER_ATTENTION,
    QSA_ATTENTION,
    SPARSE_METHODS,
)
from automodel.errors import CPUnsupportedError

__all__ = [
    "DSA_ATTN_NAME",
    "DYNAMIC_MASK_ATTN_NAME",
    "QUERY_BLOCK",
    "DsaStep",
    "Placement",
    "Stage",
    "dsa_attention",
    "install_sparse_attention",
    "installed_on",
    "placement_of",
    "register_attention_functions",
    "rope_halves",
    "rope_interleaved",
    "select_topk",
    "uninstall_sparse_attention",
]

#: the attention function a DSA layer looks up under CP (registered in transformers' AttentionInterface)
DSA_ATTN_NAME = "automodel_dsa"
#: the attention function Doge's dynamic mask attention looks up under CP (:mod:`~.dynamic_mask`)
DYNAMIC_MASK_ATTN_NAME = "automodel_dynamic_mask"
#: the attention function a QSA layer looks up under CP: the same kernel, the selection already in the mask
QSA_ATTN_NAME = "automodel_qsa"
#: queries per block of the indexer's scores and of the attention (whose blocks are recomputed in the backward)
QUERY_BLOCK = 256
_MARK = "_automodel_cp_dsa"
_ROPE = {"half": "apply_rotary_pos_emb", "interleaved": "apply_rotary_pos_emb_interleave"}
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------------------
# where every token is: the gather stages and the documents


@dataclass
class Stage:
    """One all-gather over a group: rank ``r`` holds ``sizes[r]`` tokens; ``order[t]`` ``[T]`` int64 is where
    output token ``t`` sits in the rank-major concatenation (each rank's part padded to ``max(sizes)``)."""

    group: Any
    world: int
    sizes: list[int]
    order: torch.Tensor

    @classmethod
    def of(cls, group: Any, rank_ids: list[torch.Tensor]) -> Stage:
        """The stage whose rank ``r`` holds output tokens ``rank_ids[r]`` ``[n_r]`` (in local order)."""
        sizes = [int(ids.numel()) for ids in rank_ids]
        m = max(sizes) if sizes else 0
        total = sum(sizes)
        order = torch.empty(total, dtype=torch.int64)
        for r, ids in enumerate(rank_ids):
            order[ids] = r * m + torch.arange(ids.numel())
        return cls(group, len(rank_ids), sizes, order)


def _gather_stage(x: torch.Tensor, stage: Stage) -> torch.Tensor:
    """``[n, ...]`` (this rank's tokens) -> ``[T, ...]`` in output order."""
    if stage.world == 1:
        return x.index_select(0, stage.order.to(x.device))
    m = max(stage.sizes)
    x = x.contiguous()
    if x.shape[0] < m:
        x = torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))])
    buf = x.new_empty((stage.world * m, *x.shape[1:]))
    _all_gather(buf, x, group=stage.group)
    return buf.index_select(0, stage.order.to(x.device))


def _scatter_stage(g: torch.Tensor, stage: Stage, n: int) -> torch.Tensor:
    """The adjoint of :func:`_gather_stage`: ``[T, ...]`` summed over the ranks, this rank's ``[n, ...]`` kept."""
    order = stage.order.to(g.device)
    if stage.world == 1:
        return g.new_zeros((n, *g.shape[1:])).index_copy_(0, order, g)
    m = max(stage.sizes)
    buf = g.new_zeros((stage.world * m, *g.shape[1:])).index_copy_(0, order, g)
    out = g.new_empty((m, *g.shape[1:]))
    _reduce_scatter(out, buf, group=stage.group)
    return out[:n]


class _Gather(torch.autograd.Function):
    """All-gather token-major ``[n, ...]`` through ``stages`` into global order; the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, stages):  # type: ignore[override]
        ctx.stages, ctx.sizes = stages, []
        for stage in stages:
            ctx.sizes.append(x.shape[0])
            x = _gather_stage(x, stage)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        for stage, n in zip(reversed(ctx.stages), reversed(ctx.sizes)):
            grad = _scatter_stage(grad.contiguous(), stage, n)
        return grad, None


@dataclass
class Placement:
    """Where a CP method puts the tokens of a step, as the DSA kernel reads it.

    Attributes:
        stages: the all-gathers that bring every rank's tokens into global order (one per group level).
        ids: ``[n]`` int64 global ids (positions in the row, or in the packed stream) of this rank's tokens.
        doc_start: ``[R, T]`` int64 first token of each token's document (``R`` = 1: the same for every row).
        doc_end: ``[R, T]`` int64 one past the last REAL token of each token's document (padding excluded).
        key_valid: ``[R, T]`` bool, False at padding tokens; ``None``: no padding.
    """

    stages: list[Stage]
    ids: torch.Tensor
    doc_start: torch.Tensor
    doc_end: torch.Tensor
    key_valid: torch.Tensor | None = None

    @property
    def total(self) -> int:
        return int(self.doc_start.shape[-1])

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, n, C]`` (this rank's tokens) -> ``[B, T, C]`` in global order, differentiable."""
        return _Gather.apply(x.transpose(0, 1), self.stages).transpose(0, 1)

    def row(self, b: int) -> int:
        return b if self.doc_start.shape[0] > 1 else 0

    def mask(self, batch: int, device: torch.device) -> torch.Tensor:
        """``[B, 1, n, T]`` bool: key ``t`` is in query ``q``'s document, not after it, and real."""
        keys = torch.arange(self.total)
        rows = []
        for b in range(batch):
            start = self.doc_start[self.row(b)]
            allowed = (start[None, :] == start[self.ids][:, None]) & (keys[None, :] <= self.ids[:, None])
            if self.key_valid is not None:
                allowed &= self.key_valid[self.row(b)][None, :]
            rows.append(allowed)
        return torch.stack(rows)[:, None].to(device)


def _ends(doc_start: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[R, T]`` one past the last real token of each token's document (the document's end without padding)."""
    R, T = doc_start.shape
    index = torch.arange(T).expand(R, T)
    real = index + 1 if valid is None else torch.where(valid, index + 1, doc_start)
    end = torch.zeros(R, T, dtype=torch.int64)
    end.scatter_reduce_(1, doc_start, real, reduce="amax", include_self=True)
    out = end.gather(1, doc_start)
    return torch.where(out > doc_start, out, doc_start + 1)  # a document of padding only: one token


def _starts_of(document_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` document index per token -> ``[B, S]`` first token of each token's document."""
    B, S = document_ids.shape
    index = torch.arange(S).expand(B, S)
    first = torch.ones(B, S, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return (index * first).cummax(dim=1).values


def _real_ends_thd(plan: Any) -> torch.Tensor:
    """``[1, T]`` real end of each token's document in a thd plan's padded stream (``cu_seqlens`` real)."""
    padded, real = plan.cu_seqlens_padded, plan.cu_seqlens
    ends = []
    for i in range(len(padded) - 1):
        n = padded[i + 1] - padded[i]
        ends.append(torch.full((n,), padded[i] + max(1, real[i + 1] - real[i]), dtype=torch.int64))
    return torch.cat(ends)[None] if ends else torch.zeros(1, 0, dtype=torch.int64)


def _from_layout(layout: Any, real_end: torch.Tensor | None = None) -> Placement:
    start = layout.doc_start[None]
    end = _ends(start, None) if real_end is None else real_end
    return Placement([Stage.of(layout.group, layout.rank_ids)], layout.ids, start, end)


def placement_of(method: str, ctx: Any) -> Placement:
    """The :class:`Placement` of the active context ``ctx`` of ``method`` (cached on it for the step)."""
    cached = getattr(ctx, "_automodel_dsa_placement", None)
    if cached is not None:
        return cached
    if method == "ring":  # a TokenLayout: every row split head-tail, one document per row, right-padded maybe
        out = _from_layout(ctx)
        real = getattr(ctx, "real_length", None)
        if real is not None:
            out.key_valid = (torch.arange(out.total) < real)[None]
            out.doc_end = torch.full_like(out.doc_end, real)
    elif method == "thd":  # a THDPlan: documents padded to multiples of 2W, head-tail each
        out = _from_layout(ctx.token_layout(), _real_ends_thd(ctx))
    elif method == "thd_docs":  # a DocPlan: documents unpadded, whole or split
        out = _from_layout(ctx.token_layout())
    elif method == "ulysses":  # contiguous slices of every row
        sizes, at, rank_ids = ctx.shard_sizes, 0, []
        for n in sizes:
            rank_ids.append(torch.arange(at, at + n))
            at += n
        S = ctx.seq_len
        start = torch.zeros(1, S, dtype=torch.int64) if ctx.document_ids is None else _starts_of(ctx.document_ids.cpu())
        # the caller's padding mask: those keys are masked, the row keeps its length (one process on the same
        # batch scores the padded row); padding inside packed documents (seq_lens within seq_lens_padded) also
        # shortens the document's row to its real length (each document alone has that row)
        valid = None if ctx.padding_mask is None else ctx.padding_mask.cpu().bool()
        real = getattr(ctx, "real_tokens", None)
        if real is not None:
            real = real.cpu().bool()
            valid = real if valid is None else valid & real
        rows = max(start.shape[0], 1 if valid is None else valid.shape[0])
        start = start.expand(rows, S).contiguous()
        out = Placement([Stage.of(ctx.group, rank_ids)], rank_ids[ctx.rank], start, _ends(start, real), valid)
    elif method == "usp":  # thd's placement over the ring sub-group, each share cut in U contiguous slices
        g, plan = ctx.groups, ctx.plan
        layout = plan.token_layout()
        u = g.ulysses_size
        share = layout.rank_ids[g.ring_rank]
        m = share.numel() // u
        inner = Stage.of(g.ulysses_group, [torch.arange(j * m, (j + 1) * m) for j in range(u)])
        outer = Stage.of(g.ring_group, layout.rank_ids)
        start = layout.doc_start[None]
        out = Placement([inner, outer], share[g.ulysses_rank * m : (g.ulysses_rank + 1) * m], start,
                        _real_ends_thd(plan))  # fmt: skip
    else:
        raise ValueError(f"no DSA kernel for cp_method {method!r}; kernels: {', '.join(SPARSE_METHODS)}")
    try:
        ctx._automodel_dsa_placement = out
    except AttributeError:  # a context without a __dict__: rebuilt per layer
        pass
    return out


# ---------------------------------------------------------------------------------------------------------
# the indexer: top-k per query over its document


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    place: Placement,
    topk: int,
    scale: float | None,
    fill: torch.dtype | None = None,
) -> torch.Tensor:
    """Each local query's top-k keys, in global token ids (``-1``: an empty slot).

    Args:
        q: ``[B, n, H, D]`` the indexer's queries (RoPE applied), this rank's tokens.
        weights: ``[B, n, H]`` fp32 per-head weights (``weights_proj`` times ``H ** -0.5``).
        keys: ``[B, T, D]`` the indexer keys of every token in global order (RoPE applied).
        place: the step's :class:`Placement`; topk: ``index_topk``; scale: the indexer's ``softmax_scale`` on the
            scores (``None``: already in ``weights``, HY-V4's order of the same product).
        fill: ``None``: masked scores are ``-inf`` (transformers with a boolean mask: sdpa); a dtype: they are
            the score plus that dtype's lowest value (transformers' additive mask: eager).

    Returns:
        ``[B, n, min(topk, T)]`` int64. Query ``i`` at global id ``g`` of a document ``[d, e)`` (``e`` its real
        end) scores the keys ``[d, e)`` as one row (the document alone has that row), keys after ``g`` (and
        padding) masked; it takes the top ``min(topk, e - d)`` and keeps those that are visible, the others
        (top-k larger than the visible prefix) become ``-1``, as do the slots beyond ``e - d``.
    """
    B, n = q.shape[:2]
    T = place.total
    K = min(topk, T)
    out = torch.full((B, n, K), -1, dtype=torch.int64, device=q.device)
    ids = place.ids
    for b in range(B):
        r = place.row(b)
        start, end = place.doc_start[r][ids], place.doc_end[r][ids]
        real = ids < end
        # queries grouped by document; padding queries (past the real end) score their padded prefix
        length = torch.where(real, end - start, ids + 1 - start)
        groups = torch.stack([start, length], 1).unique(dim=0)
        for d, L in groups.tolist():
            every = ((start == d) & (length == L)).nonzero().flatten()
            key = keys[b, d : d + L].float()
            for sel in every.split(QUERY_BLOCK):  # [m, H, L] scores per block of queries (each row on its own)
                _select_block(out, b, r, sel, d, L, q, weights, key, place, topk, scale, fill)
    return out


def _select_block(
    out: torch.Tensor, b: int, r: int, sel: torch.Tensor, d: int, L: int, q: torch.Tensor, weights: torch.Tensor,
    key: torch.Tensor, place: Placement, topk: int, scale: float | None, fill: torch.dtype | None,
) -> None:  # fmt: skip
    """:func:`select_topk` for the local queries ``sel`` of row ``b`` (placement row ``r``) whose document starts at
    ``d`` and is scored over ``L`` keys (``key`` ``[L, D]`` fp32); writes their slots of ``out``."""
    rows = sel.to(q.device)
    scores = torch.matmul(q[b, rows].float(), key.transpose(0, 1))  # [m, H, L]
    if scale is not None:  # else the scale is in the weights (HY-V4)
        scores = scores * scale
    index = torch.matmul(weights[b, rows].unsqueeze(-2), F.relu(scores)).squeeze(-2)  # [m, L]
    pos = (place.ids[sel] - d).to(q.device)
    visible = torch.arange(L, device=q.device)[None, :] <= pos[:, None]
    if place.key_valid is not None:
        visible = visible & place.key_valid[r][d : d + L].to(q.device)[None, :]
    if fill is None:
        index = index.masked_fill(~visible, float("-inf"))
    else:
        dtype = torch.promote_types(index.dtype, fill)
        lowest = torch.tensor(torch.finfo(fill).min, dtype=dtype, device=q.device)  # fp64's: not a float32 scalar
        index = index.to(dtype) + torch.where(visible, torch.zeros((), dtype=dtype, device=q.device), lowest)
    k = min(topk, L)
    top = index.topk(k, dim=-1).indices
    out[b, rows, :k] = torch.where(visible.gather(1, top), top + d, torch.full_like(top, -1))


# ---------------------------------------------------------------------------------------------------------
# the step object handed to the module as its cache, and the attention function


class DsaStep:
    """What a DSA module's forward gets as ``cache`` under CP: ``update`` returns the latent KV of every token
    (all-gathered, differentiable), and the module's indexer selects through :meth:`select`."""

    def __init__(self, place: Placement, attn_implementation: str | None) -> None:
        self.place = place
        self.eager = attn_implementation == "eager"

    def update(self, first: torch.Tensor, second: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """``first`` ``[B, h, n, r]``, ``second`` ``[B, h, n, p]`` -> the same for all ``T`` tokens: the latents
        (``h = 1``: ``k_pass`` and ``k_rot``, transformers >= 5.25), or the expanded keys and values (transformers
        < 5.25 caches those)."""
        B, h, n, r = first.shape
        both = torch.cat([first, second.to(first.dtype)], dim=-1)  # [B, h, n, r + p]
        width = both.shape[-1]
        full = self.place.gather(both.transpose(1, 2).reshape(B, n, h * width))
        full = full.view(B, -1, h, width).transpose(1, 2)
        return full[..., :r], full[..., r:].to(second.dtype)

    def select(self, indexer: Any, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings: Any) -> torch.Tensor:
        """The indexer's top-k for this rank's queries (global token ids, ``-1`` empty), without gradient."""
        with torch.no_grad():
            B, n, _ = hidden.shape
            heads, dim, rope_dim = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
            rope = _rope_function(indexer)
            cos, sin = position_embeddings
            q = indexer.wq_b(q_resid).view(B, n, heads, dim)
            weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * heads**-0.5
            if getattr(indexer, "_automodel_dsa_rope_last", False):  # HY-V4: RoPE on the last dims, scale on weights
                q_pass, q_rot = torch.split(q, [dim - rope_dim, rope_dim], dim=-1)
                norm_dtype = indexer.k_norm.weight.dtype
                k = indexer.k_norm(indexer.wk(hidden).to(norm_dtype)).to(hidden.dtype).unsqueeze(2)
                k_pass, k_rot = torch.split(k, [dim - rope_dim, rope_dim], dim=-1)
                q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
                q = torch.cat([q_pass, q_rot], dim=-1)
                k = torch.cat([k_pass, k_rot], dim=-1).squeeze(2)
                weights, scale = weights * indexer.softmax_scale, None
            else:
                q_rot, q_pass = torch.split(q, [rope_dim, dim - rope_dim], dim=-1)
                k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
                k_rot, k_pass = torch.split(k, [rope_dim, dim - rope_dim], dim=-1)
                q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
                q = torch.cat([q_rot, q_pass], dim=-1)
                k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
                scale = indexer.softmax_scale
            keys = self.place.gather(k)
            fill = hidden.dtype if self.eager else None
            return select_topk(q, weights, keys, self.place, indexer.index_topk, scale, fill)


def dsa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    indices: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Local queries over the gathered row: ``query`` ``[B, H, n, Dqk]``, ``key`` / ``value`` ``[B, Hkv, T, D]``,
    ``attention_mask`` ``[B, 1, n, T]`` bool (same document, causal, real), ``indices`` ``[B, n, K]`` global ids
    of the selected keys (``-1``: none; never used as an index). Returns ``([B, n, H, Dv], None)``."""
    if dropout:
        raise ValueError(
            f"{type(module).__name__}: attention dropout ({dropout}) is not implemented by the CP DSA kernel; set the "
            "model's attention_dropout to 0"
        )
    if kwargs.get("sliding_window"):
        raise CPUnsupportedError(f"{type(module).__name__}: a sliding window on a DSA layer has no CP kernel")
    B, Hq, n, _ = query.shape
    T = key.shape[2]
    if indices is None:
        raise ValueError(f"{type(module).__name__}: the CP DSA kernel got no top-k indices")
    slot = indices.long().to(query.device)
    slot = torch.where(slot < 0, T, slot)  # -1: a column past the row, dropped below
    chosen = torch.zeros(B, n, T + 1, dtype=torch.bool, device=query.device).scatter_(-1, slot, True)[..., :T]
    return _attend(module, query, key, value, attention_mask & chosen[:, None], scaling, kwargs)


def qsa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`dsa_attention` for a QSA layer, whose ``attention_mask`` ``[B, 1, n, T]`` bool already holds the
    selection (the module ANDs its indexer's mask into the layout's)."""
    if dropout:
        raise ValueError(
            f"{type(module).__name__}: attention dropout ({dropout}) is not implemented by the CP QSA kernel; set the "
            "model's attention_dropout to 0"
        )
    if kwargs.get("sliding_window"):
        raise CPUnsupportedError(f"{type(module).__name__}: a sliding window on a QSA layer has no CP kernel")
    return _attend(module, query, key, value, attention_mask, scaling, kwargs)


def _attend(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
            scaling: float | None, kwargs: dict) -> tuple[torch.Tensor, None]:  # fmt: skip
    """Local queries ``[B, H, n, D]`` over the gathered row's keys ``mask`` ``[B, 1, n, T]`` allows; ``([B, n, H, Dv],
    None)``."""
    Hq, n = query.shape[1], query.shape[2]
    if key.shape[1] != Hq:  # transformers' repeat_kv: each KV head serves Hq / Hkv consecutive query heads
        key = key.repeat_interleave(Hq // key.shape[1], dim=1)
        value = value.repeat_interleave(Hq // value.shape[1], dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.nn.Parameter):  # eager reads the module's
        sinks = module.sinks
    if n <= QUERY_BLOCK or not torch.is_grad_enabled():
        out = _masked_attention(query, key, value, mask, scale, sinks)
    else:  # blocks of queries, recomputed in the backward: one block's [B, H, block, T] scores at a time
        from torch.utils.checkpoint import checkpoint

        out = torch.cat([
            checkpoint(_masked_attention, query[:, :, i : i + QUERY_BLOCK], key, value,
                       mask[:, :, i : i + QUERY_BLOCK], scale, sinks, use_reentrant=False)
            for i in range(0, n, QUERY_BLOCK)
        ], dim=2)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Softmax attention ``[B, H, m, Dqk] x [B, H, T, Dqk] -> [B, H, m, Dv]`` over the keys ``mask`` ``[B, 1, m, T]``
    allows. Plain math, not ``F.scaled_dot_product_attention``: inside ring's context torch replaces that with its
    ring. A masked score is the dtype's lowest value, whose ``exp`` is 0 (as transformers' eager mask). ``sinks``
    ``[H]``: a per-head logit joins every query's softmax and its probability is dropped (HY-V4, as its eager
    attention: the max subtracted first)."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    softmax_dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(value.dtype)
        return torch.matmul(probs, value)
    B, H, m, _ = scores.shape
    sink = sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, m, 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=softmax_dtype)[..., :-1].to(value.dtype)
    return torch.matmul(probs, value)


# ---------------------------------------------------------------------------------------------------------
# installing the forward


class _ConfigView:
    """The module's config with ``_attn_implementation`` = ``name`` (:data:`DSA_ATTN_NAME` by default; for one
    call)."""

    def __init__(self, config: Any, name: str = DSA_ATTN_NAME) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_attn_implementation", name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def rope_halves(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """RoPE on dimensions split in two halves (``x[:d/2]`` pairs with ``x[d/2:]``): DeepSeek-V3.2's indexer.
    ``cos`` / ``sin`` ``[B, n, d]`` are ``cat(freqs, freqs)``; the same operations in the same order as
    transformers' ``apply_rotary_pos_emb``, so the scores are the same numbers."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    return (q * cos) + (rotate(q) * sin), (k * cos) + (rotate(k) * sin)


def rope_interleaved(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    """RoPE on dimensions in (even, odd) pairs, written out in halves: GLM-5's and dots3's indexer (transformers'
    ``apply_rotary_pos_emb_interleave``, the same operations in the same order)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2, k1, k2 = q[..., 0::2], q[..., 1::2], k[..., 0::2], k[..., 1::2]
    return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
            torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))  # fmt: skip


_ROPE_KERNELS = {"half": rope_halves, "interleaved": rope_interleaved}


def _rope_function(indexer: Any):
    layout = getattr(indexer, "_automodel_dsa_rope", None)
    if layout is None:
        raise CPUnsupportedError(f"{type(indexer).__name__}: no DSA kernel installed for this indexer")
    return _ROPE_KERNELS[layout]


def _active() -> tuple[str, Any] | None:
    top = innermost()
    return top if top is not None and top[0] in SPARSE_METHODS else None


_SIGNATURES: dict[type, inspect.Signature] = {}


def _bound(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    cls = type(module)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = _SIGNATURES[cls].bind_partial(module, *args, **kwargs).arguments
    bound.pop("self", None)
    extra = bound.pop("kwargs", {})
    return {**bound, **(extra if isinstance(extra, dict) else {})}


def _packed_placement(call: dict[str, Any]) -> Placement | None:
    """One process on packed rows (``position_ids`` restart, transformers' rule): a one-rank placement whose
    documents are the rows' documents, so that each query's top-k is taken over its own document (ties resolve
    as in the document alone); ``None`` for rows of one document."""
    positions = call.get("position_ids")
    hidden = call["hidden_states"]
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] != hidden.shape[1]:
        return None
    from automodel.distributed.torch_internals import find_packed_sequence_indices

    documents = find_packed_sequence_indices(positions.expand(hidden.shape[0], -1))
    if documents is None:
        return None
    S = hidden.shape[1]
    start = _starts_of(documents.cpu())
    ids = torch.arange(S)
    return Placement([Stage.of(None, [ids])], ids, start, _ends(start, None))


def _run(module: torch.nn.Module, call: dict[str, Any], place: Placement) -> Any:
    """The module's own forward on ``place``: the gathering cache, the layout's mask, the DSA (or QSA) attention."""
    hidden = call["hidden_states"]
    call["attention_mask"] = place.mask(hidden.shape[0], hidden.device)
    config = module.config
    gather_kv = type(module).__name__ in KV_GATHER_ATTENTION  # QSA, Kolibri-1.1: K/V gathered, the class selects
    qsa = type(module).__name__ in QSA_ATTENTION
    module.config = _ConfigView(config, QSA_ATTN_NAME if gather_kv else DSA_ATTN_NAME)
    cache_name = "cache" if "cache" in _SIGNATURES[type(module)].parameters else "past_key_values"
    step: Any = QsaStep(place.gather) if gather_kv else DsaStep(place, config._attn_implementation)
    if qsa:  # the selection reads the RoPE of every key's position: gathered once for the layer
        module.indexer.__dict__[POSITIONS_ATTR] = gather_positions(call["position_embeddings"], hidden.shape[0],
                                                                   place.gather)  # fmt: skip
    try:
        return type(module).forward(module, **{cache_name: step}, **call)
    finally:
        module.config = config
        if qsa:
            module.indexer.__dict__.pop(POSITIONS_ATTR, None)


def dsa_module_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The installed forward of a DSA attention module (see the module docstring)."""
    call = _bound(self, args, kwargs)
    cache = call.pop("past_key_values", None) or call.pop("cache", None)
    active = _active()
    if active is None and type(self).__name__ in KV_GATHER_ATTENTION:  # one process: the class's mask is per document
        return type(self).forward(self, *args, **kwargs)
    return dispatch_installed_forward(self, args, kwargs, call, cache, active, _run)


def dispatch_installed_forward(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict[str, Any],
    call: dict[str, Any],
    cache: Any,
    active: tuple[str, Any] | None,
    run: Callable[[torch.nn.Module, dict[str, Any], Placement], Any],
) -> Any:
    """What an installed kernel's module forward does once it has bound its call (``call``, the cache popped):
    without an active CP context the class's own forward, or ``run`` per document on a packed row (no cache);
    under one (``active``: ``(method, ctx)`` of :func:`_active`) ``run`` at the method's placement, counted in
    ``ctx.calls``. Refuses a cache under CP."""
    if active is None:  # one process: the class's forward, or per document on packed rows
        place = _packed_placement(call) if cache is None else None
        return type(module).forward(module, *args, **kwargs) if place is None else run(module, call, place)
    method, ctx = active
    if cache is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {type(module).__name__} got a cache; CP runs training forwards only "
            "(call the model with use_cache=False)"
        )
    ctx.calls += 1  # a CP kernel ran: the context's "nothing was switched" check must not fire
    return run(module, call, placement_of(method, ctx))


def _run_dynamic_mask(module: torch.nn.Module, call: dict[str, Any], place: Placement) -> Any:
    """Doge's own forward on ``place`` (:mod:`~.dynamic_mask`): the cache gathers K and V, the dynamic mask is the
    document's, the attention function :data:`DYNAMIC_MASK_ATTN_NAME`. Restores the module afterwards."""
    call["attention_mask"] = None  # the placement's documents replace the method's mask
    config = module.config
    module.config = _ConfigView(config, DYNAMIC_MASK_ATTN_NAME)
    module.prepare_dynamic_mask = types.MethodType(lambda self, **kw: dynamic_mask(self, place, **kw), module)
    cache_name = "cache" if "cache" in _SIGNATURES[type(module)].parameters else "past_key_values"
    try:
        return type(module).forward(module, **{cache_name: DsaStep(place, None)}, **call)
    finally:
        module.config = config
        del module.prepare_dynamic_mask


def dynamic_mask_module_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The installed forward of a Doge attention module: the class's forward outside a CP context (per document on
    packed rows), :func:`_run_dynamic_mask` on the context's placement inside one."""
    call = _bound(self, args, kwargs)
    cache = call.pop("past_key_values", None) or call.pop("cache", None)
    active = _active()
    if active is None:
        place = _packed_placement(call) if cache is None else None
        return type(self).forward(self, *args, **kwargs) if place is None else _run_dynamic_mask(self, call, place)
    method, ctx = active
    if cache is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {type(self).__name__} got a cache; CP runs training forwards only "
            "(call the model with use_cache=False)"
        )
    ctx.calls += 1
    return _run_dynamic_mask(self, call, placement_of(method, ctx))


# a compiled model runs the DSA layer outside its graph (per-document loops, collectives), as every CP attention
_DSA_FORWARD = torch._dynamo.disable(dsa_module_forward, reason="automodel: CP DSA runs outside the compiled graph")
_DYNAMIC_MASK_FORWARD = torch._dynamo.disable(dynamic_mask_module_forward,
                                              reason="automodel: CP dynamic mask attention runs outside the graph")


def dsa_indexer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                        position_embeddings: Any, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """The installed forward of a DSA indexer: :meth:`DsaStep.select` when the module's forward handed it a
    :class:`DsaStep`, else the class's forward."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, DsaStep):
        return cache.select(self, hidden_states, q_resid, position_embeddings)
    return type(self).forward(self, hidden_states, q_resid, position_embeddings, *args, **kwargs)


def _release_layout(indexer: torch.nn.Module) -> str:
    """The RoPE layout whose function the installed indexer's forward calls (``"interleaved"`` when it calls
    ``apply_rotary_pos_emb_interleave``, else ``"half"``; :func:`_check_indexer` then checks that one is called)."""
    try:
        source = inspect.getsource(type(indexer).forward)
    except (OSError, TypeError):
        source = ""
    return "interleaved" if f"{_ROPE['interleaved']}(" in source else "half"


def _check_indexer(module: torch.nn.Module, indexer: torch.nn.Module, layout: str, rope_last: bool = False) -> None:
    """Refuse an indexer whose forward is not the scoring :meth:`DsaStep.select` computes (a transformers release
    that changed it): its RoPE function, which end of q it rotates, ReLU, the per-head weights and the top-k must
    all be there."""
    try:
        source = inspect.getsource(type(indexer).forward)
    except (OSError, TypeError):
        source = ""
    split = "q_pass, q_rot = torch.split(q," if rope_last else "q_rot, q_pass = torch.split(q,"
    needed = (f"{_ROPE[layout]}(", split, "relu", "weights_proj", "topk", "softmax_scale")
    missing = [word for word in needed if word not in source]
    attrs = [a for a in ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "qk_rope_head_dim",
                         "index_topk", "softmax_scale") if not hasattr(indexer, a)]  # fmt: skip
    if missing or attrs:
        import transformers

        raise CPUnsupportedError(
            f"{type(module).__name__}'s indexer {type(indexer).__name__} (transformers {transformers.__version__}) "
            f"does not compute what the CP DSA kernel computes (missing {', '.join(missing + attrs)}); open an issue "
            "with the class name and your transformers version"
        )


def register_attention_functions(functions: dict[str, Any]) -> None:
    """Put each CP attention function in transformers' ``AttentionInterface`` under its name (mutates the global
    registry; idempotent): the name a layer's ``_ConfigView`` makes it look up."""
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    for name, function in functions.items():
        if ALL_ATTENTION_FUNCTIONS._global_mapping.get(name) is not function:
            ALL_ATTENTION_FUNCTIONS._global_mapping[name] = function


def _register() -> None:
    register_attention_functions({DSA_ATTN_NAME: dsa_attention, DYNAMIC_MASK_ATTN_NAME: dynamic_mask_attention,
                                  QSA_ATTN_NAME: qsa_attention})  # fmt: skip


def install_sparse_attention(model: torch.nn.Module, profile: Any) -> int:
    """Give every DSA attention module of ``profile``'s ``sparse_attention`` layers (and its indexer) the CP
    forward (mutates ``model``; idempotent). Returns how many attention modules carry it.

    Raises:
        CPUnsupportedError: an indexer whose forward does not compute what the kernel computes.
    """
    from automodel.distributed.cp.profile import SPARSE

    sparse = {layer.index: layer.mixer for layer in profile.layers if layer.kind == SPARSE}
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name in DYNAMIC_MASK_ATTENTION and sparse.get(getattr(module, "layer_idx", None)) == name:
            if not getattr(module, _MARK, False):  # Doge: K and V gathered, top-k per document (dynamic_mask.py)
                module.forward = types.MethodType(_DYNAMIC_MASK_FORWARD, module)
                setattr(module, _MARK, True)
            count += 1
            continue
        # dots3's class runs its sliding-window layers too: only the layers the profile calls sparse get the kernel
        if (name not in DSA_ATTENTION and name not in KV_GATHER_ATTENTION) or sparse.get(getattr(module, "layer_idx", None)) != name:
            continue
        indexer = getattr(module, "indexer", None)
        if name in KV_GATHER_ATTENTION and name not in QSA_ATTENTION:  # Kolibri-1.1: the class's forward, unchanged
            check_kolibri_attention(module, sparse)
        elif name in QSA_ATTENTION:  # Qwen4-Exp: its own selection over the gathered keys and positions
            check_qsa_indexer(module, indexer)
            if not getattr(indexer, _MARK, False):
                indexer._select_tokens = types.MethodType(qsa_select_tokens, indexer)
                setattr(indexer, _MARK, True)
        elif indexer is not None:
            layout = _release_layout(indexer) if name in DSA_ROPE_BY_RELEASE else DSA_ATTENTION[name]
            _check_indexer(module, indexer, layout, name in DSA_ROPE_LAST)
            if not getattr(indexer, _MARK, False):
                indexer.forward = types.MethodType(dsa_indexer_forward, indexer)
                indexer._automodel_dsa_rope = layout
                indexer._automodel_dsa_rope_last = name in DSA_ROPE_LAST
                setattr(indexer, _MARK, True)
        if not getattr(module, _MARK, False):
            module.forward = types.MethodType(_DSA_FORWARD, module)
            setattr(module, _MARK, True)
        count += 1
    if count:
        _register()
    return count


def installed_on(model: torch.nn.Module) -> int:
    """How many attention modules of ``model`` carry the CP DSA forward."""
    return sum(1 for module in model.modules() if module.__dict__.get(_MARK, False))


def uninstall_sparse_attention(model: torch.nn.Module) -> None:
    """Give every module :func:`install_sparse_attention` changed its class's forward back (mutates ``model``)."""
    for module in model.modules():
        if getattr(module, _MARK, False):
            for name in ("forward", "_select_tokens"):  # a QSA indexer: its _select_tokens
                module.__dict__.pop(name, None)
            delattr(module, _MARK)
