"""ZAYA's compressed convolutional attention projection (``ZayaCCAProjection``) as a CP mixer kernel.

transformers' ``ZayaCCAProjection.forward`` is, on a row of tokens ``hidden [B, n, D]`` (no cache; ``conv_mask``, a
padding mask, zeroes padded tokens first):

1. project (token-local): ``q_proj`` and ``k_proj`` (``H`` and ``Hkv`` heads of ``hd``), their residuals (the mean of
   each query head and its key head, and of each key's group of queries), ``v_proj_current`` and the delayed
   value projection ``v_proj_delayed`` (``Hkv * hd / 2`` channels each);
2. core (mixes the sequence): the q/k projections ``[q, k]`` (``(H + Hkv) * hd`` channels) through a depthwise
   causal conv over ``cca_time0`` tokens and then a conv grouped per head over ``cca_time1`` tokens, after
   ``K = (cca_time0 - 1) + (cca_time1 - 1)`` zeros at the row's start (both convs with bias, no padding); and the
   delayed value of token ``i`` is ``v_proj_delayed`` of token ``i - 1`` (of zeros at the start: its bias);
3. finish (token-local): ``q = conv_q + q_residual``, ``k = conv_k + k_residual``,
   ``v = [v_current, v_delayed]`` per head. The layer's attention then runs on them (the method's own).

The core's input is one tensor of ``H + 2 * Hkv`` heads of ``hd``: the ``H + Hkv`` q/k heads (one conv group each)
and ``Hkv`` heads holding the delayed value projection without its bias (``hd / 2`` channels, zero-padded to
``hd``). Its state is the last ``max(K, 1)`` inputs of every channel (zeros at a document start, which is the
class's zero padding and, with the bias added in ``finish``, its ``v_proj_delayed(0)``), so a row cut in pieces and
chained is the whole row. Both convs are per head group, so a Ulysses rank holding heads ``[a, b)`` runs them with
those groups' weight rows; the delayed-value heads are a shift by one token.
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

__all__ = ["CCA_MIXERS", "CCAKernel"]

#: the transformers classes this kernel computes
CCA_MIXERS = ("ZayaCCAProjection",)


def _sizes(mixer: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(H, Hkv, hd, K)``: query heads, KV heads, head size, conv tail (tokens before a piece the convs read)."""
    return (mixer.num_attention_heads, mixer.num_key_value_heads, mixer.head_dim,
            max(1, (mixer.depthwise_kernel_size - 1) + (mixer.grouped_kernel_size - 1)))  # fmt: skip


class CCAKernel(MixerKernel):
    """ZAYA's CCA projection (module docstring): core input ``x [B, n, H + 2 Hkv, hd]``; state ``[tail [B, C', K]]``;
    output ``[B, n, H' + Hkv', hd]`` (the rank's heads); ``finish`` returns ``(query, key, value)`` as the class."""

    name = "compressed convolutional attention"

    def problem(self, mixer: torch.nn.Module, method: str, heads_world: int) -> str | None:
        if mixer.head_dim % 2 or mixer.num_attention_heads % mixer.num_key_value_heads:
            return (f"{type(mixer).__name__}: head_dim {mixer.head_dim} (odd) or {mixer.num_attention_heads} heads over "
                    f"{mixer.num_key_value_heads} KV heads is not a layout the CP kernel computes")  # fmt: skip
        return super().problem(mixer, method, heads_world)

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        H, Hkv, hd, _ = _sizes(mixer)
        B, n, _ = hidden.shape
        queries, keys = mixer.q_proj(hidden), mixer.k_proj(hidden)
        query_residual = queries.view(B, n, H, hd)
        key_residual = keys.view(B, n, Hkv, hd).repeat_interleave(H // Hkv, dim=2)  # transformers' repeat_kv
        query_residual = (query_residual + key_residual) * 0.5
        key_residual = query_residual.view(B, n, -1, H // Hkv, hd).mean(dim=-2)
        delayed = F.linear(hidden, mixer.v_proj_delayed.weight).view(B, n, Hkv, hd // 2)
        x = torch.cat([torch.cat([queries, keys], dim=-1).view(B, n, H + Hkv, hd),
                       F.pad(delayed, (0, hd - hd // 2))], dim=2)  # fmt: skip
        return Projected({"x": x}, (query_residual, key_residual, mixer.v_proj_current(hidden)))

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        H, Hkv, _, _ = _sizes(mixer)
        return {"x": H + 2 * Hkv}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        H, Hkv, _, _ = _sizes(mixer)
        return H + 2 * Hkv

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        H, Hkv, hd, _ = _sizes(mixer)
        heads = range(H + 2 * Hkv) if shard is None else range(H + 2 * Hkv)[shard.slice(H + 2 * Hkv)]
        groups = [h for h in heads if h < H + Hkv]  # the rank's conv groups (q/k heads); the rest delayed values
        rows = slice(groups[0] * hd, (groups[-1] + 1) * hd) if groups else slice(0, 0)
        depth, grouped = mixer.conv_qk_depthwise, mixer.conv_qk_grouped
        return {"depth_weight": depth.weight[rows], "depth_bias": None if depth.bias is None else depth.bias[rows],
                "group_weight": grouped.weight[rows],
                "group_bias": None if grouped.bias is None else grouped.bias[rows]}  # fmt: skip

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        _, _, hd, K = _sizes(mixer)
        x = seq["x"]
        B, n, heads, _ = x.shape
        groups = params["group_weight"].shape[0] // hd
        xt = x.reshape(B, n, heads * hd).transpose(1, 2)  # [B, C', n]
        tail = xt.new_zeros(B, heads * hd, K) if state is None else state[0].to(xt.dtype)
        full = torch.cat([tail, xt], dim=-1)  # [B, C', K + n]
        new_tail = full[..., full.shape[-1] - K:]
        outs = []
        if groups:
            qk = full[:, : groups * hd]
            conv_k = (mixer.depthwise_kernel_size - 1) + (mixer.grouped_kernel_size - 1)
            qk = qk[..., qk.shape[-1] - (conv_k + n):]  # the convs read conv_k tokens before the piece
            qk = F.conv1d(qk, params["depth_weight"], params["depth_bias"], groups=groups * hd)
            qk = F.conv1d(qk, params["group_weight"], params["group_bias"], groups=groups)
            outs.append(qk)
        if heads > groups:  # the delayed values: each token gets the previous token's projection
            outs.append(full[:, groups * hd :, K - 1 : K - 1 + n])
        out = torch.cat(outs, dim=1).transpose(1, 2).reshape(B, n, heads, hd)
        return out, [new_tail]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        H, Hkv, hd, K = _sizes(mixer)
        heads = H + 2 * Hkv if shard is None else (H + 2 * Hkv) // shard.world
        return [((batch, heads * hd, K), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> Any:
        H, Hkv, hd, _ = _sizes(mixer)
        query_residual, key_residual, value_current = local
        B, n = out.shape[:2]
        query = out[:, :, :H] + query_residual
        key = out[:, :, H : H + Hkv] + key_residual
        delayed = out[:, :, H + Hkv :, : hd // 2].reshape(B, n, Hkv * (hd // 2))
        if mixer.v_proj_delayed.bias is not None:  # v_proj_delayed of the previous token, or of zeros
            delayed = delayed + mixer.v_proj_delayed.bias
        value = torch.cat([value_current, delayed], dim=-1).view(B, n, Hkv, hd)
        return query, key, value


register(CCA_MIXERS, CCAKernel())
