"""All-to-all with autograd: trade a shard of one dimension for a shard of another.

``all_to_all(x, group, scatter_dim, gather_dim)`` splits ``x`` along ``scatter_dim`` into ``W`` pieces
(``W`` = the group's size), sends piece ``j`` to rank ``j``, and concatenates the pieces it receives
along ``gather_dim`` in rank order. Ulysses attention uses it twice per layer: q/k/v go from
sequence-sharded ``[B, H, S/W, D]`` to head-sharded ``[B, H/W, S, D]`` (scatter heads, gather sequence),
and the output goes back (scatter sequence, gather heads).

Sizes. A dimension of total size ``N`` is split near-evenly with the remainder on the first ranks
(:func:`even_split_sizes`: 100 over 3 -> ``[34, 33, 33]``). The scatter side is split that way from
``x.size(scatter_dim)``; the gather side is ``x.size(gather_dim)`` on every rank unless ``gather_size``
(the total after gathering) says otherwise, in which case rank ``r`` must hold
``even_split_sizes(gather_size, W)[r]`` elements along ``gather_dim``. When both sides are even the
exchange is one ``all_to_all_single`` on a stacked tensor; otherwise it is one ``all_to_all_single``
with per-rank split sizes on flattened pieces (gloo and NCCL both support uneven splits).

Backward is the reverse all-to-all (scatter the gradient along ``gather_dim``, gather it along
``scatter_dim``), which is the exact adjoint: all-to-all only moves values. At world size 1 the
function returns its input unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "adjust_tensor_dimensions",
    "all_to_all",
    "all_to_all_SBH",
    "cal_split_sizes",
    "cal_split_sizes_multi",
    "even_split_sizes",
    "unadjust_tensor_dimensions",
]


def even_split_sizes(total: int, world_size: int) -> list[int]:
    """Near-even split of ``total`` items over ``world_size`` ranks, remainder on the first ranks.

    ``even_split_sizes(100, 3) == [34, 33, 33]``; ``even_split_sizes(8, 2) == [4, 4]``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, rem = divmod(total, world_size)
    return [base + 1 if r < rem else base for r in range(world_size)]


def cal_split_sizes(dim_size: int, world_size: int) -> list[int]:
    """MindSpeed-MM's name for :func:`even_split_sizes`: ``cal_split_sizes(10, 3) == [4, 3, 3]``."""
    return even_split_sizes(int(dim_size), int(world_size))


def cal_split_sizes_multi(sizes: list[int] | tuple[int, ...] | torch.Tensor, world_size: int) -> torch.Tensor:
    """Near-even split of several sizes at once: ``[world_size, len(sizes)]`` int64, row ``r`` = rank ``r``'s share.

    ``cal_split_sizes_multi([10, 15], 3)`` is ``tensor([[4, 5], [3, 5], [3, 5]])`` (MindSpeed-MM's example).
    Column ``j`` is :func:`cal_split_sizes` of ``sizes[j]``.
    """
    values = [int(v) for v in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    cols = [even_split_sizes(v, int(world_size)) for v in values]
    if not cols:
        return torch.zeros((int(world_size), 0), dtype=torch.int64)
    return torch.tensor(cols, dtype=torch.int64).T


def adjust_tensor_dimensions(tensor: torch.Tensor, scatter_idx: int, gather_idx: int) -> tuple[torch.Tensor, list[int]]:
    """Permute ``tensor`` so that ``scatter_idx`` becomes dim 0 and ``gather_idx`` dim 1 (MindSpeed-MM's helper).

    Two transpositions: dim 0 <-> the scatter dim, then dim 1 <-> wherever the gather dim now is; the
    other dims keep their places except the ones swapped out. Returns ``(contiguous permuted tensor,
    dims)`` with ``dims`` the permutation (``permuted = tensor.permute(dims)``); undo it with
    :func:`unadjust_tensor_dimensions`. E.g. a 4-D tensor with ``(scatter_idx=2, gather_idx=0)`` gives
    ``dims == [2, 0, 1, 3]``.
    """
    if scatter_idx == gather_idx:
        raise ValueError(f"scatter_idx and gather_idx must differ, both are {scatter_idx}")
    dims = list(range(tensor.dim()))
    p = dims.index(scatter_idx % tensor.dim())
    dims[0], dims[p] = dims[p], dims[0]
    q = dims.index(gather_idx % tensor.dim())
    dims[1], dims[q] = dims[q], dims[1]
    return tensor.permute(dims).contiguous(), dims


def unadjust_tensor_dimensions(tensor: torch.Tensor, adjusted_dims: list[int]) -> torch.Tensor:
    """Inverse of :func:`adjust_tensor_dimensions`: permute back to the original dim order (contiguous)."""
    inverse = [0] * len(adjusted_dims)
    for new_pos, old_pos in enumerate(adjusted_dims):
        inverse[old_pos] = new_pos
    return tensor.permute(inverse).contiguous()


def world_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    """``(size, rank)`` of ``group`` (``None`` = the default group); ``(1, 0)`` without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _exchange(
    x: torch.Tensor,
    group: ProcessGroup | None,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: list[int],
    gather_sizes: list[int],
    rank: int,
) -> torch.Tensor:
    """One all_to_all_single moving piece j of ``x`` (along scatter_dim) to rank j; no autograd."""
    world = len(scatter_sizes)
    if len(set(scatter_sizes)) == 1 and len(set(gather_sizes)) == 1:
        # Aligned: stack the W pieces on a new leading dim; rank i's piece arrives at out[i].
        send = torch.stack(x.split(scatter_sizes[0], dim=scatter_dim), dim=0).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return torch.cat(recv.unbind(0), dim=gather_dim)
    # Uneven: flatten each piece; split sizes are element counts.
    pieces = x.split(scatter_sizes, dim=scatter_dim)
    send = torch.cat([p.contiguous().reshape(-1) for p in pieces])
    in_splits = [p.numel() for p in pieces]
    recv_shapes = []
    for i in range(world):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[rank]
        shape[gather_dim] = gather_sizes[i]
        recv_shapes.append(shape)
    out_splits = [math.prod(s) for s in recv_shapes]
    recv = x.new_empty(sum(out_splits))
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    parts = [p.view(s) for p, s in zip(recv.split(out_splits), recv_shapes)]
    return torch.cat(parts, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank):  # type: ignore[override]
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        ctx.scatter_sizes, ctx.gather_sizes, ctx.rank = scatter_sizes, gather_sizes, rank
        return _exchange(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes, rank)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        # Reverse exchange: scatter along the forward gather dim in the forward's gather sizes, gather
        # along the forward scatter dim in its scatter sizes. All-to-all only moves values: exact adjoint.
        grad_x = _AllToAll.apply(
            grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim, ctx.gather_sizes, ctx.scatter_sizes, ctx.rank
        )
        return grad_x, None, None, None, None, None, None


def all_to_all(
    input_: torch.Tensor,
    process_group: ProcessGroup | None,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    gather_size: int | None = None,
    *,
    scatter_sizes: list[int] | None = None,
    gather_sizes: list[int] | None = None,
) -> torch.Tensor:
    """All-to-all over ``process_group`` with autograd: scatter along ``scatter_dim``, gather along ``gather_dim``.

    MindSpeed-MM's signature and defaults (``scatter_dim=2, gather_dim=1``: ``[B, S/W, H, D]`` ->
    ``[B, S, H/W, D]``, the Ulysses exchange in the BSHD layout).

    Args:
        input_: any-dtype tensor, the same shape on every rank except along ``gather_dim`` (when uneven).
        process_group: the process group (``None`` = the default group). World size 1 (or
            torch.distributed not initialised) returns ``input_`` unchanged.
        scatter_dim: dimension split into ``W`` near-even pieces (remainder on the first ranks); piece
            ``j`` goes to rank ``j``.
        gather_dim: dimension along which the received pieces are concatenated in rank order.
        gather_size: total size along ``gather_dim`` after gathering; ``None`` means every rank holds
            ``x.size(gather_dim)``. Rank ``r`` must hold ``even_split_sizes(gather_size, W)[r]``. A list
            here is MindSpeed-MM's older ``scatter_sizes`` argument (5th in ``models/common/communications.py``).
        scatter_sizes, gather_sizes: explicit per-rank sizes (the older MindSpeed-MM form): the pieces
            of ``scatter_dim`` sent to each rank, and every rank's size along ``gather_dim``.

    Returns:
        A new tensor whose ``scatter_dim`` is rank ``r``'s piece and whose ``gather_dim`` is the total.
        E.g. ``[B, H, S/W, D]`` with ``scatter_dim=1, gather_dim=2`` -> ``[B, H/W, S, D]``.
        ``input_`` is not mutated. Backward is the reverse all-to-all.

    Raises:
        ValueError: ``scatter_dim == gather_dim``, a dim out of range, or a local size that does not
        match ``gather_size`` / ``gather_sizes``.
    """
    x, group = input_, process_group
    if isinstance(gather_size, (list, tuple)):
        if scatter_sizes is not None:
            raise TypeError(f"got scatter_sizes twice: {gather_size!r} (5th) and scatter_sizes={scatter_sizes!r}")
        scatter_sizes, gather_size = list(gather_size), None
    ndim = x.dim()
    for name, d in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
        if not -ndim <= d < ndim:
            raise ValueError(
                f"all_to_all: {name}={d} is out of range for a {ndim}-d tensor of shape {tuple(x.shape)}"
            )
    scatter_dim, gather_dim = scatter_dim % ndim, gather_dim % ndim
    if scatter_dim == gather_dim:
        raise ValueError(f"all_to_all: scatter_dim and gather_dim must differ, both are {scatter_dim}")
    world, rank = world_and_rank(group)
    if gather_sizes is not None and gather_size is not None:
        raise TypeError("pass gather_size (a total) or gather_sizes (per rank), not both")
    if world == 1:
        want = gather_size if gather_sizes is None else sum(gather_sizes)
        if want is not None and want != x.size(gather_dim):
            raise ValueError(
                f"all_to_all: world size 1 but gather_size={want} != x.size({gather_dim})={x.size(gather_dim)}"
            )
        return x
    if scatter_sizes is None:
        scatter_sizes = even_split_sizes(x.size(scatter_dim), world)
    elif len(scatter_sizes) != world or sum(scatter_sizes) != x.size(scatter_dim):
        raise ValueError(
            f"all_to_all: scatter_sizes {list(scatter_sizes)} must be {world} sizes summing to "
            f"x.size({scatter_dim})={x.size(scatter_dim)}"
        )
    if gather_sizes is None:
        gather_sizes = [x.size(gather_dim)] * world if gather_size is None else even_split_sizes(gather_size, world)
        how = "" if gather_size is None else f" (gather_size={gather_size} split near-evenly, remainder first)"
    else:
        gather_sizes, how = [int(v) for v in gather_sizes], " (gather_sizes)"
    if len(gather_sizes) != world or gather_sizes[rank] != x.size(gather_dim):
        raise ValueError(
            f"all_to_all: rank {rank} holds {x.size(gather_dim)} elements along gather_dim={gather_dim}, "
            f"but {world} ranks hold {gather_sizes}{how}, which gives it "
            f"{gather_sizes[rank] if len(gather_sizes) == world else '?'}; shard the input with even_split_sizes "
            "or pass the right gather_size"
        )
    return _AllToAll.apply(x.contiguous(), group, scatter_dim, gather_dim, list(scatter_sizes), gather_sizes, rank)


def all_to_all_SBH(  # noqa: N802 - MindSpeed-MM's name
    input_: torch.Tensor,
    process_group: ProcessGroup | None,
    scatter_dim: int = 2,
    gather_dim: int = 1,
    scatter_sizes: list[int] | None = None,
    gather_sizes: list[int] | None = None,
) -> torch.Tensor:
    """MindSpeed-MM's older single-collective variant: :func:`all_to_all` (which uses one collective too)."""
    return all_to_all(input_, process_group, scatter_dim, gather_dim, scatter_sizes=scatter_sizes, gather_sizes=gather_sizes)
