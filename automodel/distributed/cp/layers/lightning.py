"""MiniMax's lightning attention (``MiniMaxLightningAttention``) as a CP mixer kernel.

transformers' ``MiniMaxLightningAttention.forward`` is, on a row of tokens ``hidden [B, n, D]`` (no cache):

1. project (token-local): ``act(qkv_proj)`` split into q, k, v ``[B, n, H, d]``, and the output gate
   ``sigmoid(output_gate(hidden))``;
2. core (mixes the sequence): linear attention with a fixed per-head decay (``slope_rate``), computed in
   blocks of ``block_size`` tokens: within a block ``(Q K^T * decay) V``, across blocks through the state
   ``KV [B, H, d, d]`` (``Q * query_decay @ KV``; ``KV <- KV * exp(-slope * block) + (K * key_decay)^T V``);
3. finish (token-local): the RMS norm over all heads, the gate and ``out_proj``. The class returns
   ``(output, state)``; the CP forward returns ``(output, None)`` (a training forward keeps no cache).

The block loop is written inline in the class's forward, with no function to call, so :meth:`LightningKernel.core`
repeats it line for line, with two changes: the state starts from the ``state`` it is given (zeros: a document
start), and it returns the state after the piece. A piece that starts at a multiple of ``block_size`` (a
whole row included) computes the same operations in the same order as the class. Elsewhere the blocks fall
differently and the result agrees to round-off. The decay buffers (``slope_rate``, ``query_decay``,
``key_decay``, ``diagonal_decay``) are constants. They are passed to the core as tensors, restricted to the
rank's heads. All of the core is per head: a Ulysses rank holding heads ``[h0, h1)`` runs them on the whole
row. The state keeps the inputs' dtype (transformers computes no part of this layer in fp32 except its RMS
norm).
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

__all__ = ["LIGHTNING_MIXERS", "LightningKernel"]

#: the transformers classes this kernel computes
LIGHTNING_MIXERS = ("MiniMaxLightningAttention",)

_DECAYS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


class LightningKernel(MixerKernel):
    """MiniMax's lightning attention (module docstring): core inputs q, k, v ``[B, n, H, d]``; state
    ``[KV [B, H', d, d]]``; output ``[B, n, H', d]``."""

    name = "lightning attention"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        qkv = mixer.act_fn(mixer.qkv_proj(hidden)).reshape(*hidden.shape[:2], mixer.num_attention_heads, -1)
        q, k, v = torch.split(qkv, mixer.head_dim, dim=3)
        return Projected({"q": q, "k": k, "v": v}, F.sigmoid(mixer.output_gate(hidden)))

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return dict.fromkeys(("q", "k", "v"), mixer.num_attention_heads)

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.num_attention_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        mine = slice(None) if shard is None else shard.slice(mixer.num_attention_heads)
        params = {name: getattr(mixer, name) for name in _DECAYS}
        params["diagonal_decay"] = params["diagonal_decay"][:, mine]  # [1, H, b, b]
        for name in ("slope_rate", "query_decay", "key_decay"):  # [H, ...]
            params[name] = params[name][mine]
        return params

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        q, k, v = (seq[name].transpose(1, 2) for name in ("q", "k", "v"))  # [B, H', n, d]
        bsz, heads, n, d = q.shape
        kv = q.new_zeros(bsz, heads, d, v.shape[-1]) if state is None else state[0].to(v.dtype)
        slope, block = params["slope_rate"], mixer.block_size
        outs = []
        for start in range(0, n, block):
            size = min(start + block, n) - start
            qb, kb, vb = q[:, :, start : start + size], k[:, :, start : start + size], v[:, :, start : start + size]
            intra = torch.matmul(torch.matmul(qb, kb.transpose(-1, -2)) * params["diagonal_decay"][:, :, :size, :size], vb)
            inter = torch.matmul(qb * params["query_decay"][:, :size], kv)
            outs.append(inter + intra)
            kv = kv * torch.exp(-slope * size) + torch.matmul((kb * params["key_decay"][:, -size:]).transpose(-1, -2), vb)
        return torch.cat(outs, dim=-2).transpose(1, 2), [kv]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        heads, d = params["slope_rate"].shape[0], mixer.head_dim
        return [((batch, heads, d, d), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> tuple[torch.Tensor, None]:
        out = mixer.norm(out.reshape(*out.shape[:2], -1))
        return mixer.out_proj(local * out), None


register(LIGHTNING_MIXERS, LightningKernel())
