"""Sequence-parallel sharding helpers and a validator that catches shards never gathered back.

``sp_shard(x, dim)`` keeps this rank's contiguous ``1/W`` of ``x`` along ``dim`` (rank ``r`` holds
``[r*N/W, (r+1)*N/W)``); ``sp_gather(x, dim)`` concatenates every rank's shard back. Both are
autograd-aware (built on :mod:`automodel.distributed.sp_split_gather`):

* ``sp_gather`` backward keeps this rank's slice of the gradient. This is the exact gradient when the
  computation after the gather is replicated (every rank computes the same loss from the gathered
  tensor), which is what gathering is for. It does NOT sum the gradient over ranks (a naive
  all-gather backward that reduce-scatters would multiply it by ``W``).
* ``sp_shard`` backward all-gathers the shards' gradients, so a replicated tensor that was sharded
  receives the full gradient of ``sum over ranks of each rank's loss`` on every rank.

Composed, ``sp_gather(f(sp_shard(x)))`` followed by a replicated loss gives ``x`` exactly its
single-process gradient on every rank; parameters used inside ``f`` get their shard's contribution
and must be SUM-all-reduced over the group (the CP convention). ``grad_scale`` (``"up"``/``"down"``)
is forwarded for other conventions; see :mod:`automodel.distributed.sp_split_gather`.

``sp_shard_with_padding`` pads the end of ``dim`` up to a multiple of ``W`` first and returns the pad
so that ``sp_gather_with_padding`` can trim it after gathering.

``ShardingValidator`` records named ``sp_shard*``/``sp_gather*`` calls made inside ``track()`` and
``validate()`` raises a ``ValueError`` listing every name sharded but never gathered (or gathered
along another dim). Unnamed calls are not recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from automodel.distributed.sp_split_gather import gather_forward_split_backward, split_forward_gather_backward

__all__ = [
    "sp_shard",
    "sp_gather",
    "sp_shard_with_padding",
    "sp_gather_with_padding",
    "ShardingValidator",
    "ShardingEvent",
]


def _world(group: ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


# ---------------------------------------------------------------------------------------------------------
# validator


@dataclass(frozen=True)
class ShardingEvent:
    """One recorded operation: ``kind`` is ``"shard"`` or ``"gather"``; ``shape`` is the input's shape."""

    kind: str
    name: str
    dim: int
    shape: tuple[int, ...]


_ACTIVE: contextvars.ContextVar[tuple[ShardingValidator, ...]] = contextvars.ContextVar(
    "automodel_sp_sharding_validators", default=()
)


@dataclass
class ShardingValidator:
    """Records named shard/gather operations made inside :meth:`track` and checks they pair up.

    Example::

        v = ShardingValidator()
        with v.track():
            h = sp_shard(hidden, dim=1, name="hidden")
            ...
            out = sp_gather(h, dim=1, name="hidden")
        v.validate()  # ValueError if some named tensor was sharded but never gathered

    Every ``sp_shard(..., name=n)`` opens one shard of ``n``; every ``sp_gather(..., name=n)`` closes
    one. Several validators may track at once (nested ``track()``); each records every operation.
    """

    events: list[ShardingEvent] = field(default_factory=list)

    @contextlib.contextmanager
    def track(self) -> Iterator[ShardingValidator]:
        """Record named shard/gather calls made (in this thread/task) until the block exits."""
        token = _ACTIVE.set(_ACTIVE.get() + (self,))
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def record(self, kind: str, name: str, dim: int, shape: tuple[int, ...]) -> None:
        """Record an operation by hand (for custom shard/gather code). ``kind``: ``"shard"``/``"gather"``."""
        if kind not in ("shard", "gather"):
            raise ValueError(f"kind must be 'shard' or 'gather', got {kind!r}")
        self.events.append(ShardingEvent(kind, name, dim, tuple(shape)))

    def open_shards(self) -> dict[str, list[ShardingEvent]]:
        """Name -> the shard events not (yet) closed by a gather of that name, oldest first."""
        open_: dict[str, list[ShardingEvent]] = {}
        for ev in self.events:
            stack = open_.setdefault(ev.name, [])
            if ev.kind == "shard":
                stack.append(ev)
            elif stack:
                stack.pop()
        return {k: v for k, v in open_.items() if v}

    def dim_mismatches(self) -> list[tuple[ShardingEvent, ShardingEvent]]:
        """(shard, gather) pairs where the gather used another dim than the shard it closed."""
        open_: dict[str, list[ShardingEvent]] = {}
        bad = []
        for ev in self.events:
            stack = open_.setdefault(ev.name, [])
            if ev.kind == "shard":
                stack.append(ev)
            elif stack:
                shard = stack.pop()
                if shard.dim != ev.dim:
                    bad.append((shard, ev))
        return bad

    def validate(self) -> None:
        """Raise ``ValueError`` listing every tensor sharded but never gathered, and every dim mismatch."""
        problems = []
        for name, shards in self.open_shards().items():
            dims = ", ".join(f"dim={s.dim} shape={s.shape}" for s in shards)
            problems.append(f"'{name}' sharded {len(shards)}x without a matching gather ({dims})")
        for shard, gather in self.dim_mismatches():
            problems.append(
                f"'{shard.name}' sharded along dim {shard.dim} but gathered along dim {gather.dim}"
            )
        if problems:
            raise ValueError(
                f"ShardingValidator found {len(problems)} problem(s): "
                + "; ".join(problems)
                + ". Gather every sharded tensor with sp_gather(..., name=<same name>) along the same dim "
                "before using it as a full-sequence tensor."
            )

    def reset(self) -> None:
        """Forget every recorded event."""
        self.events.clear()


def _record(kind: str, name: str | None, dim: int, shape: torch.Size) -> None:
    if name is None:
        return
    for v in _ACTIVE.get():
        v.record(kind, name, dim, tuple(shape))


# ---------------------------------------------------------------------------------------------------------
# shard / gather


def sp_shard(
    x: torch.Tensor,
    dim: int,
    group: ProcessGroup | None = None,
    *,
    name: str | None = None,
    grad_scale: str | None = None,
) -> torch.Tensor:
    """This rank's contiguous ``1/W`` of ``x`` along ``dim`` (autograd: backward all-gathers the gradient).

    Args:
        x: the full tensor, identical on every rank.
        dim: dimension to shard; ``x.size(dim)`` must be divisible by ``W`` and at least ``W``.
        group: process group (``None`` = default group).
        name: recorded by an active :class:`ShardingValidator` when given.
        grad_scale: ``None``/``"up"``/``"down"``, see :mod:`automodel.distributed.sp_split_gather`.

    Raises:
        ValueError: ``x.size(dim) < W`` or not divisible by ``W`` (use :func:`sp_shard_with_padding`).
    """
    world, _ = _world(group)
    dim = dim % x.dim()
    n = x.size(dim)
    if n < world:
        raise ValueError(
            f"sp_shard: size {n} along dim {dim} is shorter than the world size {world}; every rank needs "
            "at least one element: use sp_shard_with_padding or a smaller group"
        )
    if n % world != 0:
        raise ValueError(
            f"sp_shard: size {n} along dim {dim} is not divisible by the world size {world}; pad it to "
            f"{-(-n // world) * world} (sp_shard_with_padding does this and returns the pad to trim later)"
        )
    _record("shard", name, dim, x.shape)
    return split_forward_gather_backward(x, group, dim, grad_scale=grad_scale)


def sp_gather(
    x: torch.Tensor,
    dim: int,
    group: ProcessGroup | None = None,
    *,
    name: str | None = None,
    grad_scale: str | None = None,
) -> torch.Tensor:
    """Concatenate every rank's equal-size shard along ``dim`` (autograd: backward keeps this rank's slice).

    Returns the full tensor (``W * x.size(dim)`` along ``dim``), identical on every rank.
    """
    dim = dim % x.dim()
    _record("gather", name, dim, x.shape)
    return gather_forward_split_backward(x, group, dim, grad_scale=grad_scale)


def sp_shard_with_padding(
    x: torch.Tensor,
    dim: int,
    pad_value: float = 0,
    group: ProcessGroup | None = None,
    *,
    name: str | None = None,
    grad_scale: str | None = None,
) -> tuple[torch.Tensor, int]:
    """Pad the end of ``dim`` with ``pad_value`` up to a multiple of ``W``, then :func:`sp_shard`.

    Returns:
        ``(shard, pad)``: ``shard`` has ``(x.size(dim) + pad) / W`` elements along ``dim``; ``pad`` is the
        number of padding elements added at the end (``0 <= pad < W``), to pass to
        :func:`sp_gather_with_padding`. The padding lands in the last ranks' shards.
    """
    world, _ = _world(group)
    dim = dim % x.dim()
    n = x.size(dim)
    if n == 0:
        raise ValueError(f"sp_shard_with_padding: x has no elements along dim {dim} (shape {tuple(x.shape)})")
    pad = (-n) % world
    if pad:
        spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, spec, value=pad_value)
    return sp_shard(x, dim, group, name=name, grad_scale=grad_scale), pad


def sp_gather_with_padding(
    x: torch.Tensor,
    dim: int,
    pad: int,
    group: ProcessGroup | None = None,
    *,
    name: str | None = None,
    grad_scale: str | None = None,
) -> torch.Tensor:
    """Inverse of :func:`sp_shard_with_padding`: :func:`sp_gather`, then drop the last ``pad`` elements."""
    full = sp_gather(x, dim, group, name=name, grad_scale=grad_scale)
    dim = dim % full.dim()
    if not 0 <= pad <= full.size(dim):
        raise ValueError(
            f"sp_gather_with_padding: pad={pad} is out of range for {full.size(dim)} gathered elements"
        )
    return full.narrow(dim, 0, full.size(dim) - pad)
