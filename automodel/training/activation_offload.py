"""Activation-checkpoint offload (``model.activation_offload: true``): the layer inputs that activation
checkpointing keeps for the backward live in host memory, not on the device.

With non-reentrant checkpointing each decoder layer keeps only its inputs (the hidden states ``[B, S, H]``
that enter it) for the backward, which recomputes the layer from them. :func:`apply_activation_offload` wraps
every decoder block's ``forward`` (outside the checkpoint, and outside ``torch.compile``'s code when the block
is compiled) in :func:`torch.autograd.graph.saved_tensors_hooks` whose pack hook moves each tensor saved
there into an :class:`OffloadStore` and whose unpack hook brings it back. Only what is saved outside the
checkpoint's own hooks reaches them: the block's inputs; the recomputation runs in the backward, where these
hooks are not active, so it is untouched. The values come back bit for bit: the loss and every gradient are
those of the run without offload.

The store's copies (one :class:`Copier` per device type):

- CUDA (:class:`StreamCopier`): pinned host buffers from a pool (:class:`HostBufferPool`, reused by shape
  and dtype, so the steady state allocates nothing), device -> host copies on a side stream that waits for
  the compute stream at that point (``wait_stream``) and ``record_stream`` on the source so its memory is not
  reused before the copy ends; host -> device copies on the side stream into memory allocated on the compute
  stream, with one event per copy that the compute stream waits on before the tensor is used. When the
  backward unpacks layer ``i``'s input, the inputs of layer ``i - 1`` (the previous wrapped call) are
  prefetched, so their copy overlaps layer ``i``'s recomputation and backward. Nothing else synchronises the
  compute stream.
- CPU (:class:`HostCopier`): the same store, pool, order and prefetch with synchronous copies: the saved
  tensor is copied into a pool buffer (its own storage) and released; the backward gets a fresh copy. The
  original tensor is really freed (tests hold a weak reference to it), which is what lets CI prove the
  path exact.

What it removes from the device (the memory planner's term): every checkpointed layer input of the
micro-batch except those in flight, i.e. the current layer's (being recomputed) and the prefetched previous
layer's: ``(L - 2) * B * S_local * H * bytes`` instead of ``L * ...`` at the backward's start; the forward
holds one layer input at a time. Host memory: the pool holds one buffer per offloaded tensor of a micro-batch
(``L * B * S_local * H * bytes`` for the hidden states, pinned on CUDA), reused step after step;
:meth:`OffloadStore.stats` reports it (``host_bytes`` and ``peak_host_bytes``).
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

from automodel.models.parallelize import decoder_layers

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


class HostBufferPool:
    """Host buffers reused by ``(shape, dtype)``: :meth:`acquire` hands out a free one or allocates.

    ``pin``: page-locked memory (CUDA: the only kind a copy on a side stream overlaps with compute).
    ``host_bytes`` is what the pool holds (free and in use); ``peak_in_use_bytes`` the most handed out at once.
    """

    def __init__(self, pin: bool = False):
        self.pin = pin
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.host_bytes = 0
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    def acquire(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype`` (contents undefined)."""
        free = self._free.get((tuple(shape), dtype))
        if free:
            buf = free.pop()
        else:
            buf = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)
            self.host_bytes += buf.numel() * buf.element_size()
        self.in_use_bytes += buf.numel() * buf.element_size()
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse."""
        self.in_use_bytes -= buf.numel() * buf.element_size()
        self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def clear(self) -> None:
        """Drop the free buffers (the ones in use stay theirs)."""
        for bufs in self._free.values():
            for buf in bufs:
                self.host_bytes -= buf.numel() * buf.element_size()
        self._free.clear()


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
    kept: int = 0  # saved tensors left where they were (parameters, non-contiguous views, other devices)
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
        self.counts = ActivationOffloadStats()

    # ------------------------------------------------------------ the hooks
    @contextlib.contextmanager
    def layer_call(self) -> Iterator[None]:
        """Around one decoder block's forward: what it saves (outside the checkpoint) goes to the host."""
        if self._backward_started:  # a new forward after a backward (the next micro-batch)
            self._calls, self._backward_started = [], False
        group: list = []
        self._calls.append(group)
        previous, self._current = self._current, group
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._current = previous

    def pack(self, tensor: torch.Tensor) -> Any:
        """Save hook: ``tensor`` copied into a host buffer; returns the handle autograd keeps (or ``tensor``
        itself when it is not moved: a parameter, a non-contiguous tensor, a tensor on another device)."""
        local, spec = tensor, None
        if _is_dtensor(tensor):
            local = tensor._local_tensor
            spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
        if (
            isinstance(tensor, nn.Parameter)
            or type(local) is not torch.Tensor
            or not local.is_contiguous()
            or local.device.type != self.copier.device_type  # e.g. a host tensor of a CUDA model
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


_WRAPPED = "_automodel_activation_offload"


def apply_activation_offload(model: nn.Module, store: OffloadStore | None = None) -> OffloadStore:
    """Offload the inputs that activation checkpointing keeps, for every decoder block of ``model``. Mutates it.

    Call after activation checkpointing and after ``model.compile`` (the hooks must be outside the compiled
    code), before or after FSDP2 (its hooks run around ``forward``, outside these). Each block's ``forward``
    becomes ``forward`` run inside :meth:`OffloadStore.layer_call`; parameter names and classes are unchanged.

    Args:
        model: an HF causal LM with checkpointing enabled on its decoder blocks.
        store: the store to use; default one for the device of the model's first parameter.

    Returns:
        The store (its :meth:`~OffloadStore.stats` report what was offloaded).

    Raises:
        ValueError: a decoder block is not checkpointed (offload keeps only what checkpointing keeps), or the
            blocks are wrapped already.
    """
    layers = decoder_layers(model)
    plain = [type(layer).__name__ for layer in layers if not getattr(layer, "gradient_checkpointing", False)]
    if plain:
        raise ValueError(
            f"activation offload moves the layer inputs that activation checkpointing keeps, but {len(plain)} "
            f"decoder block(s) ({plain[0]}) are not checkpointed; enable checkpointing first "
            f"(model.activation_checkpointing=true)"
        )
    if any(getattr(layer, _WRAPPED, False) for layer in layers):
        raise ValueError("activation offload is applied to this model already")
    if store is None:
        store = OffloadStore(make_copier(next(model.parameters()).device))
    for layer in layers:
        inner = layer.forward  # the class's checkpointing forward, or its compiled version (model.compile)

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            with store.layer_call():
                return _inner(*args, **kwargs)

        layer.forward = functools.wraps(inner)(forward)
        setattr(layer, _WRAPPED, True)
    return store
