"""Point-to-point lend and return among the ranks a document spans.

A rank lends pieces of its local K/V (one tensor ``[1, H, n, D]``, pieces along dim 2) to the peers that
attend to them, and borrows theirs; after the backward it returns the gradients of what it borrowed
and adds the gradients of what it lent into its own. Which pieces go where is a :class:`LendTable`,
the same rule on both ends of every message, so every send has its matching receive. Only the ranks
that share a piece take part; all messages of one exchange are posted together
(``batch_isend_irecv``, gloo and NCCL).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["LendTable", "batch_p2p", "give_back", "lend"]


class LendTable(Protocol):
    """Who lends which pieces to whom (ranks are ranks of ``group``; ``None`` at world size 1)."""

    rank: int
    group: Any

    def peers(self) -> list[int]:
        """The ranks this rank exchanges with."""
        ...

    def messages(self, sender: int, receiver: int) -> list[Hashable]:
        """The keys of the pieces ``sender`` lends ``receiver``, in message order."""
        ...

    def size(self, key: Hashable) -> int:
        """The piece's length along dim 2."""
        ...

    def offset(self, key: Hashable) -> int:
        """Where this rank's own piece ``key`` starts in its local tensor (dim 2)."""
        ...


def batch_p2p(sends: list, send_to: list, recvs: list, recv_from: list, group: Any) -> None:
    """Post every send and receive (peers are GLOBAL ranks), then wait for all; fills ``recvs``."""
    if not sends and not recvs:
        return
    ops = [dist.P2POp(dist.isend, t, p, group) for t, p in zip(sends, send_to)]
    ops += [dist.P2POp(dist.irecv, t, p, group) for t, p in zip(recvs, recv_from)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _swap(
    table: LendTable, outgoing: list[tuple[torch.Tensor, int]], incoming: list[tuple[int, list]], like: torch.Tensor
) -> list[tuple[Hashable, torch.Tensor]]:
    """Send each ``(tensor, peer)``, receive from each ``(peer, keys)`` the pieces ``keys`` (concatenated on
    dim 2); returns ``[(key, piece)]`` in receive order."""

    def global_rank(peer: int) -> int:
        return peer if table.group is None else dist.get_global_rank(table.group, peer)

    buffers = [
        like.new_empty((*like.shape[:2], sum(table.size(k) for k in keys), like.shape[3])) for _, keys in incoming
    ]
    batch_p2p(
        [t for t, _ in outgoing],
        [global_rank(p) for _, p in outgoing],
        buffers,
        [global_rank(p) for p, _ in incoming],
        table.group,
    )
    pieces = []
    for buf, (_, keys) in zip(buffers, incoming):
        at = 0
        for key in keys:
            n = table.size(key)
            pieces.append((key, buf[:, :, at : at + n]))
            at += n
    return pieces


def lend(table: LendTable, local: torch.Tensor) -> dict[Hashable, torch.Tensor]:
    """Lend this rank's pieces of ``local`` ``[1, H, n, D]`` to the peers that attend to them and borrow
    theirs: ``{key: [1, H, size, D]}`` of every borrowed piece (no autograd; ``local`` is not mutated)."""
    outgoing, incoming = [], []
    for peer in table.peers():
        out = [local[:, :, table.offset(k) : table.offset(k) + table.size(k)] for k in table.messages(table.rank, peer)]
        if out:
            outgoing.append((torch.cat(out, 2).contiguous(), peer))
        want = table.messages(peer, table.rank)
        if want:
            incoming.append((peer, want))
    return dict(_swap(table, outgoing, incoming, local))


def give_back(table: LendTable, grads: dict[Hashable, torch.Tensor], local: torch.Tensor) -> None:
    """Return the gradients ``grads`` of every borrowed piece to its owner and add the ones received for
    this rank's lent pieces into ``local`` ``[1, H, n, D]`` (mutated)."""
    outgoing, incoming = [], []
    for peer in table.peers():
        back = table.messages(peer, table.rank)  # what the peer lent us, in its order
        if back:
            outgoing.append((torch.cat([grads[k] for k in back], 2).contiguous(), peer))
        lent = table.messages(table.rank, peer)
        if lent:
            incoming.append((peer, lent))
    for key, piece in _swap(table, outgoing, incoming, local):
        off = table.offset(key)
        local[:, :, off : off + piece.shape[2]] += piece
