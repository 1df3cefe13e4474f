"""Block attention: a query block against a key block, and THE one log-sum-exp merge.

Every CP attention kernel cuts its work into blocks (a query block against the keys it may see: a
document prefix, a diagonal block, a halo) and runs each block here. A block's forward returns its
output and its log-sum-exp (LSE); blocks of the same queries are combined with :func:`merge`, which
is exact (as in ring attention). The backward of a block takes the MERGED output and LSE of its
queries, so its probabilities ``exp(s - lse)`` are the final ones and the gradients of the blocks add
up to the gradient of the whole softmax.

Features (each optional): causal (lower-right aligned: the last query sees the last key), a softmax
scale, GQA (the query heads of a KV head are grouped, K/V are never repeated per query head on the
math path), an ``allowed`` boolean mask, per-head sink logits (an extra LSE column with a zero
value), logit soft-capping (``softcap * tanh(s / softcap)``), and a value head size that differs
from the query/key one (MLA).

Backends, one slot per device (:data:`BACKENDS`):

- ``"flash"``: torch's blocked CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``
  and its backward, which return / take the LSE). CPU only; blocks with sinks, soft-capping, unequal
  value heads or a rectangular causal block run ``"math"``.
- ``"math"``: exact math with fp32 scores (fp64 for fp64 inputs). Runs everywhere.
- ``"cuda"``: torch's fused CUDA kernels (:mod:`automodel.distributed.cp.cuda_blocks`, registered here):
  SDPA flash / memory-efficient with their LSE and backward ops, FlexAttention for soft-capping and sinks;
  the kernel per block is the pure function :func:`~automodel.distributed.cp.block_backend.select_backend`.
  Blocks no fused kernel takes (fp64, an install without the ops) run ``"math"`` after one logged warning
  per layer kind. :func:`register_backend` replaces the slot's functions.

The default is the device's slot; :func:`force_backend` (a context manager, for tests) or the
``backend=`` argument choose one. Resolve the backend once with :func:`resolve_backend` where a
forward is recomputed later (activation checkpointing), so the recomputation runs the same kernel.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from automodel.distributed.cp.cuda_blocks import (
    cuda_block_backward,
    cuda_block_forward,
    packed_takes,
    varlen_documents,
)
from automodel.distributed.cp.cuda_blocks import packed_backward as _cuda_packed_backward
from automodel.distributed.cp.cuda_blocks import packed_forward as _cuda_packed_forward

__all__ = [
    "BACKENDS",
    "BlockScheme",
    "blocked_attention",
    "block_backward",
    "block_forward",
    "documents_forward",
    "packed_backward",
    "packed_forward",
    "force_backend",
    "merge",
    "merge_sinks",
    "register_backend",
    "resolve_backend",
]

#: The backend slots: the CPU flash kernel, exact math, and the CUDA slot (torch's fused kernels).
BACKENDS = ("flash", "math", "cuda")
_DEVICE_SLOT = {"cpu": "flash", "cuda": "cuda"}
# a plain list (not a ContextVar): autograd may run the backward on another thread
_FORCED: list[str] = []
# name -> (forward, backward) of a registered backend (the "cuda" slot: cuda_blocks, registered below)
_REGISTERED: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
_logger = logging.getLogger("automodel.distributed.cp.blocks")
_LOGGED: set[tuple[str, str]] = set()


def _log_cpu_kernel(name: str, device: torch.device, what: str) -> None:
    """One INFO line per device type and backend: which kernel the blocks off CUDA run (the run log names it)."""
    key = (torch.device(device).type, name)
    if key not in _LOGGED:
        _LOGGED.add(key)
        _logger.info("attention blocks on %s run %s", key[0], what)


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"block attention backend {name!r} is not one of {BACKENDS}")


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Run every block inside the block with backend ``name`` where it applies (tests: ``"math"``, the
    exact blocks non-CPU devices run). Nests; mutates a module-level stack seen by every thread."""
    _check_name(name)
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def register_backend(name: str, forward: Callable[..., Any], backward: Callable[..., Any]) -> None:
    """Fill the slot ``name`` (``"cuda"``) with ``forward(q, k, v, causal, scale, allowed, sinks, softcap, kernel)
    -> (out, lse)`` and ``backward(dout, q, k, v, out, lse, causal, scale, allowed, softcap, kernel) -> (dq, dk,
    dv)``: the arguments of :func:`block_forward` / :func:`block_backward`, in order, positionally. Either may
    return ``None`` for a block it does not take; the block then runs ``"math"``."""
    _check_name(name)
    if name != "cuda":
        raise ValueError(f"only the 'cuda' slot can be filled; {name!r} is built in")
    _REGISTERED[name] = (forward, backward)


def resolve_backend(
    device: torch.device,
    backend: str | None = None,
    *,
    sinks: bool = False,
    softcap: float | None = None,
    equal_heads: bool = True,
    square_causal: bool = True,
) -> str:
    """The backend a block on ``device`` runs: ``backend`` if given, else the innermost
    :func:`force_backend`, else the device's slot; a backend that cannot take the block (the flash kernel
    off CPU or with sinks / soft-capping / unequal value heads / a rectangular causal block; an empty
    CUDA slot, or one off CUDA) becomes ``"math"``. On CUDA the slot may still run exact math for a block no
    fused kernel takes (:func:`~automodel.distributed.cp.block_backend.select_backend`), with a warning."""
    name = backend or (_FORCED[-1] if _FORCED else _DEVICE_SLOT.get(torch.device(device).type, "math"))
    _check_name(name)
    if name == "flash":
        ok = torch.device(device).type == "cpu" and not sinks and not softcap and equal_heads and square_causal
        return "flash" if ok else "math"
    if name == "cuda":
        return "cuda" if "cuda" in _REGISTERED and torch.device(device).type == "cuda" else "math"
    return name


# ---------------------------------------------------------------------------------------------------------
# exact math


def _scale(scale: float | None, head_dim: int) -> float:
    return scale if scale is not None else head_dim**-0.5


def _visible(allowed: torch.Tensor | None, causal: bool, n: int, m: int, device: torch.device) -> torch.Tensor | None:
    """``[..., n, m]`` bool of the keys each query sees, broadcastable to ``[B, Hkv, g, n, m]`` (``None``: all)."""
    mask = None
    if causal:
        mask = torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)
    if allowed is not None:
        a = allowed.unsqueeze(2) if allowed.dim() == 4 else allowed  # [B, 1|Hq?, n, m] -> [B, 1, 1, n, m]
        mask = a if mask is None else mask & a
    return mask


def _math_scores(q, k, causal: bool, scale: float | None, allowed, softcap):
    """``(s, capped, qg)``: ``[B, Hkv, g, n, m]`` scores (fp32+) after soft-capping and masking, the tanh
    of the capped scores (``None`` without soft-capping) and the grouped queries ``[B, Hkv, g*n, D]``."""
    b, hq, n, d = q.shape
    hkv, m = k.shape[1], k.shape[2]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, hkv, (hq // hkv) * n, d).to(dtype)
    s = torch.matmul(qg, k.to(dtype).transpose(-1, -2)) * _scale(scale, d)
    s = s.view(b, hkv, hq // hkv, n, m)
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    visible = _visible(allowed, causal, n, m, q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return s, t, qg


def _sink_column(sinks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[Hq]`` sink logits as ``[B, Hkv, g, n, 1]`` matching the scores ``like``."""
    b, hkv, g, n, _ = like.shape
    return sinks.to(like.dtype).reshape(1, hkv, g, 1, 1).expand(b, hkv, g, n, 1)


def _math_forward(q, k, v, causal, scale, allowed, sinks, softcap):
    b, hq, n, _ = q.shape
    s, _, _ = _math_scores(q, k, causal, scale, allowed, softcap)
    logits = s if sinks is None else torch.cat([s, _sink_column(sinks, s)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    hkv, m, dv = v.shape[1], v.shape[2], v.shape[3]
    p = torch.exp(s - lse.unsqueeze(-1)).reshape(b, hkv, -1, m)
    out = torch.matmul(p, v.to(s.dtype))
    return out.reshape(b, hq, n, dv).to(q.dtype), lse.reshape(b, hq, n)


def _math_backward(dout, q, k, v, out, lse, causal, scale, allowed, softcap):
    b, hq, n, d = q.shape
    hkv, m, dv = k.shape[1], k.shape[2], v.shape[3]
    s, t, qg = _math_scores(q, k, causal, scale, allowed, softcap)
    g = hq // hkv
    p = torch.exp(s - lse.reshape(b, hkv, g, n, 1).to(s.dtype))
    do = dout.reshape(b, hkv, g * n, dv).to(s.dtype)
    pf = p.reshape(b, hkv, g * n, m)
    dvv = torch.matmul(pf.transpose(-1, -2), do)
    dp = torch.matmul(do, v.to(s.dtype).transpose(-1, -2)).view(b, hkv, g, n, m)
    delta = (do * out.reshape(b, hkv, g * n, dv).to(s.dtype)).sum(-1).view(b, hkv, g, n, 1)
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1 - t * t)
    ds = ds.reshape(b, hkv, g * n, m) * _scale(scale, d)
    dq = torch.matmul(ds, k.to(s.dtype))
    dk = torch.matmul(ds.transpose(-1, -2), qg)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype)


# ---------------------------------------------------------------------------------------------------------
# torch's CPU flash kernel


def _additive(allowed: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))


def _flash_kv(q, k, v, allowed):
    """K/V for the flash kernel: with a mask the KV heads are repeated per query head."""
    g = q.shape[1] // k.shape[1]
    if allowed is not None and g > 1:
        return k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    return k, v


def _flash_forward(q, k, v, causal, scale, allowed):
    k, v = _flash_kv(q, k, v, allowed)
    mask = None if allowed is None else _additive(allowed, q)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k, v, 0.0, causal, attn_mask=mask, scale=scale
    )[:2]
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale
    )[:3]


# ---------------------------------------------------------------------------------------------------------
# the public block functions


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    allowed: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hq, n, Dv], lse [B, Hq, n])`` of the queries ``q`` over the keys ``k`` / values ``v``.

    Args:
        q: ``[B, Hq, n, D]``; k: ``[B, Hkv, m, D]``; v: ``[B, Hkv, m, Dv]`` (``Hq % Hkv == 0``).
        causal: query ``i`` sees keys ``j <= i + m - n`` (lower-right aligned; a square diagonal block).
        scale: softmax scale (``None``: ``D ** -0.5``).
        allowed: bool mask of visible keys, ``[n, m]`` or ``[B, 1, n, m]`` (combined with ``causal``).
        sinks: ``[Hq]`` per-head sink logits: one extra softmax column with a zero value; the LSE includes it.
        softcap: scores become ``softcap * tanh(s / softcap)`` before masking.
        backend: see :func:`resolve_backend`.
        kernel: one of the CUDA slot's kernels (:data:`~automodel.distributed.cp.block_backend.KERNELS`)
            instead of its own choice; the block then runs in the CUDA slot whatever ``backend`` and the device
            (tests: ``"flex"`` on CPU). ``None``: the backend decides.

    Returns:
        ``out`` in ``q``'s dtype, ``lse`` in fp32 (fp64 for fp64 inputs). Differentiable by autograd
        (w.r.t. q, k, v and sinks); :func:`block_backward` is the explicit backward for merged blocks.
        Nothing is mutated.
    """
    n, m = q.shape[2], k.shape[2]
    name = resolve_backend(
        q.device, backend, sinks=sinks is not None, softcap=softcap, equal_heads=v.shape[-1] == q.shape[-1],
        square_causal=not causal or n == m,
    )
    if kernel is not None or name == "cuda":
        got = _REGISTERED["cuda"][0](q, k, v, causal, scale, allowed, sinks, softcap, kernel)
        if got is not None:
            return got
    elif name == "flash":
        _log_cpu_kernel(name, q.device, "torch's CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu)")
        return _flash_forward(q, k, v, causal, scale, allowed)
    if q.device.type != "cuda":
        _log_cpu_kernel("math", q.device, "exact math for blocks the CPU flash kernel does not take (sinks, "
                        "soft-capping, unequal value heads, rectangular causal blocks, forced math)")  # fmt: skip
    return _math_forward(q, k, v, causal, scale, allowed, sinks, softcap)


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    allowed: torch.Tensor | None = None,
    softcap: float | None = None,
    backend: str | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block given the MERGED ``out`` ``[B, Hq, n, Dv]`` and ``lse`` ``[B, Hq, n]`` of its
    queries (exact: the probabilities are ``exp(s - lse)`` with the final LSE, and ``rowsum(dout * out)`` uses
    the final output). Shapes and arguments as in :func:`block_forward`; sinks need no block term (their
    gradient is ``-sum(exp(sink - lse) * rowsum(dout * out))``, taken where they are merged)."""
    n, m = q.shape[2], k.shape[2]
    name = resolve_backend(
        q.device, backend, softcap=softcap, equal_heads=v.shape[-1] == q.shape[-1],
        square_causal=not causal or n == m,
    )
    if kernel is not None or name == "cuda":
        got = _REGISTERED["cuda"][1](dout, q, k, v, out, lse, causal, scale, allowed, softcap, kernel)
        if got is not None:
            return got
    elif name == "flash" and allowed is None:
        return _flash_backward(dout, q, k, v, out, lse, causal, scale)
    return _math_backward(dout, q, k, v, out, lse, causal, scale, allowed, softcap)


def documents_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor | None:
    """Every document of a packed token stream in ONE kernel call where the device's slot has one (CUDA:
    ``varlen_attn``), else ``None`` (the caller runs one :func:`block_forward` per document).

    ``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]``, ``cu_seqlens`` ``[N+1]`` document offsets; ``causal``
    inside each document (else bidirectional), ``window`` a sliding window (causal only). Returns ``[T, Hq, D]``
    differentiable w.r.t. q, k, v. Nothing is mutated."""
    if resolve_backend(q.device, backend) != "cuda":
        return None
    return varlen_documents(q, k, v, cu_seqlens, max_len, causal, window, scale)


def _packed_slot(device: torch.device, backend: str | None) -> bool:
    """Whether a packed-row call may run: no backend forced other than the CUDA slot (the CUDA slot itself says
    no off CUDA: its device caps are ``None`` there)."""
    name = backend or (_FORCED[-1] if _FORCED else None)
    return name in (None, "cuda")


def packed_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], *, causal: bool,
    scale: float | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A set of blocks of one kind in ONE packed-row call where the device's slot has one (CUDA: cuDNN's
    ``_cudnn_attention_forward``, :func:`~automodel.distributed.cp.cuda_blocks.packed_forward`), else ``None`` (the
    caller runs one :func:`block_forward` per block). q ``[Tq, Hq, D]``, k / v ``[Tk, Hkv, D]``; block ``i`` is
    ``q[cu_q[i]:cu_q[i+1]]`` against ``k[cu_k[i]:cu_k[i+1]]`` (``causal``: square). Returns ``(out [Tq, Hq, Dv],
    lse [Tq, Hq] fp32)``, not differentiable (:func:`packed_backward`). Nothing is mutated."""
    if not _packed_slot(q.device, backend):
        return None
    return _cuda_packed_forward(q, k, v, cu_q, cu_k, causal, scale)


def packed_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: list[int], cu_k: list[int], *, causal: bool, scale: float | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq, dk, dv)`` of :func:`packed_forward`'s blocks given the MERGED ``out`` ``[Tq, Hq, Dv]`` / ``lse``
    ``[Tq, Hq]`` of their queries, or ``None`` where the packed call does not apply (the same rule)."""
    if not _packed_slot(q.device, backend):
        return None
    return _cuda_packed_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


def packed_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], *, causal: bool,
                   backend: str | None = None) -> bool:  # fmt: skip
    """Whether :func:`packed_forward` / :func:`packed_backward` take these blocks (pure of the tensors' metadata)."""
    return _packed_slot(q.device, backend) and packed_takes(q, k, v, cu_q, causal)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """THE log-sum-exp merge: the attention of queries over the union of two disjoint key sets.

    ``out_*`` ``[..., n, Dv]`` and ``lse_*`` ``[..., n]`` of the same queries; returns ``(out, lse)``, the
    output as if one softmax had run over both key sets (exact). Differentiable; nothing is mutated.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1).to(out_a.dtype) + out_b * torch.exp(
        lse_b - lse
    ).unsqueeze(-1).to(out_b.dtype)
    return out, lse


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join per-head sink logits to merged blocks: the sink is one more key with a zero value.

    ``out`` ``[B, Hq, n, Dv]``, ``lse`` ``[B, Hq, n]``, ``sinks`` ``[Hq]``; returns ``(out, lse)`` with the sink
    column in the softmax (:func:`merge` with an all-zero block of LSE ``sinks``). Differentiable.
    """
    sink = sinks.to(lse.dtype).reshape(1, -1, 1).expand_as(lse)
    return merge(out, lse, torch.zeros_like(out), sink)


# ---------------------------------------------------------------------------------------------------------
# one autograd function for every blocked kernel


class BlockScheme(Protocol):
    """How a CP method cuts one attention call into blocks (its K/V exchange included).

    ``forward(q, k, v, scale) -> (out, lse)`` on this rank's q ``[1, Hq, n, D]`` and k/v ``[1, Hkv, n, D]``;
    ``backward(dout, q, k, v, out, lse, scale) -> (dq, dk, dv)`` exchanges K/V again and returns the gradients
    of this rank's tensors (the exchanged K/V's gradients already returned to their owners).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        lse: torch.Tensor, scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class _BlockedAttention(torch.autograd.Function):
    """Saves only this rank's q, k, v, the output and the LSE; the scheme exchanges K/V again in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, scheme: BlockScheme, scale):  # type: ignore[override]
        out, lse = scheme.forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scheme, ctx.scale = scheme, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.scheme.backward(dout, q, k, v, out, lse, ctx.scale), None, None)


def blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scheme: BlockScheme, scale: float | None = None
) -> torch.Tensor:
    """``scheme``'s attention of this rank's queries, differentiable w.r.t. ``q``, ``k``, ``v`` (memory: the
    local tensors, the output and the LSE; never the exchanged K/V)."""
    return _BlockedAttention.apply(q, k, v, scheme, scale)


register_backend("cuda", cuda_block_forward, cuda_block_backward)
