"""Exact attention of a rank's queries over its own and its halo's keys (:mod:`~automodel.distributed.cp.exchange.halo`).

One softmax per query over every key it may see (the local keys and the halo, selected per query block),
so a per-head sink logit joins each query's softmax exactly once and no partial results are merged.
On CPU, blocks without sinks or softcapping and with equal head sizes run torch's blocked flash kernel
with the block's mask; the others (and every block off CPU) run exact math with scores in fp32.
The query blocks are recomputed in the backward (activation checkpointing), so the memory held per
layer is the inputs plus, transiently, one block's ``[B, H, block, block + W]`` scores: O(W) per query,
not O(S). Math scores are computed in fp32 (fp64 for fp64 inputs). Tests make every block run the math
(what off-CPU blocks run) with :func:`force_math` or ``halo_attention(..., force_math=True)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

from automodel.distributed.cp.exchange.halo import halo_exchange
from automodel.distributed.cp.layout import TokenLayout

__all__ = ["DEFAULT_BLOCK", "force_math", "halo_attention"]

#: queries per block: bounds the transient score matrix at ``block x (block + W)`` per head
DEFAULT_BLOCK = 256
_FORCE_MATH: list[bool] = []  # the open force_math() blocks


@contextlib.contextmanager
def force_math() -> Iterator[None]:
    """Inside the block, every halo attention block runs the exact math, also where the CPU flash kernel
    would run (a test's switch: the math is what blocks with sinks, softcapping or other head sizes, and
    every block off CPU, run). Re-entrant; affects the forward and its recomputation in the backward."""
    _FORCE_MATH.append(True)
    try:
        yield
    finally:
        _FORCE_MATH.pop()


def _flash_block(q, kbuf, vbuf, key_index, allowed, scale: float):
    """torch's blocked CPU flash kernel with the block's mask (no sinks / softcap; equal head sizes)."""
    g = q.shape[1] // kbuf.shape[1]
    k = kbuf.index_select(2, key_index)
    v = vbuf.index_select(2, key_index)
    if g > 1:
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k, v, 0.0, False, attn_mask=mask, scale=scale
    )[0]


def _block(q, kbuf, vbuf, sinks, key_index, allowed, scale: float, softcap: float | None, flash: bool):
    """``[B, Hq, nq, Dv]`` attention of one query block; ``kbuf``/``vbuf`` ``[B, Hkv, n + h, D]``.

    The query heads of a KV head are stacked along the rows (``[B*Hkv, g*nq, D]``), so both products are
    plain batched matmuls with no copy of K/V per query head.
    """
    b, hq, nq, d = q.shape
    hkv = kbuf.shape[1]
    g = hq // hkv
    if flash:
        return _flash_block(q, kbuf, vbuf, key_index, allowed, scale)
    dtype = torch.promote_types(q.dtype, torch.float32)
    k = kbuf.index_select(2, key_index).to(dtype).reshape(b * hkv, -1, d)
    v = vbuf.index_select(2, key_index).to(dtype)
    dv = v.shape[-1]
    v = v.reshape(b * hkv, -1, dv)
    s = torch.bmm(q.to(dtype).reshape(b * hkv, g * nq, d), k.transpose(1, 2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.view(b * hkv, g, nq, -1).masked_fill(~allowed, float("-inf"))
    logits = s
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, hkv, g, 1, 1).expand(b, hkv, g, nq, 1).reshape(b * hkv, g, nq, 1)
        logits = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    out = torch.bmm(torch.exp(s - lse).view(b * hkv, g * nq, -1), v)
    return out.view(b, hq, nq, dv).to(q.dtype)


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
    force_math: bool = False,
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
        force_math: run the exact math blocks also where the CPU flash kernel would run (as inside
            :func:`force_math`).

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
    plan = layout.halo_plan(window, chunk, block)
    rows = torch.cat([key.permute(2, 0, 1, 3).reshape(n, -1), value.permute(2, 0, 1, 3).reshape(n, -1)], dim=1)
    halo = halo_exchange(rows, plan)
    h = halo.shape[0]
    k_halo = halo[:, : b * hkv * d].reshape(h, b, hkv, d).permute(1, 2, 0, 3)
    v_halo = halo[:, b * hkv * d :].reshape(h, b, hkv, dv).permute(1, 2, 0, 3)
    kbuf = torch.cat([key, k_halo], dim=2)
    vbuf = torch.cat([value, v_halo], dim=2)
    scale = scale if scale is not None else d**-0.5
    _, blocks = plan.on(query.device)
    # decided here, not in the block: the backward recomputes each block the same way
    math_only = force_math or bool(_FORCE_MATH)
    flash = query.device.type == "cpu" and sinks is None and not softcap and dv == d and not math_only
    outs = [
        checkpoint(
            _block, query[:, :, q0:q1], kbuf, vbuf, sinks, key_index, allowed, scale, softcap, flash,
            use_reentrant=False,
        )
        for q0, q1, key_index, allowed in blocks
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
