"""Attention over packed / padded rows one document block at a time: no ``[S, S]`` mask.

A row of ``S`` tokens that holds several documents (packing) and/or padding needs a mask that
keeps every query inside its own document and away from pads. Built densely that is a
``[B, 1, S, S]`` tensor (16 MiB at 4K, 16 GiB at 128K): a term that grows as ``S**2`` and that
context parallelism cannot divide (Ulysses' inner kernel sees the whole sequence). The same
attention, computed as one kernel call per document block, needs no mask at all for ``sdpa`` (the
kernel's own ``is_causal`` inside the block) and a block-sized one for ``eager``:

* the row is cut into **segments**: maximal runs of one document id; inside each segment the real
  tokens (``padding_mask`` True) must come first and the pad slots last (the layout of a packed
  row: each document, then its pad slots, then the row's trailing pad);
* the real tokens ``[start, real_end)`` of a segment attend to each other (causally, or fully for a
  bidirectional layer) exactly as under the dense mask;
* the pad queries of a segment attend to all of its real tokens (which precede them), as under the
  dense mask; a segment of pads only gets a zero output (the dense mask leaves such rows fully
  masked). Nothing real ever attends to a pad and no loss is taken there, so every real token's
  output, the loss and every gradient are exactly the dense computation's either way.

Memory: ``O(S)`` for ``sdpa`` (the blocks of :mod:`automodel.distributed.cp.blocks`: the CPU flash kernel
with ``causal``), ``O(L_doc**2)`` for ``eager`` (the model's own eager function, which materialises its
scores anyway). Cost: one kernel call per document.
:func:`document_segments` returns ``None`` for a layout this cannot express (a pad between two real
tokens of one document, left padding): the caller then keeps the dense mask, which is exact too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from automodel.distributed.cp.blocks import block_forward, documents_forward, resolve_backend

__all__ = ["Segment", "document_segments", "document_block_attention"]

Segment = tuple[int, int, int]  # (start, real_end, end): real tokens [start, real_end), pads [real_end, end)


def document_segments(
    document_ids: torch.Tensor | None, padding_mask: torch.Tensor | None, batch_size: int, seq_len: int
) -> list[list[Segment]] | None:
    """Cut each row into document segments, real tokens first (see the module docstring).

    Args:
        document_ids: ``[B, S]`` int64 document index per token, or ``None`` (one document per row).
        padding_mask: ``[B, S]`` bool, True = real token, or ``None`` (no padding).
        batch_size, seq_len: ``B`` and ``S``.

    Returns:
        Per row, its segments ``(start, real_end, end)`` in order, covering ``[0, S)``; ``None`` when some
        segment has a pad before one of its real tokens (then only a dense mask expresses the layout).
    """
    rows: list[list[Segment]] = []
    for b in range(batch_size):
        if document_ids is None:
            bounds = [0, seq_len]
        else:
            d = document_ids[b]
            change = (d[1:] != d[:-1]).nonzero().flatten() + 1
            bounds = [0, *change.tolist(), seq_len]
        real = None if padding_mask is None else padding_mask[b].to(torch.bool)
        segments: list[Segment] = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if real is None:
                segments.append((start, end, end))
                continue
            n_real = int(real[start:end].sum())
            if not bool(real[start : start + n_real].all()):
                return None  # a pad before a real token of the same document
            segments.append((start, start + n_real, end))
        rows.append(segments)
    return rows


def _causal_additive_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill(blocked, torch.finfo(dtype).min)[None, None]


def document_block_attention(
    attention_fn: Callable[..., tuple[torch.Tensor, Any]] | None,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[list[Segment]],
    *,
    is_causal: bool,
    needs_mask: bool,
    **kwargs: Any,
) -> torch.Tensor:
    """Run ``attention_fn`` once per document block and assemble the rows.

    Args:
        attention_fn: a transformers attention function (``sdpa_attention_forward``, a model's
            ``eager_attention_forward``): ``fn(module, q, k, v, mask, **kwargs) -> ([b, L, h, D], _)``; or
            ``None``: each block is :func:`~automodel.distributed.cp.blocks.block_forward` (what ``sdpa``
            computes: ``is_causal`` inside the block, GQA, the ``scaling`` keyword; no dropout).
        module: passed through (``num_key_value_groups``, ``scaling``, ...).
        query: ``[B, Hq, S, D]``; key/value: ``[B, Hkv, S, D]`` (GQA handled by ``attention_fn``).
        segments: from :func:`document_segments`.
        is_causal: causal attention inside each document (False: bidirectional).
        needs_mask: the kernel takes no ``is_causal`` (eager): give it a block-sized additive mask.
        kwargs: forwarded (``dropout``, ``scaling``, ...).

    Returns:
        ``[B, S, Hq, D]`` (sequence-major, like transformers' attention functions).
        Differentiable w.r.t. query, key and value. Nothing is mutated.
    """
    bsz, n_heads, seq_len, head_dim = query.shape
    if attention_fn is None:
        fused = _one_call(query, key, value, segments, is_causal, kwargs.get("scaling"))
        if fused is not None:
            return fused

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        if attention_fn is None:
            return block_forward(q, k, v, causal=causal, scale=kwargs.get("scaling"))[0].transpose(1, 2)
        mask = None
        if needs_mask and causal:
            mask = _causal_additive_mask(q.shape[2], query.dtype, query.device)
        return attention_fn(module, q, k, v, mask, is_causal=causal, **kwargs)[0]

    rows = []
    for b in range(bsz):
        pieces = []
        for start, real_end, end in segments[b]:
            if real_end > start:
                sl = slice(start, real_end)
                pieces.append(block(query[b : b + 1, :, sl], key[b : b + 1, :, sl], value[b : b + 1, :, sl], is_causal))
            if end > real_end and real_end > start:
                # pad queries see every real key of their document, as under the dense mask (they sit after
                # them); no real token reads these outputs, so this only keeps pad hidden states identical
                real = slice(start, real_end)
                pad = slice(real_end, end)
                pieces.append(block(query[b : b + 1, :, pad], key[b : b + 1, :, real], value[b : b + 1, :, real], False))
            elif end > real_end:  # a segment of pads only: nothing to attend to
                pieces.append(query.new_zeros(1, end - real_end, n_heads, head_dim))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


def _one_call(query, key, value, segments, is_causal: bool, scale: float | None) -> torch.Tensor | None:
    """All real-token document blocks of all rows in ONE :func:`~automodel.distributed.cp.blocks.documents_forward`
    call (CUDA: ``varlen_attn``), the pad queries as blocks; ``None`` where the device has no such call (CPU)."""
    if resolve_backend(query.device) != "cuda":
        return None  # no one-call kernel in the CPU slot: nothing to build
    bsz, n_heads, seq_len, head_dim = query.shape
    real, lengths, pads = [], [], []
    for b in range(bsz):
        for start, real_end, end in segments[b]:
            if real_end > start:
                real.append(torch.arange(b * seq_len + start, b * seq_len + real_end))
                lengths.append(real_end - start)
            if end > real_end:
                pads.append((b, start, real_end, end))
    if not lengths:
        return None
    tok = [x.transpose(1, 2).reshape(bsz * seq_len, x.shape[1], x.shape[-1]) for x in (query, key, value)]
    idx = torch.cat(real).to(query.device)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=query.device)
    got = documents_forward(tok[0][idx], tok[1][idx], tok[2][idx], cu, max(lengths), causal=is_causal, scale=scale)
    if got is None:
        return None
    out = got.new_zeros(bsz * seq_len, n_heads, got.shape[-1]).index_copy(0, idx, got)
    for b, start, real_end, end in pads:
        if real_end == start:
            continue  # a segment of pads only: zeros, as below
        sl, pad = slice(start, real_end), slice(real_end, end)
        o = block_forward(query[b : b + 1, :, pad], key[b : b + 1, :, sl], value[b : b + 1, :, sl], scale=scale)[0]
        rows = torch.arange(b * seq_len + real_end, b * seq_len + end, device=query.device)
        out = out.index_copy(0, rows, o[0].transpose(0, 1).to(out.dtype))
    return out.view(bsz, seq_len, n_heads, -1)
