"""The recurrent-state hand-off of linear mixers: one message of several tensors to or from a CP peer.

A linear mixer under a split document (:mod:`automodel.distributed.cp.layers.state_chain`) passes each
document's conv halo and recurrent state from the rank holding one chunk to the rank holding the next, in
sequence order; its backward returns the gradients of what it received the same way. Every message here
is blocking point-to-point (``dist.send`` / ``dist.recv`` on the CP group), so sends and receives pair up in
the fixed order the caller issues them. The tensors of one message travel as one flat fp64 buffer
(states are fp32 or fp64, halos any float dtype: fp64 carries all of them exactly) and come back in their
own shapes and dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["per_document", "recv_state", "send_state"]

#: the shape and dtype of each tensor of a message, in order
Like = list[tuple[tuple[int, ...], torch.dtype]]


def _peer(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank)


def send_state(group: Any, tensors: list[torch.Tensor], rank: int) -> None:
    """Send ``tensors`` (detached, any shapes / float dtypes) as one message to CP rank ``rank`` of ``group``.

    Blocks until the peer posted the matching :func:`recv_state`. Nothing is mutated.
    """
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    dist.send(flat.contiguous(), dst=_peer(group, rank), group=group)


def recv_state(group: Any, like: Like, rank: int, device: torch.device) -> list[torch.Tensor]:
    """Receive one :func:`send_state` message from CP rank ``rank`` of ``group``: one new tensor per
    ``(shape, dtype)`` of ``like``, on ``device`` (not requiring grad)."""
    sizes = [int(torch.Size(shape).numel()) for shape, _ in like]
    flat = torch.empty(sum(sizes), dtype=torch.float64, device=device)
    dist.recv(flat, src=_peer(group, rank), group=group)
    return [part.reshape(shape).to(dtype) for part, (shape, dtype) in zip(flat.split(sizes), like)]


def per_document(t: torch.Tensor, n_docs: int) -> list[torch.Tensor]:
    """``[n_docs * B, ...]`` (documents major, as messages hold them) -> one ``[B, ...]`` per document."""
    return list(t.chunk(n_docs, dim=0)) if n_docs else []
