"""How fast each attention kernel runs on each GPU: the step estimate's attention constants, one per kernel,
GPU and pass, each cited to a published measurement (``docs/estimate.md``, "Attention kernels").

A constant is the achieved fraction of the GPU's dense BF16 peak (:mod:`automodel.config.gpu_specs`) with the
estimate's FLOP count: causal attention counted halved, the backward as twice the forward. Papers count the
backward as 2.5 forward passes (five matrix products against two), so a published backward figure ``T``
becomes ``0.8 T`` here. The published figures are the kernels alone (one call, long rows); the estimate uses
them as they are (no derating inside a step): TRL's measured 1M-token steps, with flash and with cuDNN, land
within 10% of that (docs/estimate.md, "Checked against published long-row runs").

Kernel names are those of :mod:`automodel.distributed.cp.block_backend` (the dry run's planned kernel,
``RunShape.attention_kernel``), plus :data:`FLASH3` (FlashAttention-3 of the flash-attn package: no
``model.attention_backend`` runs it; the estimate has it for published runs that used it). Pure data and
arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from automodel.config.gpu_specs import GPU_SPECS, GPUSpec
from automodel.distributed.cp.block_backend import CUDNN, EFFICIENT, FLASH, FLEX, MATH

__all__ = ["FLASH3", "KernelSpeed", "SOURCES", "attention_seconds", "kernel_speed", "speed_table_lines"]

#: FlashAttention-3 (flash-attn's Hopper build): for the estimate of published runs only
FLASH3 = "flash3"

#: short names of the published measurements (docs/estimate.md, "Attention kernels", gives each link, figure and
#: number): FlashAttention-3 paper arXiv:2407.08608 (forward causal / backward, head dim 128, 16K tokens: FA2 335 /
#: 322, cuDNN 539 / 516, FA3 616 / 561, standard attention 35 / 181 TFLOP/s at 8K); FlashAttention-2 paper
#: arXiv:2307.08691 (A100: up to 73% of the peak forward, 63% backward); transformers PR #48163 (cuDNN over flash:
#: 1.7-2.3x on Hopper, 0.82x A100, 1.00x L40S); the PyTorch FlexAttention blog (A100: 90% of FlashAttention-2
#: forward, 85% backward) and the GTC 2025 FlexAttention session abstract (H100: ~25% faster than FlashAttention-2
#: forward, ~3% backward); NVIDIA/TileGym PR #49 (SDPA memory-efficient over SDPA flash, causal, head dim 128, 8K: 0.43
#: forward, 0.42 backward)
SOURCES = {
    "fa3": "FlashAttention-3 paper, H100 SXM5, head dim 128, 16K",
    "fa2": "FlashAttention-2 paper, A100 maxima",
    "cudnn_pr": "transformers PR #48163",
    "flex": "PyTorch FlexAttention blog (A100)",
    "flex_h100": "GTC 2025 FlexAttention session (H100)",
    "efficient": "NVIDIA/TileGym PR #49",
    "math": "FlashAttention-3 paper, standard attention, H100",
    "same_die": "H200 = H100's compute and peak",
    "l40s_assumed": "ASSUMED: A100's fractions, no published L40S figure found",
}


@dataclass(frozen=True)
class KernelSpeed:
    """One kernel on one GPU: achieved fractions of the BF16 peak (the estimate's FLOP count) and their source."""

    forward: float
    backward: float
    source: str

    def fraction(self, activation_checkpointing: bool) -> float:
        """The fraction over a training pass: forward (twice with checkpointing) and backward (2 x forward FLOPs)."""
        fwd = 2.0 if activation_checkpointing else 1.0
        return (fwd + 2.0) / (fwd / self.forward + 2.0 / self.backward)


_H100_PEAK = 989.0
# FlashAttention-3 paper, H100 SXM5, TFLOP/s: forward causal hdim 128 at 16K; backward hdim 128 at 16K (x 0.8)
_H100_FA2 = KernelSpeed(335 / _H100_PEAK, 0.8 * 322 / _H100_PEAK, SOURCES["fa3"])
_H100_FA3 = KernelSpeed(616 / _H100_PEAK, 0.8 * 561 / _H100_PEAK, SOURCES["fa3"])
_H100_MATH = KernelSpeed(35 / _H100_PEAK, 0.8 * 181 / _H100_PEAK, SOURCES["math"])
_A100_FA2 = KernelSpeed(0.73, 0.8 * 0.63, SOURCES["fa2"])

#: (GPU key of GPU_SPECS, kernel) -> speed; cuDNN, memory-efficient and FlexAttention are published as ratios
#: to flash (FlashAttention-2) on the same GPU
_FLASH = {"h100": _H100_FA2, "h200": _H100_FA2, "a100": _A100_FA2, "l40s": _A100_FA2}
_CUDNN_RATIO = {"h100": 1.7, "h200": 1.7, "a100": 0.82, "l40s": 1.00}
_RATIOS = {EFFICIENT: (0.43, 0.42, SOURCES["efficient"]), FLEX: (0.90, 0.85, SOURCES["flex"])}
#: FlexAttention on Hopper: ~1.25x FlashAttention-2 forward, ~1.03x backward (its Triton kernels use Hopper's
#: instructions, FlashAttention-2's do not)
_HOPPER_RATIOS = {FLEX: (1.25, 1.03, SOURCES["flex_h100"])}


def _gpu_key(spec: GPUSpec) -> str:
    for key, value in GPU_SPECS.items():
        if value == spec:
            return key
    return "h100"


def kernel_speed(kernel: str, spec: GPUSpec) -> KernelSpeed:
    """The :class:`KernelSpeed` of ``kernel`` on ``spec`` (an unknown or CPU kernel name: flash, what ``auto``
    plans when the installed torch cannot tell; an unknown GPU: the H100's figures)."""
    key = _gpu_key(spec)
    flash = _FLASH.get(key, _H100_FA2)
    note = {"h200": "; " + SOURCES["same_die"], "l40s": "; " + SOURCES["l40s_assumed"]}.get(key, "")
    if kernel == FLASH3:
        if key in ("h100", "h200"):
            return KernelSpeed(_H100_FA3.forward, _H100_FA3.backward, _H100_FA3.source + note)
        return KernelSpeed(flash.forward, flash.backward, f"FlashAttention-3 runs on Hopper only: flash's ({flash.source})")
    if kernel == CUDNN:
        r = _CUDNN_RATIO.get(key, 1.0)
        return KernelSpeed(flash.forward * r, flash.backward * r, f"{r:.2f} x flash, {SOURCES['cudnn_pr']}; flash: "
                           f"{flash.source}{note}")  # fmt: skip
    if kernel in _RATIOS:
        rf, rb, src = (_HOPPER_RATIOS if key in ("h100", "h200") else {}).get(kernel, _RATIOS[kernel])
        return KernelSpeed(flash.forward * rf, flash.backward * rb, f"{src}; flash: {flash.source}{note}")
    if kernel == MATH:
        return KernelSpeed(_H100_MATH.forward, _H100_MATH.backward, _H100_MATH.source)
    return KernelSpeed(flash.forward, flash.backward, flash.source + note)


def attention_seconds(flops: float, kernel: str, spec: GPUSpec, activation_checkpointing: bool) -> float:
    """Seconds of ``flops`` causal-attention FLOPs of a training step (forward, its recompute under checkpointing,
    backward: the split of :func:`automodel.training.step_estimate.flops_per_token`) with ``kernel`` on ``spec``."""
    frac = kernel_speed(kernel, spec).fraction(activation_checkpointing)
    return flops / (spec.bf16_tflops * 1e12 * frac)


def speed_table_lines(kernels: tuple[str, ...] = (FLASH, CUDNN, FLASH3, EFFICIENT, FLEX, MATH)) -> list[str]:
    """A markdown table of every kernel's forward / backward / training-pass fraction per GPU (docs/estimate.md)."""
    out = ["| GPU | kernel | forward | backward | pass (no AC) | pass (AC) |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for key, spec in GPU_SPECS.items():
        for kernel in kernels:
            s = kernel_speed(kernel, spec)
            out.append(f"| {key} | {kernel} | {s.forward:.3f} | {s.backward:.3f} | {s.fraction(False):.3f} | "
                       f"{s.fraction(True):.3f} |")  # fmt: skip
    return out
