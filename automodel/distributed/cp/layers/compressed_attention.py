"""DeepSeek-V4's attention under CP: a sliding window with sinks plus compressed KV, exact under every method.

``DeepseekV4Attention`` is multi-query attention (one K = V head) whose every query attends, in one softmax with a
per-head sink logit, to

- the last ``sliding_window`` tokens of its document (itself included), and
- compressed entries: entry ``w`` of a document pools the tokens of block ``w`` (``m`` tokens from the document's
  start; heavily compressed attention, HCA: ``m`` = 128 by default) or, for compressed sparse attention (CSA,
  ``m`` = 4), blocks ``w - 1`` and ``w`` (each token projects two series; entry ``w`` softmax-pools the first series
  of block ``w - 1`` with the second of block ``w``: overlapping windows of ``2m`` tokens, stride ``m``). The pooled
  vector is RMS-normalised and rotated (RoPE) at position ``m * w``. A query at in-document position ``p`` sees the
  entries ``w < (p + 1) // m`` (every token they pool is at most ``p``); a CSA layer's indexer keeps only its
  ``index_topk`` best of those (``sum_h w[q, h] relu(q_h . k_w)`` over the indexer's own pooled keys).

Under CP (:func:`install_compressed_attention`) the queries stay on their rank, as for DSA
(:mod:`~automodel.distributed.cp.layers.sparse_attention`, whose :class:`~.sparse_attention.Placement` this reuses),
and the per-token state the layer attends to is all-gathered over the CP group in global order: the window's K = V
(``head_dim``) and the compressor's per-token projections (``kv_proj`` and ``gate_proj``: ``2 * head_dim`` per HCA
token, ``4 * head_dim`` per CSA token) with their gradients reduce-scattered back to the owning ranks, and the CSA
indexer's projections (``4 * index_head_dim``, no gradient: the top-k is not differentiable, as in transformers).
Every rank then pools whole blocks of every document in global order, so a block that straddles ranks is pooled
exactly as one process pools it, scores its queries against its documents' indexer keys at in-document positions
(one row of the document's entries per query, as the document alone has: ties resolve as there) and attends, per
block of :data:`QUERY_BLOCK` queries, to the window keys that block reaches and the entries it may see.

The model's own forward runs with its ``cache`` argument a :class:`CompressedStep` (``update`` gathers the window's
K = V), its compressor's forward replaced for the call (pooling the gathered projections per document) and its
attention function :data:`V4_ATTN_NAME`; the projections, norms, RoPE of q and K = V, the sinks' parameter, the
output's inverse RoPE and the grouped output projection stay the model's code. Outside a CP context the class's
forward runs, except on packed rows (``position_ids`` restart), where the same kernel runs on the one rank (the
model's own compressor would pool blocks across documents).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from automodel.distributed.cp.layers.sparse_attention import (
    _SIGNATURES,
    QUERY_BLOCK,
    Placement,
    _active,
    _bound,
    _masked_attention,
    dispatch_installed_forward,
    register_attention_functions,
)
from automodel.distributed.cp.layers.sparse_support import COMPRESSED_ATTENTION
from automodel.errors import CPUnsupportedError

__all__ = [
    "V4_ATTN_NAME",
    "pool_weights",
    "CompressedStep",
    "compressed_attention",
    "install_compressed_attention",
    "installed_compressed_on",
    "uninstall_compressed_attention",
]

#: the attention function a DeepSeek-V4 layer looks up under CP (registered in transformers' AttentionInterface)
V4_ATTN_NAME = "automodel_v4_compressed"
_MARK = "_automodel_cp_v4"


def _modeling(module: torch.nn.Module) -> Any:
    """The modeling file of ``module``'s class (its ``apply_rotary_pos_emb``: V4's interleaved RoPE on the last
    dimensions)."""
    return sys.modules[type(module).__module__]


def _documents(place: Placement, row: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every document of placement row ``row``, in order (``end``: one past its last real token)."""
    start, end = place.doc_start[row], place.doc_end[row]
    firsts = torch.unique(start).tolist()
    return [(int(d), int(end[d])) for d in firsts]


def pool_weights(gate: torch.Tensor) -> torch.Tensor:
    """The pooling weights of a block: the gates' softmax over its tokens (dim 2), in fp32 as transformers'
    compressor computes it whatever the dtype (the fp64 tests make both compute in fp64)."""
    return gate.softmax(dim=2, dtype=torch.float32)


def _weights(gate: torch.Tensor) -> torch.Tensor:
    return sys.modules[__name__].pool_weights(gate)  # looked up per call: the fp64 tests patch it


def _pool(module: torch.nn.Module, kv: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, rate: int, dim: int,
          overlap: bool, rope: Any) -> torch.Tensor:  # fmt: skip
    """Every document's compressed entries in one batch, each as transformers' compressor computes it for the
    document alone (the same operations on the same numbers per block).

    Args:
        module: the compressor (or indexer): its ``position_bias``, ``kv_norm``, ``rotary_emb``.
        kv, gate: ``[N, rate, C]`` the per-token projections of ``N`` blocks (``C`` = ``2 * dim`` when ``overlap``,
            else ``dim``), in document order.
        index: ``[N]`` int64 each block's index in its document (``w``; 0: the document's first block).
        overlap: CSA's two series: entry ``w`` pools the first series of block ``w - 1`` (none for ``w`` = 0, weight
            0 as transformers' ``-inf`` gates give it) and the second of block ``w``.
        rope: the modeling file's ``apply_rotary_pos_emb``.

    Returns:
        ``[N, dim]``: entry ``w`` normalised and rotated at position ``rate * w``.
    """
    chunk_kv = kv[None]
    chunk_gate = gate[None] + module.position_bias
    if overlap:
        first = (index == 0).view(1, -1, 1, 1)
        prev_kv = torch.cat([chunk_kv.new_zeros((1, 1, rate, dim)), chunk_kv[:, :-1, :, :dim]], dim=1)
        prev_gate = torch.cat([chunk_gate.new_full((1, 1, rate, dim), float("-inf")), chunk_gate[:, :-1, :, :dim]], 1)
        prev_kv = torch.where(first, torch.zeros((), dtype=prev_kv.dtype, device=prev_kv.device), prev_kv)
        prev_gate = torch.where(first, torch.full((), float("-inf"), dtype=prev_gate.dtype, device=prev_gate.device),
                                prev_gate)  # fmt: skip
        chunk_kv = torch.cat([prev_kv, chunk_kv[..., dim:]], dim=2)
        chunk_gate = torch.cat([prev_gate, chunk_gate[..., dim:]], dim=2)
    pooled = module.kv_norm((chunk_kv * _weights(chunk_gate).to(chunk_kv.dtype)).sum(dim=2))  # [1, N, dim]
    positions = (index.to(pooled.device) * rate)[None]
    cos, sin = module.rotary_emb(pooled, position_ids=positions, layer_type=module.rope_layer_type)
    return rope(pooled.unsqueeze(1), cos, sin).squeeze(1)[0]


def _blocks(place: Placement, row: int, rate: int) -> tuple[torch.Tensor, torch.Tensor, dict[int, tuple[int, int]]]:
    """The blocks of ``rate`` tokens of every document of placement row ``row`` (from its start, up to its real end):
    ``([N, rate]`` the blocks' token ids, ``[N]`` each block's index in its document, ``{document start: (its
    first entry on the row's entry axis, its number of entries)})``."""
    tokens, index, doc_of, at = [], [], {}, 0
    for d, e in _documents(place, row):
        count = (e - d) // rate
        doc_of[d] = (at, count)
        if count:
            tokens.append(d + torch.arange(count * rate).view(count, rate))
            index.append(torch.arange(count))
        at += count
    if not tokens:
        return torch.zeros(0, rate, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), doc_of
    return torch.cat(tokens), torch.cat(index), doc_of


class CompressedStep:
    """What a DeepSeek-V4 attention module's forward gets as ``cache`` under CP, and what its compressor and the
    attention function read: the :class:`~.sparse_attention.Placement`, the gathered window keys (``tokens`` of them)
    and, after :meth:`compress`, each local query's visible entries.

    Attributes (after :meth:`compress`; ``None`` for a layer without a compressor):
        entry_lo, entry_hi: ``[B, n]`` int64 the query's visible entries ``[lo, hi)`` on the row's entry axis.
        picks: ``[B, n, K]`` int64 the entries a CSA query's indexer keeps (``-1``: none); ``None`` for HCA.
    """

    def __init__(self, place: Placement, window: int | None) -> None:
        self.place = place
        self.window = window
        self.tokens = place.total
        self.entry_lo: torch.Tensor | None = None
        self.entry_hi: torch.Tensor | None = None
        self.picks: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """``key`` (= ``value``) ``[B, 1, n, D]`` -> ``[B, 1, T, D]`` every token's, in global order, differentiable."""
        B, h, n, D = key.shape
        full = self.place.gather(key.transpose(1, 2).reshape(B, n, h * D)).view(B, -1, h, D).transpose(1, 2)
        return full, full

    def compress(self, compressor: torch.nn.Module, hidden: torch.Tensor, q_residual: torch.Tensor,
                 position_ids: torch.Tensor) -> tuple[torch.Tensor, None]:  # fmt: skip
        """The compressor's forward under CP: ``([B, 1, E, D]`` every document's entries of each row, ``None)``; each
        local query's visible entries (and a CSA query's top-k) recorded on the step for the attention."""
        place, rope = self.place, _modeling(compressor).apply_rotary_pos_emb
        B, n, _ = hidden.shape
        rate, dim = compressor.compress_rate, compressor.head_dim
        indexer = getattr(compressor, "indexer", None)
        overlap = indexer is not None
        kv = compressor.kv_proj(hidden)
        width = kv.shape[-1]
        full = place.gather(torch.cat([kv, compressor.gate_proj(hidden)], dim=-1))  # [B, T, 2 * width]
        index_full = None
        if indexer is not None:
            with torch.no_grad():
                index_full = place.gather(torch.cat([indexer.kv_proj(hidden), indexer.gate_proj(hidden)], dim=-1))
        ids = place.ids
        rows, lo, hi, offsets, index_rows = [], [], [], [], []
        for b in range(B):
            r = place.row(b)
            tokens, index, doc_of = _blocks(place, r, rate)
            if tokens.shape[0]:
                seg = full[b][tokens.to(full.device)]  # [N, rate, 2 * width]
                rows.append(_pool(compressor, seg[..., :width], seg[..., width:], index, rate, dim, overlap, rope))
                if indexer is not None:
                    with torch.no_grad():
                        iseg = index_full[b][tokens.to(full.device)]
                        half = iseg.shape[-1] // 2
                        index_rows.append(_pool(indexer, iseg[..., :half], iseg[..., half:], index, rate,
                                                indexer.head_dim, True, rope))  # fmt: skip
            else:
                rows.append(full.new_zeros((0, dim)))
                index_rows.append(None)
            start = place.doc_start[r][ids]
            first = torch.tensor([doc_of[int(s)][0] for s in start.tolist()], dtype=torch.int64)
            count = torch.tensor([doc_of[int(s)][1] for s in start.tolist()], dtype=torch.int64)
            seen = torch.minimum((ids - start + 1) // rate, count)
            lo.append(first)
            hi.append(first + seen)
            offsets.append(doc_of)
        E = max(x.shape[0] for x in rows)
        out = torch.stack([torch.cat([x, x.new_zeros((E - x.shape[0], dim))]) for x in rows])  # [B, E, D]
        self.entry_lo, self.entry_hi = torch.stack(lo), torch.stack(hi)
        if indexer is not None:
            with torch.no_grad():
                self.picks = self._select(indexer, hidden, q_residual, position_ids, index_rows, offsets, rope)
        return out.unsqueeze(1), None

    def _select(self, indexer: torch.nn.Module, hidden: torch.Tensor, q_residual: torch.Tensor,
                position_ids: torch.Tensor, index_rows: list, offsets: list, rope: Any) -> torch.Tensor:  # fmt: skip
        """``[B, n, K]`` each local query's top-``index_topk`` entries on its row's entry axis (``-1``: none), scored
        as transformers' indexer scores them over the query's document alone (its entries as one row, the entries a
        query may not see yet at ``-inf``, picks among those replaced by ``-1``)."""
        place = self.place
        B, n, _ = hidden.shape
        cos, sin = indexer.rotary_emb(hidden, position_ids=position_ids, layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual).view(B, n, -1, indexer.head_dim).transpose(1, 2)
        q = rope(q, cos, sin).transpose(1, 2)  # [B, n, H, d]
        K = indexer.index_topk
        picks = torch.full((B, n, K), -1, dtype=torch.int64, device=hidden.device)
        for b in range(B):
            r = place.row(b)
            start = place.doc_start[r][place.ids]
            for d, (first, count) in offsets[b].items():
                if not count:
                    continue
                key = index_rows[b][first : first + count]
                rows = (start == d).nonzero().flatten()
                if not rows.numel():
                    continue
                for sel in rows.split(QUERY_BLOCK):
                    dev = sel.to(hidden.device)
                    scores = indexer.scorer(q[b : b + 1, dev], key[None], hidden[b : b + 1, dev])[0]  # [m, count]
                    visible = ((place.ids[sel] - d + 1) // indexer.compress_rate).to(hidden.device)
                    future = torch.arange(count, device=hidden.device)[None, :] >= visible[:, None]
                    scores = scores.masked_fill(future, float("-inf"))
                    k = min(K, count)
                    top = scores.topk(k, dim=-1).indices
                    picks[b, dev, :k] = torch.where(top >= visible[:, None], torch.full_like(top, -1), top + first)
        return picks


def _query_blocks(ids: torch.Tensor) -> list[slice]:
    """This rank's queries ``ids`` ``[n]`` (global ids, local order) in blocks of at most :data:`QUERY_BLOCK`, each a
    run of consecutive ids (a block never spans a gap: ring's two chunks, thd's documents), so that the window keys a
    block reaches are at most ``QUERY_BLOCK + window - 1``."""
    n = int(ids.numel())
    gaps = ((ids[1:] != ids[:-1] + 1).nonzero().flatten() + 1).tolist() if n > 1 else []
    blocks = []
    for lo, hi in zip([0, *gaps], [*gaps, n]):
        blocks += [slice(i, min(hi, i + QUERY_BLOCK)) for i in range(lo, hi, QUERY_BLOCK)]
    return blocks


def compressed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The local queries' attention over their window and their visible (selected) entries, with the sinks.

    ``query`` ``[B, H, n, D]``; ``key`` (= ``value``) ``[B, 1, T + E, D]``: the gathered window keys of every token,
    then the row's entries (:meth:`CompressedStep.compress`). Per block of :data:`QUERY_BLOCK` queries only the
    window keys the block reaches and the entries it may see are scored (recomputed in the backward). A masked score
    is the dtype's lowest value, as transformers' eager mask; the sink logit joins every softmax and is dropped.
    Returns ``([B, n, H, D], None)``."""
    step = getattr(module, "_automodel_v4_step", None)
    if not isinstance(step, CompressedStep):
        raise CPUnsupportedError(f"{type(module).__name__}: the CP compressed-attention kernel ran outside its step")
    if dropout:
        raise ValueError(
            f"{type(module).__name__}: attention dropout ({dropout}) is not implemented by the CP compressed-attention "
            "kernel; set the model's attention_dropout to 0"
        )
    place, T = step.place, step.tokens
    window = kwargs.get("sliding_window") or step.window
    sinks = kwargs.get("s_aux")
    B, H, n, _ = query.shape
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    ids = place.ids.to(query.device)
    outs, blocks = [], _query_blocks(place.ids)
    for blk in blocks:
        q_ids = ids[blk]
        top = int(q_ids.max()) + 1
        low = max(0, int(q_ids.min()) - window + 1) if window else 0
        keys = torch.arange(low, top, device=query.device)
        masks = []
        for b in range(B):
            start = place.doc_start[place.row(b)].to(query.device)
            allowed = (start[keys][None, :] == start[q_ids][:, None]) & (keys[None, :] <= q_ids[:, None])
            if window:
                allowed &= keys[None, :] > q_ids[:, None] - window
            if place.key_valid is not None:
                allowed &= place.key_valid[place.row(b)].to(query.device)[keys][None, :]
            masks.append(allowed)
        mask = torch.stack(masks)  # [B, m, keys]
        parts = [key[:, :, low:top]]
        if step.entry_lo is not None:
            e_lo, e_hi = step.entry_lo[:, blk].to(query.device), step.entry_hi[:, blk].to(query.device)
            first, last = int(e_lo.min()), int(e_hi.max())
            if last > first:
                entries = torch.arange(first, last, device=query.device)
                seen = (entries[None, None, :] >= e_lo[..., None]) & (entries[None, None, :] < e_hi[..., None])
                if step.picks is not None:
                    slot = step.picks[:, blk].to(query.device) - first
                    slot = torch.where((slot < 0) | (slot >= last - first), last - first, slot)
                    chosen = torch.zeros(B, slot.shape[1], last - first + 1, dtype=torch.bool, device=query.device)
                    seen &= chosen.scatter_(-1, slot, True)[..., :-1]
                mask = torch.cat([mask, seen], dim=-1)
                parts.append(key[:, :, T + first : T + last])
        k_blk = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        args = (query[:, :, blk], k_blk, k_blk, mask[:, None], scale, sinks)
        if torch.is_grad_enabled() and len(blocks) > 1:
            from torch.utils.checkpoint import checkpoint

            outs.append(checkpoint(_masked_attention, *args, use_reentrant=False))
        else:
            outs.append(_masked_attention(*args))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------------------------
# installing the forward


class _ConfigView:
    """The module's config with ``_attn_implementation`` = :data:`V4_ATTN_NAME` (for one call)."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_attn_implementation", V4_ATTN_NAME)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _run(module: torch.nn.Module, call: dict[str, Any], place: Placement) -> Any:
    """The module's own forward on ``place``: the gathering step as its cache, no mask (the kernel builds its own)."""
    call["attention_mask"] = None
    step = CompressedStep(place, getattr(module, "sliding_window", None))
    config = module.config
    module.config = _ConfigView(config)
    module._automodel_v4_step = step
    cache_name = "cache" if "cache" in _SIGNATURES[type(module)].parameters else "past_key_values"  # < 5.25
    try:
        return type(module).forward(module, **{cache_name: step}, **call)
    finally:
        module.config = config
        del module._automodel_v4_step


def compressed_module_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The installed forward of a DeepSeek-V4 attention module (see the module docstring)."""
    call = _bound(self, args, kwargs)
    cache = call.pop("cache", None) or call.pop("past_key_values", None)
    return dispatch_installed_forward(self, args, kwargs, call, cache, _active(), _run)


_V4_FORWARD = torch._dynamo.disable(compressed_module_forward, reason="automodel: CP attention runs outside the graph")


def compressor_forward(self: torch.nn.Module, hidden_states: torch.Tensor, q_residual: torch.Tensor,
                       position_ids: torch.Tensor, cache: Any = None, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    """The installed forward of a V4 compressor: :meth:`CompressedStep.compress` when the attention handed it a
    :class:`CompressedStep`, else the class's forward."""
    if isinstance(cache, CompressedStep):
        return cache.compress(self, hidden_states, q_residual, position_ids)
    return type(self).forward(self, hidden_states, q_residual, position_ids, cache, *args, **kwargs)


def _check(module: torch.nn.Module) -> None:
    """Refuse a module whose parts are not the ones the kernel computes with (a transformers release that changed
    them)."""
    needed = ["q_a_proj", "kv_proj", "kv_norm", "sinks", "o_a_proj", "compressor"]
    compressor = getattr(module, "compressor", None)
    if compressor is not None:
        needed += [f"compressor.{a}" for a in ("kv_proj", "gate_proj", "position_bias", "kv_norm", "rotary_emb",
                                                "compress_rate", "head_dim", "rope_layer_type")]  # fmt: skip
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            needed += [f"compressor.indexer.{a}" for a in ("kv_proj", "gate_proj", "position_bias", "kv_norm",
                                                           "q_b_proj", "scorer", "index_topk", "head_dim")]  # fmt: skip
    missing = []
    for path in needed:
        obj = module
        for part in path.split("."):
            if not hasattr(obj, part):
                missing.append(path)
                break
            obj = getattr(obj, part)
    if missing or not hasattr(_modeling(module), "apply_rotary_pos_emb"):
        import transformers

        raise CPUnsupportedError(
            f"{type(module).__name__} (transformers {transformers.__version__}) does not have the parts the CP "
            f"compressed-attention kernel computes with (missing {', '.join(missing) or 'apply_rotary_pos_emb'}); "
            "open an issue with the class name and your transformers version"
        )




def install_compressed_attention(model: torch.nn.Module, profile: Any) -> int:
    """Give every DeepSeek-V4 attention module of ``profile``'s ``sparse_attention`` layers (and its compressor) the CP
    forward (mutates ``model``; idempotent). Returns how many attention modules carry it.

    Raises:
        CPUnsupportedError: a module without the parts the kernel computes with.
    """
    from automodel.distributed.cp.profile import SPARSE

    sparse = {layer.index: layer.mixer for layer in profile.layers if layer.kind == SPARSE}
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name not in COMPRESSED_ATTENTION or sparse.get(getattr(module, "layer_idx", None)) != name:
            continue
        _check(module)
        compressor = module.compressor
        if compressor is not None and not getattr(compressor, _MARK, False):
            compressor.forward = types.MethodType(compressor_forward, compressor)
            setattr(compressor, _MARK, True)
        if not getattr(module, _MARK, False):
            module.forward = types.MethodType(_V4_FORWARD, module)
            setattr(module, _MARK, True)
        count += 1
    if count:
        register_attention_functions({V4_ATTN_NAME: compressed_attention})
    return count


def installed_compressed_on(model: torch.nn.Module) -> int:
    """How many attention modules of ``model`` carry the CP compressed-attention forward."""
    return sum(1 for module in model.modules() if type(module).__name__ in COMPRESSED_ATTENTION
               and module.__dict__.get(_MARK, False))  # fmt: skip


def uninstall_compressed_attention(model: torch.nn.Module) -> None:
    """Give every module :func:`install_compressed_attention` changed its class's forward back (mutates ``model``)."""
    for module in model.modules():
        if module.__dict__.get(_MARK, False):
            del module.forward
            delattr(module, _MARK)
