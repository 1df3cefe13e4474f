"""The CUDA slot of :mod:`automodel.distributed.cp.blocks`: torch's fused attention kernels with their LSE.

:func:`cuda_block_forward` / :func:`cuda_block_backward` fill the slot (``blocks.register_backend``):
they take the arguments of ``blocks.block_forward`` / ``blocks.block_backward`` in order, positionally
(those two are the typed keyword API, and a block's ``kernel=`` reaches the slot through them): a block
of queries ``[B, Hq, n, D]`` against keys ``[B, Hkv, m, D]`` and values ``[B, Hkv, m, Dv]`` returns
``(out, lse)``, and the backward takes the MERGED output and LSE of its queries. :func:`~automodel.distributed.cp.block_backend.select_backend` picks the kernel:

- SDPA flash / memory-efficient (``aten._scaled_dot_product_flash_attention`` /
  ``_scaled_dot_product_efficient_attention`` and their ``_backward`` ops, which take an output and an
  LSE, so the merged ones give the exact gradient, as in torch's ring attention). Flash takes grouped K/V
  (GQA) as they are (``aten_schemas.GROUPED_KV``); for memory-efficient they are repeated per query head and their
  gradients summed back; head sizes are zero-padded to one multiple of 8
  (MLA), which is exact; a mask or a rectangular causal block becomes an additive bias (efficient only).
- cuDNN (``aten._scaled_dot_product_cudnn_attention`` and its ``_backward``, which take the output and the
  LSE as well, as torch's own ring attention uses them): under ``auto`` before flash on the GPUs and cuDNN
  versions torch's SDPA prefers it on (``CudaCaps.cudnn_preferred``), or where ``model.attention_backend=cudnn``
  pins it (:func:`~automodel.distributed.cp.attention_kernels.pinned_kernel`); the same padding, grouped K/V as they
  are.
- cuDNN's packed-row call (``aten._cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k``):
  all documents of a packed row (:func:`varlen_documents`, Ulysses) or a set of blocks of one kind
  (:func:`packed_forward` / :func:`packed_backward`, thd and thd_docs), where the installed torch runs that call
  itself (:func:`~automodel.distributed.cp.block_backend.varlen_choice` / ``packed_choice``).
- FlexAttention (``torch.nn.attention.flex_attention``, compiled on CUDA): soft-capping as a
  ``score_mod``, masks as a block mask, native GQA, and sinks joined by an exact merge of the sink
  column with its differentiable LSE. Its explicit backward recomputes the block under autograd and
  feeds the merged weights to ``torch.autograd.grad`` (exact, see :func:`_flex_backward`).
- exact math (``None`` is returned: ``blocks`` runs its math block) where none applies, after ONE logged
  warning per layer kind and reason.

Under autograd (``block_forward`` with inputs that require grad: the halo kernel, Ulysses' document
blocks) the fused forward is an autograd function whose backward is the fused backward; its LSE carries
no gradient, and a graph that needs one raises instead of dropping it (blocks with sinks run FlexAttention,
whose LSE is differentiable). A kernel pinned by ``model.attention_backend`` runs every block or raises
(:func:`~automodel.distributed.cp.block_backend.select_backend`). This module imports no other module of the
package but the kernel table and the pin.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from automodel.distributed.cp import aten_schemas
from automodel.distributed.cp.attention_kernels import packed_blocks_enabled, pinned_kernel
from automodel.distributed.cp.block_backend import (
    CUDNN,
    CUDNN_PREFERRED_CAPABILITIES,
    CUDNN_PREFERRED_MIN_VERSION,
    EFFICIENT,
    FLASH,
    FLEX,
    MATH,
    BlockSpec,
    Choice,
    CudaCaps,
    layer_kind,
    packed_choice,
    packed_refusal,
    padded_head_dim,
    release_caps,
    select_backend,
    varlen_choice,
    varlen_refusal,
)

__all__ = [
    "cuda_block_backward",
    "cuda_block_forward",
    "cuda_caps",
    "packed_backward",
    "packed_forward",
    "packed_takes",
    "varlen_documents",
    "varlen_available",
    "varlen_has_enable_gqa",
]

logger = logging.getLogger("automodel.distributed.cp.blocks")
_WARNED: set[tuple[str, str]] = set()


# ---------------------------------------------------------------------------------------------------------
# what the device and the installed torch offer


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name) and hasattr(torch.ops.aten, name + "_backward")


@functools.cache
def flex_available(device_type: str = "cuda") -> bool:
    """FlexAttention imports (and, on CUDA, Triton is there to compile it)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    if device_type != "cuda":
        return True
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def varlen_available() -> bool:
    """``torch.nn.attention.varlen.varlen_attn`` imports (torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def varlen_has_enable_gqa() -> bool:
    """The installed ``varlen_attn`` has the ``enable_gqa`` keyword (torch >= 2.12,
    ``aten_schemas.VARLEN_ENABLE_GQA_FIRST_RELEASE``), which grouped K/V need there; 2.11's takes them without it."""
    if not varlen_available():
        return False
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


@functools.cache
def _caps_of(index: int) -> CudaCaps:
    """The device's :class:`CudaCaps`: the installed ops and the device's cuDNN, with the release's rules from
    :func:`~automodel.distributed.cp.block_backend.release_caps`, as ``caps_for`` plans them."""
    capability = tuple(torch.cuda.get_device_capability(index))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    cudnn_op = _has_op("_scaled_dot_product_cudnn_attention") and cudnn is not None
    return release_caps(
        capability, aten_schemas.torch_release(torch.__version__), cudnn,
        flash_op=_has_op("_scaled_dot_product_flash_attention"),
        efficient_op=_has_op("_scaled_dot_product_efficient_attention"), flex=flex_available("cuda"),
        varlen=varlen_available(), cudnn_op=cudnn_op, cudnn_preferred=cudnn_op and _cudnn_preferred(capability),
        cudnn_varlen_ops=all(hasattr(torch.ops.aten, op) for op in aten_schemas.VARLEN_OPS),
    )  # fmt: skip


@functools.cache
def _takes_grouped_kv(kernel: str) -> bool:
    """The installed torch's ``kernel`` op (cuDNN, flash) takes fewer K/V heads than Q heads
    (``aten_schemas.GROUPED_KV``)."""
    return aten_schemas.takes_grouped_kv(kernel, aten_schemas.torch_release(torch.__version__))


def _cudnn_preferred(capability: tuple[int, int]) -> bool:
    """The rule of ``block_backend.CUDNN_PREFERRED_CAPABILITIES`` for this process's cuDNN."""
    if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") not in ("", "0"):  # torch's own switch, honoured here
        return False
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (version is not None and capability in CUDNN_PREFERRED_CAPABILITIES
            and version > CUDNN_PREFERRED_MIN_VERSION)  # fmt: skip


def cuda_caps(device: torch.device) -> CudaCaps | None:
    """The :class:`CudaCaps` of a CUDA ``device`` (``None`` for any other device). Cached per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _caps_of(device.index if device.index is not None else torch.cuda.current_device())


def _spec(q, k, v, causal, allowed, sinks, softcap) -> BlockSpec:
    return BlockSpec(
        dtype=q.dtype, head_dim=q.shape[-1], value_dim=v.shape[-1], causal=bool(causal),
        square=q.shape[2] == k.shape[2], masked=allowed is not None, sinks=sinks is not None,
        softcap=bool(softcap), grouped=q.shape[1] != k.shape[1],
    )


def _warn_math(spec: BlockSpec, reason: str) -> None:
    key = (layer_kind(spec), reason)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "CUDA attention blocks of layer kind '%s' (%s) run exact math (a score matrix per block: slow and "
            "memory-hungry): %s", key[0], spec.dtype, reason,
        )


def _choose(q, k, v, causal, allowed, sinks, softcap, kernel: str | None) -> tuple[str, BlockSpec]:
    spec = _spec(q, k, v, causal, allowed, sinks, softcap)
    if kernel is not None:
        return kernel, spec
    choice = select_backend(q.device.type, spec, cuda_caps(q.device), pinned_kernel())
    if choice.kernel == MATH:
        _warn_math(spec, choice.reason)
    else:
        _log_kernel(spec, choice)
    return choice.kernel, spec


def _log_kernel(spec: BlockSpec, choice: Choice) -> None:
    """One INFO line per layer kind and kernel: which kernel runs its blocks (and, where the GPU's preferred
    kernel could not take them, why): the run log names the kernel that ran."""
    key = (layer_kind(spec), choice.kernel + "|" + choice.fallback)
    if key in _WARNED:
        return
    _WARNED.add(key)
    extra = f"; {choice.fallback}" if choice.fallback else ""
    logger.info("CUDA attention blocks of layer kind '%s' (%s) run %s (%s%s)", key[0], spec.dtype, choice.kernel,
                choice.reason, extra)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# shared pieces: padding, GQA, masks


def _scale(scale: float | None, head_dim: int) -> float:
    return scale if scale is not None else head_dim**-0.5


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` zero-padded on its last dim to ``dim``, contiguous."""
    if x.shape[-1] == dim:
        return x.contiguous()
    return torch.nn.functional.pad(x, (0, dim - x.shape[-1])).contiguous()


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, Hkv, m, D]`` -> ``[B, Hkv*groups, m, D]``: query head ``h`` uses KV head ``h // groups``."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _unrepeat(dx: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_repeat`: the query heads of a KV head summed."""
    if groups == 1:
        return dx
    b, h, m, d = dx.shape
    return dx.view(b, h // groups, groups, m, d).sum(2)


def _visible(allowed: torch.Tensor | None, causal: bool, n: int, m: int, device) -> torch.Tensor | None:
    """``[n, m]`` or ``[B, 1, n, m]`` bool of the keys each query sees (``causal`` lower-right aligned)."""
    mask = None
    if causal:
        mask = torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)
    if allowed is not None:
        mask = allowed.to(torch.bool) if mask is None else mask & allowed.to(torch.bool)
    return mask


def _bias(visible: torch.Tensor, b: int, h: int, dtype: torch.dtype) -> torch.Tensor:
    """An additive ``[b, h, n, m]`` bias (``-inf`` where not visible) whose rows are 16-element aligned (what
    the memory-efficient kernel reads), broadcast over heads (and the batch for an ``[n, m]`` mask)."""
    vis = visible if visible.dim() == 4 else visible[None, None]
    n, m = vis.shape[-2:]
    m_pad = -(-m // 16) * 16
    buf = torch.zeros(vis.shape[0], 1, n, m_pad, dtype=dtype, device=vis.device)
    view = buf[..., :m]
    view.masked_fill_(~vis, float("-inf"))
    return view.expand(b, h, n, m)


# ---------------------------------------------------------------------------------------------------------
# SDPA flash / memory-efficient


def _op(name: str):
    """``torch.ops.aten.<name>`` (one indirection, so CPU tests can stand in for the CUDA-only ops)."""
    return getattr(torch.ops.aten, name)


@functools.cache
def _philox(kernel: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The RNG-state tensors a fused forward returns without dropout, to hand its backward op (which reads
    them only with dropout): taken from one tiny forward, so their format is the installed torch's."""
    # flash and cuDNN take fp16/bf16 only; the memory-efficient kernel fp32 too
    x = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16 if kernel in (FLASH, CUDNN) else torch.float32, device=device)
    if kernel == FLASH:
        got = _op("_scaled_dot_product_flash_attention")(x, x, x, 0.0, False, False, scale=1.0)
        return got[6], got[7]
    if kernel == CUDNN:
        got = _op("_scaled_dot_product_cudnn_attention")(x, x, x, None, True, 0.0, False, False, scale=1.0)
        return got[6], got[7]
    got = _op("_scaled_dot_product_efficient_attention")(x, x, x, None, True, 0.0, False, scale=1.0)
    return got[2], got[3]


def _sdpa_inputs(q, k, v, causal, allowed, kernel):
    """Padded inputs (K/V repeated per query head unless the kernel takes grouped heads: cuDNN and flash where
    ``aten_schemas.GROUPED_KV`` says so) and the kernel's ``is_causal`` / bias; ``g``: the repeat (1: none)."""
    b, hq, n, d = q.shape
    m = k.shape[2]
    g = 1 if kernel in (CUDNN, FLASH) and _takes_grouped_kv(kernel) else hq // k.shape[1]
    dim = padded_head_dim(BlockSpec(q.dtype, d, v.shape[-1]))
    qp, kp, vp = _pad(q, dim), _repeat(_pad(k, dim), g), _repeat(_pad(v, dim), g)
    bias, is_causal = None, bool(causal)
    if allowed is not None or (causal and n != m):
        if kernel != EFFICIENT:
            raise ValueError(f"a masked block needs the memory-efficient kernel, not {kernel!r}")
        bias, is_causal = _bias(_visible(allowed, causal, n, m, q.device), b, hq, q.dtype), False
    return qp, kp, vp, bias, is_causal, dim, g


def _sdpa_forward(kernel, q, k, v, causal, scale, allowed):
    n, d, dv = q.shape[2], q.shape[-1], v.shape[-1]
    qp, kp, vp, bias, is_causal, _, _ = _sdpa_inputs(q, k, v, causal, allowed, kernel)
    sc = _scale(scale, d)
    if kernel == FLASH:
        out, lse = _op("_scaled_dot_product_flash_attention")(qp, kp, vp, 0.0, is_causal, False, scale=sc)[:2]
    elif kernel == CUDNN:
        out, lse = _op("_scaled_dot_product_cudnn_attention")(qp, kp, vp, None, True, 0.0, is_causal, False, scale=sc)[:2]
        lse = lse.reshape(lse.shape[:3])  # cuDNN's LSE is [B, H, n, 1]
    else:
        out, lse = _op("_scaled_dot_product_efficient_attention")(
            qp, kp, vp, bias, True, 0.0, is_causal, scale=sc
        )[:2]
        lse = lse[..., :n]  # the kernel pads the LSE's query dim to a multiple of 32
    return out[..., :dv].contiguous(), lse.float().contiguous()


def _sdpa_backward(kernel, dout, q, k, v, out, lse, causal, scale, allowed):
    n, m, d, dv = q.shape[2], k.shape[2], q.shape[-1], v.shape[-1]
    qp, kp, vp, bias, is_causal, dim, g = _sdpa_inputs(q, k, v, causal, allowed, kernel)
    dop, op = _pad(dout.to(q.dtype), dim), _pad(out.to(q.dtype), dim)
    sc = _scale(scale, d)
    seed, offset = _philox(kernel, q.device)
    if kernel == FLASH:
        dq, dk, dvv = _op("_scaled_dot_product_flash_attention_backward")(
            dop, qp, kp, vp, op, lse.float().contiguous(), None, None, n, m, 0.0, is_causal, seed, offset, scale=sc
        )[:3]
    elif kernel == CUDNN:
        dq, dk, dvv = _op("_scaled_dot_product_cudnn_attention_backward")(
            dop, qp, kp, vp, op, lse.float().unsqueeze(-1).contiguous(), seed, offset, None, None, None, n, m, 0.0,
            is_causal, scale=sc,
        )[:3]
    else:
        lse_p = lse.new_zeros(*lse.shape[:-1], -(-n // 32) * 32, dtype=torch.float32)
        lse_p[..., :n] = lse
        dq, dk, dvv = _op("_scaled_dot_product_efficient_attention_backward")(
            dop, qp, kp, vp, bias, op, lse_p, seed, offset, 0.0, [True, True, True, False], is_causal, scale=sc
        )[:3]
    dq = dq[..., :d]
    dk = _unrepeat(dk, g)[..., :d]
    dvv = _unrepeat(dvv, g)[..., :dv]
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dvv.to(v.dtype).contiguous()


class _FusedBlock(torch.autograd.Function):
    """A fused SDPA block under autograd: the backward is the fused backward op. The LSE output carries no
    gradient; a graph that would send it one raises (never a silently dropped term)."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, causal, scale, allowed):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        out, lse = _sdpa_forward(kernel, q, k, v, causal, scale, allowed)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale, allowed)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[override]
        if dlse is not None:
            raise RuntimeError(
                "a fused CUDA attention block's log-sum-exp got a gradient; only FlexAttention blocks (sinks) "
                "carry one: run such a block with sinks, or through blocks.block_backward"
            )
        if dout is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale, allowed = ctx.args
        return (*_sdpa_backward(kernel, dout, q, k, v, out, lse, causal, scale, allowed), None, None, None, None)


# ---------------------------------------------------------------------------------------------------------
# FlexAttention


@functools.cache
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention)  # the eager form is a reference implementation, not a kernel
    return flex_attention


def _flex_forward(q, k, v, causal, scale, allowed, softcap):
    """``(out, lse)`` of one block with FlexAttention (differentiable w.r.t. q, k, v, and the LSE too)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, hq, n, d = q.shape
    m = k.shape[2]
    vis = _visible(allowed, causal, n, m, q.device)
    block_mask = None
    if vis is not None:
        if vis.dim() == 4:
            def mask_mod(bi, hi, qi, ki):
                return vis[bi, 0, qi, ki]
            batch = vis.shape[0]
        else:
            def mask_mod(bi, hi, qi, ki):
                return vis[qi, ki]
            batch = None
        block_mask = create_block_mask(mask_mod, batch, None, n, m, device=q.device)
    score_mod = None
    if softcap:
        cap = float(softcap)

        def score_mod(s, bi, hi, qi, ki):
            return torch.tanh(s / cap) * cap

    kwargs: dict[str, Any] = {"enable_gqa": hq != k.shape[1], "scale": _scale(scale, d)}
    dv = v.shape[-1]
    # head sizes every Triton kernel takes: powers of two >= 16 (zero padding is exact; on CPU too, so the
    # CPU tests cover it)
    q, k, v = _pad(q, _pow2(d)), _pad(k, _pow2(d)), _pad(v, _pow2(dv))
    try:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _flex_fn(q.device.type)(q, k, v, score_mod, block_mask, return_aux=AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    except ImportError:  # torch without AuxRequest
        out, lse = _flex_fn(q.device.type)(q, k, v, score_mod, block_mask, return_lse=True, **kwargs)
    return out[..., :dv], lse.to(torch.promote_types(q.dtype, torch.float32))


def _pow2(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _join_sinks(out, lse, sinks):
    """The sink column joined to a block's softmax (a zero value): exact, differentiable."""
    sink = sinks.to(lse.dtype).reshape(1, -1, 1).expand_as(lse)
    joined = torch.logaddexp(lse, sink)
    return out * torch.exp(lse - joined).unsqueeze(-1).to(out.dtype), joined


def _flex_backward(dout, q, k, v, out, lse, causal, scale, allowed, softcap):
    """``(dq, dk, dv)`` of a FlexAttention block given the MERGED ``out`` / ``lse`` of its queries.

    The block is recomputed under autograd (``out_b``, ``lse_b``); with ``w = exp(lse_b - lse)`` the merged
    output is ``sum_b w_b out_b``, so the block's share of the gradient is ``d out_b = w dout`` and
    ``d lse_b = w * rowsum(dout * (out_b - out))``: exactly ``p * (dout.v - rowsum(dout * out))`` per score.
    """
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        ob, lb = _flex_forward(qq, kk, vv, causal, scale, allowed, softcap)
        dt = torch.promote_types(q.dtype, torch.float32)
        w = torch.exp(lb.detach().to(dt) - lse.to(dt))
        dob = (dout.to(dt) * w.unsqueeze(-1)).to(ob.dtype)
        dlb = w * (dout.to(dt) * (ob.detach().to(dt) - out.to(dt))).sum(-1)
        return torch.autograd.grad((ob, lb), (qq, kk, vv), (dob, dlb.to(lb.dtype)))


# ---------------------------------------------------------------------------------------------------------
# the slot


def cuda_block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
    allowed: torch.Tensor | None, sinks: torch.Tensor | None, softcap: float | None, kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out [B, Hq, n, Dv], lse [B, Hq, n] fp32)`` of one block with a fused kernel, or ``None`` (exact math
    applies; one warning per layer kind was logged). The arguments of ``blocks.block_forward``, in order;
    ``kernel`` overrides :func:`~automodel.distributed.cp.block_backend.select_backend` (tests: ``"flex"``
    on CPU). Differentiable w.r.t. q, k, v (and sinks); nothing is mutated."""
    name, _ = _choose(q, k, v, causal, allowed, sinks, softcap, kernel)
    if name == MATH:
        return None
    if name == FLEX:
        out, lse = _flex_forward(q, k, v, causal, scale, allowed, softcap)
        if sinks is not None:
            out, lse = _join_sinks(out, lse, sinks)
        return out, lse
    if sinks is not None or softcap:
        raise ValueError(f"kernel {name!r} takes no sinks or soft-capping (FlexAttention does)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _FusedBlock.apply(q, k, v, name, causal, scale, allowed)
    return _sdpa_forward(name, q, k, v, causal, scale, allowed)


def cuda_block_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    causal: bool, scale: float | None, allowed: torch.Tensor | None, softcap: float | None, kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq, dk, dv)`` of one block given the MERGED ``out`` / ``lse`` of its queries (``blocks.block_backward``'s
    contract and arguments, in order), or ``None`` (exact math applies). ``kernel`` as in
    :func:`cuda_block_forward`."""
    name, _ = _choose(q, k, v, causal, allowed, None, softcap, kernel)
    if name == MATH:
        return None
    if name == FLEX:
        return _flex_backward(dout, q, k, v, out, lse, causal, scale, allowed, softcap)
    return _sdpa_backward(name, dout, q, k, v, out, lse, causal, scale, allowed)


# ---------------------------------------------------------------------------------------------------------
# one varlen call for all documents of packed rows


class _CudnnVarlen(torch.autograd.Function):
    """All documents of a packed stream in one cuDNN call (``aten._cudnn_attention_forward`` with ``cum_seq_q`` /
    ``cum_seq_k``) and its backward op; q/k/v ``[T, H, D]`` with equal head counts (the caller repeats grouped K/V,
    as torch 2.14's own ``varlen_attn`` requires). The LSE (``[H, T]`` fp32 on torch 2.14-2.15,
    ``aten_schemas.VARLEN_LSE_LAYOUT``) stays inside: it is handed back to the backward op as the forward returned
    it."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, causal, scale):  # type: ignore[override]
        got = _op("_cudnn_attention_forward")(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, causal, False,
                                              scale=scale)  # fmt: skip
        out, lse, seed, offset = got[0], got[1], got[6], got[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu)
        ctx.args = (max_len, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, seed, offset, cu = ctx.saved_tensors
        max_len, causal, scale = ctx.args
        dq, dk, dv = _op("_cudnn_attention_backward")(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu, cu, max_len, max_len, 0.0, causal, scale=scale
        )[:3]
        return dq, dk, dv, None, None, None, None


def _log_varlen(spec: BlockSpec, what: str) -> None:
    key = ("documents " + layer_kind(spec), what)
    if key not in _WARNED:
        _WARNED.add(key)
        logger.info("CUDA attention of whole documents, layer kind '%s' (%s): %s", layer_kind(spec), spec.dtype, what)


def varlen_documents(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, causal: bool,
    window: int | None, scale: float | None,
) -> torch.Tensor | None:
    """Attention of every document of a packed token stream in ONE call, or ``None`` where no such call applies
    (the caller runs per-document blocks). The CUDA slot of ``blocks.documents_forward`` (its arguments, in order,
    without ``backend``). The call is :func:`~automodel.distributed.cp.block_backend.varlen_choice`'s: cuDNN's
    packed-row op where the installed torch runs it itself and cuDNN is preferred or pinned, else flash's
    ``varlen_attn``; which one (or why neither) is logged once per layer kind.

    Args:
        q: ``[T, Hq, D]``; k / v: ``[T, Hkv, D]`` (grouped K/V go to the call as they are where it takes them:
            cuDNN's on torch 2.15, flash's ``varlen_attn`` on 2.11-2.15, with ``enable_gqa`` from 2.12; elsewhere
            they are repeated per query head, :attr:`~automodel.distributed.cp.block_backend.Choice.expand_kv`).
        cu_seqlens: ``[N+1]`` int32 document offsets into the T tokens.
        max_len: the longest document.
        causal: causal inside each document (else bidirectional).
        window: a query sees itself and the ``window - 1`` keys before it (causal only).
        scale: softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype, differentiable w.r.t. q, k, v (the call's own backward). ``None`` too
        where ``model.attention_backend`` pins a kernel without a packed-row call (the per-document blocks then
        run it).
    """
    spec = BlockSpec(q.dtype, q.shape[-1], v.shape[-1], causal=causal, grouped=q.shape[1] != k.shape[1])
    caps = cuda_caps(q.device)
    if caps is None:
        return None
    choice = varlen_choice(spec, caps, pinned_kernel(), window=window, max_len=max_len)
    if choice is None:
        _log_varlen(spec, "per-document blocks (" + varlen_refusal(spec, caps, pinned_kernel(), window=window,
                                                                    max_len=max_len) + ")")  # fmt: skip
        return None
    _log_varlen(spec, f"{choice.kernel} ({choice.reason})")
    g = q.shape[1] // k.shape[1]
    if g > 1 and choice.expand_kv:  # cuDNN's call takes grouped K/V where torch hands them so (2.15)
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    sc = _scale(scale, q.shape[-1])
    if choice.kernel == CUDNN:
        return _CudnnVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu.contiguous(), int(max_len),
                                  bool(causal), sc)  # fmt: skip
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if window is None else window - 1
    window_size = (left, 0) if causal else (-1, -1)
    # grouped K/V as they are (choice.expand_kv off): 2.12 on wants enable_gqa for them, 2.11 has no such keyword
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] and varlen_has_enable_gqa() else {}
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=sc, window_size=window_size, **gqa)


# ---------------------------------------------------------------------------------------------------------
# one packed-row cuDNN call for a set of blocks of one kind (thd, thd_docs), merged by the caller


def _packed_call(q, k, v, cu_q, cu_k, causal) -> Choice | None:
    """:func:`~automodel.distributed.cp.block_backend.packed_choice` for these blocks, its reason or refusal logged
    once per layer kind and call kind."""
    spec = BlockSpec(q.dtype, q.shape[-1], v.shape[-1], causal=causal, grouped=q.shape[1] != k.shape[1])
    caps = cuda_caps(q.device)
    if caps is None:
        return None
    max_q = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    enabled = packed_blocks_enabled()
    choice = packed_choice(spec, caps, pinned_kernel(), causal=causal, max_q=max_q) if enabled else None
    what = "causal diagonal blocks" if causal else "full prefix blocks"
    key = ("packed " + what + " " + layer_kind(spec), choice.kernel if choice else "blocks" if enabled else "off")
    if key not in _WARNED:
        _WARNED.add(key)
        refusal = (packed_refusal(spec, caps, pinned_kernel(), causal=causal, max_q=max_q) if enabled
                   else "model.cudnn_packed_blocks=false")  # fmt: skip
        how = (f"one {choice.kernel} packed-row call per layer" if choice else f"one kernel call per block ({refusal})")
        logger.info("CUDA attention, %s of layer kind '%s' (%s): %s", what, layer_kind(spec), spec.dtype, how)
    return choice


def packed_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], causal: bool) -> bool:
    """Whether :func:`packed_forward` / :func:`packed_backward` run these blocks as one packed-row call (logged
    once per layer kind and call kind, as they are)."""
    return _packed_call(q, k, v, cu_q, cu_q, causal) is not None


def _packed_args(q, k, v, cu_q, cu_k, causal):
    """The packed call's K/V (grouped K/V as they are: ``packed_choice`` takes them only where torch does, 2.15),
    offsets (one int32 tensor for Q and K of causal blocks, as torch 2.15 requires) and longest chunks."""
    cq = torch.tensor(cu_q, dtype=torch.int32, device=q.device)
    ck = cq if causal else torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    max_q = max(b - a for a, b in zip(cu_q[:-1], cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k[:-1], cu_k[1:]))
    return k.contiguous(), v.contiguous(), cq, ck, max_q, max_k


def _lse_layout() -> str:
    layout = aten_schemas.varlen_lse_layout(aten_schemas.torch_release(torch.__version__))
    if layout is None:
        raise RuntimeError(f"torch {torch.__version__}: the packed-row cuDNN call's LSE layout is not in "
                           "aten_schemas.VARLEN_LSE_LAYOUT; add the release")  # fmt: skip
    return layout


def packed_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: list[int], cu_k: list[int], causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(out [Tq, Hq, Dv], lse [Tq, Hq] fp32)`` of a set of blocks in ONE packed-row cuDNN call, or ``None`` where
    :func:`~automodel.distributed.cp.block_backend.packed_choice` says no (the caller runs each block; the reason is
    logged once per layer kind). Block ``i``: queries ``q[cu_q[i]:cu_q[i+1]]`` against keys ``k[cu_k[i]:cu_k[i+1]]``,
    ``causal`` only for square blocks (``cu_q == cu_k``). q ``[Tq, Hq, D]``, k / v ``[Tk, Hkv, D]`` token-major; not
    differentiable (the caller's autograd function runs :func:`packed_backward`); nothing is mutated. The op's LSE
    (``aten_schemas.VARLEN_LSE_LAYOUT``: ``[Hq, Tq]`` on torch 2.14-2.15) is returned token-major for the merge."""
    if causal and list(cu_q) != list(cu_k):
        raise ValueError("causal packed blocks must be square (the packed call aligns the diagonal top-left)")
    if _packed_call(q, k, v, cu_q, cu_k, causal) is None:
        return None
    kk, vv, cq, ck, max_q, max_k = _packed_args(q, k, v, cu_q, cu_k, causal)
    got = _op("_cudnn_attention_forward")(q.contiguous(), kk, vv, None, cq, ck, max_q, max_k, True, 0.0, causal, False,
                                          scale=_scale(scale, q.shape[-1]))  # fmt: skip
    out, lse = got[0], got[1]
    t, h = q.shape[0], q.shape[1]
    want = (h, t) if _lse_layout() == "HT" else (t, h, 1)
    if tuple(lse.shape) != want:
        raise RuntimeError(f"the packed-row cuDNN call returned an LSE of shape {tuple(lse.shape)}, "
                           f"aten_schemas.VARLEN_LSE_LAYOUT says {want} for torch {torch.__version__}")  # fmt: skip
    lse = lse.transpose(0, 1) if len(want) == 2 else lse[..., 0]
    return out, lse.float().contiguous()


def packed_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_q: list[int], cu_k: list[int], causal: bool, scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv])`` of the blocks of :func:`packed_forward` given the
    MERGED ``out`` ``[Tq, Hq, Dv]`` and ``lse`` ``[Tq, Hq]`` of their queries (exact, as for every block kernel), or
    ``None`` where the packed call does not apply (the same rule as the forward). dK/dV at K/V's head count."""
    if _packed_call(q, k, v, cu_q, cu_k, causal) is None:
        return None
    kk, vv, cq, ck, max_q, max_k = _packed_args(q, k, v, cu_q, cu_k, causal)
    lse_op = lse.float().transpose(0, 1) if _lse_layout() == "HT" else lse.float().unsqueeze(-1)
    # what torch's own varlen_attn hands this op without dropout (unread there): one zero uint64 pair
    seed = offset = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = _op("_cudnn_attention_backward")(
        dout.to(q.dtype).contiguous(), q.contiguous(), kk, vv, out.to(q.dtype).contiguous(), lse_op.contiguous(), seed,
        offset, None, cq, ck, max_q, max_k, 0.0, causal, scale=_scale(scale, q.shape[-1]),
    )[:3]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
