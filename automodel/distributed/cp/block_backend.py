"""Which kernel computes one block of attention on CUDA: a pure function of the block and the device.

:mod:`automodel.distributed.cp.blocks` has one slot per device; its CUDA slot
(:mod:`automodel.distributed.cp.cuda_blocks`) asks :func:`select_backend` which of torch's fused kernels
takes a block, from the block's features (:class:`BlockSpec`) and what the device and the installed
torch offer (:class:`CudaCaps`). Nothing here touches a GPU, so the table is unit-tested on CPU case by
case (tests/test_block_backend.py).

The kernels, in order of preference:

- ``"sdpa_flash"``: ``aten._scaled_dot_product_flash_attention`` and its backward (FlashAttention-2 in
  torch): fp16/bf16, compute capability >= 8.0, head size <= 256 after padding to a multiple of 8; no
  mask (``causal`` only on a square block).
- ``"sdpa_efficient"``: ``aten._scaled_dot_product_efficient_attention`` and its backward
  (memory-efficient attention): fp32/fp16/bf16 (bf16 from 8.0), an additive bias for a mask or a
  rectangular causal block.
- ``"flex"``: FlexAttention (``torch.nn.attention.flex_attention``, compiled with Triton): soft-capping
  (a ``score_mod``), sinks (its log-sum-exp is differentiable, so the sink column joins by an exact
  merge), and any mask the two above take.
- ``"sdpa_cudnn"``: ``aten._scaled_dot_product_cudnn_attention`` and its backward (cuDNN's fused
  attention): fp16/bf16, compute capability >= 8.0, head size <= 128 after padding, no mask (``causal`` only on
  a square block). ``auto`` puts it before flash where torch's SDPA does (``CudaCaps.cudnn_preferred``: compute
  capability 9.0 / 10.0 / 10.3 with a runtime cuDNN newer than 9.15.0; on Hopper it runs training shapes
  1.7-2.3x faster than flash, transformers PR #48163), else only where ``model.attention_backend=cudnn`` pins it.
  A block it cannot take there runs the next kernel, and :attr:`Choice.fallback` says why (logged once per
  layer kind and reason).
- ``"math"``: exact math, only where nothing above applies (fp64, or an install without the ops); the
  caller logs one warning per layer kind and reason.

Unequal query/key and value head sizes (MLA) are padded with zeros to one size, which is exact (zero
key columns add nothing to a score, zero value columns are sliced off the output), so they need no
kernel of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CUDNN",
    "EFFICIENT",
    "FLASH",
    "FLEX",
    "KERNELS",
    "MATH",
    "BlockSpec",
    "Choice",
    "CudaCaps",
    "layer_kind",
    "GpuInfo",
    "caps_for",
    "expands_kv",
    "padded_head_dim",
    "cudnn_packed_problem",
    "packed_choice",
    "packed_refusal",
    "pin_problem",
    "release_caps",
    "select_backend",
    "select_kernel",
    "varlen_applies",
    "varlen_choice",
    "varlen_refusal",
]

FLASH = "sdpa_flash"
EFFICIENT = "sdpa_efficient"
FLEX = "flex"
MATH = "math"
CUDNN = "sdpa_cudnn"
#: every kernel :func:`select_backend` may name (cuDNN only where ``model.attention_backend`` pins it)
KERNELS = (FLASH, EFFICIENT, FLEX, MATH, CUDNN)

_HALF = (torch.float16, torch.bfloat16)
#: the largest head size torch's flash kernel takes
FLASH_MAX_HEAD_DIM = 256
#: the largest head size the cuDNN kernel takes (torch's check_cudnn_tensor_shapes, sdp_utils.cpp)
CUDNN_MAX_HEAD_DIM = 128


@dataclass(frozen=True)
class BlockSpec:
    """The features of one block that decide its kernel.

    Attributes:
        dtype: of the queries (keys and values share it).
        head_dim: query/key head size; value_dim: value head size (differs for MLA).
        causal: lower-right causal; square: the block has as many queries as keys.
        masked: an explicit ``allowed`` mask (windows, chunks, documents inside a block).
        sinks: per-head sink logits; softcap: logit soft-capping.
        grouped: fewer key/value heads than query heads (GQA). cuDNN and flash take them as they are where the
            installed torch's op does (``CudaCaps.cudnn_gqa`` / ``flash_gqa``); memory-efficient gets K/V repeated
            per query head (:attr:`Choice.expand_kv` says which).
    """

    dtype: torch.dtype
    head_dim: int
    value_dim: int
    causal: bool = False
    square: bool = True
    masked: bool = False
    sinks: bool = False
    softcap: bool = False
    grouped: bool = False


@dataclass(frozen=True)
class CudaCaps:
    """What one CUDA device and the installed torch offer.

    Attributes:
        capability: the device's compute capability ``(major, minor)``.
        flash_op / efficient_op: torch has ``aten._scaled_dot_product_flash_attention`` /
            ``_scaled_dot_product_efficient_attention`` with their backward ops.
        flex: ``torch.nn.attention.flex_attention`` imports and Triton is there to compile it.
        varlen: ``torch.nn.attention.varlen.varlen_attn`` imports (torch >= 2.10).
        cudnn_op: torch has ``aten._scaled_dot_product_cudnn_attention`` with its backward and cuDNN is there.
        cudnn_preferred: ``auto`` runs cuDNN before flash (the GPU and runtime cuDNN torch's SDPA prefers it on).
        cudnn_gqa: the cuDNN op takes fewer key/value heads than query heads and returns grouped dK/dV
            (``aten_schemas.GROUPED_KV``: torch 2.11-2.15), so K/V are not repeated for it.
        flash_gqa: the flash op takes fewer key/value heads than query heads and returns grouped dK/dV
            (``aten_schemas.GROUPED_KV``: torch 2.11-2.15), so K/V are not repeated for it.
        cudnn_varlen: the packed-row cuDNN op (``aten._cudnn_attention_forward`` / ``_backward`` with
            ``cum_seq_q`` / ``cum_seq_k``) is one torch itself runs on this device (``varlen_attn`` from torch 2.14
            with a runtime cuDNN >= 9.18 on compute capability 9.x / 10.x; ``aten_schemas.CUDNN_VARLEN_*``). Which
            calls it runs: ``cudnn_varlen_causal`` / ``cudnn_varlen_short`` (torch 2.14's own ``varlen_attn`` runs
            it, whatever a pin says, for full attention of equal heads with no window and queries past 128 tokens).
        cudnn_varlen_causal: ... for causal documents too (torch >= 2.15; 2.14 runs flash for them).
        cudnn_varlen_short: ... for a longest query chunk of at most 128 tokens too (torch >= 2.15, cuDNN >= 9.24).
        cudnn_varlen_gqa: ... with grouped K/V as they are too (torch >= 2.15; 2.14's gate wants equal heads).
        varlen_follows_sdpa: the installed torch's ``varlen_attn`` picks cuDNN or flash by SDPA's enabled backends
            and priority (torch >= 2.15), so under a flash pin or auto's order it runs flash when asked.
        varlen_gqa: the installed torch's ``varlen_attn`` hands grouped K/V to flash's varlen op as they are
            (``aten_schemas.VARLEN_GQA``: torch 2.11-2.15, with ``enable_gqa`` from 2.12), so they are not repeated
            for it; 2.14's then runs flash, never its cuDNN path.
    """

    capability: tuple[int, int]
    flash_op: bool = True
    efficient_op: bool = True
    flex: bool = True
    varlen: bool = False
    cudnn_op: bool = False
    cudnn_preferred: bool = False
    cudnn_gqa: bool = False
    cudnn_varlen: bool = False
    varlen_follows_sdpa: bool = False
    flash_gqa: bool = False
    cudnn_varlen_causal: bool = False
    cudnn_varlen_short: bool = False
    cudnn_varlen_gqa: bool = False
    varlen_gqa: bool = False


@dataclass(frozen=True)
class Choice:
    """A kernel and why it was chosen (for ``"math"``: the reason no fused kernel applies). ``fallback``: the
    preferred kernel of this GPU could not take the block, and why (empty: it ran the preferred one).
    ``expand_kv``: grouped K/V are repeated per query head for this kernel (and dK/dV summed back); ``False`` for
    equal heads and for kernels that take grouped heads (cuDNN where ``CudaCaps.cudnn_gqa``, FlexAttention).
    ``varlen``: one call takes all documents of a packed row (:func:`varlen_choice`)."""

    kernel: str
    reason: str
    fallback: str = ""
    expand_kv: bool = False
    varlen: bool = False


def expands_kv(kernel: str, spec: BlockSpec, caps: CudaCaps | None) -> bool:
    """Whether the glue repeats grouped K/V per query head for ``kernel`` (``False`` without GQA, for
    FlexAttention and math, and for cuDNN and flash where the installed torch's op takes grouped heads)."""
    if not spec.grouped or kernel in (FLEX, MATH):
        return False
    if caps is None:
        return True
    return not ((kernel == CUDNN and caps.cudnn_gqa) or (kernel == FLASH and caps.flash_gqa))


def _with_kv(choice: Choice, spec: BlockSpec, caps: CudaCaps | None) -> Choice:
    expand = expands_kv(choice.kernel, spec, caps)
    reason = choice.reason
    if spec.grouped and choice.kernel in (FLASH, EFFICIENT, CUDNN):
        reason += "; grouped K/V repeated per query head" if expand else "; grouped K/V as they are (no repeat)"
    return Choice(choice.kernel, reason, choice.fallback, expand, choice.varlen)


def padded_head_dim(spec: BlockSpec) -> int:
    """The one head size the fused ops see: ``max(head_dim, value_dim)`` rounded up to a multiple of 8."""
    d = max(spec.head_dim, spec.value_dim)
    return -(-d // 8) * 8


def layer_kind(spec: BlockSpec) -> str:
    """A short name of the layer kind a block belongs to (the key of the one warning per kind)."""
    parts = []
    if spec.sinks:
        parts.append("sinks")
    if spec.softcap:
        parts.append("softcap")
    if spec.head_dim != spec.value_dim:
        parts.append("MLA")
    if spec.masked:
        parts.append("masked (window/chunk/document)")
    if spec.grouped:
        parts.append("GQA")
    parts.append("causal" if spec.causal else "full")
    return " ".join(parts)


def pin_problem(kernel: str, spec: BlockSpec, caps: CudaCaps) -> str | None:
    """Why the pinned ``kernel`` cannot compute a block like ``spec`` on a device with ``caps`` (``None``: it can)."""
    half, sm80 = spec.dtype in _HALF, tuple(caps.capability) >= (8, 0)
    needs_mask = spec.masked or (spec.causal and not spec.square)
    dim = padded_head_dim(spec)
    if kernel == MATH:
        return None
    if kernel == FLEX:
        return None if caps.flex else "FlexAttention (torch.nn.attention.flex_attention with Triton) is not available"
    if spec.sinks or spec.softcap:
        return "sinks / soft-capping need FlexAttention (model.attention_backend=flex or auto)"
    if kernel == EFFICIENT:
        if not caps.efficient_op:
            return "this torch has no memory-efficient SDPA op"
        if spec.dtype not in (*_HALF, torch.float32) or (spec.dtype == torch.bfloat16 and not sm80):
            return f"the memory-efficient kernel takes fp32/fp16 (bf16 from compute capability 8.0), not {spec.dtype}"
        return None
    limit, op = (FLASH_MAX_HEAD_DIM, caps.flash_op) if kernel == FLASH else (CUDNN_MAX_HEAD_DIM, caps.cudnn_op)
    if not op:
        return f"this torch / device has no {kernel} op"
    if not (half and sm80):
        return f"{kernel} takes fp16/bf16 on compute capability >= 8.0, not {spec.dtype} on {tuple(caps.capability)}"
    if dim > limit:
        return f"{kernel} takes head sizes up to {limit}, this block's is {dim}"
    if needs_mask:
        return f"{kernel} takes no mask (windows, chunks, documents inside a block, rectangular causal blocks)"
    return None


def select_backend(device_type: str, spec: BlockSpec, caps: CudaCaps | None, pinned: str | None = None) -> Choice:
    """The kernel for one block on a device of type ``device_type`` (pure: no device is touched).

    Args:
        device_type: ``"cuda"`` (anything else: ``"math"``; the CPU keeps its own slot in ``blocks``).
        spec: the block's features.
        caps: the CUDA device's capabilities (``None``: unknown, ``"math"``).
        pinned: a kernel ``model.attention_backend`` pins (:mod:`automodel.distributed.cp.attention_kernels`);
            ``None``: the table below.

    Returns:
        A :class:`Choice`; its ``reason`` says why (for ``"math"``, what a fused kernel lacked).

    Raises:
        ValueError: the pinned kernel cannot compute this block (never a silent fallback to another kernel).
    """
    if device_type != "cuda" or caps is None:
        return Choice(MATH, f"device type {device_type!r} has no fused kernel in this slot")
    if pinned is not None:
        problem = pin_problem(pinned, spec, caps)
        if problem:
            raise ValueError(
                f"model.attention_backend pins {pinned!r}, which cannot compute a {layer_kind(spec)} attention block "
                f"({spec.dtype}, head size {spec.head_dim}/{spec.value_dim}): {problem}; set model.attention_backend="
                "auto (each block runs the kernel that takes it) or pin a kernel that takes this block"
            )
        return _with_kv(Choice(pinned, "pinned by model.attention_backend"), spec, caps)
    return _with_kv(_select(spec, caps), spec, caps)


def _select(spec: BlockSpec, caps: CudaCaps) -> Choice:
    if spec.dtype not in (*_HALF, torch.float32):
        return Choice(MATH, f"dtype {spec.dtype} is taken by no fused CUDA attention kernel (fp16/bf16/fp32 are)")
    sm80 = tuple(caps.capability) >= (8, 0)
    if spec.dtype == torch.bfloat16 and not sm80:
        return Choice(MATH, f"bf16 attention kernels need compute capability >= 8.0, the device has {caps.capability}")
    if spec.sinks or spec.softcap:
        if caps.flex:
            return Choice(FLEX, "sinks / soft-capping: FlexAttention (score_mod, differentiable log-sum-exp)")
        what = "sinks" if spec.sinks else "soft-capping"
        return Choice(MATH, f"{what} need FlexAttention (torch.nn.attention.flex_attention with Triton), not available")
    needs_mask = spec.masked or (spec.causal and not spec.square)
    dim = padded_head_dim(spec)
    fallback = ""
    if caps.cudnn_preferred:
        problem = pin_problem(CUDNN, spec, caps)
        if problem is None:
            return Choice(CUDNN, "no mask, fp16/bf16 on a GPU and cuDNN torch's SDPA prefers cuDNN on: cuDNN")
        fallback = f"cuDNN (preferred on this GPU) cannot take it: {problem.removeprefix(CUDNN + ' ')}"
    choice = _after_cudnn(spec, caps, needs_mask, dim)
    return Choice(choice.kernel, choice.reason, fallback)


def _after_cudnn(spec: BlockSpec, caps: CudaCaps, needs_mask: bool, dim: int) -> Choice:
    sm80 = tuple(caps.capability) >= (8, 0)
    if needs_mask:
        if caps.efficient_op:
            return Choice(EFFICIENT, "a mask: memory-efficient SDPA with an additive bias")
        if caps.flex:
            return Choice(FLEX, "a mask: FlexAttention block mask (memory-efficient op missing)")
        return Choice(MATH, "a masked block needs the memory-efficient SDPA op or FlexAttention; neither is available")
    if spec.dtype in _HALF and sm80 and dim <= FLASH_MAX_HEAD_DIM and caps.flash_op:
        return Choice(FLASH, "no mask, fp16/bf16: SDPA flash")
    if caps.efficient_op:
        return Choice(EFFICIENT, "no mask: memory-efficient SDPA (fp32, or a head size / device the flash op lacks)")
    if caps.flex:
        return Choice(FLEX, "no mask: FlexAttention (SDPA ops missing)")
    return Choice(MATH, "neither torch's SDPA ops nor FlexAttention are available")


def varlen_applies(spec: BlockSpec, caps: CudaCaps | None) -> bool:
    """Whether ``varlen_attn`` (one call for all documents of a packed row) takes blocks like ``spec``:
    fp16/bf16 on compute capability >= 8.0, equal head sizes <= 256 that are a multiple of 8, no mask,
    sinks or soft-capping, and a torch that has it."""
    if caps is None or not caps.varlen or spec.dtype not in _HALF or tuple(caps.capability) < (8, 0):
        return False
    if spec.masked or spec.sinks or spec.softcap or spec.head_dim != spec.value_dim:
        return False
    return spec.head_dim % 8 == 0 and spec.head_dim <= FLASH_MAX_HEAD_DIM


#: the packed-row cuDNN call needs a longest query chunk past this many tokens before torch 2.15 with cuDNN 9.24
#: (torch's ``varlen_attn``: 2.14 ``_can_use_cudnn``, 2.15 "max_q <= 128 requires cuDNN >= 9.24")
CUDNN_VARLEN_MIN_MAX_LEN = 129


def cudnn_packed_problem(spec: BlockSpec, caps: CudaCaps | None, *, causal: bool, max_q: int | None,
                         window: int | None = None) -> str | None:  # fmt: skip
    """Why one packed-row cuDNN call (``aten._cudnn_attention_forward`` with ``cum_seq_q`` / ``cum_seq_k``) cannot take
    these blocks, or ``None``: exactly the calls the installed torch's own ``varlen_attn`` runs it for
    (``aten_schemas.cudnn_varlen_problem``). ``causal``: square causal blocks (one ``cu_seq`` for Q and K); else full
    blocks of query chunks against key ranges; ``max_q``: the longest query chunk (``None``: unknown, assumed long).
    Pure."""
    if not varlen_applies(spec, caps):
        return ("the packed-row call takes fp16/bf16 on compute capability >= 8.0, equal head sizes that are multiples "
                "of 8, no mask, sinks or soft-capping")  # fmt: skip
    assert caps is not None
    if not caps.cudnn_varlen:
        return ("this torch / cuDNN has no packed-row cuDNN call torch itself runs (torch >= 2.14, cuDNN >= 9.18, "
                "compute capability 9.x / 10.x)")  # fmt: skip
    if window is not None:
        return "cuDNN's packed-row call takes no window"
    if padded_head_dim(spec) > CUDNN_MAX_HEAD_DIM:
        return f"head size {padded_head_dim(spec)} is past cuDNN's {CUDNN_MAX_HEAD_DIM}"
    if max_q is not None and max_q <= 1:
        return "one-token query chunks (torch's decode path, which some cuDNN versions disable)"
    if causal and not caps.cudnn_varlen_causal:
        return "this torch's varlen_attn runs the packed-row cuDNN call for full attention only, not causal (torch 2.14)"
    if max_q is not None and max_q < CUDNN_VARLEN_MIN_MAX_LEN and not caps.cudnn_varlen_short:
        return f"the longest query chunk ({max_q} tokens) is not past 128 tokens (torch 2.15 with cuDNN >= 9.24 takes it)"
    return None


def packed_choice(spec: BlockSpec, caps: CudaCaps | None, pinned: str | None = None, *, causal: bool,
                  max_q: int | None) -> Choice | None:  # fmt: skip
    """One packed-row cuDNN call for a set of blocks of one kind (thd's and thd_docs' diagonal blocks: ``causal``,
    square; their prefix blocks: full, query chunks against longer key ranges), or ``None`` (each block then runs its
    own kernel, :func:`select_backend`). The conditions of Ulysses' whole documents (:func:`varlen_choice`'s cuDNN
    branch): ``auto`` where cuDNN is preferred on this GPU, or ``model.attention_backend=cudnn``, and
    :func:`cudnn_packed_problem` is ``None``. Pure."""
    if not (pinned == CUDNN or (pinned is None and caps is not None and caps.cudnn_preferred)):
        return None
    if _packed_set_problem(spec, caps, causal=causal, max_q=max_q) is not None:
        return None
    return Choice(CUDNN, f"{'causal' if causal else 'full'} blocks in one cuDNN packed-row call "
                  "(aten._cudnn_attention_forward with cum_seq_q / cum_seq_k)", varlen=True)  # fmt: skip


def _packed_set_problem(spec: BlockSpec, caps: CudaCaps | None, *, causal: bool, max_q: int | None) -> str | None:
    """:func:`cudnn_packed_problem`, and grouped K/V only where torch hands them to the call as they are (2.15):
    the block sets never repeat K/V (a repeat of the whole row's gathered keys would cost ``Hq / Hkv`` times their
    memory; the per-block cuDNN kernel takes them grouped instead)."""
    if spec.grouped and caps is not None and not caps.cudnn_varlen_gqa:
        return ("this torch's varlen_attn runs the packed-row cuDNN call for equal head counts only (torch 2.14); "
                "the blocks keep their grouped K/V in per-block calls")  # fmt: skip
    return cudnn_packed_problem(spec, caps, causal=causal, max_q=max_q)


def packed_refusal(spec: BlockSpec, caps: CudaCaps | None, pinned: str | None = None, *, causal: bool,
                   max_q: int | None) -> str:  # fmt: skip
    """Why :func:`packed_choice` is ``None`` for these arguments (one line, for the log)."""
    if pinned not in (None, CUDNN):
        return f"model.attention_backend pins {pinned}, which has no packed-row call here"
    if pinned is None and (caps is None or not caps.cudnn_preferred):
        return "cuDNN is not preferred on this GPU / cuDNN (auto)"
    return _packed_set_problem(spec, caps, causal=causal, max_q=max_q) or "the packed-row call does not apply"


def varlen_choice(
    spec: BlockSpec, caps: CudaCaps | None, pinned: str | None = None, *, window: int | None = None,
    max_len: int | None = None,
) -> Choice | None:  # fmt: skip
    """The one call that takes all documents of a packed row (causal or full inside each document), or ``None``:
    each document then runs as blocks (:func:`select_backend`). Pure.

    - cuDNN (``aten._cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k``; grouped K/V
      repeated per query head on torch 2.14, whose gate wants equal heads, as they are on 2.15) where the installed
      torch's own ``varlen_attn`` runs that op for these documents (:func:`cudnn_packed_problem`: torch >= 2.14,
      cuDNN >= 9.18, compute capability 9.x / 10.x, no window, head sizes <= 128, the longest document
      ``max_len`` past 128 tokens unless torch 2.15 with cuDNN >= 9.24, and causal
      documents from torch 2.15 only) and ``auto`` prefers cuDNN on this GPU (``caps.cudnn_preferred``) or
      ``model.attention_backend=cudnn`` pins it;
    - else flash through ``varlen_attn`` (causal, full, or a sliding ``window``) under ``auto`` or a flash pin,
      grouped K/V as they are where that torch's ``varlen_attn`` hands them on so (``caps.varlen_gqa``: torch
      2.11-2.15, with ``enable_gqa`` from 2.12; repeated per query head outside the table), except where that
      ``varlen_attn`` would itself run cuDNN regardless of SDPA's backends (torch 2.14: full attention of equal heads
      the cuDNN call takes; grouped K/V turn its cuDNN path off): a flash pin (or ``auto`` where cuDNN is not
      preferred) then runs per-document blocks. From 2.15 ``varlen_attn`` follows the flash pin (``sdpa_kernel``) and
      auto's order, so it runs flash there;
    - ``None`` for any other pin (the per-document blocks run the pinned kernel) or where neither applies.
    """
    if not varlen_applies(spec, caps) or (window is not None and not spec.causal):
        return None
    assert caps is not None
    cudnn_takes = cudnn_packed_problem(spec, caps, causal=spec.causal, max_q=max_len, window=window) is None
    want_cudnn = pinned == CUDNN or (pinned is None and caps.cudnn_preferred)
    if want_cudnn and cudnn_takes:
        return Choice(CUDNN, "all documents of the row in one cuDNN varlen call (aten._cudnn_attention_forward "
                      "with cum_seq_q / cum_seq_k)", expand_kv=spec.grouped and not caps.cudnn_varlen_gqa,
                      varlen=True)  # fmt: skip
    # torch 2.14's varlen_attn runs cuDNN whenever its gate passes, which refuses grouped K/V handed as they are
    # (enable_gqa); 2.15's follows the flash pin / auto's order
    if pinned not in (None, FLASH) or _varlen_attn_runs_cudnn(spec, caps, cudnn_takes):
        return None
    expand = spec.grouped and not caps.varlen_gqa
    return Choice(FLASH, "all documents of the row in one varlen_attn call (flash)" +
                  ("; grouped K/V as they are" if spec.grouped and not expand else ""), expand_kv=expand,
                  varlen=True)  # fmt: skip


def _varlen_attn_runs_cudnn(spec: BlockSpec, caps: CudaCaps, cudnn_takes: bool) -> bool:
    """Whether torch's own ``varlen_attn`` would run its cuDNN path for a call the glue means for flash, whatever
    SDPA's backends say (torch 2.14, ``aten_schemas.varlen_follows_sdpa`` false): where cuDNN's packed-row call takes
    these documents and K/V reach it with equal heads (``enable_gqa`` with grouped K/V turns 2.14's cuDNN path off)."""
    return cudnn_takes and not caps.varlen_follows_sdpa and not (spec.grouped and caps.varlen_gqa)


def varlen_refusal(spec: BlockSpec, caps: CudaCaps | None, pinned: str | None = None, *, window: int | None = None,
                   max_len: int | None = None) -> str:  # fmt: skip
    """Why :func:`varlen_choice` is ``None`` for these arguments (one line, for the log)."""
    if caps is None or not caps.varlen:
        return "this torch has no varlen_attn (torch >= 2.10) or the device is not CUDA"
    if not varlen_applies(spec, caps):
        return "varlen_attn takes fp16/bf16 on compute capability >= 8.0, equal head sizes <= 256 (multiples of 8), no sinks or soft-capping"
    if window is not None and not spec.causal:
        return "a window without causal masking"
    if pinned not in (None, FLASH, CUDNN):
        return f"model.attention_backend pins {pinned}, which has no packed-row call"
    problem = cudnn_packed_problem(spec, caps, causal=spec.causal, max_q=max_len, window=window)
    if _varlen_attn_runs_cudnn(spec, caps, problem is None):
        return ("this torch's varlen_attn runs cuDNN for these documents (torch 2.14: whatever SDPA's backends), and "
                "the flash kernel is pinned or cuDNN is not preferred here")  # fmt: skip
    if pinned == CUDNN:
        return problem or "cuDNN's packed-row call does not apply"
    return "varlen_attn does not apply"


# ---------------------------------------------------------------------------------------------------------
# the selection from what a GPU, a torch and a cuDNN are (pure: tests per GPU and release, the dry run's plan)

#: torch's SDPA puts cuDNN first on these compute capabilities (H100/H200, B200, B300) when the runtime cuDNN is
#: newer than 9.15.0 (``check_prefer_cudnn_attention``, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, torch
#: 2.11-2.15); ``auto`` follows the same rule for the CP blocks. Not Ampere, Ada or sm120 (RTX PRO 6000): cuDNN is
#: slower or even there (0.82x A100, 1.00x L40S, 0.88x RTX PRO 6000; transformers PR #48163)
CUDNN_PREFERRED_CAPABILITIES = ((9, 0), (10, 0), (10, 3))
CUDNN_PREFERRED_MIN_VERSION = 91500  # strictly greater than this (cuDNN 9.15.1 and newer)
#: the runtime cuDNN the plans assume where the installed torch cannot say (a CPU-only torch planning for a GPU):
#: 9.19, the cuDNN of torch 2.11's CUDA wheel (docs/gpu.md), the oldest release the kernel table covers; a run
#: on a CUDA torch plans with its own ``torch.backends.cudnn.version()``
REFERENCE_CUDNN_VERSION = 91900
#: compute capability of the GPUs the docs name (``GpuInfo.named``)
GPU_CAPABILITIES = {"a100": (8, 0), "a10g": (8, 6), "l40s": (8, 9), "h100": (9, 0), "h200": (9, 0),
                    "b200": (10, 0), "b300": (10, 3), "rtx pro 6000": (12, 0)}  # fmt: skip


@dataclass(frozen=True)
class GpuInfo:
    """A GPU by name and compute capability (``torch.cuda.get_device_name`` / ``get_device_capability``)."""

    name: str
    capability: tuple[int, int]

    @staticmethod
    def named(name: str) -> GpuInfo:
        """One of :data:`GPU_CAPABILITIES` (``"h100"``, case-insensitive)."""
        key = name.lower()
        if key not in GPU_CAPABILITIES:
            raise ValueError(f"GPU {name!r} is not in the table {sorted(GPU_CAPABILITIES)}; give GpuInfo(name, capability)")
        return GpuInfo(name, GPU_CAPABILITIES[key])


def caps_for(gpu: GpuInfo, torch_version: str, cudnn_version: int | None) -> CudaCaps:
    """The :class:`CudaCaps` of ``gpu`` with a torch of ``torch_version`` (a CUDA build: Triton and flash, efficient
    and cuDNN ops in every supported release, ``aten_schemas``) and a runtime cuDNN ``cudnn_version``
    (``torch.backends.cudnn.version()``: 91900 is 9.19.0; ``None``: none, or unknown)."""
    from automodel.distributed.cp import aten_schemas

    release = aten_schemas.torch_release(torch_version)
    if release not in aten_schemas.SUPPORTED_RELEASES:
        raise ValueError(
            f"torch {torch_version} is outside the releases the kernel table covers ({', '.join(aten_schemas.SUPPORTED_RELEASES)}); "
            "add its schemas to automodel/distributed/cp/aten_schemas.py"
        )

    def has(op: str) -> bool:
        return aten_schemas.schema_for(op, release) is not None and aten_schemas.schema_for(op + "_backward", release) is not None

    cap = tuple(gpu.capability)
    cudnn_op = has("_scaled_dot_product_cudnn_attention") and cudnn_version is not None and cap >= (8, 0)
    return release_caps(
        cap, release, cudnn_version, flash_op=has("_scaled_dot_product_flash_attention"),
        efficient_op=has("_scaled_dot_product_efficient_attention"), flex=True, varlen=True, cudnn_op=cudnn_op,
        cudnn_preferred=cudnn_op and cap in CUDNN_PREFERRED_CAPABILITIES and cudnn_version > CUDNN_PREFERRED_MIN_VERSION,
        cudnn_varlen_ops=True,
    )  # fmt: skip


def release_caps(
    capability: tuple[int, int], release: str, cudnn_version: int | None, *, flash_op: bool, efficient_op: bool,
    flex: bool, varlen: bool, cudnn_op: bool, cudnn_preferred: bool, cudnn_varlen_ops: bool,
) -> CudaCaps:  # fmt: skip
    """The :class:`CudaCaps` of a device of ``capability`` under torch ``release`` (``"2.15"``) with a runtime
    ``cudnn_version``, from what the caller found (the ops, FlexAttention, ``varlen_attn``, cuDNN and whether SDPA
    prefers it: a plan reads them from the tables, :func:`caps_for`; a run from the installed torch and the device,
    ``cuda_blocks.cuda_caps``) and what the tables of :mod:`~automodel.distributed.cp.aten_schemas` say of the
    release: one place for both, so a run selects exactly what its plan printed. ``cudnn_varlen_ops``: the
    packed-row cuDNN ops exist."""
    from automodel.distributed.cp import aten_schemas

    def cudnn_varlen_takes(**kw: Any) -> bool:
        return aten_schemas.cudnn_varlen_problem(release, cudnn_version, **kw) is None

    return CudaCaps(
        capability=tuple(capability), flash_op=flash_op, efficient_op=efficient_op, flex=flex, varlen=varlen,
        cudnn_op=cudnn_op, cudnn_preferred=cudnn_preferred,
        cudnn_gqa=cudnn_op and aten_schemas.takes_grouped_kv(CUDNN, release),
        cudnn_varlen=cudnn_op and cudnn_varlen_ops and aten_schemas.cudnn_varlen_runs(release, cudnn_version,
                                                                                      tuple(capability)),
        varlen_follows_sdpa=aten_schemas.varlen_follows_sdpa(release),
        flash_gqa=aten_schemas.takes_grouped_kv(FLASH, release),
        cudnn_varlen_causal=cudnn_varlen_takes(causal=True, max_q=None),
        cudnn_varlen_short=cudnn_varlen_takes(causal=False, max_q=1),
        cudnn_varlen_gqa=cudnn_varlen_takes(causal=False, max_q=None, grouped=True),
        varlen_gqa=varlen and aten_schemas.varlen_takes_grouped_kv(release),
    )  # fmt: skip


def select_kernel(
    gpu: GpuInfo, torch_version: str, cudnn_version: int | None, spec: BlockSpec, *, varlen: bool = False,
    pinned: str | None = None, window: int | None = None, max_len: int | None = None,
) -> Choice:  # fmt: skip
    """The kernel that computes a block like ``spec`` (its dtype, head sizes, causal square / full / rectangular
    shape, mask, GQA) on ``gpu`` with this torch and cuDNN; ``varlen``: the block is all documents of a packed
    row (a sliding ``window``, the longest document ``max_len``), which one call takes where
    :func:`varlen_choice` applies (cuDNN's packed-row op or flash's ``varlen_attn``), else the per-document
    blocks' kernel. :attr:`Choice.expand_kv` says whether grouped K/V are repeated for it. Pure; the docs' table
    (docs/gpu.md, "Which kernel runs") is this function per GPU.

    Raises:
        ValueError: a ``pinned`` kernel cannot take the block, or the torch release is outside the table.
    """
    caps = caps_for(gpu, torch_version, cudnn_version)
    if varlen:
        choice = varlen_choice(spec, caps, pinned, window=window, max_len=max_len)
        if choice is not None:
            return choice
    return select_backend("cuda", spec, caps, pinned)
