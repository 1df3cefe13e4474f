"""Split and gather along one dimension, with autograd, for sequence/context parallelism.

Two pairs of operations, each the other's adjoint up to the gradient scale:

* ``split_forward_gather_backward``: forward keeps this rank's piece of a tensor that every rank
  holds in full; backward all-gathers the pieces' gradients into the full gradient.
* ``gather_forward_split_backward``: forward all-gathers every rank's piece into the full tensor;
  backward keeps this rank's piece of the gradient.

Three ways to cut the dimension:

* contiguous (``sizes=None``: ``W`` equal pieces; ``sizes=[...]``: explicit, possibly uneven, pieces
  in rank order);
* ``*_load_balanced``: ``2W`` equal chunks, rank ``r`` holds chunks ``r`` and ``2W-1-r`` (the
  head-tail partition that balances causal attention, as in THD/TE);
* ``*_per_sequence``: packed variable-length sequences given ``cu_seqlens_padded``, each sequence of
  padded length ``L`` starting at ``S`` cut the load-balanced way: with ``c = L/(2W)``, rank ``r`` gets
  ``[S+r*c, S+(r+1)*c)`` then ``[S+(2W-1-r)*c, S+(2W-r)*c)``, sequences in order (exactly TE's
  ``thd_get_partitioned_indices``).

Gradient scale (``grad_scale``), applied to the gradient in backward only. The MindSpeed-MM names
keep MindSpeed-MM's defaults: ``split_forward_gather_backward`` and
``load_balanced_split_forward_gather_backward`` scale ``"down"``, ``gather_forward_split_backward`` and
``load_balanced_gather_forward_split_backward`` scale ``"up"``. Our own names (``*_load_balanced``,
``*_per_sequence``, and ``sp_shard``/``sp_gather``) default to ``None``:

* ``None``: the gradient is passed on unchanged. Correct when the objective is the SUM over
  ranks of each rank's loss and each term appears exactly once, e.g. a split whose pieces feed
  disjoint loss terms (tokens of the shard) with the global loss normalised by the GLOBAL token
  count, or a gather followed by a loss that every rank computes identically and only one copy of
  which is the objective.
* ``"down"``: gradient / ``W``. Use when every rank computes the same (replicated) loss after a gather
  AND parameter gradients are later SUM-all-reduced over the group: each of the ``W`` copies
  contributes, so each must count ``1/W``.
* ``"up"``: gradient * ``W``. Use when parameter gradients are later AVERAGED (all-reduce MEAN) over
  the group while each rank's loss is a disjoint part of a summed objective: the average divides by
  ``W``, the scale restores it.

All functions return their input unchanged (apart from the slice) at world size 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from automodel.distributed.cp.layout import head_tail_indices, head_tail_spans
from automodel.distributed.sp.all_to_all import even_split_sizes, world_and_rank
from automodel.distributed.torch_internals import all_gather_single

__all__ = [
    "split_forward_gather_backward",
    "gather_forward_split_backward",
    "split_forward_gather_backward_load_balanced",
    "gather_forward_split_backward_load_balanced",
    "split_forward_gather_backward_per_sequence",
    "gather_forward_split_backward_per_sequence",
    "load_balanced_split_forward_gather_backward",
    "load_balanced_gather_forward_split_backward",
    "load_balanced_indices",
    "split_forward_gather_backward_by_indices",
    "gather_forward_split_backward_by_indices",
    "per_sequence_indices",
]

_SCALES = (None, "up", "down")


def _check_scale(grad_scale: str | None) -> None:
    if grad_scale not in _SCALES:
        raise ValueError(f"grad_scale must be one of {_SCALES}, got {grad_scale!r}")


def _scale(t: torch.Tensor, grad_scale: str | None, world: int) -> torch.Tensor:
    if grad_scale == "up":
        return t * world
    if grad_scale == "down":
        return t / world
    return t


def _all_gather_dim(x: torch.Tensor, dim: int, group: ProcessGroup | None, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order; ``sizes[r]`` is rank r's size there.

    Uneven sizes are padded to the largest, gathered, and trimmed (gloo's all-gather needs equal sizes).
    """
    world = len(sizes)
    biggest = max(sizes)
    front = x.movedim(dim, 0)
    if front.size(0) < biggest:
        pad = front.new_zeros((biggest - front.size(0), *front.shape[1:]))
        front = torch.cat([front, pad], dim=0)
    front = front.contiguous()
    out = front.new_empty((world * biggest, *front.shape[1:]))
    # torch_internals.all_gather_single: all_gather_into_tensor on torch < 2.13
    all_gather_single(out, front, group=group)
    if len(set(sizes)) == 1:
        full = out
    else:
        full = torch.cat([out[r * biggest : r * biggest + sizes[r]] for r in range(world)], dim=0)
    return full.movedim(0, dim)


# ---------------------------------------------------------------------------------------------------------
# contiguous pieces (even or explicit sizes)


def _resolve_sizes(total: int | None, local: int | None, sizes: list[int] | None, world: int, what: str):
    if sizes is None:
        if total is not None:
            if total % world != 0:
                raise ValueError(
                    f"{what}: size {total} along the split dim is not divisible by the world size {world}; "
                    "pass explicit sizes=[...] (one per rank) or pad the tensor first"
                )
            return [total // world] * world
        return [local] * world
    sizes = [int(s) for s in sizes]
    if len(sizes) != world or any(s < 0 for s in sizes):
        raise ValueError(f"{what}: sizes must be {world} non-negative ints (one per rank), got {sizes}")
    if total is not None and sum(sizes) != total:
        raise ValueError(
            f"{what}: sizes {sizes} sum to {sum(sizes)}, but the tensor has {total} along the split dim"
        )
    return sizes


class _SplitContiguous(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes, grad_scale, world, rank):  # type: ignore[override]
        ctx.group, ctx.dim, ctx.sizes, ctx.grad_scale, ctx.world = group, dim, sizes, grad_scale, world
        offset = sum(sizes[:rank])
        return x.narrow(dim, offset, sizes[rank]).clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        full = _all_gather_dim(grad, ctx.dim, ctx.group, ctx.sizes)
        return _scale(full, ctx.grad_scale, ctx.world), None, None, None, None, None, None


class _GatherContiguous(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes, grad_scale, world, rank):  # type: ignore[override]
        ctx.dim, ctx.sizes, ctx.grad_scale, ctx.world, ctx.rank = dim, sizes, grad_scale, world, rank
        return _all_gather_dim(x, dim, group, sizes)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        offset = sum(ctx.sizes[: ctx.rank])
        piece = grad.narrow(ctx.dim, offset, ctx.sizes[ctx.rank])
        return _scale(piece, ctx.grad_scale, ctx.world).contiguous(), None, None, None, None, None, None


def _positional_scale(split_sizes, grad_scale, default):
    """MindSpeed-MM's older ``communications.py`` put ``grad_scale`` 4th and the sizes 5th: a string in the
    sizes slot is a ``grad_scale`` (a size list never is a string), so those calls port unchanged."""
    if isinstance(split_sizes, str):
        if grad_scale != default:
            raise TypeError(
                f"got grad_scale twice: {split_sizes!r} in the sizes position and grad_scale={grad_scale!r}"
            )
        return None, split_sizes
    return split_sizes, grad_scale


def split_forward_gather_backward(
    input_: torch.Tensor,
    process_group: ProcessGroup | None,
    dim: int,
    split_sizes: list[int] | None = None,
    grad_scale: str | None = "down",
    shift: bool = False,
) -> torch.Tensor:
    """Keep this rank's contiguous piece of ``input_`` along ``dim``; backward all-gathers the gradient.

    MindSpeed-MM's signature and default: ``grad_scale="down"`` (the gathered gradient is divided by
    ``W``). Pass ``grad_scale=None`` for the plain adjoint (see the module docstring for which one a
    loss convention needs); :func:`automodel.distributed.sp.sharding.sp_shard` defaults to ``None``.

    Args:
        input_: the full tensor (identical on every rank), any shape/dtype.
        process_group: process group (``None`` = default group).
        dim: dimension to split.
        split_sizes: per-rank piece sizes in rank order (sum = ``input_.size(dim)``); ``None`` = the
            near-even split of :func:`automodel.distributed.sp.all_to_all.cal_split_sizes` (remainder on the
            first ranks; equal pieces when ``W`` divides the size). A string here is taken as
            ``grad_scale`` (the argument order of MindSpeed-MM's older ``communications.py``).
        grad_scale: ``"down"`` (/ W, default), ``"up"`` (x W) or ``None`` on the gradient.
        shift: MindSpeed-MM's older option (subtract the previous piece's last element); refused
            with ``ValueError``: its backward ignores the subtraction, so the gradient would be wrong.

    Returns:
        rank ``r``'s piece, a new tensor of size ``split_sizes[r]`` along ``dim``; ``input_`` is not mutated.
        Unlike the reference, the backward of an uneven default split gathers the uneven pieces correctly.
    """
    split_sizes, grad_scale = _positional_scale(split_sizes, grad_scale, "down")
    if shift:
        raise ValueError(
            "split_forward_gather_backward(shift=True) is not supported: MindSpeed-MM's shift subtracts the previous "
            "piece's last element in the forward but not in the backward, so its gradient is wrong; subtract it "
            "yourself after the split"
        )
    x, group = input_, process_group
    _check_scale(grad_scale)
    world, rank = world_and_rank(group)
    dim = dim % x.dim()
    if split_sizes is None:
        split_sizes = even_split_sizes(x.size(dim), world)
    sizes = _resolve_sizes(x.size(dim), None, split_sizes, world, "split_forward_gather_backward")
    if world == 1:
        return x
    return _SplitContiguous.apply(x, group, dim, sizes, grad_scale, world, rank)


def gather_forward_split_backward(
    input_: torch.Tensor,
    process_group: ProcessGroup | None,
    dim: int,
    gather_sizes: list[int] | None = None,
    grad_scale: str | None = "up",
) -> torch.Tensor:
    """All-gather every rank's piece along ``dim`` (rank order); backward keeps this rank's gradient piece.

    MindSpeed-MM's signature and default: ``grad_scale="up"`` (the gradient piece is multiplied by
    ``W``). Pass ``grad_scale=None`` for the plain adjoint; :func:`automodel.distributed.sp.sharding.sp_gather`
    defaults to ``None``.

    Args:
        input_: this rank's piece; every other dimension equal across ranks.
        process_group: process group (``None`` = default group).
        dim: dimension to concatenate along.
        gather_sizes: every rank's piece size along ``dim`` (``gather_sizes[rank]`` must equal
            ``input_.size(dim)``); ``None`` = all ranks hold ``input_.size(dim)``. A string here is taken as
            ``grad_scale`` (the older MindSpeed-MM argument order).
        grad_scale: ``"up"`` (x W, default), ``"down"`` (/ W) or ``None``.

    Returns:
        the full tensor (size ``sum(gather_sizes)`` along ``dim``), identical on every rank.
    """
    gather_sizes, grad_scale = _positional_scale(gather_sizes, grad_scale, "up")
    x, group = input_, process_group
    _check_scale(grad_scale)
    world, rank = world_and_rank(group)
    dim = dim % x.dim()
    sizes = _resolve_sizes(None, x.size(dim), gather_sizes, world, "gather_forward_split_backward")
    if sizes[rank] != x.size(dim):
        raise ValueError(
            f"gather_forward_split_backward: rank {rank} holds {x.size(dim)} elements along dim {dim}, "
            f"but gather_sizes={sizes} says {sizes[rank]}"
        )
    if world == 1:
        return x
    return _GatherContiguous.apply(x, group, dim, sizes, grad_scale, world, rank)


# ---------------------------------------------------------------------------------------------------------
# index-based pieces (load-balanced and per-sequence)


def load_balanced_indices(total: int, world_size: int, rank: int, device=None) -> torch.Tensor:
    """Indices rank ``rank`` holds of a dimension of size ``total`` cut into ``2*world_size`` chunks.

    Rank ``r`` holds chunks ``r`` and ``2W-1-r`` (each ``total/(2W)`` long), in that order: the head-tail
    spans of :func:`automodel.distributed.cp.layout.head_tail_spans`. Returns an int64 tensor of length
    ``total / W``. ``ValueError`` if ``total % (2W) != 0`` or ``rank`` is out of range.
    """
    spans = head_tail_spans(total, world_size, rank)
    return torch.cat([torch.arange(a, b, device=device) for a, b in spans])


def per_sequence_indices(
    cu_seqlens_padded: torch.Tensor, world_size: int, rank: int, device=None
) -> torch.Tensor:
    """Indices rank ``rank`` holds of packed sequences cut the load-balanced way, one sequence at a time.

    Args:
        cu_seqlens_padded: ``[P+1]`` int cumulative padded sequence lengths, starting at 0 (the token
            range of sequence ``i`` is ``[cu[i], cu[i+1])``). Every length must be divisible by ``2W``.
        world_size: ``W``; rank: ``r``.

    Returns:
        int64 ``[cu[-1] / W]``: for each sequence (start ``S``, length ``L``, ``c = L/(2W)``) the indices
        ``[S+r*c, S+(r+1)*c)`` then ``[S+(2W-1-r)*c, S+(2W-r)*c)``; the same as TE's
        ``thd_get_partitioned_indices`` (computed by :func:`automodel.distributed.cp.layout.head_tail_indices`,
        after the checks here).
    """
    cu = [int(v) for v in torch.as_tensor(cu_seqlens_padded).reshape(-1).tolist()]
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens_padded must start at 0 and be non-decreasing, got {cu}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for world size {world_size}")
    two_w = 2 * world_size
    for i, (start, end) in enumerate(zip(cu, cu[1:])):
        if (end - start) % two_w != 0:
            raise ValueError(
                f"sequence {i} has padded length {end - start}, not divisible by 2*world_size={two_w}; "
                f"pad every sequence to a multiple of {two_w} (e.g. with get_padding)"
            )
    return head_tail_indices(torch.tensor(cu, dtype=torch.int64, device=device), world_size, rank)


def _gather_by_indices(x: torch.Tensor, dim: int, group, indices: list[torch.Tensor]) -> torch.Tensor:
    gathered = _all_gather_dim(x, dim, group, [len(i) for i in indices])  # rank-ordered pieces
    inverse = torch.argsort(torch.cat(indices))
    return gathered.index_select(dim, inverse.to(gathered.device))


class _SplitIndexed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, indices, grad_scale, world, rank):  # type: ignore[override]
        ctx.group, ctx.dim, ctx.indices, ctx.grad_scale, ctx.world = group, dim, indices, grad_scale, world
        return x.index_select(dim, indices[rank].to(x.device))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        full = _gather_by_indices(grad.contiguous(), ctx.dim, ctx.group, ctx.indices)
        return _scale(full, ctx.grad_scale, ctx.world), None, None, None, None, None, None


class _GatherIndexed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, indices, grad_scale, world, rank):  # type: ignore[override]
        ctx.dim, ctx.indices, ctx.grad_scale, ctx.world, ctx.rank = dim, indices, grad_scale, world, rank
        return _gather_by_indices(x.contiguous(), dim, group, indices)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        piece = grad.index_select(ctx.dim, ctx.indices[ctx.rank].to(grad.device))
        return _scale(piece, ctx.grad_scale, ctx.world), None, None, None, None, None, None


def _indexed(
    split: bool, x: torch.Tensor, group: ProcessGroup | None, dim: int, grad_scale: str | None, what: str,
    *, cu: torch.Tensor | Callable[[int], torch.Tensor] | None = None, indices: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The one body of every index-based split (``split=True``) and gather (``split=False``).

    The per-rank indices come from packed-sequence boundaries ``cu`` (head-tail per sequence, see
    :func:`per_sequence_indices`; a callable gets the world size) or are given as ``indices`` (one int64
    tensor per rank, together a partition of ``range(n)``). ``ValueError`` if ``x`` does not match them
    along ``dim``: a split needs the whole ``n``, a gather this rank's share.
    """
    _check_scale(grad_scale)
    world, rank = world_and_rank(group)
    dim = dim % x.dim()
    if indices is None:
        cu = cu(world) if callable(cu) else cu
        indices = [per_sequence_indices(cu, world, r, device=x.device) for r in range(world)]
    else:
        _check_partition(indices, world, what)
    want = sum(len(i) for i in indices) if split else len(indices[rank])
    if want != x.size(dim):
        holder = "the indices of all ranks cover" if split else f"rank {rank} should hold"
        raise ValueError(f"{what}: {holder} {want} elements along dim {dim}, but x has {x.size(dim)}")
    if world == 1:
        return x
    fn = _SplitIndexed if split else _GatherIndexed
    return fn.apply(x, group, dim, indices, grad_scale, world, rank)


def split_forward_gather_backward_load_balanced(
    x: torch.Tensor, group: ProcessGroup | None, dim: int, grad_scale: str | None = None
) -> torch.Tensor:
    """Keep chunks ``r`` and ``2W-1-r`` of ``2W`` equal chunks of ``x`` along ``dim``; backward all-gathers.

    ``x.size(dim)`` must be divisible by ``2W`` (``ValueError`` otherwise). Returns a new tensor of size
    ``x.size(dim)/W`` along ``dim``.
    """
    cu = torch.tensor([0, x.size(dim)])
    return _indexed(True, x, group, dim, grad_scale, "split_forward_gather_backward_load_balanced", cu=cu)


def gather_forward_split_backward_load_balanced(
    x: torch.Tensor, group: ProcessGroup | None, dim: int, grad_scale: str | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_forward_gather_backward_load_balanced`: rebuild the full tensor in order.

    ``x`` is this rank's ``[chunk r, chunk 2W-1-r]`` (size ``N/W`` along ``dim``, even); returns size ``N``.
    """
    what = "gather_forward_split_backward_load_balanced"
    return _indexed(False, x, group, dim, grad_scale, what, cu=lambda w: torch.tensor([0, x.size(dim) * w]))


def split_forward_gather_backward_per_sequence(
    x: torch.Tensor, cu_seqlens_padded: torch.Tensor, group: ProcessGroup | None, dim: int, grad_scale: str | None = None
) -> torch.Tensor:
    """Keep this rank's load-balanced part of every packed sequence along ``dim``; backward all-gathers.

    ``cu_seqlens_padded``: ``[P+1]`` int, ``cu[-1] == x.size(dim)``, every length divisible by ``2W``.
    Returns the rank's tokens (see :func:`per_sequence_indices`), ``x.size(dim)/W`` along ``dim``.
    """
    what = "split_forward_gather_backward_per_sequence"
    return _indexed(True, x, group, dim, grad_scale, what, cu=cu_seqlens_padded)


def gather_forward_split_backward_per_sequence(
    x: torch.Tensor, cu_seqlens_padded: torch.Tensor, group: ProcessGroup | None, dim: int, grad_scale: str | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_forward_gather_backward_per_sequence`: rebuild the packed tokens in order."""
    what = "gather_forward_split_backward_per_sequence"
    return _indexed(False, x, group, dim, grad_scale, what, cu=cu_seqlens_padded)


def load_balanced_split_forward_gather_backward(
    input_: torch.Tensor, process_group: ProcessGroup | None, dim: int = 0, *, grad_scale: str | None = "down"
) -> torch.Tensor:
    """MindSpeed-MM's name: keep chunks ``r`` and ``2W-1-r`` of ``2W`` along ``dim``; backward all-gathers / ``W``.

    The reference always divides the gathered gradient by ``W`` (``grad_scale="down"``, the default here);
    :func:`split_forward_gather_backward_load_balanced` is the same split with ``grad_scale=None``.
    """
    return split_forward_gather_backward_load_balanced(input_, process_group, dim, grad_scale=grad_scale)


def load_balanced_gather_forward_split_backward(
    input_: torch.Tensor, process_group: ProcessGroup | None, dim: int = 0, *, grad_scale: str | None = "up"
) -> torch.Tensor:
    """MindSpeed-MM's name: rebuild the full tensor from the head-tail pieces; backward keeps ours x ``W``.

    The reference always multiplies the gradient piece by ``W`` (``grad_scale="up"``, the default here);
    :func:`gather_forward_split_backward_load_balanced` is the same gather with ``grad_scale=None``.
    """
    return gather_forward_split_backward_load_balanced(input_, process_group, dim, grad_scale=grad_scale)


def split_forward_gather_backward_by_indices(
    x: torch.Tensor, group: ProcessGroup | None, dim: int, indices: list[torch.Tensor], grad_scale: str | None = None
) -> torch.Tensor:
    """Keep ``x.index_select(dim, indices[rank])``; backward all-gathers every rank's gradient into place.

    ``indices``: one int64 tensor per rank, together a partition of ``range(x.size(dim))`` (each index
    exactly once). The general form behind the load-balanced, per-sequence and packed splits.
    """
    return _indexed(True, x, group, dim, grad_scale, "split_forward_gather_backward_by_indices", indices=indices)


def gather_forward_split_backward_by_indices(
    x: torch.Tensor, group: ProcessGroup | None, dim: int, indices: list[torch.Tensor], grad_scale: str | None = None
) -> torch.Tensor:
    """Inverse of :func:`split_forward_gather_backward_by_indices`: rank ``r``'s ``x`` lands at ``indices[r]``."""
    return _indexed(False, x, group, dim, grad_scale, "gather_forward_split_backward_by_indices", indices=indices)


def _check_partition(indices: list[torch.Tensor], world: int, what: str) -> None:
    """``ValueError`` unless ``indices`` holds one tensor per rank and together they cover ``0..n-1`` once."""
    if len(indices) != world:
        raise ValueError(f"{what}: need one index tensor per rank ({world}), got {len(indices)}")
    flat = torch.cat([torch.as_tensor(i, dtype=torch.int64).reshape(-1).cpu() for i in indices])
    if not torch.equal(flat.sort().values, torch.arange(flat.numel())):
        raise ValueError(f"{what}: the per-rank indices must cover 0..{flat.numel() - 1} exactly once")
