"""Bytes autograd keeps for a backward: the distinct storages of the tensors a forward saves, counted on the meta
device by the planner's probes (:mod:`automodel.training.mlp_memory`, :mod:`automodel.training.residual_memory`)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["saved_storage_bytes"]


def saved_storage_bytes(forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages that autograd still holds for the backward of ``forward()`` (run under
    saved-tensor hooks, with grad enabled), its output alive, less those of ``exclude`` (the parameters, the input).

    Only what the graph still holds counts: a saved tensor of a branch the output does not need is freed, as in a
    real step. A saved tensor and its node hold each other, so such a branch waits for the cycle collector (run
    before counting). Storages are told apart while alive (a freed storage's address may be the next one's)."""
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(weakref.ref(t))  # the graph holds t while the node that saved it lives
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    gc.collect()
    skip = {t.untyped_storage()._cdata for t in exclude}
    alive = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (r() for r in packed)
             if t is not None and t.untyped_storage()._cdata not in skip}  # fmt: skip
    del out
    return sum(alive.values())
