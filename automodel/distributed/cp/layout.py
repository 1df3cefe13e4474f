"""Token layout: which tokens of a row, or of packed documents, each CP rank holds.

This module is the one place the placement formulas are written:

- **head-tail** (ring, thd, usp's ring level, the seed primitives' load-balanced split): a sequence of
  padded length ``L`` is cut into ``2W`` chunks of ``c = L / (2W)`` tokens and rank ``r`` holds
  chunks ``r`` and ``2W-1-r``, in that order (each rank gets one early and one late chunk, which
  balances causal attention). Packed sequences are cut one by one, in order: exactly what TE's
  ``thd_get_partitioned_indices`` returns.
- **contiguous** (Ulysses, usp's Ulysses level): rank ``r`` holds ``[r*L/W, (r+1)*L/W)``.

The formulas are pure functions of integers (no process group): every rank computes every rank's share.
:class:`TokenLayout` holds the result for the per-layer kernels (:mod:`automodel.distributed.cp.layers`):
the global token ids of every rank (ring's head-tail split of a row: :func:`ring_layout`; thd's partition
of every packed document: :func:`thd_layout`; thd_docs builds its placement's), so each rank knows without communication what its peers
need from it (the halo exchange, :mod:`automodel.distributed.cp.exchange.halo`).

Importing this module imports no torch (the functions that build tensors import it): the CP method
registry and the config rules read the integer formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "TokenLayout",
    "check_head_tail",
    "contiguous_span",
    "head_tail_chunks",
    "head_tail_indices",
    "head_tail_pair",
    "head_tail_spans",
    "ring_layout",
    "thd_layout",
]


def check_head_tail(length: int, world_size: int, what: str = "sequence") -> None:
    """``ValueError`` unless ``length`` splits into ``2 * world_size`` equal chunks."""
    if length % (2 * world_size):
        raise ValueError(
            f"{what} length {length} is not divisible by 2*cp_size={2 * world_size}; the head-tail split cuts it "
            f"into {2 * world_size} equal chunks: pad it to a multiple of {2 * world_size}"
        )


def head_tail_spans(length: int, world_size: int, rank: int) -> list[tuple[int, int]]:
    """The two ``[start, end)`` token ranges rank ``rank`` holds of one sequence of ``length`` tokens.

    ``ValueError`` if ``length % (2 * world_size) != 0`` or ``rank`` is out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    check_head_tail(length, world_size)
    chunks = head_tail_chunks(length, world_size)
    return [chunks[j] for j in head_tail_pair(rank, world_size)]


def head_tail_pair(rank: int, world_size: int) -> tuple[int, int]:
    """The two chunk indices rank ``rank`` of ``world_size`` holds: ``(rank, 2*world_size - 1 - rank)``."""
    return rank, 2 * world_size - 1 - rank


def head_tail_chunks(length: int, world_size: int) -> list[tuple[int, int]]:
    """The ``2 * world_size`` head-tail chunks ``[(start, end)]`` of ``length`` tokens, in order.

    ``length // (2W)`` tokens each, the first ``length % (2W)`` one more (no padding needed; chunks are
    empty where ``length < 2W``). Rank ``r`` holds chunks :func:`head_tail_pair` ``(r, W)``.
    """
    q, r = divmod(length, 2 * world_size)
    out, at = [], 0
    for j in range(2 * world_size):
        n = q + (1 if j < r else 0)
        out.append((at, at + n))
        at += n
    return out


def head_tail_indices(cu_seqlens_padded: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """The token indices rank ``rank`` holds of packed sequences, each cut head-tail (vectorised).

    Args:
        cu_seqlens_padded: ``[N+1]`` integer tensor of sequence boundaries in the flat token stream,
            starting at 0, non-decreasing, every length divisible by ``2 * world_size`` (the caller
            validates; zero-length sequences are skipped).
        world_size: ``W``; rank: ``r`` in ``[0, W)``.

    Returns:
        ``[cu[-1] / W]`` int64 on ``cu_seqlens_padded``'s device: for each sequence (start ``s``, chunk
        ``c``) the indices ``[s+r*c, s+(r+1)*c)`` then ``[s+(2W-1-r)*c, s+(2W-r)*c)``.
    """
    import torch

    cu = cu_seqlens_padded.to(torch.int64)
    local_cu = cu // world_size  # each rank holds L/W tokens of every sequence
    k = torch.arange(int(cu[-1]) // world_size, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(local_cu, k, right=True) - 1  # the last i with local_cu[i] <= k
    local_start = local_cu[seq]
    idx = k - local_start
    chunk = (local_cu[seq + 1] - local_start) // 2
    offset = torch.where(idx < chunk, rank * chunk, (2 * world_size - 2 - rank) * chunk)
    return cu[seq] + idx + offset


def contiguous_span(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` range rank ``rank`` holds of ``length`` tokens cut into ``W`` equal slices.

    ``ValueError`` if ``length % world_size != 0``.
    """
    if length % world_size:
        raise ValueError(
            f"length {length} is not divisible by cp_size={world_size}; pad it to a multiple of {world_size}"
        )
    n = length // world_size
    return rank * n, (rank + 1) * n


# ---------------------------------------------------------------------------------------------------------
# the token ids of every rank, for the per-layer kernels


@dataclass
class TokenLayout:
    """The global token ids of every CP rank.

    Token ids are global positions in one row (ring) or in the packed stream of documents (thd);
    ``doc_start[t]`` is where token ``t``'s document begins, so windows and chunks never cross a document.

    Attributes:
        group: the CP process group (``None`` at world size 1).
        world_size, rank: the CP group's size and this rank.
        rank_ids: per rank, ``[n_r]`` int64 (CPU) global ids of its local tokens, in local order.
        doc_start: ``[T]`` int64 (CPU) global id of the first token of each token's document.
        calls: attention calls routed under this layout while it is active
            (:func:`automodel.distributed.cp.active.activate`).
        halo_transport: how the halo of windows and chunks travels (:mod:`~automodel.distributed.cp.exchange.
            halo`): ``"all_to_all"`` (one collective of the whole group: ring, thd) or ``"p2p"`` (point to point
            between the ranks that share a halo only: thd_docs, where most documents sit whole on one rank).
    """

    group: Any
    world_size: int
    rank: int
    rank_ids: list[torch.Tensor]
    doc_start: torch.Tensor
    calls: int = 0
    halo_transport: str = "all_to_all"
    #: ring rows right-padded to split evenly: the real row length (the tokens from it on are padding); ``None``:
    #: no padding (the DSA kernel's top-k row is the real length, as one process has it)
    real_length: int | None = None
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
        import torch

        if "longest" not in self._plans:
            starts = torch.unique(self.doc_start)
            ends = torch.cat([starts[1:], torch.tensor([self.total])])
            self._plans["longest"] = int((ends - starts).max()) if starts.numel() else 0
        return self._plans["longest"]

    def halo_plan(self, window: int | None, chunk: int | None, block: int):
        """The cached :class:`~automodel.distributed.cp.exchange.halo.HaloPlan` for a window / chunk."""
        from automodel.distributed.cp.exchange.halo import HaloPlan

        key = (window, chunk, block)
        if key not in self._plans:
            self._plans[key] = HaloPlan(self, window, chunk, block)
        return self._plans[key]


def ring_layout(seq_len: int, group: Any, world_size: int, rank: int) -> TokenLayout:
    """Ring's head-tail split of a ``seq_len`` row: rank r holds chunks r and 2W-1-r of 2W (one document)."""
    import torch

    if world_size <= 1:
        return TokenLayout(group, 1, 0, [torch.arange(seq_len)], torch.zeros(seq_len, dtype=torch.int64))
    if seq_len % (2 * world_size):
        raise ValueError(f"a ring row of {seq_len} tokens does not split into 2*cp_size={2 * world_size} chunks")
    row = torch.tensor([0, seq_len])
    ids = [head_tail_indices(row, world_size, r) for r in range(world_size)]
    return TokenLayout(group, world_size, rank, ids, torch.zeros(seq_len, dtype=torch.int64))


def thd_layout(cu_seqlens_padded: list[int], group: Any, world_size: int, rank: int) -> TokenLayout:
    """thd's partition of packed documents (``cu_seqlens_padded`` ``[N+1]`` global offsets, every length a
    multiple of ``2W``): rank r holds chunks r and 2W-1-r of every document, documents in order (TE's
    ``thd_get_partitioned_indices``)."""
    import torch

    cu = torch.tensor(cu_seqlens_padded, dtype=torch.int64)
    total = int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    doc_start = torch.repeat_interleave(cu[:-1], lengths)
    if world_size <= 1:
        return TokenLayout(group, 1, 0, [torch.arange(total)], doc_start)
    ids = [head_tail_indices(cu, world_size, r) for r in range(world_size)]
    return TokenLayout(group, world_size, rank, ids, doc_start)
