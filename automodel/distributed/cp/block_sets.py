"""Sets of attention blocks of one kind, each set in ONE packed-row kernel call where the device has one.

thd's gathered-K/V kernel and thd_docs' document blocks cut a rank's queries into blocks of two kinds: the
**diagonal** blocks (a query chunk against its own keys, causal, square) and the **prefix** blocks (a query chunk
against the keys of its document before it, no mask). One :class:`BlockSet` per kind names the blocks as index runs
into a query stream and a key stream (token-major ``[T, H, D]``); :func:`sets_forward` computes both sets and merges
each query's two parts with their log-sum-exp (:func:`~automodel.distributed.cp.blocks.merge`), and
:func:`sets_backward` hands each set the MERGED output and LSE (exact, as every block kernel's backward).

A set runs as one packed-row call (:func:`~automodel.distributed.cp.blocks.packed_forward`: cuDNN's
``aten._cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k`` on CUDA, under the conditions of Ulysses' whole
documents, :func:`~automodel.distributed.cp.block_backend.packed_choice`) or, where that call does not apply, as one
:func:`~automodel.distributed.cp.blocks.block_forward` per block (the reason logged once per layer kind). When
neither set takes the packed call, :func:`sets_forward` / :func:`sets_backward` return ``None`` and the caller keeps
its own per-block loop (every CPU run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from automodel.distributed.cp.blocks import (
    block_backward,
    block_forward,
    merge,
    packed_applies,
    packed_backward,
    packed_forward,
)

__all__ = ["BlockSet", "packed_call_bytes", "sets_backward", "sets_forward"]


@dataclass(frozen=True)
class BlockSet:
    """Blocks of one kind. Block ``i``'s queries are the query-stream tokens ``q_index[cu_q[i]:cu_q[i+1]]``, its keys
    the key-stream tokens ``k_index[cu_k[i]:cu_k[i+1]]``; ``causal`` blocks are square (``cu_q == cu_k``, the
    diagonal), the others see all their keys. ``q_index`` / ``k_index`` ``[n]`` int64 on the tensors' device."""

    causal: bool
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]

    @staticmethod
    def of(causal: bool, blocks: list[tuple[int, int, list[tuple[int, int]]]], device: torch.device) -> BlockSet | None:
        """From ``(q_start, q_len, [(k_start, k_len), ...])`` per block: its queries one run of the query stream, its
        keys runs of the key stream in order (``None`` for no block)."""
        blocks = [(a, n, [r for r in runs if r[1] > 0]) for a, n, runs in blocks]
        blocks = [b for b in blocks if b[1] > 0 and b[2]]
        if not blocks:
            return None
        q = torch.cat([torch.arange(a, a + n) for a, n, _ in blocks]).to(device)
        k = torch.cat([torch.arange(a, a + m) for _, _, runs in blocks for a, m in runs]).to(device)
        cu_q, cu_k = [0], [0]
        for _, n, runs in blocks:
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + sum(m for _, m in runs))
        return BlockSet(causal, q, k, tuple(cu_q), tuple(cu_k))

    def runs(self):
        """``(q_index slice, k_index slice)`` per block."""
        for i in range(len(self.cu_q) - 1):
            yield slice(self.cu_q[i], self.cu_q[i + 1]), slice(self.cu_k[i], self.cu_k[i + 1])


def _head_major(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` -> ``[1, H, n, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


def _packed_taken(sets, q, k, v, scale) -> list:
    """Each set's packed forward, or ``None`` per set the packed call does not take."""
    return [None if s is None else packed_forward(q.index_select(0, s.q_index), k.index_select(0, s.k_index),
                                                  v.index_select(0, s.k_index), list(s.cu_q), list(s.cu_k),
                                                  causal=s.causal, scale=scale)
            for s in sets]  # fmt: skip


def _set_forward(s: BlockSet, q, k, v, scale, softcap):
    """``(out [n, Hq, Dv], lse [n, Hq])`` of a set, one block call per block."""
    outs, lses = [], []
    for qs, ks in s.runs():
        qi, ki = s.q_index[qs], s.k_index[ks]
        o, lse = block_forward(_head_major(q.index_select(0, qi)), _head_major(k.index_select(0, ki)),
                               _head_major(v.index_select(0, ki)), causal=s.causal, scale=scale, softcap=softcap)
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def sets_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sets: list[BlockSet | None], scale: float | None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The merged attention of every query over its sets' blocks: ``(out [Tq, Hq, Dv], lse [Tq, Hq])`` (a query in no
    block: zero output, LSE ``-inf``), or ``None`` when no set takes the packed call (the caller runs its own loop).

    ``q`` ``[Tq, Hq, D]`` the query stream; ``k`` / ``v`` ``[Tk, Hkv, D]`` the key stream (token-major views are
    fine). Not differentiable (the caller's autograd function calls :func:`sets_backward`). Nothing is mutated."""
    if softcap:
        return None  # no packed call takes soft-capping
    packed = _packed_taken(sets, q, k, v, scale)
    if all(p is None for p in packed):
        return None
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for s, got in zip(sets, packed):
        if s is None:
            continue
        o, ls = got if got is not None else _set_forward(s, q, k, v, scale, softcap)
        o0, l0 = out.index_select(0, s.q_index), lse.index_select(0, s.q_index)
        # a query's parts merge by LSE (a first part: exp(-inf - lse) = 0 keeps the zero start out)
        om, lm = merge(o0.transpose(0, 1), l0.transpose(0, 1), o.transpose(0, 1).to(out.dtype),
                       ls.to(lse.dtype).transpose(0, 1))
        out.index_copy_(0, s.q_index, om.transpose(0, 1))
        lse.index_copy_(0, s.q_index, lm.transpose(0, 1))
    return out, lse


def sets_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    sets: list[BlockSet | None], scale: float | None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv])`` of :func:`sets_forward`'s attention given the MERGED
    ``out`` ``[Tq, Hq, Dv]`` and ``lse`` ``[Tq, Hq]``, or ``None`` when no set takes the packed call (the same rule as
    the forward). Each set's packed backward, or one block backward per block where it does not apply."""
    if softcap or not any(s is not None and packed_applies(q, k, v, list(s.cu_q), causal=s.causal) for s in sets):
        return None
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s in sets:
        if s is None:
            continue
        qi, ki = s.q_index, s.k_index
        rows = [x.index_select(0, qi) for x in (dout, q, out, lse)]
        got = packed_backward(rows[0], rows[1], k.index_select(0, ki), v.index_select(0, ki), rows[2], rows[3],
                              list(s.cu_q), list(s.cu_k), causal=s.causal, scale=scale)  # fmt: skip
        if got is not None:
            dq.index_add_(0, qi, got[0].to(dq.dtype))
            dk.index_add_(0, ki, got[1].to(dk.dtype))
            dv.index_add_(0, ki, got[2].to(dv.dtype))
            continue
        for qs, ks in s.runs():
            a, b = qi[qs], ki[ks]
            g = block_backward(*(_head_major(x.index_select(0, a)) for x in (dout, q)),
                               *(_head_major(x.index_select(0, b)) for x in (k, v)),
                               _head_major(out.index_select(0, a)), lse.index_select(0, a).transpose(0, 1).unsqueeze(0),
                               causal=s.causal, scale=scale, softcap=softcap)  # fmt: skip
            dq.index_add_(0, a, g[0][0].transpose(0, 1).to(dq.dtype))
            dk.index_add_(0, b, g[1][0].transpose(0, 1).to(dk.dtype))
            dv.index_add_(0, b, g[2][0].transpose(0, 1).to(dv.dtype))
    return dq, dk, dv


def packed_call_bytes(kv_width: float, q_width: float, key_tokens: float, query_tokens: float, dtype_bytes: int,
                      kernel: str, enabled: bool = True) -> float:  # fmt: skip
    """What the packed-row calls of one attention call hold beyond the per-block path, at its backward (an upper
    bound, for the memory plan; 0 unless ``kernel`` is cuDNN, the one kernel with a packed-row call): the key
    stream's K/V copies for the calls and the calls' dK/dV (``4 x kv_width`` per key token), the diagonal set's
    (``4 x kv_width`` per query token), and, for the set in flight, its copies of q, the output and its gradient,
    the call's dQ, and the dQ both sets add into (``5 x q_width`` per query token; :func:`sets_backward`). ``kv_width`` / ``q_width``: K/V and query heads times head size on
    the rank; ``key_tokens``: the prefix keys the calls see (at most the row; thd_docs adds its key stream). Like the
    plan's cuDNN version, the torch release is the one the plan runs under: 0 where its ``varlen_attn`` runs no
    packed-row cuDNN call for these heads (``aten_schemas.cudnn_varlen_problem``: before 2.14; GQA before 2.15), and
    where ``enabled`` is false (``model.cudnn_packed_blocks=false``: one call per block)."""
    from automodel.distributed.cp import aten_schemas
    from automodel.distributed.cp.block_backend import CUDNN

    release = aten_schemas.torch_release(torch.__version__)
    grouped = kv_width < q_width
    if not enabled or kernel != CUDNN or aten_schemas.cudnn_varlen_problem(release, aten_schemas.CUDNN_VARLEN_SHORT_MIN_CUDNN,
                                                            causal=False, max_q=None, grouped=grouped):  # fmt: skip
        return 0.0
    return (4 * kv_width * key_tokens + (4 * kv_width + 5 * q_width) * query_tokens) * dtype_bytes
