"""Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) split into pieces that CP can run: projections, the sequence core, output.

transformers' ``Qwen3NextGatedDeltaNet.forward`` (and Qwen3.5's) is, on a row of tokens:

1. :func:`project` (token-local): ``mixed_qkv [B, n, C]`` (q | k | v channels, before the causal conv),
   the output gate ``z [B, n, Hv, dv]``, and ``b``, ``a`` ``[B, n, Hv]`` (the write strength and decay inputs);
2. :func:`run_core` (mixes the sequence): the depthwise causal conv (kernel ``K``) + SiLU over ``mixed_qkv``,
   ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, and the gated delta rule, which carries
   a state ``[B, Hv, dk, dv]`` along the tokens; returns ``[B, n, Hv, dv]``;
3. :func:`finish` (token-local): the gated RMS norm with ``z`` and ``out_proj``.

Only step 2 needs anything from other tokens: the last ``K-1`` conv inputs before the piece (the *conv
halo*, zeros at a document start, which is exactly the conv's zero padding) and the recurrent state at
the piece's start (zeros at a document start). :func:`run_core` takes both and returns the piece's own
(its last ``K-1`` conv inputs and its final state), so a row cut into pieces and chained gives the
whole-row result. The conv and the rule are the model module's own functions (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule`` of its transformers module), unchanged.

Numerics: transformers' torch kernel computes in fp32 whatever the input dtype and pads each call to its
chunk (64 tokens); a row cut at a multiple of 64 chains bit for bit, a cut elsewhere to fp32 round-off
(~1e-6 relative), fp64 inputs included. Inside :func:`rule_override` a test substitutes a rule that honours
the dtype (:func:`recurrent_gated_delta_rule`) to prove the chaining itself to fp64 round-off.

:class:`GatedDeltaNetKernel` is these pieces as a :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel`
(registered for every class of :data:`GATED_DELTANET_MIXERS`): core inputs q, k ``[B, n, Hk, dk]``, v
``[B, n, Hv, dv]`` (before the conv), b, a ``[B, n, Hv]``; state ``[conv halo [B, C, K-1], S [B, Hv, dk, dv]]``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from automodel.distributed.cp.layers.linear_support import GATED_DELTANET_MIXERS
from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)

__all__ = [
    "GATED_DELTANET_MIXERS",
    "CoreParams",
    "GatedDeltaNetKernel",
    "core_params",
    "finish",
    "project",
    "recurrent_gated_delta_rule",
    "rule_override",
    "run_core",
]

_RULES: list[Callable] = []  # the open rule_override() blocks, innermost last


@contextlib.contextmanager
def rule_override(rule: Callable) -> Iterator[None]:
    """Inside the block, :func:`run_core` runs ``rule`` (a function with ``torch_chunk_gated_delta_rule``'s
    signature, e.g. :func:`recurrent_gated_delta_rule`) instead of the model module's own rule: a test's
    switch. Re-entrant (the innermost wins); covers a backward run inside the block."""
    _RULES.append(rule)
    try:
        yield
    finally:
        _RULES.pop()


def _model_module(mixer: torch.nn.Module) -> Any:
    return sys.modules[type(mixer).__module__]


def project(mixer: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The token-local input projections of ``mixer`` on ``hidden [B, n, D]``.

    Returns ``(mixed_qkv [B, n, 2*Hk*dk + Hv*dv], z [B, n, Hv, dv], b [B, n, Hv], a [B, n, Hv])`` in
    ``hidden``'s dtype; the q | k | v channel order is the one the conv weight is laid out in.
    """
    bsz, n = hidden.shape[:2]
    layout = GATED_DELTANET_MIXERS[type(mixer).__name__]
    if layout == "olmo":
        mixed = torch.cat([mixer.q_proj(hidden), mixer.k_proj(hidden), mixer.v_proj(hidden)], dim=-1)
        z = mixer.g_proj(hidden).reshape(bsz, n, -1, mixer.head_v_dim)
        return mixed, z, mixer.b_proj(hidden), mixer.a_proj(hidden)
    if layout == "qkvz":
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden), mixer.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(bsz, n, -1) for x in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = mixer.in_proj_z(hidden).reshape(bsz, n, -1, mixer.head_v_dim)
    return mixer.in_proj_qkv(hidden), z, mixer.in_proj_b(hidden), mixer.in_proj_a(hidden)


def finish(mixer: torch.nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated norm and output projection: ``core, z [B, n, Hv, dv]`` -> ``[B, n, D]``."""
    bsz, n = core.shape[:2]
    olmo = GATED_DELTANET_MIXERS[type(mixer).__name__] == "olmo"
    norm, proj = (mixer.o_norm, mixer.o_proj) if olmo else (mixer.norm, mixer.out_proj)
    out = norm(core.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return proj(out.reshape(bsz, n, -1))


class CoreParams:
    """The parameters :func:`run_core` reads, possibly restricted to some heads (Ulysses).

    Attributes:
        conv_weight: ``[C, K]`` the depthwise conv's weight for the channels the core sees.
        conv_bias: ``[C]`` or ``None``.
        A_log, dt_bias: ``[Hv]`` for the value heads the core sees.
        key_dim, value_dim: channels of q (= of k) and of v in ``mixed_qkv``; dk, dv: head sizes.
    """

    def __init__(self, mixer: torch.nn.Module, conv_weight, conv_bias, A_log, dt_bias, key_dim: int, value_dim: int):
        self.mixer = mixer
        self.conv_weight, self.conv_bias, self.A_log, self.dt_bias = conv_weight, conv_bias, A_log, dt_bias
        self.key_dim, self.value_dim = key_dim, value_dim
        self.dk, self.dv = mixer.head_k_dim, mixer.head_v_dim
        self.kernel = mixer.conv_kernel_size
        self.beta_scale = 2.0 if getattr(mixer, "allow_neg_eigval", False) else None  # OLMo-Hybrid: beta in [0, 2]

    @property
    def channels(self) -> int:
        return 2 * self.key_dim + self.value_dim


def core_params(mixer: torch.nn.Module, k_heads: slice | None = None, v_heads: slice | None = None) -> CoreParams:
    """:class:`CoreParams` of ``mixer`` for all heads, or for key heads ``k_heads`` and value heads ``v_heads``."""
    weight = mixer.conv1d.weight.squeeze(1)  # [C, K]
    bias = mixer.conv1d.bias
    if k_heads is None:
        return CoreParams(mixer, weight, bias, mixer.A_log, mixer.dt_bias, mixer.key_dim, mixer.value_dim)
    dk, dv, kd = mixer.head_k_dim, mixer.head_v_dim, mixer.key_dim
    q_ch = torch.arange(k_heads.start * dk, k_heads.stop * dk)
    v_ch = torch.arange(v_heads.start * dv, v_heads.stop * dv)
    channels = torch.cat([q_ch, kd + q_ch, 2 * kd + v_ch]).to(weight.device)
    return CoreParams(
        mixer,
        weight.index_select(0, channels),
        None if bias is None else bias.index_select(0, channels),
        mixer.A_log[v_heads],
        mixer.dt_bias[v_heads],
        len(q_ch),
        len(v_ch),
    )


def run_core(
    p: CoreParams,
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_halo: torch.Tensor | None,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequence-mixing core on one piece of tokens, started from ``conv_halo`` and ``state``.

    Args:
        mixed: ``[B, n, C]`` the conv's inputs (``C = 2*key_dim + value_dim`` of ``p``).
        b, a: ``[B, n, Hv]``.
        conv_halo: ``[B, C, K-1]`` the ``K-1`` conv inputs before the piece (``None``: a document start).
        state: ``[B, Hv, dk, dv]`` recurrent state before the piece (``None``: a document start); any float
            dtype (the rule casts it to its compute dtype, fp32 for transformers' kernel).

    Returns:
        ``(out [B, n, Hv, dv] in mixed's dtype, halo [B, C, K-1] (the last K-1 conv inputs up to the
        piece's end), state [B, Hv, dk, dv] after the piece, in the rule's compute dtype)``. Nothing is mutated.
    """
    module = _model_module(p.mixer)
    bsz, n, channels = mixed.shape
    x = mixed.transpose(1, 2)  # [B, C, n]
    if conv_halo is None:
        conv_halo = x.new_zeros(bsz, channels, p.kernel - 1)
    x = torch.cat([conv_halo.to(x.dtype), x], dim=-1)
    new_halo = x[..., x.shape[-1] - (p.kernel - 1) :]
    conv = module.causal_conv1d_fn(x, p.conv_weight, p.conv_bias, activation=p.mixer.activation)
    conv = conv[..., p.kernel - 1 :].transpose(1, 2)  # [B, n, C]
    q, k, v = torch.split(conv, [p.key_dim, p.key_dim, p.value_dim], dim=-1)
    q = q.reshape(bsz, n, -1, p.dk)
    k = k.reshape(bsz, n, -1, p.dk)
    v = v.reshape(bsz, n, -1, p.dv)
    beta = b.sigmoid()
    if p.beta_scale is not None:
        beta = beta * p.beta_scale
    g = -p.A_log.float().exp() * F.softplus(a.float() + p.dt_bias)
    if k.shape[2] != v.shape[2]:
        # each q/k head serves Hv // Hk consecutive value heads: repeated here, as older transformers'
        # mixers (5.17) do before calling the rule (5.24's rule repeats itself: a no-op once they match)
        q = q.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    rule = _RULES[-1] if _RULES else module.torch_chunk_gated_delta_rule
    out, final = rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out, new_halo, final


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token, in the inputs' dtype (fp64 stays fp64): a slow reference.

    Per value head, with ``q, k`` L2-normalised (if asked) and ``q`` scaled by ``dk**-0.5``:
    ``S <- exp(g_t) S``; ``S <- S + k_t ((v_t - S^T k_t) beta_t)^T``; ``o_t = S^T q_t``. Shapes as
    ``torch_chunk_gated_delta_rule``: q, k ``[B, n, Hk, dk]``, v ``[B, n, Hv, dv]``, g, beta ``[B, n, Hv]``,
    state ``[B, Hv, dk, dv]``. Returns ``(out [B, n, Hv, dv], final state or None)``.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    hv = value.shape[2]
    if key.shape[2] != hv:
        query = query.repeat_interleave(hv // key.shape[2], dim=2)
        key = key.repeat_interleave(hv // key.shape[2], dim=2)
    q, k, v = (x.to(dtype) for x in (query, key, value))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    bsz, n = q.shape[:2]
    s = (
        initial_state.to(dtype)
        if initial_state is not None
        else q.new_zeros(bsz, hv, q.shape[-1], v.shape[-1])
    )
    decay, beta = g.to(dtype).exp(), beta.to(dtype)
    outs = []
    for t in range(n):
        s = s * decay[:, t, :, None, None]
        kt = k[:, t]  # [B, Hv, dk]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, kt)) * beta[:, t, :, None]
        s = s + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    out = torch.stack(outs, dim=1).to(query.dtype) if outs else v.new_zeros(v.shape)
    return out, (s if output_final_state else None)


class GatedDeltaNetKernel(MixerKernel):
    """Gated DeltaNet as a :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel` (module docstring).
    A head shard needs ``linear_num_key_heads % W == 0`` (the value heads are a multiple of the key heads)."""

    name = "Gated DeltaNet"

    def problem(self, mixer: torch.nn.Module, method: str, heads_world: int) -> str | None:
        hk = mixer.num_k_heads
        if heads_world > 1 and hk % heads_world:
            return (
                f"distributed.cp_method={method}: {type(mixer).__name__} has linear_num_key_heads={hk}, not divisible "
                f"by the {heads_world} ranks {method} splits heads over; set cp_size (ulysses_size) to a divisor of "
                f"{hk}, or use distributed.cp_method=thd"
            )
        return None

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        mixed, z, b, a = project(mixer, hidden)
        bsz, n = mixed.shape[:2]
        kd = mixer.key_dim
        q, k, v = torch.split(mixed, [kd, kd, mixer.value_dim], dim=-1)
        seq = {"q": q.reshape(bsz, n, mixer.num_k_heads, -1), "k": k.reshape(bsz, n, mixer.num_k_heads, -1),
               "v": v.reshape(bsz, n, mixer.num_v_heads, -1), "b": b, "a": a}
        return Projected(seq, z)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        hk, hv = mixer.num_k_heads, mixer.num_v_heads
        return {"q": hk, "k": hk, "v": hv, "b": hv, "a": hv}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.num_v_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        if shard is None:
            p = core_params(mixer)
        else:
            p = core_params(mixer, shard.slice(mixer.num_k_heads), shard.slice(mixer.num_v_heads))
        return {"conv_weight": p.conv_weight, "conv_bias": p.conv_bias, "A_log": p.A_log, "dt_bias": p.dt_bias}

    def _params(self, mixer: torch.nn.Module, params: dict, shard: HeadShard | None) -> CoreParams:
        world = 1 if shard is None else shard.world
        return CoreParams(mixer, params["conv_weight"], params.get("conv_bias"), params["A_log"], params["dt_bias"],
                          mixer.key_dim // world, mixer.value_dim // world)

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        p = self._params(mixer, params, shard)
        mixed = torch.cat([seq[k].flatten(2) for k in ("q", "k", "v")], dim=-1)
        halo, s = (None, None) if state is None else state
        out, new_halo, final = run_core(p, mixed, seq["b"], seq["a"], halo, s)
        return out, [new_halo, final]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        p = self._params(mixer, params, shard)
        heads = mixer.num_v_heads // (1 if shard is None else shard.world)
        return [((batch, p.channels, p.kernel - 1), dtype), ((batch, heads, p.dk, p.dv), torch.float64)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        return finish(mixer, out, local)


register(tuple(GATED_DELTANET_MIXERS), GatedDeltaNetKernel())
