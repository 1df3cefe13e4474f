"""Checkpoint groups (``model.checkpoint_group_layers: k``): only every ``k``-th decoder layer's input is kept for the
backward; the inputs in between are rebuilt from it when the backward needs them.

With activation checkpointing every decoder layer keeps its input ``[B, S, H]`` (on the device, or in host memory
with ``model.activation_offload``). With groups of ``k`` consecutive layers (layers ``g k .. g k + k - 1``) only
the group's first layer (its *start*) keeps its input; the others (its *members*) keep nothing: when the backward
reaches the group (its last member first), the group's start input is brought back once (from the host under
activation offload: its one copy) and the group's layers but the last are run forward again, in order, from it,
which rebuilds every member's input (the same values, bit for bit: the same layers, weights, kwargs, RNG and autocast
state as their forward). Each layer's own checkpoint then recomputes and back-propagates it as before. The loss and
every gradient are those of the run without groups.

What it trades (the memory planner's terms, ``automodel.training.memory_plan``): the layer inputs kept through the
step fall from ``L`` to ``ceil(L / k)`` (host memory under activation offload, device memory without it); while the
backward runs through a group its ``k`` inputs are on the device (the start's and the rebuilt members'), beside the
previous group's start input prefetched: ``k + 1`` instead of 2 under offload. The rebuild is one more forward of
``k - 1`` of each group's ``k`` layers (``L - ceil(L / k)`` layer forwards per step), charged in the step estimate.

How (no change to the model's code): each decoder block's :class:`~automodel.models.block_call.BlockCall` gets a
:class:`GroupSlot`. Around a start's checkpoint a ``saved_tensors_hooks`` pair takes what the checkpoint saves
outside its own hooks (the block's positional inputs) and hands the hidden state to the inner hooks (activation
offload's store: :meth:`CheckpointGroups.set_inner_hooks`) or keeps it; around a member's checkpoint the hidden
state is replaced by a handle that rebuilds it. The rebuild calls each block through its module (FSDP2's and
other module hooks gather its parameters as in a forward) with a flag on its ``BlockCall`` that runs the plain
forward (no checkpoint, no offload), under hooks that save nothing (no graph is kept). A layer whose input is not
the previous layer's output (a model that changes the hidden state between layers) is refused at its first call.

Order of the techniques: :func:`apply_checkpoint_groups` after activation checkpointing, before activation offload
(which then offloads the starts' inputs only) and FSDP2. Tensor parallelism and ``model.compile`` are refused by the
config rules (not proven here).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel.models.block_call import (
    BlockCall,
    apply_activation_checkpointing,
    block_call,
    outermost_blocks,
)

__all__ = ["CheckpointGroups", "GroupCounts", "GroupSlot", "apply_checkpoint_groups", "check_group_layers",
           "checkpoint_groups_of", "group_starts"]  # fmt: skip


def check_group_layers(value: Any) -> int:
    """``model.checkpoint_group_layers`` as layers per group (an int >= 1; ``auto`` is resolved before this).

    Raises:
        ValueError: not an int >= 1 (naming the value and the fix).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"model.checkpoint_group_layers={value!r} must be an int >= 1 (layers per checkpoint group; 1: every "
            f"layer keeps its input) or auto; set e.g. model.checkpoint_group_layers=2"
        )
    return value


def group_starts(layers: int, size: int) -> int:
    """How many layer inputs are kept: one per group of ``size`` consecutive layers, ``ceil(layers / size)``."""
    return math.ceil(layers / max(size, 1)) if layers else 0


@dataclass
class GroupCounts:
    """What the groups did since the last :meth:`reset` (counts of calls)."""

    kept: int = 0  # layer inputs kept for the backward (the starts', one per group and micro-batch)
    dropped: int = 0  # layer inputs not kept (the members')
    rebuilt: int = 0  # member inputs rebuilt in the backward
    replayed: int = 0  # layer forwards run again to rebuild them

    def reset(self) -> None:
        self.kept = self.dropped = self.rebuilt = self.replayed = 0


class _StartHandle:
    """What autograd keeps for a start's hidden state: the inner hooks' handle (or the tensor itself)."""

    __slots__ = ("run", "inner", "__weakref__")

    def __init__(self, run: _GroupRun, inner: Any):
        self.run, self.inner = run, inner


class _MemberHandle:
    """What autograd keeps for a member's hidden state: which input of which group run to rebuild."""

    __slots__ = ("run", "position", "__weakref__")

    def __init__(self, run: _GroupRun, position: int):
        self.run, self.position = run, position


@dataclass
class _Record:
    """One block call of a group run, enough to run its forward again: the call, its kwargs, RNG and autocast state."""

    call: BlockCall
    kwargs: dict
    requires_grad: bool
    rng: tuple[torch.Tensor, torch.Tensor | None]
    autocast: tuple[str, bool, torch.dtype]


class _GroupRun:
    """One forward of one group: the start's saved input and each block call's record; the rebuilt inputs."""

    def __init__(self, groups: CheckpointGroups):
        self.groups = groups
        self.start: Any = None  # the start's inner handle (the store's) or its tensor; None until packed
        self.records: list[_Record] = []
        self.cache: dict[int, torch.Tensor] = {}  # position -> rebuilt (or brought back) input

    def start_value(self) -> torch.Tensor:
        return self.groups.unpack_inner(self.start)

    def value(self, position: int) -> torch.Tensor:
        """The input of the group's ``position``-th layer, rebuilt from the start's when it is not cached."""
        if position not in self.cache:
            below = [p for p in self.cache if p < position]
            at = max(below) if below else 0
            x = self.cache[at] if below else self.start_value()
            self.cache[at] = x
            for p in range(at, position):  # all but the last replayed block go back to their shards (FSDP2)
                x = self.groups.replay(self.records[p], x, reshard=p < position - 1)
                self.cache[p + 1] = x
        if position:
            self.groups.counts.rebuilt += 1
        return self.cache.pop(position)


def _drop(tensor: torch.Tensor) -> None:  # a replay keeps no graph: nothing it saves is needed
    return None


def _never(_: Any) -> torch.Tensor:
    raise RuntimeError("a checkpoint group's replay keeps no graph; nothing it saved can be unpacked")


class GroupSlot:
    """A block's place in its group: ``position`` 0 is the start; ``index`` the block's layer index."""

    def __init__(self, groups: CheckpointGroups, index: int, position: int):
        self.groups, self.index, self.position = groups, index, position

    @contextlib.contextmanager
    def saving(self, call: BlockCall, args: tuple, kwargs: dict) -> Any:
        """Around the block's checkpointed call: its hidden state (``args[0]``) kept (start) or dropped (member)."""
        groups = self.groups
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if hidden is None:
            raise ValueError(
                f"model.checkpoint_group_layers={groups.size}: decoder layer {self.index} "
                f"({type(call.block).__name__}) was called without its hidden state as the first positional argument; "
                f"set model.checkpoint_group_layers=1"
            )
        if self.position == 0:
            run = _GroupRun(groups)
            groups.current = weakref.ref(run)  # the graph keeps the run (its handles), not the groups
        else:
            run = groups.current() if groups.current is not None else None
            previous = groups.last_output() if groups.last_output is not None else None
            if run is None or not _aliases(previous, hidden) or len(run.records) != self.position:
                raise ValueError(
                    f"model.checkpoint_group_layers={groups.size}: decoder layer {self.index} "
                    f"({type(call.block).__name__}) does not take the previous layer's output as its input (the model "
                    f"changes the hidden state between layers, or calls them out of order), so its input cannot be "
                    f"rebuilt from its group's first layer; set model.checkpoint_group_layers=1"
                )
        run.records.append(_record(call, kwargs, hidden))
        # autograd keeps the hook functions with what they saved: the hook must not hold the hidden state itself
        hidden_ref = weakref.ref(hidden)
        del hidden

        def pack(tensor: torch.Tensor) -> Any:
            if tensor is not hidden_ref():
                return groups.pack_inner(tensor) if self.position == 0 else tensor
            if self.position == 0:
                groups.counts.kept += 1
                run.start = groups.pack_inner(tensor)
                return _StartHandle(run, run.start)
            groups.counts.dropped += 1
            return _MemberHandle(run, self.position)

        with torch.autograd.graph.saved_tensors_hooks(pack, groups.unpack):
            yield

    def finished(self, output: Any) -> None:
        """After the block's call: its output is what the next member must receive."""
        first = output[0] if isinstance(output, (tuple, list)) else output
        self.groups.last_output = weakref.ref(first) if isinstance(first, torch.Tensor) else None


def _aliases(previous: torch.Tensor | None, hidden: torch.Tensor) -> bool:
    """Whether ``hidden`` is the previous layer's output (the tensor itself, or an alias of it: FSDP2's pre-forward
    hook passes its inputs through an autograd function that returns them as new tensor objects on the same memory)."""
    if previous is None:
        return False
    if previous is hidden:
        return True
    return (previous.device == hidden.device and previous.dtype == hidden.dtype and previous.shape == hidden.shape
            and previous.stride() == hidden.stride() and previous.data_ptr() == hidden.data_ptr())  # fmt: skip


def _record(call: BlockCall, kwargs: dict, hidden: torch.Tensor) -> _Record:
    device = hidden.device
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    kind = device.type
    return _Record(call, kwargs, hidden.requires_grad, (torch.get_rng_state(), cuda),
                   (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)))  # fmt: skip


class CheckpointGroups:
    """The groups of a model's decoder blocks (:func:`apply_checkpoint_groups`): their slots, the inner hooks (activation
    offload's store) and :class:`GroupCounts`."""

    def __init__(self, calls: list[BlockCall], size: int):
        self.size = size
        self.calls = calls
        self.counts = GroupCounts()
        self.current: weakref.ref | None = None  # the group run of the latest start (alive while its graph is)
        self.last_output: weakref.ref | None = None
        self._pack: Any = None
        self._unpack: Any = None
        for i, call in enumerate(calls):
            call.group = GroupSlot(self, i, i % size)

    @property
    def starts(self) -> list[int]:
        """The layer indices whose inputs are kept (the groups' first layers)."""
        return [i for i, c in enumerate(self.calls) if c.group is not None and c.group.position == 0]

    def set_inner_hooks(self, pack: Any, unpack: Any) -> None:
        """Where the starts' inputs go (activation offload's ``pack`` / ``unpack``); default: kept as they are."""
        self._pack, self._unpack = pack, unpack

    def pack_inner(self, tensor: torch.Tensor) -> Any:
        return self._pack(tensor) if self._pack is not None else tensor

    def unpack_inner(self, handle: Any) -> torch.Tensor:
        return self._unpack(handle) if self._unpack is not None else handle

    def unpack(self, handle: Any) -> torch.Tensor:
        """Unpack hook of every block of a group: a start's input (rebuilt ones from the cache), a member's rebuilt."""
        if isinstance(handle, _StartHandle):
            run = handle.run
            return run.cache.pop(0) if 0 in run.cache else self.unpack_inner(handle.inner)
        if isinstance(handle, _MemberHandle):
            return handle.run.value(handle.position)
        return self.unpack_inner(handle)

    def replay(self, record: _Record, x: torch.Tensor, reshard: bool = False) -> torch.Tensor:
        """``record``'s block run forward again on ``x`` (its input as it was): its output, detached. Through the
        module (FSDP2 gathers its parameters), the plain forward (the BlockCall's ``replaying`` flag), grad mode on as
        in the forward (kernels are picked alike) but nothing saved; the forward's RNG and autocast state. ``reshard``:
        an FSDP2 block's gathered parameters are freed after it (FSDP2 keeps them during the backward; the block just
        before the member being rebuilt is the one its own backward prefetch gathers anyway)."""
        call = record.call
        devices = [x.device] if x.device.type == "cuda" else []
        kind, enabled, dtype = record.autocast
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=devices))
            torch.set_rng_state(record.rng[0])
            if record.rng[1] is not None:
                torch.cuda.set_rng_state(record.rng[1], x.device)
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_drop, _never))
            call.replaying = True
            try:
                out = call.block(x.detach().requires_grad_(record.requires_grad), **record.kwargs)
            finally:
                call.replaying = False
        if reshard and callable(getattr(call.block, "reshard", None)):
            call.block.reshard()
        self.counts.replayed += 1
        first = out[0] if isinstance(out, (tuple, list)) else out
        return first.detach()


def apply_checkpoint_groups(model: nn.Module, layers_per_group: int) -> CheckpointGroups | None:
    """Group the checkpointed decoder blocks of ``model`` ``layers_per_group`` at a time (module docstring). Mutates
    the blocks' :class:`~automodel.models.block_call.BlockCall` (a :class:`GroupSlot` each). ``1``: nothing to do
    (``None``). Call after activation checkpointing, before activation offload and FSDP2.

    Raises:
        ValueError: ``layers_per_group`` is not an int >= 1, a block is not checkpointed, or the blocks are grouped
            already.
    """
    size = check_group_layers(layers_per_group)
    if size == 1:
        return None
    blocks = outermost_blocks(model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in blocks):
        apply_activation_checkpointing(model)
    calls = [block_call(b) for b in blocks]
    if not all(c.checkpoint for c in calls):
        raise ValueError(
            f"model.checkpoint_group_layers={size} groups the checkpointed decoder layers, but they are not "
            f"checkpointed; set model.activation_checkpointing=true"
        )
    if any(c.group is not None for c in calls):
        raise ValueError("checkpoint groups are applied to this model already")
    return CheckpointGroups(calls, size)


def checkpoint_groups_of(model: nn.Module) -> CheckpointGroups | None:
    """The :class:`CheckpointGroups` of ``model``'s decoder blocks, or ``None`` where they are not grouped."""
    try:
        blocks = outermost_blocks(model)
    except ValueError:
        return None
    for b in blocks:
        call = b.__dict__.get("_automodel_block_call")
        if call is not None and call.group is not None:
            return call.group.groups
    return None
