"""RWKV(-4)'s time mixing (``RwkvSelfAttention``) and its token shift as CP mixer kernels.

transformers' ``RwkvSelfAttention.forward`` is, on a row of tokens ``hidden [B, n, D]`` (no state):

1. the token shift: ``shifted = time_shift(hidden)``, the previous token's hidden (zeros before the first);
2. token-local: ``k, v, r`` from ``hidden`` and ``shifted`` mixed by ``time_mix_key/value/receptance``,
   the linear maps ``key, value, receptance`` and ``sigmoid`` on ``r`` (``extract_key_value``);
3. the WKV recurrence per channel (``rwkv_linear_attention``): the state ``num, den, max`` (the
   numerically stabilised form: the real numerator / denominator are ``num * exp(max)`` / ``den * exp(max)``),
   decay ``-exp(time_decay)``, bonus ``time_first`` for the current token;
4. token-local: ``output(r * wkv)``. The class returns ``(output, state)``; the CP forward ``(output, None)``.

``RwkvFeedForward`` shifts its input the same way (``time_shift``) before its token-local channel mix. So RWKV
mixes tokens in two places per block, and both run under CP:

- :class:`TokenShift` replaces the ``time_shift`` (``nn.ZeroPad2d((0, 0, 1, -1))``) of both modules
  (:data:`TOKEN_SHIFT_OWNERS`). Its kernel (:class:`TokenShiftKernel`) is a one-token conv: core input
  ``hidden [B, n, D, 1]`` (one "head" per channel), state the piece's last token ``[B, 1, D, 1]``, zeros at a
  document start (the pad's zeros). A shifted row cut into pieces and chained is the whole row to the bit.
- :class:`RwkvKernel` runs the WKV recurrence: ``project`` calls the module's own ``extract_key_value``
  (whose ``time_shift`` is the :class:`TokenShift`), the core inputs are ``k, v [B, n, A, 1]`` (one head per
  channel) and ``r`` stays local. The core is transformers' torch loop ``rwkv_linear_attention_cpu``, looked
  up in the model module at call time, which takes the start state and returns the state after the piece:
  it runs token by token, so a chained row is the whole row to the bit wherever it is cut (fp32).

The CUDA kernel (``RwkvLinearAttention``, used by the model when it is loaded) returns no gradient for its
start state, so the CP core always runs the torch loop; it computes the same recurrence. The loop reads the
key as fp32 (``key.float()``) and keeps ``den`` and ``max`` in fp32 whatever the model's dtype; the chain
hands the state on in fp32 or wider (fp64 for an fp64 model, exact for fp32 values).

A document start is ``max = -1e38`` (transformers' own start), not ``0``, which is the same function but
other round-off. The state therefore carries a flag ``started [B, 1]``: a zero state (flag 0) starts as
``None`` does, bit for bit. State between pieces: ``[num, den, max [B, A] (fp32 or wider), started [B, 1]]``.
Everything is per channel: a Ulysses rank holding channels ``[c0, c1)`` runs them on the whole row.

``rescale_every`` halves the hidden states every few layers in eval mode only (token-local either way).
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

__all__ = ["RWKV_MIXERS", "TOKEN_SHIFT_OWNERS", "RwkvKernel", "TokenShift", "TokenShiftKernel", "wkv_reference"]

#: the transformers classes :class:`RwkvKernel` computes
RWKV_MIXERS = ("RwkvSelfAttention",)
#: classes whose ``time_shift`` attribute shifts the sequence by one token -> that attribute's name; the CP
#: install replaces it by a :class:`TokenShift` (RWKV's feed-forward is not a mixer of the profile, but it
#: reads the previous token too)
TOKEN_SHIFT_OWNERS = {"RwkvSelfAttention": "time_shift", "RwkvFeedForward": "time_shift"}

_START = -1e38  # transformers' max state at a document start (rwkv_linear_attention_cpu)


class TokenShift(torch.nn.Module):
    """The previous token's hidden: ``hidden [B, n, C]`` -> ``[B, n, C]`` with ``out[:, t] = hidden[:, t-1]``
    and zeros at ``t = 0`` (what ``nn.ZeroPad2d((0, 0, 1, -1))`` computes). The CP install gives it the CP
    forward (per document on packed rows, the previous token across ranks under CP).

    Args:
        original: the module it replaces (kept to give it back).
        channels: ``C``.
    """

    def __init__(self, original: torch.nn.Module, channels: int) -> None:
        super().__init__()
        self.original = original
        self.channels = channels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.original(hidden)


class TokenShiftKernel(MixerKernel):
    """A one-token shift (:class:`TokenShift`): core input ``x [B, n, C, 1]``; state ``[last token [B, 1, C', 1]]``."""

    name = "token shift"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        return Projected({"x": hidden.unsqueeze(-1)}, None)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return {"x": mixer.channels}

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.channels

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        return {}

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        x = seq["x"]
        before = x.new_zeros(x[:, :1].shape) if state is None else state[0].to(x.dtype)
        return torch.cat([before, x[:, :-1]], dim=1), [x[:, -1:]]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        channels = mixer.channels if shard is None else mixer.channels // shard.world
        return [((batch, 1, channels, 1), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        return out.squeeze(-1)

    def contiguous_shard(self, mixer, hidden, group, rank, world, starts):  # type: ignore[override]
        """Under Ulysses: one token from the rank before (:class:`_PreviousToken`), zeros at document starts."""
        before = _PreviousToken.apply(hidden, group, rank, world)
        shifted = torch.cat([before[:, None], hidden[:, :-1]], dim=1)
        return shifted * (~starts)[..., None].to(hidden.dtype)


class _PreviousToken(torch.autograd.Function):
    """``x [B, n, D]`` (this rank's contiguous slice) -> ``[B, D]``: the last token of rank ``rank - 1``'s slice
    (zeros on rank 0). One point-to-point message each way; the backward returns the gradient the same way."""

    @staticmethod
    def forward(ctx, x, group, rank, world):  # type: ignore[override]
        ctx.group, ctx.rank, ctx.world, ctx.shape = group, rank, world, x.shape
        before = x.new_zeros(x.shape[0], x.shape[2])
        _swap([x[:, -1].contiguous()] if rank + 1 < world else [], before if rank > 0 else None, group, rank, world)
        return before

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group, rank, world = ctx.group, ctx.rank, ctx.world
        grad_last = grad.new_zeros(ctx.shape[0], ctx.shape[2])
        # the reverse: this rank's gradient of what it received goes back; the next rank's comes in
        _swap([grad.contiguous()] if rank > 0 else [], grad_last if rank + 1 < world else None, group, rank, world,
              backward=True)
        grad_x = grad.new_zeros(ctx.shape)
        grad_x[:, -1] = grad_last
        return grad_x, None, None, None


def _swap(sends: list, recv: Any, group: Any, rank: int, world: int, backward: bool = False) -> None:
    """Send ``sends`` to the next rank (the previous one when ``backward``) and receive into ``recv`` from the
    previous (the next), all posted at once."""
    import torch.distributed as dist

    from automodel.distributed.cp.exchange.p2p import batch_p2p

    ahead, behind = (rank - 1, rank + 1) if backward else (rank + 1, rank - 1)
    peer = functools.partial(dist.get_global_rank, group) if group is not None else (lambda r: r)
    batch_p2p(sends, [peer(ahead) for _ in sends], [] if recv is None else [recv],
              [] if recv is None else [peer(behind)], group)


class RwkvKernel(MixerKernel):
    """RWKV's WKV recurrence (module docstring): core inputs ``k, v [B, n, A, 1]``; state ``[num, den, max,
    started]``; output ``[B, n, A', 1]``."""

    name = "RWKV time mixing"

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        receptance, key, value, _ = mixer.extract_key_value(hidden)
        return Projected({"k": key.unsqueeze(-1), "v": value.unsqueeze(-1)}, receptance)

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        return dict.fromkeys(("k", "v"), mixer.attention_hidden_size)

    def out_heads(self, mixer: torch.nn.Module) -> int:
        return mixer.attention_hidden_size

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        mine = slice(None) if shard is None else shard.slice(mixer.attention_hidden_size)
        return {"time_decay": mixer.time_decay[mine], "time_first": mixer.time_first[mine]}

    def core(self, mixer, params, seq, state, shard):  # type: ignore[override]
        key, value = seq["k"][..., 0], seq["v"][..., 0]  # [B, n, A']
        start = None
        if state is not None:
            num, den, mx, started = state
            begun = started > 0.5  # [B, 1]: a zero state is a document start
            start = [torch.where(begun, num, 0.0), torch.where(begun, den, 0.0), torch.where(begun, mx, _START)]
        out, final = model_module(mixer).rwkv_linear_attention_cpu(
            params["time_decay"], params["time_first"], key, value, state=start, return_state=True)
        like = torch.promote_types(key.dtype, torch.float32)
        return out.unsqueeze(-1), [*(s.to(like) for s in final), key.new_ones(key.shape[0], 1)]

    def state_like(self, mixer, params, batch, dtype, shard) -> StateLike:  # type: ignore[override]
        channels = params["time_decay"].shape[0]
        like = torch.promote_types(dtype, torch.float32)
        return [((batch, channels), like)] * 3 + [((batch, 1), dtype)]

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> tuple[torch.Tensor, None]:
        return mixer.output(local * out.squeeze(-1)), None


def wkv_reference(time_decay, time_first, key, value, state=None, return_state=False):
    """``rwkv_linear_attention_cpu`` with its state and key in the inputs' dtype (fp32 or wider) instead of fp32:
    the same loop, for fp64 proofs (tests swap it into the model module in both runs). ``key, value [B, n, A]``;
    ``state``: ``[num, den, max]`` ``[B, A]`` or ``None``. Returns ``(out [B, n, A], state or None)``."""
    dtype = torch.promote_types(key.dtype, torch.float32)
    output = torch.zeros_like(key)
    if state is None:
        num = torch.zeros_like(key[:, 0], dtype=dtype)
        den = torch.zeros_like(key[:, 0], dtype=dtype)
        mx = torch.zeros_like(key[:, 0], dtype=dtype) + _START
    else:
        num, den, mx = state
    decay = -torch.exp(time_decay)
    for t in range(key.shape[1]):
        k, v = key[:, t].to(dtype), value[:, t]
        top = torch.maximum(mx, k + time_first)
        e1, e2 = torch.exp(mx - top), torch.exp(k + time_first - top)
        output[:, t] = ((e1 * num + e2 * v) / (e1 * den + e2)).to(output.dtype)
        top = torch.maximum(mx + decay, k)
        e1, e2 = torch.exp(mx + decay - top), torch.exp(k - top)
        num, den, mx = e1 * num + e2 * v, e1 * den + e2, top
    return output, ([num, den, mx] if return_state or state is not None else None)


register(RWKV_MIXERS, RwkvKernel())
register(("TokenShift",), TokenShiftKernel())
