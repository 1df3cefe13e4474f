"""The Mamba-1 mixers as a CP mixer kernel: Mamba's ``MambaMixer``, FalconMamba's ``FalconMambaMixer`` (RMS
norms without weights on dt / B / C) and Jamba's ``JambaMambaMixer`` (RMS norms with weights on dt / B / C).

The three classes share one layout (``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``,
``out_proj``); they differ only in the dt / B / C norms (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``:
absent in Mamba, weightless in FalconMamba, weighted in Jamba), which the kernel applies where the module
has them. Each class's torch forward (``forward`` without mamba-ssm / hub kernels) is, on a row of tokens ``hidden [B, n, D]`` (training: no cache):

1. project (token-local): ``in_proj`` -> the conv input ``x`` and the gate ``z`` (``I`` channels each);
2. core (mixes the sequence): the depthwise causal conv + activation over ``x`` (the model module's
   ``causal_conv1d_fn``), ``x_proj`` -> ``dt, B, C`` (with their RMS norms where the class has them), ``dt_proj``'s weight, and the
   selective scan (the module's ``mamba_selective_scan``, unchanged), which carries a state ``[B, I, N]``;
3. finish (token-local): the gate ``* silu(z)`` and ``out_proj``.

Two departures from the class's forward, both exact:

- the gate multiplies the scan's output in finish instead of inside the scan (``z=None``): the scan computes
  ``(y + D x) * silu(z)`` elementwise, so the product is the same; the gate stays token-local;
- ``mamba_selective_scan`` starts from zeros (it has no initial-state argument, nor has mamba-ssm's CUDA
  ``selective_scan_fn``). A piece that starts from a state ``h0`` adds that state's contribution, exact by
  the scan's linearity in the state: ``h_t = h_t^0 + P_t h0`` with ``P_t = exp(A * sum_{s<=t} dt_s)`` per
  channel and state dim, so the output gains ``C_t . (P_t h0)`` and the final state ``P_n h0``
  (:func:`_start_state_terms`, in the scan's compute dtype: fp32, fp64 for fp64 inputs). A zero ``h0`` adds
  exact zeros.

The state between pieces is ``[conv halo [B, I, K-1] (the last K-1 conv inputs), SSM state [B, I, N]]``, both
zeros at a document start. The RMS norms run through ``torch.func.functional_call`` with the weights the chain
passes in (the norms' own forward, unchanged); FalconMamba's weightless norms (their ``weight`` is a buffer
they do not read) are called as they are.

**Head shard.** ``x_proj`` contracts over all ``I`` channels, so the conv output of every channel is needed
for ``dt, B, C``. The core input ``x`` is one "head" of ``I`` channels (``[B, n, 1, I]``), which the shared
Ulysses path replicates to every rank (one all-gather's worth of bytes): each rank runs the conv and
``x_proj`` for all channels (cheap) and the scan, the costly part (``[B, I, n, N]``), for its channels
``[c0, c1)`` only. The output ``[B, n, I, 1]`` is split by channel.

transformers' torch scan casts ``B`` and ``x`` to fp32 (``.float()``) even in an fp64 model; an fp64 test
replaces the module's ``mamba_selective_scan`` by :func:`selective_scan_reference` (the same recurrence in the
inputs' dtype) in both the CP and the reference run.
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
from automodel.distributed.cp.layers.short_conv import conv_with_halo, model_module

__all__ = ["MAMBA1_MIXERS", "Mamba1Kernel", "ZambaMamba1Kernel", "selective_scan_reference"]

#: the transformers classes this kernel computes
MAMBA1_MIXERS = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")

_NORMS = {"dt_norm": "dt_layernorm", "b_norm": "b_layernorm", "c_norm": "c_layernorm"}


def _norms(mixer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The dt / B / C norm modules ``mixer`` has, by the kernel's key (none for Mamba)."""
    return {key: getattr(mixer, name) for key, name in _NORMS.items() if hasattr(mixer, name)}


def _weighted(norm: torch.nn.Module) -> bool:
    """The norm reads a trainable ``weight`` (Jamba's; FalconMamba's is an unused buffer)."""
    return isinstance(getattr(norm, "weight", None), torch.nn.Parameter)


class Mamba1Kernel(MixerKernel):
    """A Mamba-1 mixer (module docstring): core input ``x [B, n, 1, I]`` (before the conv); state
    ``[conv halo [B, I, K-1], SSM state [B, I', N]]``; output ``[B, n, I', 1]`` before the gate."""

    name = "Mamba"
    masks_after_conv = True  # apply_mask_to_padding_states on the conv's output

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        x, z = mixer.in_proj(hidden).chunk(2, dim=-1)
        return Projected({"x": x.unsqueeze(2)}, z)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return {"x": 1}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.intermediate_size

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        m = mixer
        mine = slice(None) if shard is None else shard.slice(m.intermediate_size)
        params = {"conv_weight": m.conv1d.weight.squeeze(1), "conv_bias": m.conv1d.bias,
                  "x_proj_weight": m.x_proj.weight, "dt_weight": m.dt_proj.weight[mine],
                  "dt_bias": None if m.dt_proj.bias is None else m.dt_proj.bias[mine],
                  "A_log": m.A_log[mine], "D": m.D[mine]}
        params.update({key: norm.weight for key, norm in _norms(m).items() if _weighted(norm)})
        return params

    @staticmethod
    def _conv(mixer: torch.nn.Module, params: dict, seq: dict, halo: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal conv + activation of all channels after ``halo``, padded tokens zeroed after it:
        ``(xc [B, n, I], new halo [B, I, K-1])``."""
        xc, new_halo = conv_with_halo(model_module(mixer).causal_conv1d_fn, seq["x"].squeeze(2), halo,
                                      params["conv_weight"], params.get("conv_bias"), mixer.activation)
        if "mask" in seq:  # the class zeroes padded tokens after the conv too
            xc = (xc * seq["mask"][:, :, 0]).to(xc.dtype)
        return xc, new_halo

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        m, module = mixer, model_module(mixer)
        halo, h0 = (None, None) if state is None else state
        xc, new_halo = self._conv(m, params, seq, halo)
        proj = F.linear(xc, params["x_proj_weight"])
        time_step, B, C = torch.split(proj, [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        norms = _norms(m)
        time_step, B, C = (t if key not in norms else
                           torch.func.functional_call(norms[key], {"weight": params[key]}, (t,)) if key in params
                           else norms[key](t)
                           for key, t in (("dt_norm", time_step), ("b_norm", B), ("c_norm", C)))
        if shard is not None:
            xc = xc[..., shard.slice(m.intermediate_size)]
        dt = params["dt_weight"] @ time_step.transpose(1, 2)  # [B, I', n]
        A = -torch.exp(params["A_log"].float())
        dt_bias = params["dt_bias"].float() if params.get("dt_bias") is not None else None
        y, last = module.mamba_selective_scan(
            xc.transpose(1, 2), dt, A, B.transpose(1, 2), C.transpose(1, 2), D=params["D"].float(), z=None,
            delta_bias=dt_bias, delta_softplus=True, return_last_state=True, use_mambapy=m.use_mambapy,
            use_associative_scan=m.use_associative_scan,
        )
        if h0 is not None:
            y_extra, last_extra = _start_state_terms(dt, dt_bias, A, C, h0.to(last.dtype))
            y = y + y_extra.to(y.dtype)
            last = last + last_extra
        return y.transpose(1, 2).unsqueeze(-1), [new_halo, last]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        conv = params["conv_weight"]
        channels, n_state = params["A_log"].shape
        return [((batch, conv.shape[0], conv.shape[-1] - 1), dtype),
                ((batch, channels, n_state), torch.promote_types(dtype, torch.float32))]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        return mixer.out_proj((out.squeeze(-1) * F.silu(local)).to(local.dtype))


class ZambaMamba1Kernel(Mamba1Kernel):
    """Zamba's ``ZambaMambaMixer``: ``n_mamba_heads`` independent Mamba-1 mixers over consecutive channel groups
    of ``mamba_head_dim`` (own ``x_proj_weight [H, R+2N, hd]``, ``dt_proj_weight [H, hd, R]``, ``dt_proj_bias``,
    ``A_log``, ``D`` per head; one conv and ``out_proj`` over all ``I`` channels). ``in_proj``'s output
    interleaves the conv input and the gate channel by channel (``x_i = p[2i]``, ``z_i = p[2i+1]``).

    The same core layout as :class:`Mamba1Kernel` (``x`` replicated as one head, the scan split by channel
    ``[c0, c1)``): each rank runs the conv and every head's ``x_proj`` (cheap), then for each head that
    meets its channels the module's ``mamba_selective_scan`` on those channels with that head's ``B, C``
    (the scan is per channel given ``B, C``, so a part of a head's channels computes what the class does)."""

    name = "Zamba Mamba"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        p = mixer.in_proj(hidden)
        p = p.view(*p.shape[:-1], mixer.intermediate_size, 2)
        return Projected({"x": p[..., 0].unsqueeze(2)}, p[..., 1])

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        m, width = mixer, mixer.intermediate_size
        mine = slice(None) if shard is None else shard.slice(width)
        return {"conv_weight": m.conv1d.weight.squeeze(1), "conv_bias": m.conv1d.bias,
                "x_proj_weight": m.x_proj_weight, "dt_weight": m.dt_proj_weight.reshape(width, -1)[mine],
                "dt_bias": None if m.dt_proj_bias is None else m.dt_proj_bias.reshape(width)[mine],
                "A_log": m.A_log.reshape(width, -1)[mine], "D": m.D.reshape(width)[mine]}

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        m, module = mixer, model_module(mixer)
        halo, h0 = (None, None) if state is None else state
        xc, new_halo = self._conv(m, params, seq, halo)
        bsz, n, width = xc.shape
        heads, hd = m.n_mamba_heads, m.mamba_head_dim
        xh = xc.transpose(1, 2).reshape(bsz, heads, hd, n).transpose(0, 1)  # [H, B, hd, n], as the class
        proj = (params["x_proj_weight"][:, None] @ xh).transpose(-1, -2)  # [H, B, n, R+2N]
        time_step, B, C = torch.split(proj, [m.time_step_rank, m.ssm_state_size, m.ssm_state_size], dim=-1)
        mine = slice(0, width) if shard is None else shard.slice(width)
        A = -torch.exp(params["A_log"].float())
        dt_bias = params["dt_bias"].float() if params.get("dt_bias") is not None else None
        ys, lasts = [], []
        for head in range(mine.start // hd, (mine.stop - 1) // hd + 1):
            lo, hi = max(mine.start, head * hd), min(mine.stop, (head + 1) * hd)  # global channels
            local = slice(lo - mine.start, hi - mine.start)  # among this rank's channels
            dt = params["dt_weight"][local] @ time_step[head].transpose(-1, -2)  # [B, k, n]
            bias = None if dt_bias is None else dt_bias[local]
            y, last = module.mamba_selective_scan(
                xh[head][:, lo - head * hd:hi - head * hd], dt, A[local], B[head].transpose(1, 2),
                C[head].transpose(1, 2), D=params["D"][local].float(), z=None, delta_bias=bias,
                delta_softplus=True, return_last_state=True, use_mambapy=False,
                # transformers 5.17's ZambaMambaMixer has no such attribute and calls the scan with it off
                use_associative_scan=getattr(m, "use_associative_scan", False),
            )
            if h0 is not None:
                y_extra, last_extra = _start_state_terms(dt, bias, A[local], C[head], h0[:, local].to(last.dtype))
                y = y + y_extra.to(y.dtype)
                last = last + last_extra
            ys.append(y)
            lasts.append(last)
        return torch.cat(ys, dim=1).transpose(1, 2).unsqueeze(-1), [new_halo, torch.cat(lasts, dim=1)]


def _start_state_terms(dt: torch.Tensor, dt_bias: torch.Tensor | None, A: torch.Tensor, C: torch.Tensor,
                       h0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a start state ``h0 [B, I, N]`` adds to the zero-start scan: ``(y [B, I, n], final state [B, I, N])``.

    ``dt [B, I, n]`` before the bias and softplus (as the scan gets it), ``A [I, N]``, ``C [B, n, N]``."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)[..., None]
    dt = F.softplus(dt).to(h0.dtype)
    decay = torch.exp(A.to(h0.dtype)[None, :, None, :] * dt.cumsum(-1)[..., None])  # [B, I, n, N]
    carried = decay * h0[:, :, None, :]
    return torch.einsum("bitn,btn->bit", carried, C.to(h0.dtype)), carried[:, :, -1]


def selective_scan_reference(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``mamba_selective_scan``'s recurrence token by token in the inputs' dtype (fp64 stays fp64): a slow
    reference. ``hidden_states, dt [B, I, n]``, ``A [I, N]``, ``B, C [B, N, n]``, ``D [I]``, ``z [B, I, n]``."""
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    x, dt, B, C = (t.to(dtype) for t in (hidden_states, dt, B, C))
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    A = A.to(dtype)
    state = x.new_zeros(x.shape[0], x.shape[1], A.shape[-1])
    outs = []
    for t in range(x.shape[-1]):
        state = torch.exp(A * dt[:, :, t, None]) * state + dt[:, :, t, None] * B[:, None, :, t] * x[:, :, t, None]
        outs.append((state * C[:, None, :, t]).sum(-1))
    y = torch.stack(outs, dim=-1) if outs else x.new_zeros(x.shape)
    if D is not None:
        y = y + x * D.to(dtype)[None, :, None]
    if z is not None:
        y = y * F.silu(z.to(dtype))
    y = y.to(hidden_states.dtype)
    return (y, state) if return_last_state else y


register(MAMBA1_MIXERS, Mamba1Kernel())
register(("ZambaMambaMixer",), ZambaMamba1Kernel())
