"""Hybrid ring x Ulysses split/gather primitives (MindSpeed-MM's ``_with_cp`` and ``packed_data_`` names).

Context parallelism over ``cp = ring * ulysses`` ranks in two levels: Ulysses (all-to-all) inside a
group of ``ulysses`` ranks, usually one node, and ring (or a packed split) across the ``ring`` groups.
A CP rank is ``ring_rank * ulysses + ulysses_rank``: a Ulysses group is ``ulysses`` consecutive ranks,
a ring group takes every ``ulysses``-th rank (:func:`new_hybrid_cp_groups`).

Sequence layout of ``split_forward_gather_backward_with_cp`` (bshd batches): the ring level cuts the
sequence into ``2 * ring`` chunks and ring rank ``i`` keeps chunks ``i`` and ``2*ring-1-i`` (the
load-balanced layout, so ``S % (2 * ring) == 0`` is required); the Ulysses level then cuts that piece
near-evenly (:func:`cal_split_sizes`, remainder on the first ranks) over the Ulysses group.

Packed rows (``packed_data_*``, many sequences back to back along ``dim``): the ring level cuts EACH
sequence near-evenly over the ring group and concatenates this rank's pieces in sequence order (no
head-tail reordering, any lengths); the Ulysses level cuts the result near-evenly. The gather
functions are the exact inverses; uneven pieces are handled on every level (``gather_sizes`` from
:func:`cal_split_sizes` / :func:`cal_split_sizes_multi`).

Gradients. Every function takes ``grad_scale`` like :mod:`automodel.distributed.sp.split_gather`,
applied on each level: the MindSpeed-MM defaults are ``"down"`` for splits (the gradient is divided
by ``ring`` and by ``ulysses``: by ``cp`` in all) and ``"up"`` for gathers; ``grad_scale=None`` gives
the plain adjoint.

Groups. MindSpeed-MM reads the groups from a global parallel state; here they come from
:func:`set_hybrid_cp_groups` (what :func:`new_hybrid_cp_groups` sets by default) or from the
``groups=`` keyword. With neither, every level is off and the functions return their input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.distributed.sp.all_to_all import cal_split_sizes, cal_split_sizes_multi
from automodel.distributed.sp.split_gather import (
    gather_forward_split_backward,
    gather_forward_split_backward_by_indices,
    load_balanced_gather_forward_split_backward,
    load_balanced_split_forward_gather_backward,
    split_forward_gather_backward,
    split_forward_gather_backward_by_indices,
)

__all__ = [
    "HybridCPGroups",
    "get_hybrid_cp_groups",
    "new_hybrid_cp_groups",
    "set_hybrid_cp_groups",
    "split_forward_gather_backward_with_cp",
    "gather_forward_split_backward_with_cp",
    "packed_data_split_forward_gather_backward",
    "packed_data_gather_forward_split_backward",
    "packed_data_split_forward_gather_backward_with_cp",
    "packed_data_gather_forward_split_backward_with_cp",
    "packed_split_indices",
]


def _size(group: ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _rank(group: ProcessGroup | None) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


@dataclass(frozen=True)
class HybridCPGroups:
    """This rank's ring group (across Ulysses groups) and Ulysses group; ``None`` = that level is off.

    The query names follow MindSpeed-MM's parallel state (``is_ring_enable``, ``get_ring_group_size``, ...).
    """

    ring_group: ProcessGroup | None = None
    ulysses_group: ProcessGroup | None = None

    def is_ring_enable(self) -> bool:
        return self.get_ring_group_size() > 1

    def is_ulysses_enable(self) -> bool:
        return self.get_ulysses_group_size() > 1

    def get_ring_group(self) -> ProcessGroup | None:
        return self.ring_group

    def get_ulysses_group(self) -> ProcessGroup | None:
        return self.ulysses_group

    def get_ring_group_size(self) -> int:
        return _size(self.ring_group)

    def get_ulysses_group_size(self) -> int:
        return _size(self.ulysses_group)

    def get_ring_rank(self) -> int:
        return _rank(self.ring_group)

    def get_ulysses_rank(self) -> int:
        return _rank(self.ulysses_group)


_CURRENT = [HybridCPGroups()]


def set_hybrid_cp_groups(groups: HybridCPGroups) -> None:
    """Make ``groups`` the default of every ``*_with_cp`` function (process-wide)."""
    if not isinstance(groups, HybridCPGroups):
        raise TypeError(f"set_hybrid_cp_groups needs a HybridCPGroups, got {type(groups).__name__}")
    _CURRENT[0] = groups


def get_hybrid_cp_groups() -> HybridCPGroups:
    """The groups set by :func:`set_hybrid_cp_groups` (both levels off until then)."""
    return _CURRENT[0]


def new_hybrid_cp_groups(ulysses_size: int, ranks: list[int] | None = None, *, set_current: bool = True) -> HybridCPGroups:
    """Create the ring and Ulysses groups of a CP group and return this rank's pair.

    Args:
        ulysses_size: ranks per Ulysses group (consecutive ranks: put them on one node); must divide
            the CP size. ``ring = cp / ulysses_size``.
        ranks: the global ranks of the CP group in CP order (default: every rank).
        set_current: also :func:`set_hybrid_cp_groups` the result.

    Every rank of the default group must call this with the same arguments (``new_group`` is collective).
    A level of size 1 is ``None`` (off).
    """
    ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
    cp = len(ranks)
    if ulysses_size < 1 or cp % ulysses_size:
        raise ValueError(f"ulysses_size={ulysses_size} must be >= 1 and divide the CP size {cp}")
    ring_size = cp // ulysses_size
    me = dist.get_rank()
    ring_group = ulysses_group = None
    for i in range(ring_size):  # Ulysses groups: consecutive blocks
        members = ranks[i * ulysses_size : (i + 1) * ulysses_size]
        g = dist.new_group(members) if ulysses_size > 1 else None
        if me in members:
            ulysses_group = g
    for j in range(ulysses_size):  # ring groups: one rank of every block
        members = ranks[j::ulysses_size]
        g = dist.new_group(members) if ring_size > 1 else None
        if me in members:
            ring_group = g
    groups = HybridCPGroups(ring_group, ulysses_group)
    if set_current:
        set_hybrid_cp_groups(groups)
    return groups


# ---------------------------------------------------------------------------------------------------------
# bshd: ring (load-balanced) x Ulysses (near-even)


def split_forward_gather_backward_with_cp(
    input_: torch.Tensor,
    dim: int,
    *,
    groups: HybridCPGroups | None = None,
    grad_scale: str | None = "down",
) -> torch.Tensor:
    """This rank's share of ``input_`` along ``dim``: ring load-balanced split, then Ulysses near-even split.

    Args:
        input_: the full tensor, identical on every CP rank.
        dim: the sequence dim; ``input_.size(dim) % (2 * ring) == 0`` when the ring level is on.
        groups: default :func:`get_hybrid_cp_groups`.
        grad_scale: applied on each level (module docstring).

    Raises:
        ValueError: the sequence is not divisible by ``2 * ring`` (pad it, e.g. with ``get_padding``).
    """
    g = groups or get_hybrid_cp_groups()
    if g.is_ring_enable():
        ring = g.get_ring_group_size()
        if input_.shape[dim] % (2 * ring):
            raise ValueError(
                f"split_forward_gather_backward_with_cp: sequence length {input_.shape[dim]} along dim {dim} is not "
                f"a multiple of 2 * ring_size = {2 * ring}; pad the sequence"
            )
        input_ = load_balanced_split_forward_gather_backward(input_, g.ring_group, dim, grad_scale=grad_scale)
    if g.is_ulysses_enable():
        sizes = cal_split_sizes(input_.shape[dim], g.get_ulysses_group_size())
        input_ = split_forward_gather_backward(input_, g.ulysses_group, dim, split_sizes=sizes, grad_scale=grad_scale)
    return input_


def gather_forward_split_backward_with_cp(
    input_: torch.Tensor,
    dim: int,
    gather_size: int,
    *,
    groups: HybridCPGroups | None = None,
    grad_scale: str | None = "up",
) -> torch.Tensor:
    """Inverse of :func:`split_forward_gather_backward_with_cp`: ``gather_size`` is the full sequence length."""
    g = groups or get_hybrid_cp_groups()
    if g.is_ring_enable():
        ring = g.get_ring_group_size()
        if gather_size % (2 * ring):
            raise ValueError(
                f"gather_forward_split_backward_with_cp: gather_size={gather_size} is not a multiple of "
                f"2 * ring_size = {2 * ring}"
            )
        gather_size //= ring
    if g.is_ulysses_enable():
        sizes = cal_split_sizes(gather_size, g.get_ulysses_group_size())
        input_ = gather_forward_split_backward(input_, g.ulysses_group, dim, gather_sizes=sizes, grad_scale=grad_scale)
    if g.is_ring_enable():
        input_ = load_balanced_gather_forward_split_backward(input_, g.ring_group, dim, grad_scale=grad_scale)
    return input_


# ---------------------------------------------------------------------------------------------------------
# packed rows: every sequence cut near-evenly over the group


def packed_split_indices(split_sizes: torch.Tensor) -> list[torch.Tensor]:
    """Per-rank int64 indices of a packed row whose sequence ``j`` is cut ``split_sizes[:, j]`` over the ranks.

    ``split_sizes``: ``[W, N]`` (e.g. :func:`cal_split_sizes_multi`); sequence ``j`` has
    ``split_sizes[:, j].sum()`` tokens, rank ``r`` holds its ``r``-th contiguous piece; a rank's pieces
    are listed in sequence order.
    """
    sizes = torch.as_tensor(split_sizes, dtype=torch.int64)
    if sizes.dim() != 2 or bool((sizes < 0).any()):
        raise ValueError(f"split sizes must be a [world_size, num_sequences] tensor of sizes >= 0, got {sizes.tolist()}")
    world, n = sizes.shape
    lengths = sizes.sum(0).tolist()
    starts = [0]
    for length in lengths[:-1]:
        starts.append(starts[-1] + length)
    before = torch.cumsum(sizes, 0) - sizes  # tokens of sequence j held by ranks < r
    out = []
    for r in range(world):
        pieces = [
            torch.arange(starts[j] + int(before[r, j]), starts[j] + int(before[r, j]) + int(sizes[r, j]))
            for j in range(n)
        ]
        out.append(torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64))
    return out


def _seq_lens(sequence_lengths, total: int, what: str) -> list[int]:
    lens = [int(v) for v in (sequence_lengths.tolist() if isinstance(sequence_lengths, torch.Tensor) else sequence_lengths)]
    if any(v < 0 for v in lens) or sum(lens) != total:
        raise ValueError(
            f"{what}: sequence lengths {lens} (sum {sum(lens)}) must be >= 0 and sum to the {total} tokens along "
            "the split dim (the reference silently drops tokens past the last sequence; pass their length too)"
        )
    return lens


def packed_data_split_forward_gather_backward(
    hidden_states: torch.Tensor,
    process_group: ProcessGroup | None,
    sequence_lengths: list[int],
    dim: int = 0,
    *,
    grad_scale: str | None = "down",
) -> torch.Tensor:
    """This rank's near-even piece of EVERY packed sequence, concatenated in sequence order.

    Args:
        hidden_states: ``[T, ...]`` (sequences back to back along ``dim``), identical on every rank.
        process_group: the group to split over.
        sequence_lengths: the lengths, summing to ``hidden_states.size(dim)`` (``ValueError`` otherwise).
        dim: the token dim.

    Returns:
        ``sum_j cal_split_sizes(L_j, W)[rank]`` tokens along ``dim``. Backward all-gathers the gradient,
        scaled by ``grad_scale`` (``"down"``: / W, the reference's fixed choice).
    """
    world = dist.get_world_size(process_group) if dist.is_available() and dist.is_initialized() else 1
    lens = _seq_lens(sequence_lengths, hidden_states.size(dim), "packed_data_split_forward_gather_backward")
    indices = packed_split_indices(cal_split_sizes_multi(lens, world))
    return split_forward_gather_backward_by_indices(hidden_states, process_group, dim, indices, grad_scale)


def packed_data_gather_forward_split_backward(
    local_hidden_states: torch.Tensor,
    all_split_sizes: torch.Tensor,
    process_group: ProcessGroup | None,
    dim: int = 0,
    *,
    grad_scale: str | None = "up",
) -> torch.Tensor:
    """Inverse of :func:`packed_data_split_forward_gather_backward`.

    ``all_split_sizes``: ``[W, N]`` how each sequence was cut (row ``r`` = rank ``r``), e.g.
    ``cal_split_sizes_multi(sequence_lengths, W)``. Returns the packed tokens in their original order.
    """
    indices = packed_split_indices(all_split_sizes)
    return gather_forward_split_backward_by_indices(local_hidden_states, process_group, dim, indices, grad_scale)


def packed_data_split_forward_gather_backward_with_cp(
    x: torch.Tensor,
    dim: int,
    seq_lens: list[int],
    *,
    groups: HybridCPGroups | None = None,
    grad_scale: str | None = "down",
) -> torch.Tensor:
    """Packed rows over ring x Ulysses: each sequence cut over the ring group, the result over Ulysses."""
    g = groups or get_hybrid_cp_groups()
    if g.is_ring_enable():
        x = packed_data_split_forward_gather_backward(x, g.ring_group, seq_lens, dim, grad_scale=grad_scale)
    if g.is_ulysses_enable():
        sizes = cal_split_sizes(x.shape[dim], g.get_ulysses_group_size())
        x = split_forward_gather_backward(x, g.ulysses_group, dim, split_sizes=sizes, grad_scale=grad_scale)
    return x


def packed_data_gather_forward_split_backward_with_cp(
    x: torch.Tensor,
    dim: int,
    seq_lens: list[int],
    *,
    groups: HybridCPGroups | None = None,
    grad_scale: str | None = "up",
) -> torch.Tensor:
    """Inverse of :func:`packed_data_split_forward_gather_backward_with_cp`: Ulysses gather, then ring gather."""
    g = groups or get_hybrid_cp_groups()
    all_split = cal_split_sizes_multi(seq_lens, g.get_ring_group_size())
    if g.is_ulysses_enable():
        sizes = cal_split_sizes(int(all_split[g.get_ring_rank()].sum()), g.get_ulysses_group_size())
        x = gather_forward_split_backward(x, g.ulysses_group, dim, gather_sizes=sizes, grad_scale=grad_scale)
    if g.is_ring_enable():
        x = packed_data_gather_forward_split_backward(x, all_split, g.ring_group, dim, grad_scale=grad_scale)
    return x
