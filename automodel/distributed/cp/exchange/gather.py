"""All-gather of token-major tensors over the CP group, and the reduce-scatter of their gradients.

Every rank holds ``n`` tokens of a stream of ``T = W * n`` (in any placement). :func:`all_gather_tokens`
returns the whole stream in global token order; :func:`reduce_scatter_tokens` is its adjoint: it sums a
global-order ``[T, ...]`` tensor over the ranks and keeps each rank's own tokens. :class:`GatherKV`
pairs them as one autograd function (the gathered K/V's gradient returns to the ranks that own the
tokens).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["GatherKV", "TokenGather", "all_gather_tokens", "gather_kv", "reduce_scatter_tokens"]

# torch >= 2.13 names (the *_tensor ones are deprecated there); older torch has only the *_tensor ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tokens(x: torch.Tensor, group: Any, world_size: int, to_global: torch.Tensor) -> torch.Tensor:
    """All-gather this rank's ``[n, ...]`` tokens into the global-order ``[W * n, ...]`` stream (no autograd).

    ``to_global`` ``[W * n]`` int64: for each global token, its position in the rank-major concatenation
    (rank 0's tokens, then rank 1's, ...). At ``world_size == 1`` ``x`` is returned as is.
    """
    if world_size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
    _all_gather(out, x, group=group)
    return out.index_select(0, to_global)


def reduce_scatter_tokens(x: torch.Tensor, group: Any, world_size: int, to_ranks: torch.Tensor) -> torch.Tensor:
    """Sum global-order ``[T, ...]`` over the ranks and keep this rank's ``[T / W, ...]`` (no autograd).

    ``to_ranks`` ``[T]`` int64: the global token at each position of the rank-major stream (the inverse
    permutation of :func:`all_gather_tokens`' ``to_global``). At ``world_size == 1`` ``x`` is returned.
    """
    if world_size == 1:
        return x
    ranked = x.index_select(0, to_ranks).contiguous()
    out = x.new_empty((x.shape[0] // world_size, *x.shape[1:]))
    _reduce_scatter(out, ranked, group=group)
    return out


class TokenGather(Protocol):
    """A step's gather plan: ``gather`` ``[n, ...] -> [T, ...]`` and its adjoint ``reduce_scatter``."""

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor: ...


class GatherKV(torch.autograd.Function):
    """All-gather token-major ``[n, H, D]`` to global ``[T, H, D]``; the backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, plan: TokenGather):  # type: ignore[override]
        ctx.plan = plan
        return plan.gather(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.plan.reduce_scatter(grad.contiguous()), None


def gather_kv(x: torch.Tensor, plan: TokenGather) -> torch.Tensor:
    """:class:`GatherKV` applied: ``[n, H, D]`` -> ``[T, H, D]``, differentiable (dK/dV reduce-scattered)."""
    return GatherKV.apply(x, plan)
