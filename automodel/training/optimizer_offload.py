"""Optimizer offload (``fsdp.offload: optimizer``): the optimizer state lives on the host and the step runs there.

:class:`HostOffloadOptimizer` wraps the configured optimizer (``optimizer._target_``, e.g. AdamW), built on
host copies of the trainable parameters (each rank's FSDP2 shard: a ``DTensor`` with the same mesh and
placements whose local tensor is on the host, so an optimizer that reduces across a parameter sees the same
layout as without offload). One :meth:`~HostOffloadOptimizer.step`:

1. the gradients (after clipping) are copied device -> host into reused host buffers (pinned on CUDA) and
   the host waits for that copy (one event: the host is about to read them);
2. the wrapped optimizer steps on the host copies (same dtype as the parameters: the same arithmetic as on
   the device; on CPU runs it is the very same code, so CI proves it exact);
3. the updated values are copied host -> device into the parameters (asynchronous on CUDA; the next step's
   wait orders the host's next write after it).

The parameters and gradients stay on the device; what leaves it is the optimizer state (AdamW: ``exp_avg``,
``exp_avg_sq`` in the parameter dtype, and a scalar ``step``). There is no separate fp32 master in this
project (``model.dtype`` is the master dtype), so none moves. Host memory: a copy of the parameters, a
gradient buffer of the same size, and the state (:meth:`HostOffloadOptimizer.host_bytes`).

Checkpoints: :meth:`~HostOffloadOptimizer.model_view` is an optimizer over the model's own parameters whose
state is the host state (the same tensors, no copy), so ``torch.distributed.checkpoint.state_dict`` names it
by parameter exactly as without offload; a checkpoint written with offload resumes without it and the other
way round (:mod:`automodel.training.checkpoint`).

``fsdp.offload: all`` is FSDP2's own ``CPUOffloadPolicy`` (:func:`automodel.models.parallelize.apply_fsdp2`):
parameters, gradients and optimizer state on the host, the step on the host; nothing here is used then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["HostOffloadOptimizer"]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``template``'s kind (a ``DTensor`` with its mesh and placements, or plain)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(
        local, template.device_mesh, template.placements, run_check=False, shape=template.shape,
        stride=template.stride(),
    )  # fmt: skip


class _StateView(torch.optim.Optimizer):
    """An optimizer over the model's parameters holding another optimizer's state (for state dicts only)."""

    def step(self, closure: Any = None) -> None:  # pragma: no cover - never stepped
        raise RuntimeError("a state view of an offloaded optimizer is not stepped")


class HostOffloadOptimizer(torch.optim.Optimizer):
    """The optimizer built by ``build(host_params)``, stepping on host copies of ``params``.

    Its ``param_groups`` and ``state`` are the wrapped optimizer's (an LR scheduler sets ``lr`` there).

    Args:
        params: the model's trainable parameters (plain or FSDP2 ``DTensor``), on any device.
        build: makes the optimizer from the host copies, e.g. ``lambda p: torch.optim.AdamW(p, lr=1e-3)``.
        pin: page-locked host memory (default: when a parameter is on CUDA).
    """

    def __init__(self, params: Iterable[nn.Parameter], build: Callable[[list[torch.Tensor]], Any],
                 pin: bool | None = None):  # fmt: skip
        self.model_params = list(params)
        if not self.model_params:
            raise ValueError("optimizer offload got no parameters")
        self.on_cuda = any(_local(p).device.type == "cuda" for p in self.model_params)
        self.pin = self.on_cuda if pin is None else pin
        with torch.no_grad():
            self.masters = [self._host_copy(p) for p in self.model_params]
        self._grad_bufs: list[torch.Tensor | None] = [None] * len(self.masters)
        self.inner = build(self.masters)
        super().__init__(self.masters, dict(self.inner.defaults))
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self.defaults = self.inner.defaults

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        local = _local(p.detach())
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=self.pin)
        host.copy_(local)
        return _like(host, p.detach())

    # ------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Gradients to the host, the wrapped optimizer's step there, the new values back to the parameters."""
        if closure is not None:
            raise ValueError("optimizer offload takes no closure")
        for i, (p, m) in enumerate(zip(self.model_params, self.masters)):
            if p.grad is None:
                m.grad = None
                continue
            g = _local(p.grad)
            buf = self._grad_bufs[i]
            if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
                buf = self._grad_bufs[i] = torch.empty(
                    g.shape, dtype=g.dtype, device="cpu", pin_memory=self.pin
                )
            buf.copy_(g, non_blocking=self.on_cuda)
            m.grad = _like(buf, m)
        if self.on_cuda:  # the host reads the gradients next: wait for their copies (and nothing later)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        self.inner.step()
        for p, m in zip(self.model_params, self.masters):
            _local(p.detach()).copy_(_local(m), non_blocking=self.on_cuda)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the host copies' (their host buffers are kept for the next step)."""
        for p, m in zip(self.model_params, self.masters):
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            m.grad = None

    # ------------------------------------------------------------ state dicts and resume
    @torch.no_grad()
    def ensure_state(self) -> None:
        """Create the wrapped optimizer's state if no step made it yet (an lr=0 step on zero gradients, as
        ``torch.distributed.checkpoint.state_dict`` does for an optimizer without state)."""
        if self.inner.state:
            return
        for m in self.masters:
            m.grad = torch.zeros_like(m)
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = 0.0
        self.inner.step()
        for g, lr in zip(self.param_groups, lrs):
            g["lr"] = lr
        for m in self.masters:
            m.grad = None

    def model_view(self) -> torch.optim.Optimizer:
        """An optimizer over the model's own parameters whose ``state`` holds this one's host state tensors
        (the same objects: loading into them in place loads this optimizer). For state dicts only."""
        self.ensure_state()
        to_model = {id(m): p for m, p in zip(self.masters, self.model_params)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [to_model[id(m)] for m in g["params"]]}
                  for g in self.param_groups]  # fmt: skip
        view = _StateView(groups, dict(self.defaults))
        for m, p in zip(self.masters, self.model_params):
            if m in self.inner.state:
                view.state[p] = self.inner.state[m]
        return view

    def load_param_groups(self, groups: list[dict]) -> None:
        """Take the hyperparameters of a loaded state dict's ``param_groups`` (all but ``params``)."""
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(groups)} parameter groups, this one {len(self.param_groups)}"
            )
        for mine, loaded in zip(self.param_groups, groups):
            mine.update({k: v for k, v in loaded.items() if k not in ("params", "param_names")})

    @torch.no_grad()
    def sync_from_model(self) -> None:
        """Copy the model's parameters into the host copies (after the model's weights were loaded)."""
        for p, m in zip(self.model_params, self.masters):
            _local(m).copy_(_local(p.detach()))

    def host_bytes(self) -> int:
        """Host bytes held: the parameter copies, the gradient buffers and the optimizer state tensors."""
        total = sum(_local(m).numel() * _local(m).element_size() for m in self.masters)
        total += sum(b.numel() * b.element_size() for b in self._grad_bufs if b is not None)
        for state in self.inner.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    total += _local(v).numel() * _local(v).element_size()
        return total
