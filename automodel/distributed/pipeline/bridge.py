"""Redistribution plans between two module stages with different dp / cp / tp layouts (no processes).

An activation crossing a module boundary is one global tensor ``[B, S, *rest]`` (a 2-D ``[N, H]``
activation is viewed as ``[1, N, H]``: one packed token row per rank). A stage layout says which
rank holds which part of it:

* ``dp``: rank ``d`` holds rows ``[d*B/dp, (d+1)*B/dp)``;
* ``cp``: along the sequence, ``"contiguous"`` (Ulysses / all-gather CP: rank ``c`` holds
  ``[c*S/cp, (c+1)*S/cp)``) or ``"head_tail"`` (ring CP: ``2*cp`` chunks, rank ``c`` holds chunks ``c``
  and ``2*cp-1-c``, the load-balanced partition of :mod:`automodel.distributed.sp.split_gather`);
* ``tp``: every tp rank holds the same (replicated) activation.

:func:`plan_transfers` lists, for a source stage and a destination stage, every message: which
source rank sends which rows and sequence positions to which destination rank, and where they
land. Every element of the destination is written exactly once per destination rank; the source
copy is taken from tp rank 0 (tp replicas are identical), and every destination tp rank receives
it. The gradient flows back with the same function and the roles swapped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from automodel.distributed.sp.split_gather import load_balanced_indices

__all__ = ["CP_LAYOUTS", "StageLayout", "Transfer", "cp_sequence_indices", "peer_pairs", "plan_transfers"]

CP_LAYOUTS = ("head_tail", "contiguous")


def cp_sequence_indices(seq_len: int, cp: int, cp_rank: int, layout: str) -> torch.Tensor:
    """Global sequence positions (int64, in the rank's local order) that cp rank ``cp_rank`` holds.

    ``ValueError`` if ``seq_len`` is not divisible by ``cp`` (contiguous) or ``2*cp`` (head_tail).
    """
    if layout not in CP_LAYOUTS:
        raise ValueError(f"cp layout must be one of {CP_LAYOUTS}, got {layout!r}")
    if cp == 1:
        return torch.arange(seq_len)
    if layout == "contiguous":
        if seq_len % cp:
            raise ValueError(f"sequence length {seq_len} is not divisible by cp={cp} (contiguous layout); pad it")
        n = seq_len // cp
        return torch.arange(cp_rank * n, (cp_rank + 1) * n)
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp={2 * cp} (head_tail layout); pad it"
        )
    return load_balanced_indices(seq_len, cp, cp_rank)


@dataclass(frozen=True)
class StageLayout:
    """The ranks of one pipeline stage of a module, ``[dp, cp, tp]`` int64, and its cp sequence layout."""

    ranks: torch.Tensor
    cp_layout: str = "head_tail"

    def __post_init__(self) -> None:
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {self.cp_layout!r}")
        if torch.as_tensor(self.ranks).dim() != 3:
            raise ValueError(f"StageLayout.ranks must be [dp, cp, tp], got shape {tuple(self.ranks.shape)}")

    @property
    def dp(self) -> int:
        return self.ranks.size(0)

    @property
    def cp(self) -> int:
        return self.ranks.size(1)

    @property
    def tp(self) -> int:
        return self.ranks.size(2)

    def check_global_shape(self, rows: int, seq_len: int) -> str | None:
        """``None`` if ``[rows, seq_len]`` can be laid out on this stage, else the reason."""
        if rows % self.dp:
            return f"{rows} rows are not divisible by dp={self.dp}"
        div = self.cp if self.cp_layout == "contiguous" or self.cp == 1 else 2 * self.cp
        if seq_len % div:
            return f"sequence length {seq_len} is not divisible by {div} ({self.cp_layout} layout, cp={self.cp})"
        return None

    def local_shape(self, rows: int, seq_len: int) -> tuple[int, int]:
        """``(rows / dp, seq_len / cp)``: what each rank of the stage holds."""
        return rows // self.dp, seq_len // self.cp

    def global_shape(self, local_rows: int, local_seq: int) -> tuple[int, int]:
        """``(local_rows * dp, local_seq * cp)``."""
        return local_rows * self.dp, local_seq * self.cp

    def canonical_shape(self) -> tuple[int, int]:
        """The smallest ``(rows, seq_len)`` this stage can hold."""
        return self.dp, self.cp if self.cp_layout == "contiguous" or self.cp == 1 else 2 * self.cp


@dataclass(frozen=True)
class Transfer:
    """One message: ``src`` sends ``x[src_rows][:, src_pos]``; ``dst`` writes it to ``buf[dst_rows][:, dst_pos]``.

    Rows are ``(start, stop)`` ranges into the local tensors; positions are int64 local sequence indices
    (same length, same order on both sides).
    """

    src: int
    dst: int
    src_rows: tuple[int, int]
    dst_rows: tuple[int, int]
    src_pos: torch.Tensor
    dst_pos: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, positions)`` of the piece."""
        return self.src_rows[1] - self.src_rows[0], len(self.src_pos)


def plan_transfers(src: StageLayout, dst: StageLayout, rows: int, seq_len: int) -> list[Transfer]:
    """Every message that moves a ``[rows, seq_len, ...]`` activation from ``src``'s layout to ``dst``'s.

    Sources are the tp-rank-0 replicas of ``src``; every tp rank of ``dst`` receives. Messages are ordered
    by (destination dp, cp, tp, then source dp, cp), the order both sides enumerate them in.

    Raises:
        ValueError: ``[rows, seq_len]`` does not fit one of the layouts (the reason is in the message).
    """
    for side, lay in (("source", src), ("destination", dst)):
        why = lay.check_global_shape(rows, seq_len)
        if why:
            raise ValueError(f"cannot lay out the activation [{rows}, {seq_len}, ...] on the {side} stage: {why}")
    owner = torch.empty(seq_len, dtype=torch.int64)
    local = torch.empty(seq_len, dtype=torch.int64)
    for c in range(src.cp):
        idx = cp_sequence_indices(seq_len, src.cp, c, src.cp_layout)
        owner[idx] = c
        local[idx] = torch.arange(len(idx))
    bs, bd = rows // src.dp, rows // dst.dp
    out = []
    for dd in range(dst.dp):
        d_lo, d_hi = dd * bd, (dd + 1) * bd
        for dc in range(dst.cp):
            want = cp_sequence_indices(seq_len, dst.cp, dc, dst.cp_layout)
            for dt in range(dst.tp):
                dst_rank = int(dst.ranks[dd, dc, dt])
                for sd in range(src.dp):
                    lo, hi = max(d_lo, sd * bs), min(d_hi, (sd + 1) * bs)
                    if lo >= hi:
                        continue
                    for sc in range(src.cp):
                        mask = owner[want] == sc
                        if not bool(mask.any()):
                            continue
                        dst_pos = mask.nonzero().flatten()
                        out.append(
                            Transfer(
                                src=int(src.ranks[sd, sc, 0]),
                                dst=dst_rank,
                                src_rows=(lo - sd * bs, hi - sd * bs),
                                dst_rows=(lo - d_lo, hi - d_lo),
                                src_pos=local[want[dst_pos]],
                                dst_pos=dst_pos,
                            )
                        )
    return out


def peer_pairs(src: StageLayout, dst: StageLayout) -> list[tuple[int, int]]:
    """The ``(src rank, dst rank)`` message pairs of :func:`plan_transfers`, independent of the activation size.

    Computed at the smallest shape both layouts can hold; every larger valid shape scales each piece and
    keeps the same pairs.
    """
    r0, s0 = src.canonical_shape()
    r1, s1 = dst.canonical_shape()
    return [(t.src, t.dst) for t in plan_transfers(src, dst, math.lcm(r0, r1), math.lcm(s0, s1))]
