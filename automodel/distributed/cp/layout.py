"""Token layout: which tokens of a row, or of packed documents, each CP rank holds.

This module is the one place the placement formulas are written:

- **head-tail** (ring, thd, usp's ring level, the seed primitives' load-balanced split): a sequence of
  padded length ``L`` is cut into ``2W`` chunks of ``c = L / (2W)`` tokens and rank ``r`` holds
  chunks ``r`` and ``2W-1-r``, in that order (each rank gets one early and one late chunk, which
  balances causal attention). Packed sequences are cut one by one, in order: exactly what TE's
  ``thd_get_partitioned_indices`` returns.
- **contiguous** (Ulysses, usp's Ulysses level): rank ``r`` holds ``[r*L/W, (r+1)*L/W)``.

Pure functions of integers (no process group): every rank computes every rank's share.
"""

from __future__ import annotations

import torch

__all__ = [
    "check_head_tail",
    "contiguous_span",
    "head_tail_chunks",
    "head_tail_indices",
    "head_tail_pair",
    "head_tail_spans",
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
