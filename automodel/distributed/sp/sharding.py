"""Sequence-parallel sharding helpers and a validator that catches shards never gathered back.

``sp_shard(x, dim)`` keeps this rank's contiguous ``1/W`` of ``x`` along ``dim`` (rank ``r`` holds
``[r*N/W, (r+1)*N/W)``); ``sp_gather(x, dim)`` concatenates every rank's shard back. Both are
autograd-aware (built on :mod:`automodel.distributed.sp.split_gather`):

* ``sp_gather`` backward keeps this rank's slice of the gradient. This is the exact gradient when the
  computation after the gather is replicated (every rank computes the same loss from the gathered
  tensor), which is what gathering is for. It does NOT sum the gradient over ranks (a naive
  all-gather backward that reduce-scatters would multiply it by ``W``).
* ``sp_shard`` backward all-gathers the shards' gradients, so a replicated tensor that was sharded
  receives the full gradient of ``sum over ranks of each rank's loss`` on every rank.

Composed, ``sp_gather(f(sp_shard(x)))`` followed by a replicated loss gives ``x`` exactly its
single-process gradient on every rank; parameters used inside ``f`` get their shard's contribution
and must be SUM-all-reduced over the group (the CP convention). ``grad_scale`` (``"up"``/``"down"``)
is forwarded for other conventions; see :mod:`automodel.distributed.sp.split_gather`.

``sp_shard_with_padding`` pads the end of ``dim`` up to a multiple of ``W`` first and returns the pad
so that ``sp_gather_with_padding`` can trim it after gathering.

``ShardingValidator`` records named ``sp_shard*``/``sp_gather*`` calls made inside ``track()`` (and
its own ``shard``/``gather`` methods) and ``validate()`` raises a ``ValueError`` listing every name
sharded but never gathered (or gathered along another dim). Unnamed calls are not recorded.

vllm-omni's ``sp_sharding`` names and signatures are kept (``sp_shard(tensor, dim, validate=True)``,
``sp_gather(tensor, dim, validate=True)``, ``sp_shard_with_padding(tensor, dim, pad_value=0.0)``,
``sp_gather_with_grad``, ``AllGatherFunction``, ``ShardingValidator.shard/gather/track/validate``,
``get_sharding_validator``). Differences, all documented in docs/seed_api.md: the group is an
argument (default: the default group) instead of vllm-omni's global SP group; ``sp_shard``'s backward
all-gathers the gradient (vllm-omni's is a local slice, so its gradient is wrong for training);
``sp_gather(validate=True)`` exchanges the shard sizes first, so uneven shards (``validate=False``)
gather correctly where vllm-omni's equal-size all-gather fails.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from automodel.distributed.sp.all_to_all import world_and_rank
from automodel.distributed.sp.split_gather import gather_forward_split_backward, split_forward_gather_backward
from automodel.distributed.torch_internals import all_gather_single

logger = logging.getLogger(__name__)

__all__ = [
    "AllGatherFunction",
    "get_sharding_validator",
    "sp_gather_with_grad",
    "sp_shard",
    "sp_gather",
    "sp_shard_with_padding",
    "sp_gather_with_padding",
    "chunk_sizes",
    "ShardingValidator",
    "ShardingEvent",
]


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

    or, as in vllm-omni, through the validator::

        with v.track():
            h = v.shard(hidden, "hidden", dim=1)
            out = v.gather(h, "hidden", dim=1)
        v.validate()

    ``validate()`` reports a name sharded but never gathered, and a gather along another dim than its
    shard; ``validate(strict=True)`` also counts (two shards of a name need two gathers). Several
    validators may track at once (nested ``track()``); each records every operation.
    """

    events: list[ShardingEvent] = field(default_factory=list)

    @property
    def _enabled(self) -> bool:
        return self in _ACTIVE.get()

    @contextlib.contextmanager
    def track(self, reset: bool = True) -> Iterator[ShardingValidator]:
        """Record named shard/gather calls made (in this thread/task) until the block exits.

        ``reset=True`` (vllm-omni's behaviour) forgets earlier events on entry, so a global validator
        checks one forward pass at a time.
        """
        if reset:
            self.reset()
        token = _ACTIVE.set(_ACTIVE.get() + (self,))
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def shard(
        self,
        tensor: torch.Tensor,
        name: str,
        dim: int,
        validate_divisible: bool = True,
        group: ProcessGroup | None = None,
    ) -> torch.Tensor:
        """:func:`sp_shard` recorded under ``name`` (when tracking); a second shard of a name logs a warning."""
        if self._enabled and any(e.kind == "shard" and e.name == name for e in self.events):
            logger.warning("ShardingValidator: tensor %r sharded more than once", name)
        return sp_shard(tensor, dim, validate_divisible, group, name=name)

    def gather(self, tensor: torch.Tensor, name: str, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
        """:func:`sp_gather` recorded under ``name``; gathering a name never sharded logs a warning."""
        if self._enabled and not any(e.kind == "shard" and e.name == name for e in self.events):
            logger.warning("ShardingValidator: tensor %r gathered without being sharded", name)
        return sp_gather(tensor, dim, group=group, name=name)

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

    def validate(self, strict: bool = False) -> None:
        """Raise ``ValueError`` listing every tensor sharded but never gathered, and every dim mismatch.

        ``strict=True``: every shard needs its own gather (counted per name).
        """
        problems = []
        gathered = {e.name for e in self.events if e.kind == "gather"}
        for name, shards in self.open_shards().items():
            if not strict and name in gathered:
                continue
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


def chunk_sizes(total: int, world_size: int) -> list[int]:
    """``torch.chunk`` sizes of ``total`` elements over ``world_size`` ranks, ``0`` for ranks left without one.

    Chunks are ``ceil(total / W)`` long, the last ones shorter: ``chunk_sizes(17, 4) == [5, 5, 5, 2]``,
    ``chunk_sizes(5, 4) == [2, 2, 1, 0]``.
    """
    c = -(-total // world_size) if total else 0
    return [max(0, min(c, total - r * c)) for r in range(world_size)]


def sp_shard(
    tensor: torch.Tensor, dim: int, validate: bool = True, group: ProcessGroup | None = None, *,
    name: str | None = None, grad_scale: str | None = None,
) -> torch.Tensor:
    """This rank's contiguous chunk of ``tensor`` along ``dim`` (autograd: backward all-gathers the gradient).

    Args:
        tensor: the full tensor, identical on every rank.
        dim: dimension to shard.
        validate: ``True``: ``tensor.size(dim)`` must be divisible by ``W`` (``ValueError`` otherwise).
            ``False``: uneven ``torch.chunk`` pieces (17 over 4 ranks: 5, 5, 5, 2; a rank past the last
            chunk gets an empty piece, where vllm-omni raises ``IndexError``).
        group: process group (``None`` = default group; vllm-omni uses its global SP group).
        name: recorded by an active :class:`ShardingValidator` when given.
        grad_scale: ``None``/``"up"``/``"down"``, see :mod:`automodel.distributed.sp.split_gather`.

    Returns:
        a new tensor (a view of ``tensor`` at world size 1); ``tensor`` is not mutated. Gather it back with
        :func:`sp_gather` (``validate=True`` handles uneven pieces).

    Raises:
        ValueError: ``validate`` and ``tensor.size(dim)`` is not a positive multiple of ``W`` (use
        :func:`sp_shard_with_padding`).
    """
    x = tensor
    world, _ = world_and_rank(group)
    dim = dim % x.dim()
    n = x.size(dim)
    if validate and n < world:
        raise ValueError(
            f"sp_shard: size {n} along dim {dim} is shorter than the world size {world}; every rank needs "
            "at least one element: use sp_shard_with_padding, a smaller group or validate=False"
        )
    if validate and n % world != 0:
        raise ValueError(
            f"sp_shard: size {n} along dim {dim} is not divisible by the world size {world}; pad it to "
            f"{-(-n // world) * world} (sp_shard_with_padding does this and returns the pad to trim later) or "
            "pass validate=False for uneven torch.chunk pieces"
        )
    _record("shard", name, dim, x.shape)
    return split_forward_gather_backward(x, group, dim, chunk_sizes(n, world), grad_scale=grad_scale)


def sp_gather(
    tensor: torch.Tensor, dim: int, validate: bool = True, group: ProcessGroup | None = None, *,
    name: str | None = None, grad_scale: str | None = None,
) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim`` (autograd: backward keeps this rank's slice).

    Args:
        tensor: this rank's shard; other dims equal on every rank.
        dim: dimension to concatenate along.
        validate: ``True``: exchange the shard sizes first (one small all-gather), so uneven shards
            (``sp_shard(..., validate=False)``) come back whole. ``False``: every shard must have
            ``tensor.size(dim)`` elements (no size exchange; the collective fails otherwise).
        group, name, grad_scale: as in :func:`sp_shard`.

    Returns the full tensor (``sum of the shard sizes`` along ``dim``), identical on every rank.
    """
    x = tensor
    dim = dim % x.dim()
    _record("gather", name, dim, x.shape)
    world, _ = world_and_rank(group)
    sizes = None
    if validate and world > 1:
        mine = torch.tensor([x.size(dim)], dtype=torch.int64, device=x.device)  # NCCL needs it on the GPU
        every = torch.empty(world, dtype=torch.int64, device=x.device)
        # torch_internals.all_gather_single: all_gather_into_tensor on torch < 2.13
        all_gather_single(every, mine, group=group)
        sizes = every.tolist()
    return gather_forward_split_backward(x, group, dim, sizes, grad_scale=grad_scale)


def sp_gather_with_grad(tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """vllm-omni's name: :func:`sp_gather` whose backward keeps this rank's gradient slice (``grad_scale=None``)."""
    return AllGatherFunction.apply(tensor, dim, group)


class AllGatherFunction(torch.autograd.Function):
    """``apply(tensor, dim, group=None)``: all-gather along ``dim``; backward: this rank's slice of the gradient.

    vllm-omni's autograd function (equal shards). The exact gradient when the computation after the
    gather is replicated on every rank; see the module docstring.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None):  # type: ignore[override]
        world, rank = world_and_rank(group)
        ctx.dim, ctx.world, ctx.rank, ctx.n = dim % tensor.dim(), world, rank, tensor.size(dim)
        return gather_forward_split_backward(tensor.detach(), group, dim, grad_scale=None).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.narrow(ctx.dim, ctx.rank * ctx.n, ctx.n).contiguous(), None, None


def sp_shard_with_padding(
    tensor: torch.Tensor,
    dim: int,
    pad_value: float = 0.0,
    group: ProcessGroup | None = None,
    *,
    name: str | None = None,
    grad_scale: str | None = None,
) -> tuple[torch.Tensor, int]:
    """Pad the end of ``dim`` with ``pad_value`` up to a multiple of ``W``, then :func:`sp_shard`.

    Returns:
        ``(shard, pad)``: ``shard`` has ``(tensor.size(dim) + pad) / W`` elements along ``dim``; ``pad`` is
        the number of padding elements added at the end (``0 <= pad < W``), to pass to
        :func:`sp_gather_with_padding` (or to trim yourself after :func:`sp_gather`). The padding lands in
        the last ranks' shards. An empty ``dim`` gives empty shards and ``pad == 0``.
    """
    x = tensor
    world, _ = world_and_rank(group)
    dim = dim % x.dim()
    n = x.size(dim)
    pad = (-n) % world
    if pad:
        spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = F.pad(x, spec, value=pad_value)
    return sp_shard(x, dim, n > 0, group, name=name, grad_scale=grad_scale), pad


_GLOBAL_VALIDATOR = ShardingValidator()


def get_sharding_validator() -> ShardingValidator:
    """The process-wide :class:`ShardingValidator` (vllm-omni's convenience instance)."""
    return _GLOBAL_VALIDATOR


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
    full = sp_gather(x, dim, group=group, name=name, grad_scale=grad_scale)
    dim = dim % full.dim()
    if not 0 <= pad <= full.size(dim):
        raise ValueError(
            f"sp_gather_with_padding: pad={pad} is out of range for {full.size(dim)} gathered elements"
        )
    return full.narrow(dim, 0, full.size(dim) - pad)
