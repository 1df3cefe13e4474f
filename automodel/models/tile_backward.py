"""The backward of a module run over token tiles: each tile recomputed, its gradients written into the whole
inputs' gradients and summed into the trainable parameters' (shared by :mod:`automodel.models.tiled_mlp` and
:mod:`automodel.models.tiled_layer`, whose autograd functions differ only in how a tile is cut and run)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["tile_gradients"]


def tile_gradients(
    bounds: Sequence[tuple[int, int]],
    xs: list[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    needs_x: list[bool],
    params: list[torch.Tensor],
    wanted: list[int],
    cut_input: Callable[[torch.Tensor, int, int, int], torch.Tensor],
    cut_output: Callable[[torch.Tensor, int, int, int], torch.Tensor],
    run: Callable[[int, list[torch.Tensor]], Sequence[torch.Tensor]],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Recompute ``run`` tile by tile and return ``(grad_xs, sums)``.

    Args:
        bounds: the tiles' ``[a, b)`` token ranges.
        xs: the module's whole token inputs (saved by the forward).
        grads: the gradients of the module's whole outputs (``None`` for an output without one).
        needs_x: which of ``xs`` want a gradient.
        params: the trainable parameters the forward saw; ``wanted``: the indices of those that want one.
        cut_input: ``(tensor, input index k, a, b)`` -> the tile of input ``k`` (a view; also used to write the
            tile of ``k``'s gradient).
        cut_output: ``(gradient, output index j, a, b)`` -> the tile of output ``j``'s gradient.
        run: ``(a, tile leaves)`` -> the module's outputs for the tile, recomputed with grad enabled by the caller.

    Returns:
        ``grad_xs``: a whole gradient per input (zeros where no tile gave one; ``None`` where ``needs_x`` is False);
        ``sums``: per parameter, the sum of its tiles' gradients (owned copies; ``None`` where none came), in the
        parameter's dtype. A half-precision parameter's sum over several tiles is accumulated in fp32 and rounded
        once, as the untiled matrix product rounds its one reduction: summed in bf16, 128 tiles put the weight
        gradients twice as far from the fp64 ones as the untiled bf16 run's (1.6e-2 against 8.4e-3 relative; a
        Llama of hidden 128 at 8,192 tokens).
    """
    grad_xs = [torch.zeros_like(x) if need else None for x, need in zip(xs, needs_x, strict=True)]
    sums: list[torch.Tensor | None] = [None] * len(params)
    widen = len(bounds) > 1  # one tile: its gradient is the sum, rounded once
    for a, b in bounds:
        leaves = [
            cut_input(x, k, a, b).detach().requires_grad_(need)
            for k, (x, need) in enumerate(zip(xs, needs_x, strict=True))
        ]
        outs = run(a, leaves)
        pairs = [
            (out, cut_output(grad, j, a, b))
            for j, (out, grad) in enumerate(zip(outs, grads, strict=True))
            if grad is not None and out.requires_grad
        ]
        if not pairs:
            continue
        inputs = [leaf for leaf, need in zip(leaves, needs_x, strict=True) if need]
        inputs += [params[i] for i in wanted]
        got = list(torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True))
        for k, grad_x in enumerate(grad_xs):
            if grad_x is not None:
                g = got.pop(0)
                if g is not None:
                    cut_input(grad_x, k, a, b).copy_(g)
        for i, g in zip(wanted, got, strict=True):
            if g is None:
                continue
            if sums[i] is None:  # owned (g may alias an output gradient); fp32 for a half-precision one
                sums[i] = g.float() if widen and g.dtype in _HALF else g.clone()
            else:
                sums[i].add_(g)
        del outs, pairs, got
    sums = [s if s is None or s.dtype == params[i].dtype else s.to(params[i].dtype) for i, s in enumerate(sums)]
    return grad_xs, sums


_HALF = (torch.bfloat16, torch.float16)


def check_same_parameters(key: str, owner: object, current: Sequence[torch.Tensor], saved: Sequence[torch.Tensor]) -> None:
    """The trainable parameters a tiled function's backward finds (``current``) are the ones its forward ran with
    (``saved``: the same tensors, in order); else its per-tile gradients cannot be recomputed.

    Raises:
        RuntimeError: they differ (``key``: the config key, ``owner``: the module whose parameters they are).
    """
    if len(current) != len(saved) or any(a is not b for a, b in zip(current, saved, strict=True)):
        raise RuntimeError(
            f"{key}: the trainable parameters of {type(owner).__name__} changed between the forward and the "
            f"backward; their gradients cannot be recomputed per tile"
        )
