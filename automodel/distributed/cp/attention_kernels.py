"""``model.attention_backend``: which CUDA attention kernel runs, the rule ``auto`` follows, and what each
kernel's backward allocates (the memory planner's per-kernel term).

One choice, made here and read everywhere:

- the CP block kernels (:mod:`automodel.distributed.cp.cuda_blocks`, ring / thd / thd_docs / usp and
  Ulysses' document blocks) read :func:`pinned_kernel` (``None``: ``auto``, their own selection table,
  :func:`~automodel.distributed.cp.block_backend.select_backend`);
- kernels torch's SDPA dispatches (Hugging Face's ``sdpa`` attention without CP, Ulysses' inner ``sdpa``
  kernel) run inside :func:`attention_backend_context`, which enters ``torch.nn.attention.sdpa_kernel``
  with the pinned backend (``auto``: SDPA's own priority order);
- the memory planner resolves ``auto`` with :func:`auto_kernel` for the GPU it plans for and adds
  :func:`kernel_buffers` to one layer's attention backward.

The names (:data:`ATTENTION_BACKENDS`): ``flash`` (FlashAttention-2 in aten), ``cudnn`` (cuDNN's fused
attention), ``efficient`` (the memory-efficient CUTLASS kernel), ``flex`` (FlexAttention, Triton), ``math``
(exact, a score matrix per call). On CPU every run uses the CPU kernels (the pin applies to CUDA only).

Nothing here imports torch.distributed or transformers; the config rules read :data:`ATTENTION_BACKENDS`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from automodel.distributed.cp.block_backend import (
    CUDNN,
    CUDNN_PREFERRED_CAPABILITIES,
    CUDNN_PREFERRED_MIN_VERSION,
    EFFICIENT,
    FLASH,
    FLEX,
    MATH,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AUTO_BACKEND",
    "CPU_KERNEL",
    "CUDNN_PREFERRED_CAPABILITIES",
    "CUDNN_PREFERRED_MIN_VERSION",
    "KERNEL_OF_BACKEND",
    "KernelBuffer",
    "KernelCall",
    "attention_backend_context",
    "attention_backend_problem",
    "auto_kernel",
    "auto_sdpa_order",
    "run_kernel_line",
    "sdpa_dispatch_choice",
    "kernel_buffers",
    "kernel_label",
    "packed_blocks_context",
    "packed_blocks_enabled",
    "pinned_kernel",
]

AUTO_BACKEND = "auto"
#: ``model.attention_backend`` values: ``auto`` and one name per kernel
ATTENTION_BACKENDS = (AUTO_BACKEND, "flash", "cudnn", "efficient", "flex", "math")
#: config name -> the kernel name of :mod:`automodel.distributed.cp.block_backend`
KERNEL_OF_BACKEND = {"flash": FLASH, "cudnn": CUDNN, "efficient": EFFICIENT, "flex": FLEX, "math": MATH}
#: the planner's name for torch's CPU kernels (the CPU flash kernel; what the planner is calibrated on)
CPU_KERNEL = "cpu"
# CUDNN_PREFERRED_CAPABILITIES / CUDNN_PREFERRED_MIN_VERSION (block_backend): torch's SDPA puts cuDNN first there;
# elsewhere its order is flash, memory-efficient, math, cuDNN
#: the largest head size the cuDNN and flash kernels take
_CUDNN_MAX_HEAD_DIM = 128
_FLASH_MAX_HEAD_DIM = 256

_LABELS = {
    FLASH: "flash (FlashAttention-2, aten)",
    CUDNN: "cudnn (cuDNN fused attention)",
    EFFICIENT: "efficient (memory-efficient, CUTLASS)",
    FLEX: "flex (FlexAttention, Triton)",
    MATH: "math (exact, a score matrix per call)",
    CPU_KERNEL: "cpu (torch's CPU flash kernel)",
    "flash3": "flash3 (FlashAttention-3, flash-attn's Hopper build; the step estimate of published runs only)",
}

# a plain list (not a ContextVar): autograd may run the backward on another thread
_PINNED: list[str] = []


def attention_backend_problem(name: object) -> str | None:
    """``None`` if ``name`` is a ``model.attention_backend`` value, else the one-line reason and fix."""
    if name in ATTENTION_BACKENDS:
        return None
    return (
        f"model.attention_backend={name!r} is not one of {list(ATTENTION_BACKENDS)}: 'auto' runs the kernel torch "
        "picks for the GPU, a kernel name pins that kernel (docs/long_context.md, 'Attention kernels')"
    )


def kernel_label(kernel: str) -> str:
    """A kernel's name with what it is (the dry run's and ``automodel plan``'s wording)."""
    return _LABELS.get(kernel, kernel)


#: the innermost :func:`packed_blocks_context`'s switch (empty: on)
_PACKED_BLOCKS: list[bool] = []


def packed_blocks_enabled() -> bool:
    """Whether thd's, thd_docs' and usp's block sets may run as cuDNN's packed-row calls where the GPU and torch take
    them (``model.cudnn_packed_blocks``, entered by :func:`packed_blocks_context`; default on)."""
    return _PACKED_BLOCKS[-1] if _PACKED_BLOCKS else True


@contextlib.contextmanager
def packed_blocks_context(enabled: bool) -> Iterator[None]:
    """Inside the block, ``model.cudnn_packed_blocks=enabled``: ``False`` runs each block set as one cuDNN call per
    block (:func:`automodel.distributed.cp.cuda_blocks.packed_takes` says no) without the packed calls' token-major
    copies of the row's K/V. Mutates a module-level stack seen by every thread (autograd's backward thread too);
    nests."""
    if not isinstance(enabled, bool):
        raise TypeError(f"model.cudnn_packed_blocks must be true or false, got {enabled!r}")
    _PACKED_BLOCKS.append(enabled)
    try:
        yield
    finally:
        _PACKED_BLOCKS.pop()


def pinned_kernel() -> str | None:
    """The kernel pinned by the innermost :func:`attention_backend_context` (a
    :data:`~automodel.distributed.cp.block_backend.KERNELS` name), or ``None`` (``auto``)."""
    return _PINNED[-1] if _PINNED and _PINNED[-1] != AUTO_BACKEND else None


def _sdpa_backend(kernel: str):  # noqa: ANN202 - a torch.nn.attention.SDPBackend
    from torch.nn.attention import SDPBackend

    return {
        FLASH: SDPBackend.FLASH_ATTENTION,
        CUDNN: SDPBackend.CUDNN_ATTENTION,
        EFFICIENT: SDPBackend.EFFICIENT_ATTENTION,
        MATH: SDPBackend.MATH,
    }[kernel]


@contextlib.contextmanager
def attention_backend_context(name: str, device_type: str = "cuda") -> Iterator[None]:
    """Run the attention inside the block with ``model.attention_backend=name`` on a ``device_type`` device.

    On CUDA with a pinned kernel: the CP block kernels run it (:func:`pinned_kernel`; a block it cannot take
    raises ``ValueError`` naming the block and the kernels that can), and torch's SDPA dispatch runs it
    (``torch.nn.attention.sdpa_kernel``: a call it cannot take raises torch's "No available kernel" error,
    never a silent fallback). ``flex`` pins the CP blocks only; SDPA-dispatched attention under ``flex``
    needs ``model.attn_implementation=flex_attention`` (the config rules say so). ``auto`` on a CUDA device
    sets SDPA's priority to :func:`auto_sdpa_order` (the block kernels' rule, so Ulysses' inner kernel follows
    it); off CUDA (or without a GPU) nothing changes. Mutates a module-level stack seen by every thread; nests.
    """
    problem = attention_backend_problem(name)
    if problem:
        raise ValueError(problem)
    if device_type != "cuda":
        yield
        return
    if name == AUTO_BACKEND:
        import torch

        if not torch.cuda.is_available():
            yield
            return
        from torch.nn.attention import sdpa_kernel

        version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "0") not in ("", "0"):  # torch's switch, honoured
            version = None
        order = auto_sdpa_order(tuple(torch.cuda.get_device_capability()), version)
        with sdpa_kernel([_sdpa_backend(k) for k in order], set_priority=True):
            yield
        return
    kernel = KERNEL_OF_BACKEND[name]
    with contextlib.ExitStack() as stack:
        if kernel != FLEX:
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel([_sdpa_backend(kernel)]))
        _PINNED.append(kernel)
        stack.callback(_PINNED.pop)
        yield


#: ``torch.nn.attention.SDPBackend`` values -> kernel names
_SDPA_BACKEND_NAMES = {0: MATH, 1: FLASH, 2: EFFICIENT, 3: CUDNN}


def sdpa_dispatch_choice(query, key, value, attn_mask, dropout_p: float, is_causal: bool,  # noqa: ANN001
                         scale: float | None) -> str | None:  # fmt: skip
    """The kernel torch's SDPA dispatch runs for a call with these tensors (``[B, H, S, D]``; fewer K/V heads: GQA)
    under the active ``sdpa_kernel`` pin / priority, as :func:`attention_backend_context` set it:
    ``aten._fused_sdp_choice`` (the selection ``scaled_dot_product_attention`` itself makes; one schema in torch
    2.11-2.15). A :data:`~automodel.distributed.cp.block_backend.KERNELS` name (on CPU ``sdpa_flash`` is the CPU
    flash kernel), or ``None`` where torch does not say. Touches no data (a CPU-side check of shapes, dtypes and
    flags)."""
    import torch

    try:
        index = torch.ops.aten._fused_sdp_choice(query, key, value, attn_mask, float(dropout_p), bool(is_causal),
                                                 scale=scale, enable_gqa=key.shape[-3] != query.shape[-3])  # fmt: skip
    except (RuntimeError, TypeError, AttributeError):  # no viable kernel (SDPA raises the same at the call), old torch
        return None
    return _SDPA_BACKEND_NAMES.get(int(index))


def run_kernel_line(name: str, device_type: str, capability: tuple[int, int] | None = None,
                    cudnn_version: int | None = None) -> str:  # fmt: skip
    """The run log's line saying which attention kernels run (pure; the trainer logs it once)."""
    if device_type != "cuda":
        pinned = f"; model.attention_backend={name} applies on CUDA only" if name != AUTO_BACKEND else ""
        return (f"attention kernels on {device_type}: torch's CPU kernels (SDPA's CPU flash kernel; the CP blocks' CPU "
                f"flash kernel, exact math for blocks it does not take){pinned}")  # fmt: skip
    if name != AUTO_BACKEND:
        return f"attention kernels: {kernel_label(KERNEL_OF_BACKEND[name])}, pinned by model.attention_backend={name}"
    order = auto_sdpa_order(capability, cudnn_version) if capability is not None else [FLASH, EFFICIENT, MATH, CUDNN]
    gpu = f"compute capability {capability[0]}.{capability[1]}" if capability else "this GPU"
    return (f"attention kernels (auto on {gpu}, cuDNN {cudnn_version}): SDPA tries {', '.join(order)}; the CP blocks "
            f"log their kernel per layer kind (logger automodel.distributed.cp.blocks)")  # fmt: skip


def auto_sdpa_order(capability: tuple[int, int], cudnn_version: int | None) -> list[str]:
    """The order ``auto`` gives torch's SDPA dispatch (HF ``sdpa`` without CP, Ulysses' inner kernel) on a GPU of
    ``capability`` with a runtime cuDNN ``cudnn_version``: the block kernels' rule (cuDNN first where
    :data:`CUDNN_PREFERRED_CAPABILITIES` and a cuDNN newer than 9.15.0, else flash, memory-efficient, math, cuDNN),
    set with ``sdpa_kernel(..., set_priority=True)`` so the inner kernel follows it on any torch. Pure."""
    if cudnn_version is not None and tuple(capability) in CUDNN_PREFERRED_CAPABILITIES and (
        cudnn_version > CUDNN_PREFERRED_MIN_VERSION
    ):
        return [CUDNN, FLASH, EFFICIENT, MATH]
    return [FLASH, EFFICIENT, MATH, CUDNN]


def auto_kernel(
    path: str,
    capability: tuple[int, int] | None,
    cudnn_version: int | None,
    *,
    half: bool = True,
    head_dim: int = 128,
) -> tuple[str, str]:
    """``(kernel, the rule that chose it)``: what ``model.attention_backend=auto`` runs on a GPU.

    Args:
        path: ``"sdpa"``: torch's SDPA dispatch (HF ``sdpa`` without CP, Ulysses' inner kernel); ``"blocks"``:
            the CP block kernels (:func:`~automodel.distributed.cp.block_backend.select_backend`).
        capability: the GPU's compute capability; ``None``: no GPU known (the CPU kernels).
        cudnn_version: the runtime cuDNN (``torch.backends.cudnn.version()``); ``None``: unknown here.
        half: the compute dtype is fp16/bf16; head_dim: the (padded) head size.

    The SDPA rule (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``priority_order`` and
    ``check_prefer_cudnn_attention``): cuDNN first on compute capability 9.0 / 10.0 / 10.3 with a runtime
    cuDNN newer than 9.15.0, else flash (fp16/bf16, compute capability >= 8.0, head size <= 256), else the
    memory-efficient kernel. With the cuDNN version unknown (a CPU-only torch plans for a GPU), the flash
    kernel is assumed: of the two it allocates more in its backward, so the plan is an upper bound. The CP
    block kernels follow the same rule for their unmasked blocks (``select_backend`` with
    ``CudaCaps.cudnn_preferred``) and take the memory-efficient kernel for masked ones.
    """
    if capability is None:
        return CPU_KERNEL, "no GPU: torch's CPU kernels"
    cap = tuple(capability)
    flash_ok = half and cap >= (8, 0) and head_dim <= _FLASH_MAX_HEAD_DIM
    if half and cap in CUDNN_PREFERRED_CAPABILITIES and head_dim <= _CUDNN_MAX_HEAD_DIM:
        if cudnn_version is None:
            if flash_ok:
                return FLASH, (f"compute capability {cap[0]}.{cap[1]}: torch's SDPA prefers cuDNN only with a cuDNN "
                               "newer than 9.15.0, and the cuDNN version is unknown here; planned for flash, whose "
                               "backward allocates more (pin model.attention_backend=cudnn to plan cuDNN)")  # fmt: skip
        elif cudnn_version > CUDNN_PREFERRED_MIN_VERSION:
            who = "torch's SDPA tries" if path == "sdpa" else "the CP block kernels run"
            return CUDNN, f"compute capability {cap[0]}.{cap[1]} with cuDNN {cudnn_version}: {who} cuDNN first"
    if flash_ok:
        where = "torch's SDPA order (flash first)" if path == "sdpa" else "the CP block kernels (flash for unmasked blocks)"
        return FLASH, f"fp16/bf16 on compute capability {cap[0]}.{cap[1]}: {where}"
    return EFFICIENT, f"compute capability {cap[0]}.{cap[1]} / this dtype or head size: the memory-efficient kernel"


@dataclass(frozen=True)
class KernelCall:
    """The shape of one attention kernel call on one rank (what its backward allocates depends on).

    Attributes:
        batch: rows; q_tokens / k_tokens: queries and keys per row the call sees.
        heads / kv_heads: query and key/value heads the call sees; head_dim: the (padded) head size.
        dtype_bytes: bytes of q/k/v (2 for bf16).
        native_gqa: the kernel receives ``kv_heads < heads`` (torch's SDPA with ``enable_gqa``); ``False``: the CP
            block glue's call, which repeats K/V to ``heads`` for the memory-efficient kernel only (cuDNN and flash
            take grouped K/V there too: ``aten_schemas.GROUPED_KV``, torch 2.11-2.15).
    """

    batch: int
    q_tokens: int
    k_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    native_gqa: bool = True


@dataclass(frozen=True)
class KernelBuffer:
    """One buffer a kernel's backward allocates beyond its gradients in the inputs' dtype."""

    name: str
    shape: str
    dtype: str
    bytes: float
    source: str


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def kernel_buffers(kernel: str, call: KernelCall) -> list[KernelBuffer]:
    """The buffers ``kernel``'s backward allocates for one call, beyond dQ/dK/dV in the inputs' dtype (the
    outputs every kernel returns, the CPU kernels included, so the CPU-calibrated activations cover them).

    Each buffer names the torch / cuDNN source that allocates it (docs/long_context.md, "Attention
    kernels", tabulates them). Pure arithmetic.
    """
    b, n, m, h, hkv, d, c = (call.batch, call.q_tokens, call.k_tokens, call.heads, call.kv_heads, call.head_dim,
                             call.dtype_bytes)  # fmt: skip
    grouped = hkv < h
    out: list[KernelBuffer] = []
    if kernel == FLASH:
        src = "aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, mha_bwd"
        out.append(KernelBuffer("dq_accum", f"[{b}, round128({n}), {h}, round32({d})]", "fp32",
                                b * _round(n, 128) * h * _round(d, 32) * 4, src))  # fmt: skip
        out.append(KernelBuffer("softmax_d", f"[{b}, {h}, round128({n})]", "fp32", b * h * _round(n, 128) * 4, src))
        if grouped:  # SDPA's own calls and the CP block glue's alike (aten_schemas.GROUPED_KV: no repeat for flash)
            out.append(KernelBuffer("dk_expanded, dv_expanded", f"2 x [{b}, {m}, {h}, {d}]", f"{c} B",
                                    2 * b * m * h * d * c, src))  # fmt: skip
    elif kernel == CUDNN:
        src = ("cudnn-frontend include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, SDPABackwardNode "
               "(the workspace of aten's _scaled_dot_product_cudnn_attention_backward, cuda/attention_backward.cu)")
        out.append(KernelBuffer("dQ_accum (workspace)", f"[{b}, {h}, {n}, {d}]", "fp32", b * h * n * d * 4, src))
        out.append(KernelBuffer("softmax_sum (workspace)", f"[{b}, {h}, {n}, 1]", "fp32", b * h * n * 4, src))
    elif kernel == EFFICIENT:
        src = ("aten/src/ATen/native/transformers/cuda/attention_backward.cu, _efficient_attention_backward; "
               "mem_eff_attention/kernel_backward.h, workspace_size")
        out.append(KernelBuffer("delta", f"[{b}, {h}, {n}]", "fp32", b * h * n * 4, src))
        out.append(KernelBuffer("workspace: gQ accumulator", f"[{b}, {h}, round64({n}), round64({d})]", "fp32",
                                b * h * _round(n, 64) * _round(d, 64) * 4, src))  # fmt: skip
        out.append(KernelBuffer("workspace: gK, gV accumulators (upper bound)", f"2 x [{b}, {h}, round64({m}), {d}]",
                                "fp32", 2 * b * h * _round(m, 64) * d * 4, src))  # fmt: skip
        if grouped:  # no native GQA: K/V and their gradients at the query head count
            out.append(KernelBuffer("K/V repeated to all heads and dK/dV before the sum", f"4 x [{b}, {h}, {m}, {d}]",
                                    f"{c} B", 4 * b * h * m * d * c,
                                    "automodel/distributed/cp/cuda_blocks.py, _sdpa_inputs / _unrepeat"))  # fmt: skip
    elif kernel == FLEX:
        src = "torch/_inductor/kernel/flex/flex_attention.py, the backward template (flex_attention_backward)"
        out.append(KernelBuffer("delta", f"[{b}, {h}, {n}]", "fp32", b * h * n * 4, src))
        if grouped:
            out.append(KernelBuffer("dK, dV per query head before the sum", f"2 x [{b}, {h}, {m}, {d}]", f"{c} B",
                                    2 * b * h * m * d * c, src))  # fmt: skip
    elif kernel == MATH:
        src = "automodel/distributed/cp/blocks.py (math blocks); aten's _scaled_dot_product_attention_math"
        out.append(KernelBuffer("scores, probabilities and their gradient", f"3 x [{b}, {h}, {n}, {m}]", "fp32",
                                3 * b * h * n * m * 4, src))  # fmt: skip
    return out
