"""Live tensor bytes on CPU, counted as a device allocator would: shared by the memory benchmarks.

:class:`AllocationTracker` counts the storages that ops create while it is active (``current``, ``peak``).
On a CPU the "device" and the host are one memory, so RSS cannot show what an offload moved; these counts can
(``scripts/bench_memory.py``'s tracked rows, ``scripts/bench_plan_cases.py``). :func:`fsdp2_storage_resizes`
adds what FSDP2 allocates without an op: it keeps each unsharded parameter's storage between steps and
resizes it (``UntypedStorage.resize_``, invisible to a dispatch mode) when it gathers and frees the parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["AllocationTracker", "PeakSnapshots", "fsdp2_storage_resizes", "tracked_inside"]


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory under ``t``: ``t`` itself, or a wrapper subclass's inner tensors (a DTensor's
    local shard), recursively."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [x for t in inner if isinstance(t, torch.Tensor) for x in _plain(t)]
    return [t]


class AllocationTracker(TorchDispatchMode):
    """Device-allocator bookkeeping on CPU: the bytes of the live storages that ops create while active
    (``current``, ``peak``); an output sharing an input's storage (a view, an in-place op) is not new memory.
    A wrapper subclass (an FSDP2 ``DTensor``) is counted by its inner tensors (its local shard).
    Inside :meth:`host` nothing is counted: what the offload code allocates on the host (the host optimizer's
    step) is not device memory. :meth:`resized` adds a storage's change of size made without an op."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.paused = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        leaves = torch.utils._pytree.tree_leaves
        inputs = {
            id(p.untyped_storage())
            for t in leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
            for p in _plain(t)
        }
        for t in leaves(out):
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    storage = p.untyped_storage()
                    key = id(storage)
                    if key not in self.live and key not in inputs:  # new memory
                        self.live[key] = storage.nbytes()
                        self._add(storage.nbytes())
                        weakref.finalize(storage, self._free, key)
        return out

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage`` went from ``before`` bytes to its size now without an op (``resize_``): count the change."""
        if self.paused:
            return
        change = storage.nbytes() - before
        key = id(storage)
        if key in self.live:  # created while tracked: its finalizer frees its new size
            self.live[key] += change
        self._add(change)

    @contextlib.contextmanager
    def host(self):  # noqa: ANN201
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


class PeakSnapshots(AllocationTracker):
    """An :class:`AllocationTracker` that also records, at every new peak, which storages are live and where each
    was made (the op, its output shapes and, for storages of 64 KiB or more, the last frames of the Python stack
    in automodel, transformers or torch.distributed): what a plan's term is checked against. Slow (a stack walk
    per large allocation): a diagnostic, not a benchmark. :meth:`report` prints the last peak's storages grouped
    by where they were made; reset ``peak`` (to ``current``) and ``snapshot`` (to ``None``) to start a phase."""

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[int, str] = {}
        self.unowned = 0  # resizes of storages made before tracking began (FSDP2's unsharded parameters)
        self.snapshot: tuple[int, dict[int, int], dict[int, str], int] | None = None

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.snapshot = (self.current, dict(self.live), dict(self.where), self.unowned)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        import traceback

        before = set(self.live)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        new = set(self.live) - before
        if new:
            frames = ""
            if any(self.live[k] >= 64 * 1024 for k in new):
                keep = ("automodel", "transformers", "torch/distributed", "torch/utils/checkpoint")
                stack = [f for f in traceback.extract_stack()[:-2] if any(k in f.filename for k in keep)]
                frames = " <- " + " | ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}:{f.name}" for f in stack[-4:])
            shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            for k in new:
                self.where[k] = f"{func} {shapes[:2]}{frames}"
        return out

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        if not self.paused and id(storage) not in self.live:
            self.unowned += storage.nbytes() - before
        super().resized(storage, before)

    def report(self, title: str, min_bytes: int = 32 * 1024) -> str:
        """The last recorded peak's live storages, grouped by where they were made, largest first (MiB)."""
        if self.snapshot is None:
            return f"{title}: no peak recorded"
        total, live, where, unowned = self.snapshot
        groups: dict[str, int] = {}
        for key, nbytes in live.items():
            label = where.get(key, "(the allocation that made this peak)")
            groups[label] = groups.get(label, 0) + nbytes
        lines = [f"{title}: {total / 2**20:.2f} MiB, of which FSDP2's resized parameter storages {unowned / 2**20:.2f}"]
        lines += [f"  {b / 2**20:7.2f}  {w}" for w, b in sorted(groups.items(), key=lambda kv: -kv[1]) if b >= min_bytes]
        small = sum(b for b in groups.values() if b < min_bytes)
        lines.append(f"  {small / 2**20:7.2f}  (groups under {min_bytes // 1024} KiB)")
        return "\n".join(lines)


@contextlib.contextmanager
def fsdp2_storage_resizes(tracker: AllocationTracker) -> Iterator[None]:
    """While active, FSDP2's storage resizes (``alloc_storage`` / ``free_storage`` of
    ``torch.distributed.fsdp._fully_shard``: gathering and freeing the unsharded parameters) are counted by
    ``tracker`` (:meth:`AllocationTracker.resized`). Patches the two functions in the modules that call them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def counted(fn):  # noqa: ANN001, ANN202
        def wrapper(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            before = storage.nbytes()
            fn(tensor)
            tracker.resized(storage, before)

        return wrapper

    patched = [(_fsdp_param, "alloc_storage", counted(alloc)), (_fsdp_param, "free_storage", counted(free)),
               (_fsdp_param_group, "alloc_storage", counted(alloc))]  # fmt: skip
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    try:
        for mod, name, fn in patched:
            setattr(mod, name, fn)
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def tracked_inside(tracker: AllocationTracker, module: object, name: str) -> Iterator[None]:
    """While active, ``module.name`` (a function) runs with ``tracker`` pushed again, so what it allocates is counted
    where a tensor subclass's handler calls it: a dispatch mode is off while a subclass (DTensor) handles an op, so
    without this only the handler's outputs are seen. For torch's ring attention on CPU
    (``automodel.distributed.cp.ring.cpu_ring._run_ring``, called by DTensor's handler of the SDPA op): its K/V
    rotation buffers, fp32 accumulators and the kernel's per-step gradients exist only in there."""
    original = getattr(module, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if tracker in _mode_stack():  # already counting (not called from inside a subclass's handler)
            return original(*args, **kwargs)
        with tracker:
            return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, original)


def _mode_stack() -> list:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return _get_current_dispatch_mode_stack()
