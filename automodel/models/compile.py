"""``torch.compile`` of a Hugging Face causal LM one decoder block at a time (``model.compile: true``).

Each decoder block's forward is compiled (``torch.compile`` of the class's ``forward`` bound to the block,
as torchtitan compiles per block) and becomes the inner forward of the block's
:class:`~automodel.models.block_call.BlockCall`: inside activation checkpointing (the recomputation in the
backward runs the compiled code again) and inside activation offload's hooks, whatever order they are
applied in. The module objects, their classes and their parameter names are unchanged, so FSDP2,
checkpoints and the HF export see the same model. The forward hooks of FSDP2 run outside the compiled code.

Graph breaks at the CP collectives: the attention kernel of every CP method runs outside the
compiled graph (:func:`compile_decoder_blocks` wraps the attention implementation the model uses
with ``torch._dynamo.disable``), so dynamo never traces ring attention's DTensor dispatch,
Ulysses' all-to-alls or the THD kernel; the projections, RoPE, norms and MLP are compiled.

Shapes: ``dynamic=False``; the recipe pads every batch to one length
(:func:`automodel.training.compile_stats.pad_batch_to_length`) so each block compiles once for
training (and once more for validation, which runs without grad).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from automodel.distributed.compiled_autograd import check_compile_backend
from automodel.models.block_call import block_call, outermost_blocks

__all__ = ["compile_decoder_blocks", "attention_outside_graph", "attention_backward_eager"]

logger = logging.getLogger(__name__)

_MARK = "_automodel_outside_graph"


def attention_outside_graph(fn: Any) -> Any:
    """``fn`` wrapped with ``torch._dynamo.disable`` (a deliberate graph break); idempotent."""
    if getattr(fn, _MARK, False):
        return fn
    wrapped = torch._dynamo.disable(fn, reason="automodel: CP attention runs outside the compiled graph")
    setattr(wrapped, _MARK, True)
    return wrapped


def _break_at_attention(model: nn.Module) -> str:
    """Make the attention implementation of ``model``'s config run outside compiled code.

    transformers looks the kernel up by name in ``ALL_ATTENTION_FUNCTIONS`` on every forward
    (``eager`` is the module-level ``eager_attention_forward``). A registered kernel is replaced in
    that registry by its disabled version; for ``eager`` the name is re-registered to a disabled
    copy of each attention module's ``eager_attention_forward``. Returns the implementation name.
    """
    import sys

    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    config = getattr(model.config, "get_text_config", lambda: model.config)()
    name = config._attn_implementation
    if name in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS[name] = attention_outside_graph(ALL_ATTENTION_FUNCTIONS[name])
        return name
    for module in model.modules():  # eager: the modeling file's own function
        mod = sys.modules.get(type(module).__module__)
        fn = getattr(mod, "eager_attention_forward", None)
        if fn is not None and not getattr(fn, _MARK, False):
            mod.eager_attention_forward = attention_outside_graph(fn)
    return name


def compile_decoder_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every decoder block's ``forward`` in place (``dynamic=False``, graph breaks allowed).

    Call after the CP method has switched the model's attention (Ulysses); before or after FSDP2, activation
    checkpointing and activation offload (each block's :class:`~automodel.models.block_call.BlockCall` keeps the
    order: offload's hooks, the checkpoint, the compiled forward).

    Args:
        model: an HF causal LM (its blocks found by :func:`automodel.models.parallelize.decoder_layers`).
        backend: ``inductor`` | ``aot_eager`` | ``eager``.

    Returns:
        The number of blocks compiled.

    Raises:
        ValueError: unknown backend, no decoder blocks, or a block compiled already.
    """
    check_compile_backend(backend)
    attn = _break_at_attention(model)
    layers = outermost_blocks(model)
    for layer in layers:
        call = block_call(layer)
        if call.inner is not None:
            raise ValueError(f"{type(layer).__name__} is compiled already (model.compile applies once)")
        # the class's forward (transformers' checkpointing flag is off: it runs the block as is)
        forward = type(layer).forward.__get__(layer)
        compiled = torch.compile(forward, backend=backend, dynamic=False, fullgraph=False)
        call.inner = functools.wraps(forward)(compiled)
    logger.info(
        "model.compile: %d decoder blocks compiled (backend %s, static shapes); attention %r runs outside the graph",
        len(layers),
        backend,
        attn,
    )
    return len(layers)


@contextlib.contextmanager
def attention_backward_eager(model: nn.Module) -> Iterator[None]:
    """Inside the block, ``model``'s attention kernel is one node whose backward runs eagerly.

    For compiled autograd with CP: the attention implementation named by the model's config is
    replaced in transformers' ``ALL_ATTENTION_FUNCTIONS`` by a wrapper that runs it through
    :func:`automodel.distributed.compiled_autograd.eager_backward` (q/k/v in, attention output out),
    so the ring's DTensor dispatch and the CP collectives of its backward are a deliberate graph
    break of the compiled backward. Restored on exit.
    """
    from automodel.distributed.compiled_autograd import eager_backward
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    config = getattr(model.config, "get_text_config", lambda: model.config)()
    name = config._attn_implementation
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"compiled autograd with CP isolates the attention kernel by name, but {name!r} is not a registered "
            f"attention implementation; use model.attn_implementation=sdpa with cp_method ring or ulysses"
        )
    had_local = name in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(name)
    inner = ALL_ATTENTION_FUNCTIONS[name]

    def attention(module: nn.Module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN202
        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return inner(module, q, k, v, attention_mask, **kwargs)[0]

        return eager_backward(run, (query, key, value)), None

    ALL_ATTENTION_FUNCTIONS[name] = attention
    try:
        yield
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS[name]
