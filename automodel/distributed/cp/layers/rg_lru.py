"""RecurrentGemma's recurrent block (``RecurrentGemmaRecurrentBlock``: conv + RG-LRU) as a CP mixer kernel.

transformers' ``RecurrentGemmaRecurrentBlock.forward`` is, on a row of tokens ``hidden [B, n, D]`` (training,
``use_cache=False``):

1. project (token-local): ``y = act(linear_y(hidden))`` and ``x = linear_x(hidden)`` (``lru_width`` channels
   in ``H`` blocks of ``block_width``);
2. core (mixes the sequence): the depthwise causal conv ``conv_1d`` (with bias) over ``x``, then the RG-LRU:
   per-block input and recurrence gates, ``a = exp(-8 * gate * softplus(recurrent_param))``, the input scaled
   by ``sqrt(1 - a^2)`` (by 1 at a document's first token), and the linear recurrence ``h <- a * h + x``
   (``RecurrentGemmaRglru._rnn_scan``, called unchanged, which accumulates in fp32);
3. finish (token-local): ``out * y`` and ``linear_out``. The class returns ``(output, None)``, so does this.

The class marks a document's first token by ``position_ids == 0``: there the gate is cut (the state
restarts) and the input is not scaled. The core gets no positions. It marks the first token of a piece that
starts a document instead: the state carries a flag ``started [B, 1]``, zero at a document start, so a zero
state computes what ``None`` computes. The gate computation is repeated from ``RecurrentGemmaRglru.forward``
with the gate weights of the core's heads (the class's forward reads the module's whole weights and its
``position_ids``); ``_rnn_scan`` and the conv (``F.conv1d`` as ``nn.Conv1d`` calls it) are the class's own.

State between pieces: ``[conv halo [B, C, K-1] (the last K-1 conv inputs), h [B, C] (fp32 or wider), started [B, 1]]``.
Everything in the core is per block of channels, so a Ulysses rank holding blocks ``[h0, h1)`` runs them on
the whole row.

transformers' own forward restarts the RG-LRU state at every ``position_ids == 0`` of a packed row but not
the conv, which reads the previous document's last ``K-1`` inputs. The CP kernels and the installed forward
outside CP restart both at every document.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)
from automodel.distributed.cp.layers.short_conv import conv_with_halo

__all__ = ["RG_LRU_MIXERS", "RgLruKernel"]

#: the transformers classes this kernel computes
RG_LRU_MIXERS = ("RecurrentGemmaRecurrentBlock",)

_GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def _conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **_: Any) -> torch.Tensor:
    """``nn.Conv1d(groups=C, padding=K-1)(x)[..., :n]`` with the given weight rows (``causal_conv1d_fn``'s
    signature): ``x [B, C, n]``, ``weight [C, K]``."""
    kernel = weight.shape[-1]
    return F.conv1d(x, weight.unsqueeze(1), bias, padding=kernel - 1, groups=x.shape[1])[..., : x.shape[-1]]


class RgLruKernel(MixerKernel):
    """RecurrentGemma's conv + RG-LRU (module docstring): core input ``x [B, n, H, block_width]`` (before
    the conv); output ``[B, n, H', block_width]``."""

    name = "RG-LRU"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        x = mixer.linear_x(hidden).reshape(*hidden.shape[:2], mixer.rg_lru.num_attention_heads, -1)
        return Projected({"x": x}, mixer.act_fn(mixer.linear_y(hidden)))

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return {"x": mixer.rg_lru.num_attention_heads}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.rg_lru.num_attention_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        rg = mixer.rg_lru
        heads = slice(None) if shard is None else shard.slice(rg.num_attention_heads)
        channels = slice(None) if shard is None else slice(heads.start * rg.block_width, heads.stop * rg.block_width)
        params = {name: getattr(rg, name)[heads] for name in _GATES}
        params.update(conv_weight=mixer.conv_1d.weight.squeeze(1)[channels], conv_bias=mixer.conv_1d.bias[channels],
                      recurrent_param=rg.recurrent_param[channels])
        return params

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        rg = mixer.rg_lru
        x = seq["x"]
        bsz, n, heads, width = x.shape
        halo, h0, started = (None, None, None) if state is None else state
        x, new_halo = conv_with_halo(_conv, x.reshape(bsz, n, heads * width), halo, params["conv_weight"],
                                     params["conv_bias"], None)
        # RecurrentGemmaRglru.forward, with this piece's gate weights and its document start
        first = torch.zeros(bsz, n, 1, dtype=torch.bool, device=x.device)
        first[:, 0] = True if started is None else started < 0.5
        blocks = x.reshape(bsz * n, heads, width).permute(1, 0, 2)
        res = torch.baddbmm(params["input_gate_bias"][:, None, :], blocks, params["input_gate_weight"])
        input_gate = torch.sigmoid(res.transpose(0, 1).reshape(bsz, n, heads * width))
        res = torch.baddbmm(params["recurrent_gate_bias"][:, None, :], blocks, params["recurrent_gate_weight"])
        recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(bsz, n, heads * width))
        log_recurrent_gate = -8.0 * recurrent_gate * F.softplus(params["recurrent_param"])
        recurrent_gate = torch.exp(log_recurrent_gate)
        a_square = torch.exp(2 * log_recurrent_gate)
        gated_inputs = x * input_gate
        multiplier = _sqrt_bound(rg)(1 - a_square)
        multiplier = first + ~first * multiplier
        normalized_x = gated_inputs * multiplier.type(x.dtype)
        out, last = type(rg)._rnn_scan(rg, hidden_states=normalized_x, recurrent_gate=recurrent_gate, reset=first,
                                       recurrent_states=h0)
        done = x.new_ones(bsz, 1)
        return out.reshape(bsz, n, heads, width), [new_halo, last, done]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        conv = params["conv_weight"]
        return [((batch, conv.shape[0], conv.shape[-1] - 1), dtype),
                ((batch, conv.shape[0]), torch.promote_types(dtype, torch.float32)), ((batch, 1), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> tuple[torch.Tensor, None]:
        return mixer.linear_out(out.reshape(*out.shape[:2], -1) * local), None


def _sqrt_bound(rg: torch.nn.Module) -> Any:
    """The model module's ``SqrtBoundDerivative.apply`` (a sqrt with a clipped gradient)."""
    import sys

    return sys.modules[type(rg).__module__].SqrtBoundDerivative.apply


register(RG_LRU_MIXERS, RgLruKernel())
