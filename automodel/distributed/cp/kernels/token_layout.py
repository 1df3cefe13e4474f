"""Which global tokens every CP rank holds, for the halo kernels (:mod:`.halo`).

A layout is the same on every rank (each rank computes every rank's token ids), so each rank knows
without communication what its peers need from it. Token ids are global positions in one row (ring)
or in the packed stream of documents (thd); ``doc_start[t]`` is where token ``t``'s document begins,
so windows and chunks never cross a document.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["TokenLayout", "ring_layout", "thd_layout"]


@dataclass
class TokenLayout:
    """The global token ids of every CP rank.

    Attributes:
        group: the CP process group (``None`` at world size 1).
        world_size, rank: the CP group's size and this rank.
        rank_ids: per rank, ``[n_r]`` int64 (CPU) global ids of its local tokens, in local order.
        doc_start: ``[T]`` int64 (CPU) global id of the first token of each token's document.
    """

    group: Any
    world_size: int
    rank: int
    rank_ids: list[torch.Tensor]
    doc_start: torch.Tensor
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return int(self.doc_start.numel())

    @property
    def ids(self) -> torch.Tensor:
        """``[n]`` int64 global ids of this rank's tokens."""
        return self.rank_ids[self.rank]

    def positions(self) -> torch.Tensor:
        """``[n]`` int64 position of each local token inside its document."""
        return self.ids - self.doc_start[self.ids]

    def longest_document(self) -> int:
        """The longest document's length in tokens (cached)."""
        if "longest" not in self._plans:
            starts = torch.unique(self.doc_start)
            ends = torch.cat([starts[1:], torch.tensor([self.total])])
            self._plans["longest"] = int((ends - starts).max()) if starts.numel() else 0
        return self._plans["longest"]

    def halo_plan(self, window: int | None, chunk: int | None, block: int):
        """The cached :class:`~automodel.distributed.cp.kernels.halo.HaloPlan` for a window / chunk."""
        from automodel.distributed.cp.kernels.halo import HaloPlan

        key = (window, chunk, block)
        if key not in self._plans:
            self._plans[key] = HaloPlan(self, window, chunk, block)
        return self._plans[key]


def ring_layout(seq_len: int, group: Any, world_size: int, rank: int) -> TokenLayout:
    """Ring's head-tail split of a ``seq_len`` row: rank r holds chunks r and 2W-1-r of 2W (one document)."""
    if world_size <= 1:
        return TokenLayout(group, 1, 0, [torch.arange(seq_len)], torch.zeros(seq_len, dtype=torch.int64))
    if seq_len % (2 * world_size):
        raise ValueError(f"a ring row of {seq_len} tokens does not split into 2*cp_size={2 * world_size} chunks")
    c = seq_len // (2 * world_size)
    ids = [
        torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * world_size - 1 - r) * c, (2 * world_size - r) * c)])
        for r in range(world_size)
    ]
    return TokenLayout(group, world_size, rank, ids, torch.zeros(seq_len, dtype=torch.int64))


def thd_layout(cu_seqlens_padded: list[int], group: Any, world_size: int, rank: int) -> TokenLayout:
    """thd's partition of packed documents (``cu_seqlens_padded`` ``[N+1]`` global offsets): rank r holds
    chunks r and 2W-1-r of every document, documents in order (TE's ``thd_get_partitioned_indices``)."""
    from automodel.distributed.thd_utils import thd_partition_indices

    cu = torch.tensor(cu_seqlens_padded, dtype=torch.int64)
    total = int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    doc_start = torch.repeat_interleave(cu[:-1], lengths)
    if world_size <= 1:
        return TokenLayout(group, 1, 0, [torch.arange(total)], doc_start)
    ids = [thd_partition_indices(cu, total, world_size, r).long() for r in range(world_size)]
    return TokenLayout(group, world_size, rank, ids, doc_start)
