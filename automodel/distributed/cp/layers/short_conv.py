"""LFM2's gated short convolution (``Lfm2ShortConv``, ``Lfm2MoeShortConv``, and LFM3's ``Lfm3ShortConv``, the same
computation) as a CP mixer kernel.

transformers' ``Lfm2ShortConv.forward`` (and ``Lfm3ShortConv.forward``, which calls the conv through the module's
``causal_conv1d_forward`` and so its ``causal_conv1d_fn``) is, on a row of tokens ``hidden [B, n, D]`` (no cache):

1. project (token-local): ``in_proj`` -> ``B, C, x`` (``D`` channels each); the conv input is ``B * x``;
2. core (mixes the sequence): the depthwise causal conv (kernel ``K = conv_L_cache``, no activation) over
   ``B * x``, by the model module's own ``causal_conv1d_fn``, unchanged;
3. finish (token-local): ``C * conv`` and ``out_proj``.

The only state is the conv's: the last ``K-1`` conv inputs before a piece (the *conv halo*, zeros at a
document start, which is the conv's own zero padding), so a row cut into pieces and chained is the whole row
to the bit. The conv is per channel: a Ulysses rank holding channels ``[c0, c1)`` of the whole row (the
core input is ``[B, n, D, 1]``, one "head" per channel) runs it with those rows of the weight.

:func:`conv_with_halo` is the conv step shared with the other kernels whose core starts with a depthwise
causal conv (:mod:`.mamba1`, :mod:`.kimi_delta`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)

__all__ = ["SHORT_CONV_MIXERS", "ShortConvKernel", "conv_with_halo", "model_module"]

#: the transformers classes this kernel computes
SHORT_CONV_MIXERS = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")


def model_module(mixer: torch.nn.Module) -> Any:
    """The transformers module that defines ``mixer``'s class (its ``causal_conv1d_fn`` and kernels)."""
    return sys.modules[type(mixer).__module__]


def conv_with_halo(
    conv_fn: Any,
    x: torch.Tensor,
    halo: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal conv of one piece ``x [B, n, C]`` after the ``K-1`` inputs ``halo [B, C, K-1]``
    (``None``: zeros, a document start), by ``conv_fn`` (transformers' ``causal_conv1d_fn`` signature).

    ``weight [C, K]``, ``bias [C]`` or ``None``. Returns ``(out [B, n, C], new_halo [B, C, K-1])``: the conv output
    of the piece's tokens and the last ``K-1`` conv inputs up to the piece's end (in ``x``'s dtype).
    """
    kernel = weight.shape[-1]
    bsz, _, channels = x.shape
    xt = x.transpose(1, 2)  # [B, C, n]
    if halo is None:
        halo = xt.new_zeros(bsz, channels, kernel - 1)
    xt = torch.cat([halo.to(xt.dtype), xt], dim=-1)
    new_halo = xt[..., xt.shape[-1] - (kernel - 1):]
    if activation is None:
        out = conv_fn(xt, weight, bias)
    else:
        out = conv_fn(xt, weight, bias, activation=activation)
    return out[..., kernel - 1:].transpose(1, 2), new_halo


class ShortConvKernel(MixerKernel):
    """LFM2's short convolution (module docstring): core input ``x = B*x [B, n, D, 1]``; state ``[conv halo
    [B, D', K-1]]``; output ``[B, n, D', 1]``."""

    name = "short convolution"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        b, c, x = mixer.in_proj(hidden).chunk(3, dim=-1)
        return Projected({"x": (b * x).unsqueeze(-1)}, c)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return {"x": mixer.conv.weight.shape[0]}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.conv.weight.shape[0]

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        weight, bias = mixer.conv.weight.squeeze(1), mixer.conv.bias
        if shard is not None:
            mine = shard.slice(weight.shape[0])
            weight, bias = weight[mine], None if bias is None else bias[mine]
        return {"conv_weight": weight, "conv_bias": bias}

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        conv_fn = model_module(mixer).causal_conv1d_fn
        out, halo = conv_with_halo(conv_fn, seq["x"].squeeze(-1), None if state is None else state[0],
                                   params["conv_weight"], params.get("conv_bias"), None)
        return out.unsqueeze(-1), [halo]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        weight = params["conv_weight"]
        return [((batch, weight.shape[0], weight.shape[-1] - 1), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        return mixer.out_proj((local * out.squeeze(-1)).contiguous())


register(SHORT_CONV_MIXERS, ShortConvKernel())
