"""The halo: the K/V tokens a rank's queries reach but another rank holds, and how they travel.

For a query at global position ``i`` in a document starting at ``d``, the keys it may see are
``[lo(i), i]`` with ``lo(i) = max(d, i - W + 1)`` for a sliding window of ``W`` tokens, ``d + C *
floor((i - d) / C)`` for attention chunks of ``C`` tokens, and ``d`` for full causal attention. The
union of these ranges over a rank's queries, minus the tokens it holds, is its halo: for a window, at
most ``W - 1`` tokens before each of its contiguous runs of queries (two runs per document under
head-tail placement), possibly from several predecessors when a chunk is shorter than the window;
nothing where chunk boundaries coincide with the shards. Every rank computes every rank's halo from
the shared :class:`~automodel.distributed.cp.layout.TokenLayout`, so the exchange is
one ``all_to_all_single`` with per-peer split sizes (the collective the seed's all-to-all uses), and
its backward is the reverse exchange with the halo's dK/dV summed into their owners' gradients. A layout
whose ``halo_transport`` is ``"p2p"`` (thd_docs: documents placed whole, a few split over a subset of the
ranks) sends the same rows point to point (:func:`~automodel.distributed.cp.exchange.p2p.batch_p2p`),
between the ranks that share a halo only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from automodel.distributed.cp.exchange.p2p import batch_p2p

__all__ = ["HaloPlan", "QueryBlock", "halo_exchange", "lower_bounds"]


def lower_bounds(ids: torch.Tensor, doc_start: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """``[n]`` int64: the first key each query of global id ``ids`` may attend to (see the module docstring)."""
    d = doc_start[ids]
    lo = d.clone()
    if window is not None:
        lo = torch.maximum(lo, ids - window + 1)
    if chunk is not None:
        lo = torch.maximum(lo, d + torch.div(ids - d, chunk, rounding_mode="floor") * chunk)
    return lo


@dataclass
class QueryBlock:
    """Local queries ``[q0, q1)`` (global ids ``[a, a + q1 - q0)``, one document) and their keys.

    ``key_index``: ``[m]`` positions in the rank's key buffer (local tokens, then the halo) of the global
    keys ``[lo(a), a + q1 - q0)``; ``allowed``: ``[q1 - q0, m]`` bool, which of them each query sees.
    """

    q0: int
    q1: int
    key_index: torch.Tensor
    allowed: torch.Tensor


class HaloPlan:
    """What this rank sends, receives and attends to for one (window, chunk) on a layout.

    Attributes:
        send_index: ``[s]`` local token indices this rank sends, grouped by destination rank.
        send_splits / recv_splits: tokens sent to / received from each rank.
        halo_ids: ``[h]`` global ids of the received tokens, in arrival order.
        blocks: the :class:`QueryBlock` list covering the local queries in order (at most ``block``
            queries each).
        exchanges: whether any rank receives anything (the same on every rank: no collective otherwise).
    """

    def __init__(self, layout: Any, window: int | None, chunk: int | None, block: int) -> None:
        total, me = layout.total, layout.rank
        owner = torch.full((total,), -1, dtype=torch.int64)
        local_index = torch.full((total,), -1, dtype=torch.int64)
        needs = []
        for r, ids in enumerate(layout.rank_ids):
            owner[ids] = r
            local_index[ids] = torch.arange(ids.numel())
        for r, ids in enumerate(layout.rank_ids):
            lo = lower_bounds(ids, layout.doc_start, window, chunk)
            edge = torch.zeros(total + 1, dtype=torch.int64)
            edge.index_add_(0, lo, torch.ones_like(lo))
            edge.index_add_(0, ids + 1, -torch.ones_like(ids))
            covered = edge.cumsum(0)[:total] > 0
            needs.append(covered & (owner != r))
        send, self.send_splits, self.recv_splits, halo = [], [], [], []
        for r in range(layout.world_size):
            out = torch.nonzero(needs[r] & (owner == me)).flatten() if r != me else torch.empty(0, dtype=torch.int64)
            send.append(local_index[out])
            self.send_splits.append(int(out.numel()))
            inc = torch.nonzero(needs[me] & (owner == r)).flatten() if r != me else torch.empty(0, dtype=torch.int64)
            halo.append(inc)
            self.recv_splits.append(int(inc.numel()))
        self.send_index = torch.cat(send)
        self.halo_ids = torch.cat(halo)
        self.exchanges = any(bool(n.any()) for n in needs)
        self.group = layout.group
        self.transport = getattr(layout, "halo_transport", "all_to_all")
        self.blocks = self._blocks(layout, window, chunk, block)
        self._device_cache: dict = {}

    @property
    def sent_tokens(self) -> int:
        return sum(self.send_splits)

    def _blocks(self, layout: Any, window: int | None, chunk: int | None, block: int) -> list[QueryBlock]:
        ids, doc = layout.ids, layout.doc_start
        buffer_ids = torch.cat([ids, self.halo_ids])
        where = torch.full((layout.total,), -1, dtype=torch.int64)
        where[buffer_ids] = torch.arange(buffer_ids.numel())
        lo_all = lower_bounds(ids, doc, window, chunk)
        id_list, doc_list, lo_list = ids.tolist(), doc[ids].tolist(), lo_all.tolist()
        blocks, n, start = [], len(id_list), 0
        while start < n:
            end = start + 1
            while (
                end < n
                and end - start < block
                and id_list[end] == id_list[end - 1] + 1
                and doc_list[end] == doc_list[start]
            ):
                end += 1
            q = ids[start:end]
            keys = torch.arange(lo_list[start], id_list[end - 1] + 1)
            key_index = where[keys]
            if bool((key_index < 0).any()):  # a bug in the plan, never a user error
                raise RuntimeError(f"halo plan: rank {layout.rank} lacks keys for queries {id_list[start]}..{id_list[end - 1]}")
            allowed = (keys.unsqueeze(0) <= q.unsqueeze(1)) & (keys.unsqueeze(0) >= lo_all[start:end].unsqueeze(1))
            blocks.append(QueryBlock(start, end, key_index, allowed))
            start = end
        return blocks

    def on(self, device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, torch.Tensor, torch.Tensor]]]:
        """``send_index`` and ``(q0, q1, key_index, allowed)`` per block on ``device`` (cached)."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = (
                self.send_index.to(device),
                [(b.q0, b.q1, b.key_index.to(device), b.allowed.to(device)) for b in self.blocks],
            )
        return self._device_cache[key]


def _rows_to_peers(
    recv: torch.Tensor, send: torch.Tensor, recv_splits: list[int], send_splits: list[int], plan: HaloPlan
) -> None:
    """Send ``send``'s rows to each rank by ``send_splits`` and fill ``recv`` (mutated) by ``recv_splits``: one
    ``all_to_all_single`` of the group, or (``plan.transport == "p2p"``) point to point with the ranks whose
    split is not empty."""
    if plan.transport != "p2p":
        dist.all_to_all_single(recv, send, recv_splits, send_splits, group=plan.group)
        return

    def peer(r: int) -> int:
        return r if plan.group is None else dist.get_global_rank(plan.group, r)

    sends, send_to, recvs, recv_from = [], [], [], []
    for r, (piece, n) in enumerate(zip(send.split(send_splits), send_splits)):
        if n:
            sends.append(piece.contiguous())
            send_to.append(peer(r))
    for r, (piece, n) in enumerate(zip(recv.split(recv_splits), recv_splits)):
        if n:
            recvs.append(piece)  # rows of a contiguous [h, F] buffer: contiguous views
            recv_from.append(peer(r))
    batch_p2p(sends, send_to, recvs, recv_from, plan.group)


class _HaloExchange(torch.autograd.Function):
    """``[n, F]`` local token rows -> ``[h, F]`` halo rows; backward sends the halo's gradient home."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:  # type: ignore[override]
        ctx.plan, ctx.n = plan, x.shape[0]
        send_index, _ = plan.on(x.device)
        send = x.index_select(0, send_index).contiguous()
        recv = x.new_empty((sum(plan.recv_splits), x.shape[1]))
        _rows_to_peers(recv, send, plan.recv_splits, plan.send_splits, plan)
        return recv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        plan = ctx.plan
        send_index, _ = plan.on(grad.device)
        back = grad.new_empty((sum(plan.send_splits), grad.shape[1]))
        _rows_to_peers(back, grad.contiguous(), plan.send_splits, plan.recv_splits, plan)
        out = grad.new_zeros((ctx.n, grad.shape[1]))
        out.index_add_(0, send_index, back)
        return out, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan) -> torch.Tensor:
    """The halo rows of ``x`` (``[n, F]``, this rank's tokens): ``[h, F]`` in ``plan.halo_ids`` order.

    Differentiable; a collective on the CP group whenever any rank needs a halo (every rank calls it).
    """
    if not plan.exchanges:
        return x[:0]
    return _HaloExchange.apply(x, plan)
