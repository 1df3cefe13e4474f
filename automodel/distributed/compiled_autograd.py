"""Compiled autograd for the train context, with the compile settings that are exact on torch 2.13.

:func:`compiled_autograd` is what :func:`automodel.distributed.cp_utils.get_train_context` enters
when ``enable_compiled_autograd`` is set: every ``loss.backward()`` inside it is captured by
``torch._dynamo.compiled_autograd`` into one FX graph of the whole backward and compiled with
``torch.compile``. Measured on torch 2.13 (CPU, tiny Llama), the choices below are what works:

- ``fullgraph=False``: ring attention's backward dispatches DTensor ops
  (``torch._C._DTensor_compute_global_tensor_info``) and Ulysses' backward runs c10d
  all-to-all; dynamo cannot trace either, so the backward graph is split there (graph breaks)
  and those pieces run eagerly.
- ``dynamic=False`` (both for the captured graph and for ``torch.compile``): with dynamic shapes
  inductor was reported (issue 13, not re-measured) to fail lowering the captured backward of an HF
  Llama (``LoweringException``); static shapes match the eager backward to fp32 round-off.
- With CP the trainer makes the attention one node whose backward runs eagerly
  (:func:`eager_backward`, via :func:`automodel.models.compile.attention_backward_eager`): traced
  into the compiled backward, the ring's DTensor dispatch gave garbage gradients.
- Shapes: the recipe pads every batch to one length, so the backward is compiled once.
- FSDP2's hooks are all ``torch._dynamo.disable``-d on torch 2.13; under compiled autograd its
  post-backward reduce-scatter does not run, and gradients come back unsharded and unreduced. So
  compiled autograd is only allowed with replicated data parallelism
  (:mod:`automodel.distributed.replicate`), which reduces gradients after the backward instead;
  the recipe rejects it with FSDP2 (``automodel.config.rules``).

The backend is ``"inductor"`` (the system C++ compiler on CPU, triton on CUDA), ``"aot_eager"``
(AOT autograd without code generation: cheap, exact, for tests) or ``"eager"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from automodel.distributed.torch_internals import (
    compiled_autograd_disable,
    compiled_autograd_enable,
    dynamo_counters,
)

__all__ = ["COMPILE_BACKENDS", "compiled_autograd", "compiled_autograd_compiles", "check_compile_backend"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

_COUNTER = "automodel_compiled_autograd"


def check_compile_backend(backend: str) -> None:
    """``ValueError`` unless ``backend`` is one of :data:`COMPILE_BACKENDS`."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(
            f"compile backend {backend!r} is not one of {COMPILE_BACKENDS}; use inductor (generated code), "
            f"aot_eager (no code generation, fast to compile) or eager"
        )


def compiled_autograd_compiles() -> int:
    """How many backward graphs compiled autograd has compiled in this process (recompiles included)."""
    return int(dynamo_counters()[_COUNTER]["compiles"])


@contextlib.contextmanager
def compiled_autograd(backend: str = "inductor") -> Iterator[None]:
    """Run every ``.backward()`` inside the block through compiled autograd, compiled with ``backend``.

    Args:
        backend: one of :data:`COMPILE_BACKENDS`.

    Raises:
        ValueError: unknown backend.
    """
    check_compile_backend(backend)
    counters = dynamo_counters()

    def compiler_fn(gm: torch.fx.GraphModule) -> Any:
        counters[_COUNTER]["compiles"] += 1
        return torch.compile(gm, backend=backend, fullgraph=False, dynamic=False)

    with compiled_autograd_enable(compiler_fn, dynamic=False):
        yield


class _EagerBackward(torch.autograd.Function):
    """``fn(*args)`` as one autograd node whose backward runs eagerly, outside compiled autograd.

    The forward records ``fn``'s own autograd graph on detached copies of the inputs; the backward
    replays it with ``torch.autograd.grad`` with compiled autograd switched off and dynamo
    disabled. Compiled autograd sees one opaque node (a deliberate graph break), so the CP
    collectives inside ``fn``'s backward (ring attention's DTensor dispatch and k/v rotation) run
    exactly as in an eager backward.
    """

    @staticmethod
    def forward(ctx: Any, fn: Any, n_tensors: int, *args: Any) -> torch.Tensor:  # type: ignore[override]
        tensors = list(args[:n_tensors])
        rest = args[n_tensors:]
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        with torch.enable_grad():
            out = fn(*leaves, *rest)
        ctx.leaves, ctx.out, ctx.n_tensors, ctx.n_rest = leaves, out, n_tensors, len(rest)
        return out.detach()

    @staticmethod
    @torch._dynamo.disable(reason="automodel: the CP attention backward runs eagerly")
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        wanted = [t for t in ctx.leaves if t.requires_grad]
        with compiled_autograd_disable():
            grads = torch.autograd.grad(ctx.out, wanted, grad_out, allow_unused=True)
        it = iter(grads)
        per_input = [next(it) if t.requires_grad else None for t in ctx.leaves]
        ctx.leaves = ctx.out = None  # free the inner graph
        return (None, None, *per_input, *([None] * ctx.n_rest))


def eager_backward(fn: Any, tensors: tuple[torch.Tensor, ...], *rest: Any) -> torch.Tensor:
    """``fn(*tensors, *rest)`` (one output tensor) with its backward run eagerly under compiled autograd."""
    return _EagerBackward.apply(fn, len(tensors), *tensors, *rest)
