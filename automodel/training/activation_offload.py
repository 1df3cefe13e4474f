"""Activation-checkpoint offload (``model.activation_offload: true``): the layer inputs that activation
checkpointing keeps for the backward live in host memory, not on the device.

With non-reentrant checkpointing each decoder layer keeps only its inputs (the hidden states ``[B, S, H]``
that enter it) for the backward, which recomputes the layer from them. :func:`apply_activation_offload` puts
:func:`torch.autograd.graph.saved_tensors_hooks` around each block's checkpoint: it is the ``outer`` context
of the block's :class:`~automodel.models.block_call.BlockCall`, so the hooks sit exactly outside the checkpoint
(and outside ``torch.compile``'s code, inside FSDP2's and TP's module hooks) whatever order checkpointing,
compile, offload and FSDP2 are applied in and whatever transformers release runs. Only what the checkpoint
saves outside its own hooks reaches them: the block's positional tensor inputs (the hidden states); the
recomputation runs in the backward, where these hooks are not active, so it is untouched. The pack hook moves
each such tensor into an :class:`OffloadStore` and the unpack hook brings it back. The values come back bit for
bit: the loss and every gradient are those of the run without offload.

The store's copies (one :class:`Copier` per device type):

- CUDA (:class:`StreamCopier`): pinned host buffers from a pool (:class:`HostBufferPool`), device -> host
  copies on a side stream that waits for the compute stream at that point (``wait_stream``) and
  ``record_stream`` on the source so its memory is not reused before the copy ends; host -> device copies on
  the side stream into memory allocated on the compute stream, with one event per copy that the compute stream
  waits on before the tensor is used. When the backward unpacks layer ``i``'s input, the inputs of layer
  ``i - 1`` (the previous wrapped call) are prefetched, so their copy overlaps layer ``i``'s recomputation and
  backward. Nothing else synchronises the compute stream.
- CPU (:class:`HostCopier`): the same store, pool, order and prefetch with synchronous copies: the saved
  tensor is copied into a pool buffer (its own storage) and released; the backward gets a fresh copy. The
  original tensor is really freed (tests hold a weak reference to it), which is what lets CI prove the
  path exact.

The pool (host memory steady over a long run): buffers are byte buffers handed out as views, a request served
by the smallest free buffer that holds it (at most twice its size), a new one rounded up to 1/8 of a power of
two (rows of slightly different lengths share buffers). When a new micro-batch's forward begins, the free
buffers that served nothing since the previous one are dropped, so the pool follows the training shapes and
keeps none of another shape (the self-check's: the trainer also clears the pool after it). With fixed shapes
the steady state allocates nothing.

What it removes from the device (the memory planner's term): every checkpointed layer input of the
micro-batch except those in flight, i.e. the current layer's (being recomputed) and the prefetched previous
layer's: ``(L - 2) * B * S_local * H * bytes`` instead of ``L * ...`` at the backward's start; the forward
holds one layer input at a time. Host memory: the pool holds one buffer per offloaded tensor of a micro-batch
(``L * B * S_local * H * bytes`` for the hidden states, pinned on CUDA, rounded up by at most 1/8), reused step
after step; :meth:`OffloadStore.stats` reports it (``host_bytes`` and ``peak_host_bytes``) and
:meth:`OffloadStore.per_layer` what each layer moved.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from automodel.distributed.torch_internals import wait_async_collective
from automodel.models.block_call import apply_activation_checkpointing, block_call, outermost_blocks

__all__ = [
    "ActivationOffloadStats",
    "Copier",
    "HostBufferPool",
    "HostCopier",
    "OffloadStore",
    "StreamCopier",
    "apply_activation_offload",
    "make_copier",
]


def _capacity(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 1/8 of its highest power of two (at most 12.5% more)."""
    if nbytes <= 64:
        return max(nbytes, 1)
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class HostBufferPool:
    """Host byte buffers reused across micro-batches: :meth:`acquire` hands out a view of a free one or allocates.

    A request of ``n`` bytes takes the smallest free buffer of at least ``n`` and at most ``2 * capacity(n)``
    bytes; a new buffer has ``capacity(n)`` bytes (``n`` rounded up by at most 1/8). :meth:`trim` drops the free
    buffers that served nothing since the previous trim: called when a micro-batch's forward begins, it keeps
    the pool at what the training shapes use. ``pin``: page-locked memory (CUDA: the only kind a copy on a side
    stream overlaps with compute).

    ``host_bytes`` is what the pool holds (free and in use); ``peak_in_use_bytes`` the most handed out at once
    (bytes of the requests); ``allocations`` how many buffers it has allocated in all.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._free: list[torch.Tensor] = []  # uint8 buffers, by capacity (ascending)
        self._in_use: dict[int, tuple[torch.Tensor, int]] = {}  # id(view) -> (its buffer, requested bytes)
        self._served: set[int] = set()  # id(buffer) of those handed out since the previous trim
        self.host_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocations = 0

    def acquire(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype`` (contents undefined), a view of a pool buffer."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        limit = 2 * _capacity(nbytes)
        at = next((i for i, b in enumerate(self._free) if nbytes <= b.numel() <= limit), None)
        if at is not None:
            buf = self._free.pop(at)
        else:
            buf = torch.empty(_capacity(nbytes), dtype=torch.uint8, device="cpu", pin_memory=self.pin)
            self.host_bytes += buf.numel()
            self.allocations += 1
        view = buf[:nbytes].view(dtype).view(shape)
        self._in_use[id(view)] = (buf, nbytes)
        self._served.add(id(buf))
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return view

    def release(self, view: torch.Tensor) -> None:
        """Give ``view`` (from :meth:`acquire`) back for reuse."""
        buf, nbytes = self._in_use.pop(id(view))
        self.in_use_bytes -= nbytes
        self._free.append(buf)
        self._free.sort(key=torch.Tensor.numel)

    def trim(self) -> int:
        """Drop the free buffers that were not handed out since the previous trim; returns the bytes dropped."""
        keep = [b for b in self._free if id(b) in self._served]
        dropped = sum(b.numel() for b in self._free) - sum(b.numel() for b in keep)
        self._free = keep
        self.host_bytes -= dropped
        self._served = {id(buf) for buf, _ in self._in_use.values()}
        return dropped

    def clear(self) -> None:
        """Drop the free buffers (the ones in use stay theirs) and forget what was served."""
        self.host_bytes -= sum(b.numel() for b in self._free)
        self._free.clear()
        self._served = {id(buf) for buf, _ in self._in_use.values()}


def _numel(shape: torch.Size | tuple) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class Copier:
    """How tensors travel between their device and the host. Subclasses: :class:`HostCopier`, :class:`StreamCopier`."""

    pin = False
    device_type = "cpu"  # the device whose tensors it moves; a saved tensor elsewhere stays where it is

    def to_host(self, tensor: torch.Tensor, buf: torch.Tensor) -> None:
        """Start copying ``tensor`` into the host buffer ``buf``; ``tensor`` may be released after the call."""
        raise NotImplementedError

    def to_device(self, buf: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        """Start copying ``buf`` to a new tensor on ``device``; returns it and a token for :meth:`wait`."""
        raise NotImplementedError

    def wait(self, ready: Any, device: torch.device) -> None:
        """Make the compute on ``device`` wait until the copy of ``ready`` is done."""


class HostCopier(Copier):
    """Synchronous copies (tensors on the CPU: the store still holds them in its own buffers)."""

    def to_host(self, tensor: torch.Tensor, buf: torch.Tensor) -> None:
        buf.copy_(tensor)

    def to_device(self, buf: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        out = torch.empty_like(buf, device=device)
        out.copy_(buf)
        return out, None


class _TorchCuda:
    """The stream API :class:`StreamCopier` uses (tests pass a fake with the same methods)."""

    Event = staticmethod(lambda: torch.cuda.Event())

    @staticmethod
    def Stream(device: torch.device) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return torch.cuda.Stream(device=device)

    @staticmethod
    def current_stream(device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    @staticmethod
    def stream(stream: Any) -> Any:
        return torch.cuda.stream(stream)

    @staticmethod
    def record_stream(tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class StreamCopier(Copier):
    """Asynchronous copies on one side stream per device (CUDA), ordered against the compute stream by events.

    - to the host: the side stream waits for the compute stream (the tensor is complete), copies into a pinned
      buffer, and the tensor's memory is marked in use by the side stream (``record_stream``) so the caching
      allocator does not hand it out before the copy ends;
    - to the device: memory is allocated on the compute stream, the side stream waits for the compute stream
      (earlier users of that memory are done), copies, records an event; :meth:`wait` makes the compute
      stream wait on that event. Host buffers are only ever read or written on the side stream, in order, so
      a released buffer can be reused at once.
    """

    pin = True
    device_type = "cuda"

    def __init__(self, api: Any = None):
        self.api = api if api is not None else _TorchCuda()
        self._streams: dict[Any, Any] = {}

    def _side(self, device: torch.device) -> Any:
        key = (device.type, device.index)
        if key not in self._streams:
            self._streams[key] = self.api.Stream(device)
        return self._streams[key]

    def to_host(self, tensor: torch.Tensor, buf: torch.Tensor) -> None:
        side = self._side(tensor.device)
        side.wait_stream(self.api.current_stream(tensor.device))
        with self.api.stream(side):
            buf.copy_(tensor, non_blocking=True)
        self.api.record_stream(tensor, side)

    def to_device(self, buf: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, Any]:
        side = self._side(device)
        out = torch.empty_like(buf, device=device)  # on the compute stream: the tensor's users run there
        side.wait_stream(self.api.current_stream(device))
        with self.api.stream(side):
            out.copy_(buf, non_blocking=True)
            ready = self.api.Event()
            ready.record(side)
        return out, ready

    def wait(self, ready: Any, device: torch.device) -> None:
        self.api.current_stream(device).wait_event(ready)


def make_copier(device: torch.device) -> Copier:
    """:class:`StreamCopier` for CUDA, :class:`HostCopier` for the CPU.

    Raises:
        ValueError: another device type (no copy path is written for it).
    """
    if device.type == "cuda":
        return StreamCopier()
    if device.type == "cpu":
        return HostCopier()
    raise ValueError(
        f"model.activation_offload=true has no copy path for device type {device.type!r} (cuda and cpu have "
        f"one); set model.activation_offload=false"
    )


@dataclass
class ActivationOffloadStats:
    """What the store did. Bytes are of the saved tensors (device side) or of host buffers."""

    packed: int = 0  # tensors moved to the host
    kept: int = 0  # saved tensors left where they were (parameters, non-contiguous views, other devices, empty)
    unpacked: int = 0
    prefetched: int = 0  # unpacks served by a prefetch issued at the layer after
    offloaded_bytes: int = 0  # bytes moved to the host, all micro-batches
    live_bytes: int = 0  # bytes now held on the host for a pending backward
    peak_live_bytes: int = 0  # the most held at once (one micro-batch's layer inputs): what leaves the device
    host_bytes: int = 0  # what the buffer pool holds (pinned on CUDA)
    peak_host_bytes: int = 0  # the most of it in use at once


class _Handle:
    """What autograd keeps instead of a saved tensor: where it lives on the host and how to rebuild it."""

    __slots__ = ("host", "device", "spec", "call", "fetched", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, spec: Any, call: list):
        self.host = host
        self.device = device
        self.spec = spec  # (mesh, placements, shape, stride) for a DTensor, else None
        self.call = call  # the handles of the same wrapped layer call (weak)
        self.fetched: torch.Tensor | None = None  # a prefetched device copy, until unpacked
        self.ready: Any = None


class OffloadStore:
    """The host store behind the pack / unpack hooks: holds saved tensors, brings them back, prefetches.

    Every wrapped layer call (:meth:`layer_call`) opens a group; its saved tensors go to the host in
    :meth:`pack`. :meth:`unpack` returns a tensor equal to the saved one on its device (a prefetched copy if
    there is one) and starts bringing back the previous call's group. Buffers go back to the pool when
    autograd drops a handle (after the backward of that layer, or with the graph).
    """

    def __init__(self, copier: Copier, pool: HostBufferPool | None = None):
        self.copier = copier
        self.pool = pool if pool is not None else HostBufferPool(pin=copier.pin)
        self._calls: list[list] = []  # the forward's layer calls in order, each a list of weakrefs to handles
        self._backward_started = False
        self._current: list | None = None
        self._layer: int | None = None
        self._per_layer: dict[int, list[int]] = {}  # layer index -> [tensors, bytes] moved since reset_counts
        self.counts = ActivationOffloadStats()

    # ------------------------------------------------------------ the hooks
    @contextlib.contextmanager
    def layer_call(self, layer: int | None = None) -> Iterator[None]:
        """Around one decoder block's checkpointed call: what it saves outside the checkpoint goes to the host.

        ``layer``: the block's index, under which :meth:`per_layer` counts what it moved."""
        if self._backward_started:  # a new forward after a backward (the next micro-batch)
            self._calls, self._backward_started = [], False
            self.pool.trim()  # buffers of shapes this micro-batch's predecessor did not use
        group: list = []
        self._calls.append(group)
        previous, self._current = self._current, group
        previous_layer, self._layer = self._layer, layer
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._current, self._layer = previous, previous_layer

    def pack(self, tensor: torch.Tensor) -> Any:
        """Save hook: ``tensor`` copied into a host buffer; returns the handle autograd keeps (or ``tensor``
        itself when it is not moved: a parameter, a non-contiguous tensor, a tensor on another device, an empty
        tensor)."""
        local, spec = tensor, None
        if _is_dtensor(tensor):
            local = tensor._local_tensor
            spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        # a pending collective's result (the first layer's input under TP with sequence parallel) is waited for:
        # its values are the tensor's, and it is a plain tensor then
        local = wait_async_collective(local)
        if (
            isinstance(tensor, nn.Parameter)
            or type(local) is not torch.Tensor
            or not local.is_contiguous()
            or local.device.type != self.copier.device_type  # e.g. a host tensor of a CUDA model
            or local.numel() == 0  # torch 2.11's checkpoint saves an empty placeholder beside the inputs
        ):
            self.counts.kept += 1
            return tensor
        with torch.no_grad():
            buf = self.pool.acquire(local.shape, local.dtype)
            self.copier.to_host(local, buf)
        group = self._current if self._current is not None else []
        handle = _Handle(buf, local.device, spec, group)
        group.append(weakref.ref(handle))
        nbytes = buf.numel() * buf.element_size()
        weakref.finalize(handle, self._release, buf, nbytes)
        if self._layer is not None:
            moved = self._per_layer.setdefault(self._layer, [0, 0])
            moved[0] += 1
            moved[1] += nbytes
        c = self.counts
        c.packed += 1
        c.offloaded_bytes += nbytes
        c.live_bytes += nbytes
        c.peak_live_bytes = max(c.peak_live_bytes, c.live_bytes)
        return handle

    def unpack(self, handle: Any) -> torch.Tensor:
        """Unpack hook: the saved tensor back on its device; the previous layer call's inputs prefetched."""
        if not isinstance(handle, _Handle):
            return handle
        self._backward_started = True
        with torch.no_grad():
            if handle.fetched is not None:
                out, ready = handle.fetched, handle.ready
                handle.fetched = handle.ready = None
                self.counts.prefetched += 1
            else:
                out, ready = self.copier.to_device(handle.host, handle.device)
            self._prefetch_before(handle.call)
            self.copier.wait(ready, handle.device)
            self.counts.unpacked += 1
            return _rebuild(out, handle.spec)

    # ------------------------------------------------------------ internals
    def _prefetch_before(self, group: list) -> None:
        """Start bringing back the handles of the layer call before ``group`` (the next one the backward needs)."""
        index = next((i for i, g in enumerate(self._calls) if g is group), None)
        if not index:  # the first layer (nothing before it), or a group of an earlier forward
            return
        for ref in self._calls[index - 1]:
            other = ref()
            if other is not None and other.fetched is None:
                other.fetched, other.ready = self.copier.to_device(other.host, other.device)

    def _release(self, buf: torch.Tensor, nbytes: int) -> None:
        self.counts.live_bytes -= nbytes
        self.pool.release(buf)

    def stats(self) -> ActivationOffloadStats:
        """A snapshot of :attr:`counts` with the pool's host bytes."""
        c = self.counts
        return ActivationOffloadStats(**{**c.__dict__, "host_bytes": self.pool.host_bytes,
                                         "peak_host_bytes": self.pool.peak_in_use_bytes})  # fmt: skip

    def per_layer(self) -> dict[int, tuple[int, int]]:
        """Layer index -> (tensors, bytes) moved to the host since :meth:`reset_counts` (all micro-batches)."""
        return {i: (n, b) for i, (n, b) in sorted(self._per_layer.items())}

    def reset_counts(self) -> None:
        """Zero the counters and :meth:`per_layer` (live bytes stay: they are still held); the pool's peak too."""
        live = self.counts.live_bytes
        self.counts = ActivationOffloadStats(live_bytes=live, peak_live_bytes=live)
        self._per_layer.clear()
        self.pool.peak_in_use_bytes = self.pool.in_use_bytes

    def peak_host_bytes(self) -> int:
        """The most host bytes held at once for layer inputs (one micro-batch's, at the end of its forward)."""
        return self.pool.peak_in_use_bytes


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _rebuild(local: torch.Tensor, spec: Any) -> torch.Tensor:
    if spec is None:
        return local
    from torch.distributed.tensor import DTensor

    mesh, placements, shape, stride = spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def apply_activation_offload(model: nn.Module, store: OffloadStore | None = None) -> OffloadStore:
    """Offload the inputs that activation checkpointing keeps, for every decoder block of ``model``. Mutates it.

    Any order against ``model.compile`` and FSDP2 (after checkpoint groups, ``model.checkpoint_group_layers``: then
    only each group's first layer's input is offloaded, the others are rebuilt from it): the store's hooks become the ``outer`` context of each block's
    :class:`~automodel.models.block_call.BlockCall`, exactly outside the checkpoint. A model whose checkpointing
    transformers' own ``gradient_checkpointing_enable`` turned on is switched to
    :func:`automodel.models.parallelize.apply_activation_checkpointing` (the same recomputation; transformers'
    place of the checkpoint moves between releases). Parameter names and classes are unchanged.

    Args:
        model: an HF causal LM with checkpointing enabled on its decoder blocks.
        store: the store to use; default one for the device of the model's first parameter.

    Returns:
        The store (its :meth:`~OffloadStore.stats` and :meth:`~OffloadStore.per_layer` report what was offloaded).

    Raises:
        ValueError: a decoder block is not checkpointed (offload keeps only what checkpointing keeps), or the
            blocks are offloaded already.
    """
    blocks = outermost_blocks(model)
    if any(getattr(m, "gradient_checkpointing", False) is True for m in blocks):
        apply_activation_checkpointing(model)  # transformers' checkpointing: ours instead, the same recompute
    calls = [block_call(b) for b in blocks]
    plain = [type(b).__name__ for b, c in zip(blocks, calls, strict=True) if not c.checkpoint]
    if plain:
        raise ValueError(
            f"activation offload moves the layer inputs that activation checkpointing keeps, but {len(plain)} "
            f"decoder block(s) ({plain[0]}) are not checkpointed; enable checkpointing first "
            f"(model.activation_checkpointing=true)"
        )
    if any(c.outer is not None for c in calls):
        raise ValueError("activation offload is applied to this model already")
    if store is None:
        store = OffloadStore(make_copier(next(model.parameters()).device))
    groups = next((c.group.groups for c in calls if c.group is not None), None)
    for index, call in enumerate(calls):
        if call.group is None or call.group.position == 0:  # checkpoint groups: only a group's first layer keeps
            call.outer = functools.partial(store.layer_call, index)  # its input (automodel.models.checkpoint_groups)
    if groups is not None:
        groups.set_inner_hooks(store.pack, store.unpack)
    return store
