"""A GPipe schedule over micro-batches that drives forward and backward across a module DAG.

Every rank runs :func:`run_gpipe` with its own ``forward_step``; the
:class:`~automodel.distributed.pipeline.multimodule.MultiModulePipelineCommunicator` moves
activations and gradients between stages and modules. All forwards run first (micro-batches in
order), then all backwards in the same order, so every send meets its receive without cycles in
a DAG. ``torch.distributed.pipelining`` schedules assume one linear chain of stages sharing one
process group; a DAG of modules with their own layouts and bridges does not fit it, so this small
schedule drives the communicator directly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["run_gpipe"]


def run_gpipe(
    comm,
    forward_step: Callable[[int, dict[str, torch.Tensor]], torch.Tensor],
    num_microbatches: int,
    stage_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> list[torch.Tensor]:
    """Run ``num_microbatches`` forwards, then their backwards, on this rank's stage.

    Args:
        comm: the rank's ``MultiModulePipelineCommunicator`` (exactly one module on this rank).
        forward_step: ``forward_step(microbatch, inputs) -> tensor``. ``inputs`` is what
            ``comm.recv_forward()`` returned (``{}`` on a source stage), with ``requires_grad`` set on
            floating-point tensors; the result is this stage's output, or on a terminal stage the
            scalar loss of the micro-batch (scale it so the micro-batch losses sum to the objective).
        num_microbatches: >= 1.
        stage_context: a factory of the context every forward step and every backward runs in
            (e.g. a fresh ring-attention context per call for a cp > 1 module); ``None``: none.

    Returns:
        the detached micro-batch losses on a terminal stage, else ``[]``. Parameter ``.grad`` s
        accumulate (are mutated) over the micro-batches; zero them before the call.

    Raises:
        ValueError: ``num_microbatches < 1`` or this rank holds colocated modules (drive those
            with ``comm.communicate`` yourself).
    """
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if len(comm.modules) != 1:
        raise ValueError(
            f"run_gpipe drives one module per rank, but rank {comm.rank} holds {list(comm.modules)}; "
            "batch the colocated modules' sends and receives with comm.communicate(...)"
        )
    name, info = next(iter(comm.modules.items()))
    ctx = stage_context or contextlib.nullcontext
    stash, losses = [], []
    for mb in range(num_microbatches):
        inputs = comm.recv_forward(module_name=name)
        inputs = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
        with ctx():
            out = forward_step(mb, inputs)
        if info.is_terminal_stage:
            if out.numel() != 1:
                raise ValueError(f"the terminal stage's forward_step must return a scalar loss, got {tuple(out.shape)}")
            losses.append(out.detach())
        else:
            comm.send_forward({name: out.detach()})
        stash.append((inputs, out))
    for mb in range(num_microbatches):
        inputs, out = stash[mb]
        stash[mb] = None
        grad = None if info.is_terminal_stage else comm.recv_backward(module_name=name)[name]
        with ctx():
            torch.autograd.backward(out, grad)
        if inputs:
            comm.send_backward(
                {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in inputs.items() if v.is_floating_point()}
            )
    return losses
