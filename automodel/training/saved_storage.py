"""Bytes autograd keeps for a backward: the distinct storages of the tensors a forward saves, counted on the meta
device by the planner's probes (:mod:`automodel.training.mlp_memory`, :mod:`automodel.training.residual_memory`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["probe_pair", "saved_storage_bytes"]


def saved_storage_bytes(forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages that autograd still holds for the backward of ``forward()`` (run under
    saved-tensor hooks, with grad enabled), its output alive, less those of ``exclude`` (the parameters, the input).

    Only what the graph still holds counts: a saved tensor of a branch the output does not need is freed, as in a
    real step. The hook saves a detached alias of each tensor (the same storage): returning the tensor itself would
    make a saved output and its node hold each other, a cycle the collector does not free, so such a branch would be
    counted. Storages are told apart while alive (a freed storage's address may be the next one's)."""
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alias = t.detach()  # no grad_fn: the node that saves it holds it, and nothing holds the node back
        packed.append(weakref.ref(alias))  # alive while the node that saved it lives
        return alias

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    skip = {t.untyped_storage()._cdata for t in exclude}
    alive = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (r() for r in packed)
             if t is not None and t.untyped_storage()._cdata not in skip}  # fmt: skip
    del out
    return sum(alive.values())


def probe_pair(cache: dict, key: tuple, probe: Callable[[torch.dtype], float]) -> tuple[float, float] | None:
    """``(probe(fp32), probe(bf16))``, kept in ``cache`` under ``key``; ``None`` (kept too) where the probe raises: a
    module that cannot be built or run on the meta device leaves the planner's own count."""
    if key not in cache:
        cache[key] = None
        try:
            cache[key] = tuple(probe(dtype) for dtype in (torch.float32, torch.bfloat16))
        except Exception:  # noqa: BLE001 - any failure of a probe: the planner's count stays
            pass
    return cache[key]
