"""Chunked linear cross-entropy: the LM head and the loss, a chunk of tokens at a time.

The plain loss materialises the ``[tokens, vocab]`` logits (and, in backward, their gradient): for a
128K vocabulary and 16K local tokens that is 8 GiB in fp32 each, a term context parallelism divides
only by ``cp_size``. :func:`chunked_linear_cross_entropy_sum` computes the same sum of per-token
cross-entropies from the final hidden states and the LM-head weight, ``chunk_tokens`` rows at a time:

* forward: each chunk's logits ``[N, V]`` are computed, reduced to their cross-entropy sum and
  freed; only the hidden states, the weight and the labels are saved;
* backward: each chunk's logits are recomputed, turned into ``softmax - onehot`` (scaled by the
  incoming gradient) and multiplied back into the gradients of the hidden states, the weight and the
  bias; a chunk without any label token is skipped in both passes.

A model whose logits are a transform of its head's output (a soft-cap, a scale:
:class:`~automodel.training.logit_transform.LogitTransform`) hands it over: each chunk's fp32 logits are transformed
in place before the cross-entropy, and the backward multiplies ``softmax - onehot`` by the transform's derivative
(``1 - tanh^2`` of the soft-cap, the scale) before the matmuls; the soft-cap's ``tanh`` is the one more ``[N, V]``
it keeps while the softmax is made (the softmax is made in place of the transformed logits).

Peak extra memory is ``O(chunk_tokens x vocab)`` whatever the number of local tokens; the price is
one more ``[N, H] x [H, V]`` matmul per chunk (the recomputation). The logits are computed in the
weight's dtype and upcast to fp32, like :func:`automodel.training.loss.token_cross_entropy_sum`, so
the two agree to round-off.

The weight is used as it is handed over: under FSDP2 the recipe reads the LM head's weight right
after the model's forward, while the root module's parameters are still unsharded (the root is
wrapped with ``reshard_after_forward=False``), so it is gathered once per micro-batch, not once per
chunk. Tied embeddings need nothing special: the gradient goes to the one shared parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel.training.logit_transform import IDENTITY, LogitTransform
from automodel.training.loss import IGNORE_INDEX, loss_dtype_logits

__all__ = ["chunked_linear_cross_entropy_sum"]


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return loss_dtype_logits(F.linear(h, weight, bias))


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens, transform):  # noqa: ANN001, ANN205
        total = torch.zeros((), dtype=loss_dtype_logits(hidden[:0]).dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            y = labels[start : start + chunk_tokens]
            if not bool((y != IGNORE_INDEX).any()):
                continue
            logits = _chunk_logits(hidden[start : start + chunk_tokens], weight, bias)
            if not transform.identity:  # in place: F.linear's output (or its upcast) is this chunk's own
                transform.apply_(logits)
            total += F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
            del logits  # free this chunk's logits before the next chunk's are computed
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk_tokens, ctx.transform = chunk_tokens, transform
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = loss_dtype_logits(weight[:0]).dtype  # fp32 accumulation (fp64 for fp64 weights)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        step, transform = ctx.chunk_tokens, ctx.transform
        for start in range(0, hidden.shape[0], step):
            y = labels[start : start + step]
            valid = y != IGNORE_INDEX
            if not bool(valid.any()):
                continue
            h = hidden[start : start + step]
            if transform.identity:
                g = torch.softmax(_chunk_logits(h, weight, bias), dim=-1)  # [N, V] fp32 (fp64)
                tanh = None
            else:  # the transformed logits made their softmax in place, the soft-cap's tanh kept beside them
                g = _chunk_logits(h, weight, bias)
                tanh = transform.apply_(g, keep_tanh=True)
                g = _softmax_(g)
            rows = valid.nonzero().squeeze(1)
            g[rows, y[rows]] -= 1.0
            g[~valid] = 0.0
            g *= grad_out
            if not transform.identity:
                g = transform.chain_(g, tanh)
                del tanh
            g_low = g.to(weight.dtype)
            if need_h:
                grad_h[start : start + step] = (g_low @ weight).to(hidden.dtype)
            if need_w:  # accumulated in place: no [V, H] temporary beyond a bf16 weight's product
                if g_low.dtype == grad_w.dtype:
                    grad_w.addmm_(g_low.t(), h)
                else:  # the product in the weight's dtype, added into the fp32 sum as it is read (no fp32 copy)
                    grad_w.add_(g_low.t() @ h)
            if need_b:
                grad_b += g.sum(0)
            del g, g_low  # at most one chunk's [N, V] softmax (and its cast) alive at a time
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """``softmax(logits, -1)`` in place of ``logits`` ``[N, V]`` (no second ``[N, V]``); returns them."""
    logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    return logits.div_(logits.sum(dim=-1, keepdim=True))


def chunked_linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = IDENTITY,
) -> torch.Tensor:
    """Sum of per-token cross-entropies of ``transform(F.linear(hidden, weight, bias))``, never materialising all
    logits.

    Args:
        hidden: ``[B, S, H]`` or ``[N, H]`` final hidden states (any float dtype), after the final norm.
        weight: ``[V, H]`` LM-head weight (same dtype as ``hidden``); bias: optional ``[V]``.
        labels: ``[B, S]`` or ``[N]`` int64, already shifted, ``-100`` = ignored.
        chunk_tokens: rows of logits computed at once (peak extra memory ``~ 2 * chunk_tokens * V * 4``
            bytes in backward).
        transform: the model's final transform of its head's output (:mod:`automodel.training.logit_transform`),
            applied to each chunk's fp32 logits; the identity by default.

    Returns:
        A 0-dim fp32 (fp64 for fp64 inputs) tensor equal to
        ``token_cross_entropy_sum(transform(F.linear(hidden, weight, bias)), labels)`` to round-off, differentiable w.r.t. ``hidden``, ``weight`` and ``bias``. Nothing is mutated.

    Raises:
        ValueError: ``chunk_tokens < 1``, or shapes that disagree.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive integer (e.g. loss.chunk_tokens=1024)")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V, H] with H={hidden.shape[-1]}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_y = labels.reshape(-1)
    return _ChunkedLinearCE.apply(flat_h, weight, bias, flat_y, chunk_tokens, transform)
