"""The memory planner's view of a hidden-size norm in half precision: what it saves beyond its fp32 count.

The planner's per-layer residual stream (:func:`automodel.training.memory_plan._layer_terms`, ``2 h`` per norm) is
calibrated on fp32 runs. In bf16 or fp16 a norm that computes in fp32 saves more, in units of the compute dtype:
transformers' RMSNorm (Llama, Qwen, Mistral) upcasts its input, so its ``pow`` and ``mul`` save the fp32 copy
(``2 h`` bf16 units) beside the normalized bf16 tensor its weight multiplies (``h``): 3 units where fp32 saves 2
(the input itself and the normalized). ``torch.nn.LayerNorm`` (GPT-2, GPT-NeoX, Falcon) saves its input and its
fp32 mean and reciprocal deviation in either dtype: no extra. The difference is measured, not looked up:
:func:`half_precision_extra` runs a copy of the model's own norm module on 64 CPU tokens in fp32 and in bf16 and
counts the storages autograd saves (parameters aside) in units of ``[N, h]`` of that dtype. A millisecond per
norm class, cached.

A norm's backward is a moment of its own (:func:`norm_peaks`, :class:`NormPeaks`): the final norm's runs after every
layer has saved its tensors (without checkpointing, before any layer's has freed them), a layer's norm's in the layer
under backward. Its forward holds its input, the fp32 copy and its output; its backward the incoming gradient and the
temporaries of the reduction's gradient (transformers' RMSNorm: five ``[N, h]`` fp32 tensors, which do not halve in
bf16). Measured the same way on the norm's own class, whole and in token tiles (the final norm runs in tiles with the
tiled MLP or layer: :func:`automodel.models.tiled_mlp.tile_final_norms`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from automodel.training.mlp_memory import _LiveBytes, _state_key  # the live-bytes mode, the probe cache's key

__all__ = [
    "NormPeaks", "RMS_NORM_PEAKS", "half_precision_extra", "norm_peaks", "peak_units", "saved_beyond_input", "saved_units",
]  # fmt: skip

_TOKENS = 64


@dataclass(frozen=True)
class NormPeaks:
    """A norm's peaks in ``[N, h]`` units of one compute dtype (:func:`peak_units`): run whole, ``forward`` and
    ``backward``; run over token tiles (:func:`automodel.models.tiled_mlp.tile_final_norms`), ``tiled_forward`` and
    ``tiled_backward`` as ``(fixed, per tile)``: the units at the peak are ``fixed + per_tile * t / N`` for tiles of
    ``t`` of ``N`` tokens (the fixed part: the input, its output or its gradients; the tile's part: one tile's
    recomputed tensors and temporaries)."""

    forward: float
    backward: float
    tiled_forward: tuple[float, float]
    tiled_backward: tuple[float, float]

    def at(self, tile_share: float | None) -> tuple[float, float]:
        """``(forward, backward)`` units whole (``tile_share=None``) or in tiles of ``tile_share`` of the tokens."""
        if tile_share is None:
            return self.forward, self.backward
        (f0, f1), (b0, b1) = self.tiled_forward, self.tiled_backward
        return f0 + f1 * tile_share, b0 + b1 * tile_share


#: transformers' RMSNorm's peaks ``(fp32, bf16)`` (:func:`peak_units`, rounded up): the planner's figures for a final
#: norm the probe cannot run
RMS_NORM_PEAKS = (NormPeaks(3.0, 6.1, (3.3, 3.0), (3.4, 7.0)), NormPeaks(7.1, 12.1, (3.4, 7.1), (3.5, 13.0)))


def _cpu_copy(norm: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A CPU copy of ``norm`` in ``dtype`` (meta parameters materialised as ones), run whole where ``norm`` is tiled
    (:func:`automodel.models.tiled_mlp.tile_final_norms`). Call under ``torch.device("cpu")``."""
    from automodel.models.tiled_mlp import remove_tiled_mlp

    probe = copy.deepcopy(norm)
    remove_tiled_mlp(probe)
    if any(p.is_meta for p in probe.parameters()) or any(b.is_meta for b in probe.buffers()):
        probe = probe.to_empty(device="cpu")
        with torch.no_grad():
            for p in probe.parameters():
                p.fill_(1.0)
    return probe.to(device="cpu", dtype=dtype)


def _own_class(norm: torch.nn.Module) -> type:
    """``norm``'s class, the untiled one where the tiled MLP or layer has wrapped it (the probe runs it whole)."""
    return getattr(type(norm), "_automodel_untiled_class", type(norm))


def _probe_input(hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """``[64, hidden]`` of ``dtype``, values spread over [-2, 2] (no random draw: the caller's generator stays)."""
    return torch.linspace(-2.0, 2.0, _TOKENS * hidden, dtype=torch.float32).reshape(_TOKENS, hidden).to(dtype)


def saved_units(norm: torch.nn.Module, dtype: torch.dtype, hidden: int, with_input: bool = True) -> float:
    """``[N, hidden]`` units of ``dtype`` that ``norm`` (a copy runs, on the CPU, in ``dtype``) saves for its backward
    for an input of ``N`` tokens: the distinct storages of the saved tensors, its parameters aside (the input counted
    where it is saved, unless ``with_input`` is false: what it saves beyond its input)."""
    with torch.device("cpu"):  # whatever the caller's default device (model_dims runs under a meta-device context)
        probe = _cpu_copy(norm, dtype)
        params = {p.untyped_storage().data_ptr() for p in probe.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        x = _probe_input(hidden, dtype)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            probe(x.requires_grad_())
    if not seen:
        raise RuntimeError("the norm saved nothing on the CPU probe")
    if not with_input:
        seen.pop(x.untyped_storage().data_ptr(), None)
    return sum(seen.values()) / (_TOKENS * hidden * x.element_size())


def saved_beyond_input(norms: list[torch.nn.Module], hidden: int) -> tuple[float, float]:
    """``(fp32, bf16)``: the most ``[N, h]`` units of the compute dtype that one of ``norms`` saves beyond its input
    (:func:`saved_units` with ``with_input=False``): transformers' RMSNorm 1 (the normalized tensor) and 3 (the fp32
    copy of its input and the normalized one); ``nn.LayerNorm`` about 0 (its fp32 mean and deviation). ``(1, 3)``
    where there is none or the probe cannot run one."""
    def measure(norm: torch.nn.Module) -> tuple[float, ...]:
        return tuple(round(saved_units(norm, dt, hidden, with_input=False), 2) for dt in (torch.float32, torch.bfloat16))

    found = _per_norm("beyond", norms, hidden, measure, (1.0, 3.0))  # RMSNorm's where the probe cannot run one
    return (max(f[0] for f in found), max(f[1] for f in found)) if found else (1.0, 3.0)


def half_precision_extra(norms: list[torch.nn.Module], hidden: int) -> float:
    """Over ``norms`` (a decoder layer's hidden-size norms, or the final norm), the ``[N, h]`` units in the compute
    dtype that each saves in bf16 beyond what it saves in fp32 (>= 0 each; transformers' RMSNorm: 1, ``nn.LayerNorm``:
    0). A norm that cannot run on the CPU probe counts 0 (the fp32 count stays)."""
    def measure(norm: torch.nn.Module) -> float:
        return max(0.0, round(saved_units(norm, torch.bfloat16, hidden) - saved_units(norm, torch.float32, hidden), 2))

    return sum(_per_norm("extra", norms, hidden, measure, 0.0))  # 0 where the probe cannot run one: the fp32 count


class _Holder(torch.nn.Module):
    """A stand-in model whose decoder's one child is the probed norm (:func:`peak_units` tiles it as the model would)."""

    def __init__(self, norm: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = norm
        self.config = type("Config", (), {"hidden_size": hidden})()

    def get_decoder(self) -> torch.nn.Module:
        return self


def peak_units(norm: torch.nn.Module, dtype: torch.dtype, hidden: int, tile: int | None = None) -> tuple[float, float]:
    """``(forward, backward)``: the most ``[N, hidden]`` units of ``dtype`` alive at once while ``norm`` (a copy, on the
    CPU, in ``dtype``) runs its forward and its backward, for ``N`` (64) tokens, its parameters and their gradients
    aside; ``tile``: run over tiles of that many tokens (:func:`automodel.models.tiled_mlp.tile_final_norms`).

    Counted as a device allocator sees it: the input is made inside the count (it is the residual stream, freed
    once nothing keeps it); the output goes to a matrix product that saves it, as the LM head does, and its gradient
    comes from that product's backward. Forward: the input, what the norm makes (transformers' RMSNorm in fp32: its
    normalized tensor and output, 3; in bf16 also the fp32 copy and the fp32 normalized one, 7). Backward, its output
    aside (the LM head has freed it by then): what the norm saved, the incoming gradient, the temporaries and the
    input's gradient (RMSNorm: 6 in fp32, with its input, which it saves; 12 in bf16: the fp32 copy and five fp32
    temporaries; ``nn.LayerNorm``: 2 and 3)."""
    with torch.device("cpu"), torch.enable_grad():
        probe = _cpu_copy(norm, dtype)
        if tile is not None:
            from automodel.models.tiled_mlp import tile_final_norms

            holder = _Holder(probe, hidden)
            tile_final_norms(holder, tile)  # the model's own rule: the probe as the final norm of a decoder
        leaf = _probe_input(hidden, dtype).requires_grad_()
        head = torch.full((hidden, 1), 1.0 / hidden, dtype=dtype, requires_grad=True)
        mode = _LiveBytes()
        with mode:
            x = leaf.clone()
            y = probe(x)
            del x
            forward = mode.peak
            mode.peak = mode.current
            out = y.untyped_storage().nbytes()
            (y @ head).sum().backward()
            backward = mode.peak - out  # the output is kept alive here by ``y`` only
        params = sum(p.grad.untyped_storage().nbytes() for p in probe.parameters() if p.grad is not None)
    unit = _TOKENS * hidden * leaf.element_size()
    return round(forward / unit, 2), round(max(backward - params, 0) / unit, 2)


def _norm_peaks(norm: torch.nn.Module, dtype: torch.dtype, hidden: int) -> NormPeaks:
    """:class:`NormPeaks` of ``norm`` in ``dtype``: whole, and in tiles of 8 and 16 of the 64 tokens, whose
    difference gives the per-tile part (the fixed part: what the 8-token tiles leave). The forward's per-tile part is
    the whole forward's peak (an upper bound: the first tile's temporaries are freed before the outputs are joined)."""
    forward, backward = peak_units(norm, dtype, hidden)
    (f8, b8), (_, b16) = peak_units(norm, dtype, hidden, tile=8), peak_units(norm, dtype, hidden, tile=16)
    per_tile = max(b16 - b8, 0.0) * _TOKENS / 8
    return NormPeaks(forward, backward, (round(f8, 2), forward), (round(b8 - per_tile * 8 / _TOKENS, 2), round(per_tile, 2)))


def norm_peaks(norms: list[torch.nn.Module], hidden: int) -> tuple[NormPeaks, NormPeaks]:
    """``(fp32, bf16)`` :class:`NormPeaks` of ``norms`` (the final norm, or a decoder layer's hidden-size norms; each
    figure the largest where there are several), in ``[N, h]`` units of the compute dtype. :data:`RMS_NORM_PEAKS` where
    there is none or the probe cannot run one."""
    found = _per_norm("peaks", norms, hidden,
                      lambda norm: (_norm_peaks(norm, torch.float32, hidden), _norm_peaks(norm, torch.bfloat16, hidden)),
                      RMS_NORM_PEAKS)  # fmt: skip
    if not found:
        return RMS_NORM_PEAKS

    def largest(i: int) -> NormPeaks:
        ps = [f[i] for f in found]
        return NormPeaks(max(p.forward for p in ps), max(p.backward for p in ps),
                         (max(p.tiled_forward[0] for p in ps), max(p.tiled_forward[1] for p in ps)),
                         (max(p.tiled_backward[0] for p in ps), max(p.tiled_backward[1] for p in ps)))  # fmt: skip

    return largest(0), largest(1)


def _per_norm(what: str, norms: list[torch.nn.Module], hidden: int, measure: Callable[[torch.nn.Module], Any],
              fallback: Any) -> list[Any]:  # noqa: ANN401
    """``measure(norm)`` for each of ``norms``, cached per ``what``, norm class (the untiled one), scalar settings and
    ``hidden``; ``fallback`` for a norm the CPU probe cannot run."""
    out = []
    for norm in norms:
        key = (what, _own_class(norm), _state_key(norm), hidden)
        if key not in _CACHE:
            try:
                _CACHE[key] = measure(norm)
            except Exception:  # noqa: BLE001 - a norm the probe cannot run (a CUDA-only kernel): the fallback
                _CACHE[key] = fallback
        out.append(_CACHE[key])
    return out


_CACHE: dict[tuple, Any] = {}
