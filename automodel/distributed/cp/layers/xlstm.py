"""xLSTM's mLSTM layer (``xLSTMLayer``) as a CP mixer kernel.

transformers' ``xLSTMLayer.forward`` is, on a row of tokens ``x [B, n, D]`` (no state passed in):

1. project (token-local): ``q, k [B, n, H, dqk]``, ``v [B, n, H, dv]``, the output gate's pre-activation
   ``o [B, n, H*dv]``, and the input / forget gates' pre-activations ``i, f [B, n, H]`` (soft-capped by
   ``gate_soft_cap``), from ``q/k/v/ogate_preact/igate_preact/fgate_preact`` (``weight_mode="single"``) or
   ``qkv_opreact / ifgate_preact`` (``"fused"``);
2. core (mixes the sequence): the mLSTM recurrence per head, with the matrix memory ``C [dqk, dv]``, the
   normaliser ``n [dqk]`` and the max stabiliser ``m [1]``, by the module's ``xLSTMBackend``;
3. finish (token-local): the per-head layer norm ``multihead_norm``, ``sigmoid(o) * h`` and ``out_proj``. The
   class returns ``(y, state)``; the CP forward returns ``(y, None)`` (a training forward keeps no state).

The backend's two forms compute one function. ``mode="train"`` runs ``mlstm_chunkwise_native_autograd`` on
the whole row (its length a multiple of ``chunk_size``); ``"inference"`` (the default config's) runs
``wrap_chunkwise_arbitrary_sequence_length``: the chunkwise kernel on the whole chunks, then the token-by-token
``mlstm_recurrent_sequence_native`` on the rest, with its state in ``inference_state_dtype``. The chunkwise
kernel's stabiliser at token ``t`` is the running maximum the token-by-token rule keeps
(``max(b_t + m_chunk, max_s (b_t - b_s + i_s))`` unrolls ``m_t = max(log f_t + m_{t-1}, i_t)``), so the two
agree to round-off anywhere. :meth:`XLstmKernel.core` calls that same wrapper, from the module, on each piece
with the piece's start state, and returns the state after it. A zero state is a document start (both forms
start from ``C = n = m = 0``). Its token-by-token part keeps its state in ``inference_state_dtype`` in
``"inference"`` mode (as the model does), and in the inputs' dtype (fp32 or wider) in ``"train"`` modes (the
model's chunkwise kernel computes in the inputs' dtype). Everything in the core is per head: a Ulysses rank
holding heads ``[h0, h1)`` runs them on the whole row. transformers' xLSTM has only mLSTM blocks (no sLSTM,
no convolution).

State between pieces: ``[C [B, H, dqk, dv], n [B, H, dqk], m [B, H, 1]]``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from automodel.distributed.cp.layers.mixer_kernel import (
    HeadShard,
    MixerKernel,
    Projected,
    StateLike,
    register,
)
from automodel.distributed.cp.layers.short_conv import model_module

__all__ = ["XLSTM_MIXERS", "XLstmKernel"]

#: the transformers classes this kernel computes
XLSTM_MIXERS = ("xLSTMLayer",)


def _state_dtype(mixer: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the token-by-token part's state: the model's ``inference_state_dtype`` in its
    ``"inference"`` mode, else the inputs' dtype (fp32 or wider), which its chunkwise kernel keeps."""
    config = mixer.config
    if "inference" in config.mode:
        return getattr(torch, config.inference_state_dtype)
    return torch.promote_types(dtype, torch.float32)


class XLstmKernel(MixerKernel):
    """xLSTM's mLSTM (module docstring): core inputs q, k ``[B, n, H, dqk]``, v ``[B, n, H, dv]``, i, f
    ``[B, n, H, 1]``; state ``[C, n, m]``; output ``[B, n, H', dv]``."""

    name = "mLSTM"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        config = mixer.config
        soft_cap = model_module(mixer).soft_cap
        if config.weight_mode == "single":
            q, k, v = mixer.q(hidden), mixer.k(hidden), mixer.v(hidden)
            o = mixer.ogate_preact(hidden)
            i = soft_cap(mixer.igate_preact(hidden), cap_value=config.gate_soft_cap)
            f = soft_cap(mixer.fgate_preact(hidden), cap_value=config.gate_soft_cap)
        else:
            q, k, v, o = torch.tensor_split(mixer.qkv_opreact(hidden),
                                            (mixer.qk_dim, 2 * mixer.qk_dim, 2 * mixer.qk_dim + mixer.v_dim), dim=-1)
            i, f = torch.tensor_split(soft_cap(mixer.ifgate_preact(hidden), cap_value=config.gate_soft_cap),
                                      (config.num_heads,), dim=-1)
        bsz, n, heads = *hidden.shape[:2], config.num_heads
        seq = {"q": q.reshape(bsz, n, heads, -1), "k": k.reshape(bsz, n, heads, -1), "v": v.reshape(bsz, n, heads, -1),
               "i": i.unsqueeze(-1), "f": f.unsqueeze(-1)}
        return Projected(seq, o)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return dict.fromkeys(("q", "k", "v", "i", "f"), mixer.config.num_heads)

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.config.num_heads

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        return {}  # the core reads no parameter: the gates are token-local inputs

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        q, k, v = (seq[name].transpose(1, 2) for name in ("q", "k", "v"))  # [B, H', n, d]
        i, f = seq["i"][..., 0].transpose(1, 2), seq["f"][..., 0].transpose(1, 2)  # [B, H', n]
        sd = _state_dtype(mixer, q.dtype)
        c0, n0, m0 = (None, None, None) if state is None else state
        h, (c, n, m) = _wrapper(mixer, sd)(query=q, key=k, value=v, igate=i, fgate=f, c_initial=c0, n_initial=n0,
                                           m_initial=m0)
        like = torch.promote_types(q.dtype, sd)
        return h.transpose(1, 2), [c.to(like), n.to(like), m.to(like)]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        config = mixer.config
        heads = config.num_heads if shard is None else config.num_heads // shard.world
        dqk, dv = mixer.qk_dim // config.num_heads, mixer.v_dim // config.num_heads
        like = torch.promote_types(dtype, _state_dtype(mixer, dtype))
        return [((batch, heads, dqk, dv), like), ((batch, heads, dqk), like), ((batch, heads, 1), like)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> tuple[torch.Tensor, None]:
        h = mixer.multihead_norm(out).reshape(*out.shape[:2], -1)
        return mixer.out_proj(mixer.ogate_act_fn(local) * h), None


def _wrapper(mixer: torch.nn.Module, state_dtype: torch.dtype) -> Any:
    """The module's ``wrap_chunkwise_arbitrary_sequence_length`` with the layer's kernels and config numbers
    (what ``xLSTMBackend`` builds for its ``"inference"`` mode), the token-by-token state in ``state_dtype``."""
    module, backend, config = model_module(mixer), mixer.mlstm_backend, mixer.config
    return functools.partial(
        module.wrap_chunkwise_arbitrary_sequence_length,
        mlstm_chunkwise_kernel=backend.chunkwise_kernel_fn,
        mlstm_sequence_kernel=functools.partial(backend.sequence_kernel_fn, dtype_state=state_dtype),
        mlstm_step_kernel=functools.partial(backend.step_kernel_fn, dtype_state=state_dtype),
        chunk_size=config.chunk_size, eps=config.eps,
        autocast_kernel_dtype=getattr(torch, config.autocast_kernel_dtype), return_last_states=True,
    )


register(XLSTM_MIXERS, XLstmKernel())
