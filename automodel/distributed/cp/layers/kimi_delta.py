"""Kimi-Linear's delta attention (``KimiLinearDeltaAttention``, KDA) as a CP mixer kernel, and Bailing-Hybrid's
(``BailingHybridDeltaAttention``: the same computation with a one-matrix output gate ``g_proj`` instead of
``g_b_proj(g_a_proj(.))``, and its own token-local forget gate, read through the module as here).

transformers' ``KimiLinearDeltaAttention.forward`` is, on a row of tokens ``hidden [B, n, D]`` (no cache):

1. project (token-local): ``q_proj``, ``k_proj``, ``v_proj`` (before the conv), the forget gate
   ``g [B, n, H, d]`` (``forget_gate``, fp32), ``beta = sigmoid(b_proj) [B, n, H]`` and the output gate;
2. core (mixes the sequence): the depthwise causal conv + activation over ``q | k | v`` (the model
   module's ``causal_conv1d_fn``) and the module's ``chunk_kimi_delta_attention`` (unchanged), which carries a
   state ``[B, H, d, d]`` and takes it as ``initial_state``;
3. finish (token-local): the gated RMS norm ``o_norm`` and ``o_proj``.

The state between pieces is the last ``K-1`` conv inputs (the *conv halo*) and the delta-rule state; both
zeros at a document start. Everything in the core is per head (the conv per channel), so a Ulysses rank that
holds heads ``[h0, h1)`` of the whole row takes its heads' conv-weight rows.

transformers' kernel computes in fp32 whatever the dtype and pads each call to its 64-token chunk; an fp64
test replaces the module's ``chunk_kimi_delta_attention`` by :func:`recurrent_kda_reference` (the same rule
token by token in the inputs' dtype) in both the CP and the reference run.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)
from automodel.distributed.cp.layers.short_conv import conv_with_halo, model_module

__all__ = ["KDA_MIXERS", "KimiDeltaKernel", "recurrent_kda_reference"]

#: the transformers classes this kernel computes
KDA_MIXERS = ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention")


class KimiDeltaKernel(MixerKernel):
    """Kimi delta attention (module docstring): core inputs q, k, v (before the conv), g ``[B, n, H, d]`` and
    beta ``[B, n, H]``; state ``[conv halo [B, 3*H'*d, K-1], S [B, H', d, d]]``; output ``[B, n, H', d]``."""

    name = "Kimi delta attention"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        shape = (*hidden.shape[:2], -1, mixer.head_dim)
        q, k, v = (proj(hidden).reshape(shape) for proj in (mixer.q_proj, mixer.k_proj, mixer.v_proj))
        seq = {"q": q, "k": k, "v": v, "g": mixer.forget_gate(hidden), "beta": torch.sigmoid(mixer.b_proj(hidden))}
        gate = mixer.g_proj(hidden) if hasattr(mixer, "g_proj") else mixer.g_b_proj(mixer.g_a_proj(hidden))
        return Projected(seq, gate.reshape(shape))

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return dict.fromkeys(("q", "k", "v", "g", "beta"), mixer.num_heads)

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.num_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias
        if shard is not None:
            d, qkv, mine = mixer.head_dim, mixer.qkv_dim, shard.slice(mixer.num_heads)
            ch = torch.arange(mine.start * d, mine.stop * d, device=weight.device)
            ch = torch.cat([ch, qkv + ch, 2 * qkv + ch])
            weight, bias = weight.index_select(0, ch), None if bias is None else bias.index_select(0, ch)
        return {"conv_weight": weight, "conv_bias": bias}

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        module = model_module(mixer)
        bsz, n, heads, d = seq["q"].shape
        halo, s0 = (None, None) if state is None else state
        mixed = torch.cat([seq[k].reshape(bsz, n, heads * d) for k in ("q", "k", "v")], dim=-1)
        conv, new_halo = conv_with_halo(module.causal_conv1d_fn, mixed, halo, params["conv_weight"],
                                        params.get("conv_bias"), mixer.activation)
        q, k, v = (t.reshape(bsz, n, heads, d) for t in conv.split(heads * d, dim=-1))
        out, last = module.chunk_kimi_delta_attention(
            q, k, v, g=seq["g"], beta=seq["beta"], initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out, [new_halo, last]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        conv = params["conv_weight"]
        heads, d = conv.shape[0] // (3 * mixer.head_dim), mixer.head_dim
        return [((batch, conv.shape[0], conv.shape[-1] - 1), dtype),
                ((batch, heads, d, d), torch.promote_types(dtype, torch.float32))]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        bsz, n = out.shape[:2]
        return mixer.o_proj(mixer.o_norm(out, local).reshape(bsz, n, -1))


def recurrent_kda_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunk_kimi_delta_attention``'s rule token by token in the inputs' dtype (fp64 stays fp64): a slow
    reference. Per head, with ``q, k`` L2-normalised (if asked, eps 1e-6 inside the root) and ``q`` scaled by
    ``d**-0.5``: ``S <- exp(g_t) * S`` (per key channel); ``S <- S + k_t ((v_t - S^T k_t) beta_t)^T``;
    ``o_t = S^T q_t``. q, k, v, g ``[B, n, H, d]``, beta ``[B, n, H]``, state ``[B, H, d, d]``."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    q, k, v, g, beta = (t.to(dtype) for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    bsz, n, heads, dk = k.shape
    s = (initial_state.to(dtype) if initial_state is not None
         else q.new_zeros(bsz, heads, dk, v.shape[-1]))
    outs = []
    for t in range(n):
        s = s * g[:, t, :, :, None].exp()
        delta = (v[:, t] - (s * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((s * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out.to(query.dtype), (s if output_final_state else None)


register(KDA_MIXERS, KimiDeltaKernel())
