"""Headwise Ulysses: run the attention of a head-sharding CP method one head group at a time.

``distributed.ulysses_head_chunks: G`` (``cp_method: ulysses`` and usp's Ulysses level). Ulysses trades each
rank's slice of the sequence for the whole row on ``H / W`` heads (``W``: the ranks the heads are split over:
the CP group for Ulysses, the Ulysses sub-group for usp). The full-row q/k/v it receives, the kernel's output
and its buffers, and the output on its way back are ``W`` times the rank's share of a head: with ``G`` groups
each of them exists for ``H / (W G)`` heads at a time.

For group ``g`` a rank takes, from its local ``[B, H, n, D]`` q (and ``[B, Hkv', n, D]`` k/v, KV heads already
replicated up to ``W`` where needed), the ``g``-th ``1/G`` of every rank's head block: heads
``[j H/W + g H/(W G), j H/W + (g+1) H/(W G))`` for ``j = 0 .. W-1``. After the all-to-all it holds the ``g``-th
``1/G`` of its own ``H/W`` heads over the whole row: the unchanged attention (the same function the method runs
unchunked, restricted to those heads: masks, windows, sinks of those heads, softcapping, document blocks) runs on
them, and the output goes back. The groups' outputs are put back in head order. A group is whole KV heads with
their query heads (``G`` divides the KV heads a rank holds after the all-to-all), so every query head of a group
finds its KV head in it.

The backward is group by group too: each group runs under a non-reentrant
:func:`torch.utils.checkpoint.checkpoint`, so its full-row tensors are not saved in the forward; the backward
recomputes one group's all-to-all and attention forward, runs its backward, and frees them before the next group.
What stays between the forward and the backward is what the layer keeps anyway: the local q/k/v (the
projections) and the local output. The cost: one more attention forward per layer and its all-to-alls (q, k, v),
``G`` times as many (smaller) collectives. Exact: each head's attention is the same computation on the same
values (gradients too: the copies of a replicated KV head and the per-head sinks sum as before).

Chunking starts at the projected q/k/v (transformers' attention modules project, normalise and rotate all heads
before calling the attention function, so a CP method cannot project per group without rewriting every model's
attention module); the output projection runs on the gathered local output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "HEAD_CHUNKS_KEY",
    "group_heads",
    "head_chunk_choices",
    "head_chunks_problem",
    "kv_heads_per_rank",
    "run_head_groups",
    "ALL_TO_ALL_LATENCY_S",
    "HEAD_GROUP_COUNTS",
    "HeadGroupCounts",
    "head_chunked_exchange",
]

#: the fixed cost of one all-to-all beyond its bytes (launch and synchronisation of NCCL's all-to-all over a node's
#: NVLink): an allowance, not a measurement; what one more head group costs per collective in the step estimate
ALL_TO_ALL_LATENCY_S = 30e-6

#: the config key
HEAD_CHUNKS_KEY = "distributed.ulysses_head_chunks"


@dataclass
class HeadGroupCounts:
    """What :func:`run_head_groups` did in this process since :meth:`reset` (the run log's technique line):
    attention calls run in head groups, the groups run in their forwards, and all group runs (the backward's
    recomputations are the difference)."""

    calls: int = 0
    groups: int = 0
    group_runs: int = 0
    max_groups: int = 0

    def reset(self) -> None:
        self.calls = self.groups = self.group_runs = self.max_groups = 0

    @property
    def recomputed(self) -> int:
        return self.group_runs - self.groups


#: the process's counts (one process runs one rank's attention)
HEAD_GROUP_COUNTS = HeadGroupCounts()


def kv_heads_per_rank(kv_heads: int, world: int) -> int:
    """KV heads a rank holds after the head all-to-all over ``world`` ranks: ``lcm(Hkv, W) / W`` (KV heads are
    replicated ``W / gcd(Hkv, W)`` times when ``W`` does not divide them)."""
    import math

    kv_heads, world = max(1, kv_heads), max(1, world)
    return kv_heads * (world // math.gcd(kv_heads, world)) // world


def head_chunk_choices(kv_heads: int, world: int) -> list[int]:
    """The valid ``ulysses_head_chunks`` for ``kv_heads`` KV heads split over ``world`` ranks: the divisors of
    :func:`kv_heads_per_rank` (a group is whole KV heads with their query heads)."""
    k = kv_heads_per_rank(kv_heads, world)
    return [g for g in range(1, k + 1) if k % g == 0]


def head_chunks_problem(chunks: Any, heads: int | None, kv_heads: int | None, world: int, where: str = "") -> str | None:
    """Why ``ulysses_head_chunks=chunks`` cannot split the attention of a model with ``heads`` query and
    ``kv_heads`` KV heads over ``world`` ranks (``None``: it can; ``auto`` and unknown head counts pass).

    ``where`` names the head split in the message (e.g. ``"cp_size=2"``)."""
    if chunks == "auto":
        return None
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        return (
            f"{HEAD_CHUNKS_KEY}={chunks!r} must be 'auto' or a positive integer (the number of head groups each "
            "rank's attention runs one after another; 1 = all heads at once)"
        )
    if chunks == 1 or heads is None or kv_heads is None or world < 1:
        return None
    per_rank = kv_heads_per_rank(kv_heads, world)
    choices = head_chunk_choices(kv_heads, world)
    if per_rank % chunks:
        return (
            f"{HEAD_CHUNKS_KEY}={chunks} does not divide the {per_rank} KV head(s) each rank holds after the head "
            f"all-to-all ({kv_heads} KV heads over {world} ranks{', ' + where if where else ''}): a head group is "
            f"whole KV heads with their query heads; set {HEAD_CHUNKS_KEY} to one of {choices} (or auto)"
        )
    return None


def _group(x: torch.Tensor, world: int, chunks: int) -> tuple[torch.Tensor, ...]:
    """``[B, W*h, n, D]`` -> ``chunks`` views ``[B, W, h/chunks, n, D]``: group ``g`` holds the ``g``-th ``1/G`` of
    every rank's ``h`` heads (views: nothing is copied until a group runs)."""
    per = x.shape[1] // world
    return x.unflatten(1, (world, chunks, per // chunks)).unbind(2)


def run_head_groups(
    fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    world: int,
    chunks: int,
) -> torch.Tensor:
    """Run a head-sharding attention one head group at a time (see the module docstring).

    Args:
        fn: ``fn(g, q, k, v) -> out``: the method's attention on ``q`` ``[B, W*h_g, n, D]``, ``k``/``v``
            ``[B, W*k_g, n, D]`` (this rank's tokens, group ``g``'s heads of every rank, rank-major), returning
            ``[B, n, W*h_g, Dv]`` (sequence-major, transformers' layout), all-to-alls included. It must read no
            state it changes (it runs again in the backward).
        query: ``[B, W*h, n, D]``; key, value: ``[B, W*k, n, D]`` / ``[B, W*k, n, Dv]`` (KV heads replicated).
        world: ``W``, the ranks the heads are split over.
        chunks: ``G``; it divides ``k`` (checked by the caller with :func:`head_chunks_problem`). ``1``: ``fn``
            runs once on everything, as without head chunks.

    Returns:
        ``[B, n, W*h, Dv]``: every head's output in head order, as ``fn(0, query, key, value)`` returns it.
    """
    if chunks == 1:
        return fn(0, query, key, value)
    qs, ks, vs = (_group(x, world, chunks) for x in (query, key, value))
    grad = torch.is_grad_enabled()
    counts = HEAD_GROUP_COUNTS
    counts.calls += 1
    counts.groups += chunks
    counts.max_groups = max(counts.max_groups, chunks)
    outs = []
    for g in range(chunks):

        def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: int = g) -> torch.Tensor:
            counts.group_runs += 1  # again when the backward recomputes the group
            return fn(g, q.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2))

        if grad:  # its full-row tensors are recomputed in the backward, one group at a time
            out = checkpoint(one, qs[g], ks[g], vs[g], use_reentrant=False)
        else:
            out = one(qs[g], ks[g], vs[g])
        outs.append(out.unflatten(2, (world, -1)))  # [B, n, W, h_g, Dv]
    return torch.stack(outs, dim=3).flatten(2, 4)  # [B, n, W, G, h_g, Dv] -> [B, n, H, Dv]


def group_heads(total: int, world: int, chunks: int, rank: int, g: int) -> tuple[int, int]:
    """``(start, count)``: the query (or KV) heads of the ``total`` that rank ``rank`` holds in group ``g``
    after the all-to-all (``total / W / G`` heads from ``rank * total / W + g * total / (W G)``)."""
    per = total // world
    size = per // chunks
    return rank * per + g * size, size


def head_chunked_exchange(term: Any, chunks: int, recomputed_fraction: float, collectives: int = 4) -> Any:
    """An all-to-all :class:`~automodel.distributed.cp.method.ExchangeTerm` of ``collectives`` all-to-alls per pass
    (q, k, v, the output) run in ``chunks`` head groups: the backward recomputes each group's forward, sending
    ``recomputed_fraction`` of the forward's bytes once more (q, k and v), and every group's collectives add
    :data:`ALL_TO_ALL_LATENCY_S` beyond the unchunked run's (``collectives (G-1)`` per pass, plus the recomputed
    ``(collectives - 1) G``). ``chunks == 1``: ``term`` as it is."""
    import dataclasses

    if chunks <= 1:
        return term
    extra = collectives * (chunks - 1) * ALL_TO_ALL_LATENCY_S
    return dataclasses.replace(
        term,
        what=f"{term.what}, in {chunks} head groups (the backward recomputes each group's q, k, v all-to-all)",
        backward_bytes=term.backward_bytes + recomputed_fraction * term.forward_bytes,
        forward_latency_s=term.forward_latency_s + extra,
        backward_latency_s=term.backward_latency_s + extra + (collectives - 1) * chunks * ALL_TO_ALL_LATENCY_S,
    )
