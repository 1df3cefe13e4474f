"""Exact attention of a rank's queries over its own and its halo's keys (:mod:`~automodel.distributed.cp.exchange.halo`).

One softmax per query over every key it may see (the local keys and the halo, selected per query block),
so a per-head sink logit joins each query's softmax exactly once and no partial results are merged.
Each query block is one :func:`~automodel.distributed.cp.blocks.block_forward` with the block's mask: on
CPU, blocks without sinks or softcapping and with equal head sizes run torch's blocked flash kernel, the
others exact math with scores in fp32 (fp64 for fp64 inputs); on CUDA every block runs a fused kernel
(SDPA memory-efficient with the mask as a bias; FlexAttention for sinks and soft-capping: docs/gpu.md). The query
blocks are recomputed in the backward (activation checkpointing), so the memory held per layer is the
inputs plus, transiently, one block's ``[B, H, block, block + W]`` scores: O(W) per query, not O(S).
Tests choose the math blocks with ``halo_attention(..., backend="math")`` or
:func:`~automodel.distributed.cp.blocks.force_backend`.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from automodel.distributed.cp.blocks import block_forward, resolve_backend
from automodel.distributed.cp.exchange.halo import halo_exchange
from automodel.distributed.cp.layout import TokenLayout

__all__ = ["DEFAULT_BLOCK", "halo_attention"]

#: queries per block: bounds the transient score matrix at ``block x (block + W)`` per head
DEFAULT_BLOCK = 256


def _block(q, kbuf, vbuf, sinks, key_index, allowed, scale: float, softcap: float | None, backend: str):
    """``[B, Hq, nq, Dv]`` attention of one query block; ``kbuf``/``vbuf`` ``[B, Hkv, n + h, D]``: the keys
    ``key_index`` of the buffers, ``allowed`` ``[nq, m]`` of them per query."""
    k = kbuf.index_select(2, key_index)
    v = vbuf.index_select(2, key_index)
    return block_forward(q, k, v, scale=scale, allowed=allowed, sinks=sinks, softcap=softcap, backend=backend)[0]


def _bias_block(q, kbuf, vbuf, bbuf, key_index, allowed, scale: float):
    """:func:`_block` with a per-key score bias ``bbuf`` ``[B, Hq, n + h]`` (ALiBi's ``slope_h * position``), in
    exact math: scores plus the bias, masked keys at the lowest value, softmax in fp32 (fp64 for fp64 inputs). Not
    SDPA: inside torch's ring context (ring CP) an SDPA call would be taken for the ring's own."""
    k = kbuf.index_select(2, key_index)
    v = vbuf.index_select(2, key_index)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q, k.transpose(-1, -2)).to(acc) * scale + bbuf.index_select(2, key_index)[:, :, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, torch.finfo(acc).min), dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def halo_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: TokenLayout,
    *,
    window: int | None = None,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    block: int = DEFAULT_BLOCK,
    backend: str | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's tokens within their documents, windows / chunks applied.

    Args:
        query: ``[B, Hq, n, Dqk]``; key: ``[B, Hkv, n, Dqk]``; value: ``[B, Hkv, n, Dv]`` (``Dv`` may differ:
            MLA), this rank's tokens in ``layout`` order (every row of the batch has the same layout).
        layout: which global tokens each rank holds (:mod:`automodel.distributed.cp.layout`).
        window: sliding window in tokens (a query sees itself and the ``window - 1`` tokens before it).
        chunk: attention chunk in tokens (a query sees the earlier tokens of its chunk), counted from the
            document's start.
        sinks: ``[Hq]`` per-head sink logits (gpt-oss), joined to every query's softmax once.
        softcap: logits are soft-capped as ``softcap * tanh(s / softcap)`` before masking (Gemma 2).
        scale: softmax scale (``None``: ``Dqk ** -0.5``).
        block: queries per block (memory: see the module docstring).
        backend: the block backend (:func:`~automodel.distributed.cp.blocks.resolve_backend`; ``"math"``:
            the exact math blocks also where the CPU flash kernel would run).
        key_bias: ``[B, Hq, n]`` a bias added to every score of each local key (ALiBi's ``slope_h * position``,
            :mod:`~automodel.distributed.cp.layers.alibi`): it travels with K and V to the ranks whose halo holds
            the key, and each block adds it in exact math (scores ``[B, Hq, block, m]``; not with sinks or softcap).

    Returns:
        ``[B, n, Hq, Dv]`` contiguous (transformers' attention-function layout), differentiable w.r.t. query, key,
        value and sinks; the halo's dK/dV return to the ranks that hold those tokens.
    """
    b, hq, n, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    if n != layout.ids.numel():
        raise ValueError(
            f"halo attention got {n} local tokens, but the CP layout gives this rank {layout.ids.numel()}; feed "
            "the model the batch the CP method's batch function returned"
        )
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if key_bias is not None and (sinks is not None or softcap):
        raise ValueError("halo attention takes a key bias without sinks or softcapping")
    plan = layout.halo_plan(window, chunk, block)
    parts = [key.permute(2, 0, 1, 3).reshape(n, -1), value.permute(2, 0, 1, 3).reshape(n, -1)]
    if key_bias is not None:
        parts.append(key_bias.to(key.dtype).permute(2, 0, 1).reshape(n, -1))
    rows = torch.cat(parts, dim=1)
    halo = halo_exchange(rows, plan)
    h = halo.shape[0]
    k_halo = halo[:, : b * hkv * d].reshape(h, b, hkv, d).permute(1, 2, 0, 3)
    v_halo = halo[:, b * hkv * d : b * hkv * (d + dv)].reshape(h, b, hkv, dv).permute(1, 2, 0, 3)
    kbuf = torch.cat([key, k_halo], dim=2)
    vbuf = torch.cat([value, v_halo], dim=2)
    scale = scale if scale is not None else d**-0.5
    _, blocks = plan.on(query.device)
    # decided here, not in the block: the backward recomputes each block the same way
    backend = resolve_backend(query.device, backend, sinks=sinks is not None, softcap=softcap, equal_heads=dv == d)
    if key_bias is not None:
        b_halo = halo[:, b * hkv * (d + dv) :].reshape(h, b, hq).permute(1, 2, 0)
        bbuf = torch.cat([key_bias.to(key.dtype), b_halo], dim=2)
        outs = [
            checkpoint(_bias_block, query[:, :, q0:q1], kbuf, vbuf, bbuf, key_index, allowed, scale,
                       use_reentrant=False)  # fmt: skip
            for q0, q1, key_index, allowed in blocks
        ]
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
    outs = [
        checkpoint(
            _block, query[:, :, q0:q1], kbuf, vbuf, sinks, key_index, allowed, scale, softcap, backend,
            use_reentrant=False,
        )
        for q0, q1, key_index, allowed in blocks
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
