"""Mamba2 mixers (Mamba-2, Nemotron-H, Falcon-H1, Granite-4.0-H, Bamba, Zamba2) as a CP :class:`MixerKernel`.

transformers' torch path of these mixers (``BambaMixer.forward`` and its copies, no cache, no mamba_ssm) is,
on a row of tokens:

1. :meth:`Mamba2Kernel.project` (token-local): ``in_proj`` (Falcon-H1: its input multiplier before and
   ``mup_vector`` after), split into the gate ``[B, n, I]``, the conv inputs ``xBC`` and ``dt [B, n, H]``;
   the core inputs are ``x [B, n, H, P]``, ``B``, ``C`` ``[B, n, G, N]`` (before the conv) and ``dt``;
2. :meth:`Mamba2Kernel.core` (mixes the sequence): the depthwise causal conv (kernel ``K``, with bias) and
   activation over ``xBC``, then ``mamba2_chunk_scan`` (the SSD scan, state ``[B, H, P, N]``) with ``D``,
   ``dt_bias``, softplus and the module's ``time_step_limit``;
3. :meth:`Mamba2Kernel.finish` (token-local): the gated RMS norm (grouped by ``G``; Falcon-H1 without
   ``mamba_rms_norm``: ``y * silu(gate)``) and ``out_proj``.

Only step 2 reads other tokens, and it needs two things from before the piece: the last ``K-1`` conv inputs
(the conv tail, zeros at a document start: the conv's own zero padding) and the SSM state (zeros at a
document start: what ``mamba2_chunk_scan`` starts from without ``initial_states``). The conv and the scan
are the model module's own functions (``causal_conv1d_fn``, ``mamba2_chunk_scan``), called unchanged: the
scan takes ``initial_states`` and returns the final state, so nothing is re-expressed.

**Head shard.** ``x``, ``dt`` and the output split by heads; ``B`` and ``C`` by groups. When ``G`` is not a
multiple of the Ulysses size the shared path repeats each group in place first (the groups are then
replicated across ranks: :meth:`~automodel.distributed.cp.layers.mixer_kernel.HeadShard.held`), and the
core picks the group of each of its heads (``B``/``C`` indexed per head, then ``mamba2_chunk_scan`` with as
many groups as heads, which reads the same numbers). The conv weight rows follow the channels each rank
holds.

**Numerics.** ``mamba2_chunk_scan`` computes in fp32 whatever the input dtype and pads every call to its
chunk (``chunk_size``). The fp64 tests swap in :func:`recurrent_mamba2_scan` (the same recurrence token by
token, in the input dtype) in both runs, as for Gated DeltaNet; the model itself reads ``A_log.float()`` and
normalises in fp32.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

from automodel.distributed.cp.layers.linear_support import MAMBA2_MIXERS
from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)

__all__ = ["Mamba2Kernel", "recurrent_mamba2_scan"]


def _module(mixer: torch.nn.Module) -> Any:
    return sys.modules[type(mixer).__module__]


class Mamba2Kernel(MixerKernel):
    """Mamba2 as a :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel` (module docstring).
    State: ``[conv tail [B, C_conv, K-1], ssm [B, H, P, N]]``. A head shard needs ``H % W == 0``."""

    name = "Mamba2"
    masks_after_conv = True  # apply_mask_to_padding_states on the conv's output

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        bsz, n = hidden.shape[:2]
        if hasattr(mixer, "ssm_in_multiplier"):  # Falcon-H1
            hidden = hidden * mixer.ssm_in_multiplier
        projected = mixer.in_proj(hidden)
        if hasattr(mixer, "mup_vector"):
            projected = projected * mixer.mup_vector
        gate, xbc, dt = projected.split([mixer.intermediate_size, mixer.conv_dim, mixer.num_heads], dim=-1)
        gn = mixer.n_groups * mixer.ssm_state_size
        x, b, c = torch.split(xbc, [mixer.intermediate_size, gn, gn], dim=-1)
        seq = {"x": x.reshape(bsz, n, mixer.num_heads, -1), "B": b.reshape(bsz, n, mixer.n_groups, -1),
               "C": c.reshape(bsz, n, mixer.n_groups, -1), "dt": dt}
        return Projected(seq, gate)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return {"x": mixer.num_heads, "B": mixer.n_groups, "C": mixer.n_groups, "dt": mixer.num_heads}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.num_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        weight, bias = mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias  # [C_conv, K]
        params = {"conv_weight": weight, "conv_bias": bias, "A_log": mixer.A_log, "dt_bias": mixer.dt_bias,
                  "D": mixer.D}
        if shard is None:
            return params
        heads = shard.slice(mixer.num_heads)
        p, gn, i = mixer.head_dim, mixer.ssm_state_size, mixer.intermediate_size
        x_ch = torch.arange(heads.start * p, heads.stop * p)
        groups = shard.held(mixer.n_groups)
        g_ch = (groups[:, None] * gn + torch.arange(gn)).flatten()
        channels = torch.cat([x_ch, i + g_ch, i + mixer.n_groups * gn + g_ch]).to(weight.device)
        params.update(conv_weight=weight.index_select(0, channels),
                      conv_bias=None if bias is None else bias.index_select(0, channels),
                      A_log=mixer.A_log[heads], dt_bias=mixer.dt_bias[heads], D=mixer.D[heads])
        return params

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        module = _module(mixer)
        x, b, c, dt = seq["x"], seq["B"], seq["C"], seq["dt"]
        bsz, n, heads, p = x.shape
        groups = b.shape[2]
        xbc = torch.cat([x.flatten(2), b.flatten(2), c.flatten(2)], dim=-1).transpose(1, 2)  # [B, C, n]
        k = mixer.conv_kernel_size
        tail = xbc.new_zeros(bsz, xbc.shape[1], k - 1) if state is None else state[0].to(xbc.dtype)
        xbc = torch.cat([tail, xbc], dim=-1)
        new_tail = xbc[..., xbc.shape[-1] - (k - 1) :]
        conv = module.causal_conv1d_fn(xbc, params["conv_weight"], params.get("conv_bias"), activation=mixer.activation)
        conv = conv[..., k - 1 :].transpose(1, 2)  # [B, n, C]
        if "mask" in seq:  # the class zeroes padded tokens after the conv too
            conv = (conv * seq["mask"][:, :, 0]).to(conv.dtype)
        x, b, c = torch.split(conv, [heads * p, b.shape[2] * b.shape[3], c.shape[2] * c.shape[3]], dim=-1)
        x = x.reshape(bsz, n, heads, p)
        b = b.reshape(bsz, n, groups, -1)
        c = c.reshape(bsz, n, groups, -1)
        if shard is not None and mixer.n_groups % shard.world:  # replicated groups: each head's own group
            index = shard.group_of_heads(mixer.num_heads, mixer.n_groups).to(b.device)
            b, c = b.index_select(2, index), c.index_select(2, index)
        A = -torch.exp(params["A_log"].float())
        out, final = module.mamba2_chunk_scan(
            x, dt, A, b, c, chunk_size=mixer.chunk_size, D=params["D"], z=None, return_final_states=True,
            dt_bias=params["dt_bias"], dt_softplus=True, initial_states=None if state is None else state[1],
            dt_limit=mixer.time_step_limit,
        )
        return out, [new_tail, final]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        heads = mixer.num_heads // (1 if shard is None else shard.world)
        channels = params["conv_weight"].shape[0]
        return [((batch, channels, mixer.conv_kernel_size - 1), dtype),
                ((batch, heads, mixer.head_dim, mixer.ssm_state_size), torch.float64)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        gate = local
        y = out.reshape(*out.shape[:2], -1)
        if getattr(mixer, "mamba_rms_norm", True):
            y = mixer.norm(y, gate)
        else:  # Falcon-H1 without its gated norm
            y = y * F.silu(gate)
        return mixer.out_proj(y.to(gate.dtype))


def recurrent_mamba2_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Any:
    """``mamba2_chunk_scan``'s recurrence token by token in the inputs' dtype (fp64 stays fp64): a slow
    reference with its signature. Per head ``h`` and token ``t``, with ``dt = clamp(softplus(dt + dt_bias))``:
    ``S <- exp(dt A) S + dt x_t B_t^T``; ``y_t = S C_t + D x_t``. Shapes: x ``[B, n, H, P]``, dt ``[B, n, H]``,
    A ``[H]``, B, C ``[B, n, G, N]``, state ``[B, H, P, N]``. Returns ``y [B, n, H, P]`` (and the final state)."""
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    bsz, n, heads, p = hidden_states.shape
    rep = heads // B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).to(dtype)
    x = hidden_states.to(dtype)
    b = B.to(dtype).repeat_interleave(rep, dim=2)
    c = C.to(dtype).repeat_interleave(rep, dim=2)
    a = A.to(dtype)
    s = initial_states.to(dtype) if initial_states is not None else x.new_zeros(bsz, heads, p, b.shape[-1])
    outs = []
    for t in range(n):
        s = s * torch.exp(dt[:, t] * a)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", s, c[:, t])
        if D is not None:
            y = y + D.to(dtype)[:, None] * x[:, t]
        outs.append(y)
    out = torch.stack(outs, dim=1) if outs else x.new_zeros(x.shape)
    return (out, s) if return_final_states else out


register(tuple(MAMBA2_MIXERS), Mamba2Kernel())
