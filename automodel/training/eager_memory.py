"""The memory planner's view of a model's eager attention: the bytes per ``[heads, S_q, S_k]`` score it keeps and
holds at its peaks, measured on the model's own eager function.

Eager attention (``model.attn_implementation=eager``) materialises its scores: what it keeps per score for the
backward and what is in flight at its forward's and its backward's peaks grow with ``S^2`` and set the step's peak
at any length worth planning. The planner's count for transformers' common eager function (the fp32 softmax's
output, its cast in bf16, two fp32 scores in flight: :func:`automodel.training.memory_plan._eager_score_bytes`)
does not hold for a model whose eager function does more: Granite-SWA's attention sinks go through a log-sum-exp of
the masked scores, which keeps those scores for its backward and makes three more score-sized temporaries there
(planned 35% under its measured step peak at 2048 tokens: ``scripts/bench_plan_families.py``).

So the figures are measured, as :mod:`.norm_memory` measures the norms: :func:`eager_scores` runs the module's own
``eager_attention_forward`` (the function transformers' attention modules fall back to when
``config._attn_implementation`` is ``eager``), forward and backward, on the CPU, for its head count and head size
at 32 and 64 tokens, in fp32 and in bf16, with a causal additive mask (made outside the count, as the planner counts
the masks apart), and counts the storages ops create (a device allocator's view). The ``S^2`` part is what doubling
the length adds beyond doubling: the ``[B, S, heads, d]`` tensors (q, k, v, the output, their gradients) drop out.
Eager attention is plain aten ops (matmul, softmax, log-sum-exp), which allocate the same on a CUDA device. A few
milliseconds per attention class, cached.

A module whose file has no ``eager_attention_forward``, or whose function cannot run on the probe (it reads a weight
it would have to compute with, a CUDA-only op), is not measured: the planner keeps its formula. The probe hands the
function q, k and v in the compute dtype and, of the keyword tensors, per-token sinks only (Inkling 2's ``sinks``,
``[B, heads, S, 1]``, made by its ``sink_proj``); the module's own small tensors in the compute dtype, but those a
lower-precision model pins to fp32 (DeepSeek-V4's ``sinks``, which promote its scores to fp32); a module that may
cast q and k up first (fp32 norms) is read by the planner (``memory_plan._attention_in_fp32``: the larger of the
fp32 and bf16 figures in bf16); a bias passed by keyword
(Inkling's ``position_bias``) is measured without it and planned apart
(:func:`automodel.training.layer_kind_memory.position_bias_bytes`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

import torch

# the probe cache's key; the live-bytes count of a forward and its backward
from automodel.training.mlp_memory import _state_key, live_moments

__all__ = ["EagerScores", "eager_function", "eager_scores", "pins_fp32"]

#: the probe's two lengths (the second twice the first: the ``S^2`` part is ``m(2S) - 2 m(S)``)
_LENGTHS = (32, 64)
#: a module's tensors the probe copies to the CPU (attention sinks: one per head); a larger one ends the probe
_SMALL = 1 << 16


@dataclass(frozen=True)
class EagerScores:
    """Bytes per ``[heads, S_q, S_k]`` score (one element) of one eager attention call, in one compute dtype.

    ``saved``: what is still alive once the forward has returned (what its backward reads; the returned weights
    aside where the backward does not keep them); ``forward``: the most alive at once during the forward;
    ``backward``: the most alive at once during the backward, the saved scores still held included. transformers'
    common function: ``(4, 8, 12)`` in fp32 (the fp32 softmax's output; at the softmax the masked scores beside it,
    the raw ones freed by the mask's add; the probabilities' gradient and the softmax's backward beside it),
    ``(6, 10, 12)`` in bf16 (the probabilities' bf16 cast kept too)."""

    saved: float
    forward: float
    backward: float


def eager_function(attention: torch.nn.Module) -> Any | None:  # noqa: ANN401 - a callable
    """The eager attention function of ``attention``'s modeling file (``eager_attention_forward``), or ``None``."""
    fn = getattr(sys.modules.get(type(attention).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else None


class _Probe:
    """``attention`` as its eager function reads it: the same attributes, its small tensors (sinks) as CPU copies in
    the probe's dtype, ``training`` on (dropout at p 0 makes no copy)."""

    def __init__(self, attention: torch.nn.Module, dtype: torch.dtype) -> None:
        self._attention = attention
        self._dtype = dtype
        self._pinned = pins_fp32(attention)
        self.training = True

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        value = getattr(self._attention, name)
        if isinstance(value, torch.Tensor):
            if value.numel() > _SMALL:
                raise RuntimeError(f"the eager function reads {name} {tuple(value.shape)}")
            # values from a fixed ramp (meta tensors have none; the caller's generator stays untouched)
            ramp = torch.linspace(-1.0, 1.0, value.numel(), device="cpu").reshape(value.shape)
            if not value.is_floating_point():
                return ramp.to(value.dtype)
            # a tensor the model pins to fp32 in a lower-precision model (DeepSeek-V4's sinks) stays fp32: the scores
            # it joins are promoted to fp32
            return ramp.to(torch.float32 if self._pinned and value.dtype == torch.float32 else self._dtype)
        return value


def pins_fp32(module: torch.nn.Module) -> bool:
    """Whether an fp32 tensor of ``module`` is one its model pins to fp32 (``_keep_in_fp32_modules_strict``): its
    largest parameter is of another dtype (a model built in bf16 / fp16)."""
    params = list(module.parameters())
    return bool(params) and max(params, key=lambda p: p.numel()).dtype != torch.float32


def _heads(attention: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(query heads, key/value heads, query/key head size, value head size)`` of ``attention`` from its attributes
    and config (MLA's ``qk_head_dim`` and ``v_head_dim`` where it has no ``head_dim``)."""
    config = getattr(attention, "config", None)
    heads = getattr(attention, "num_heads", None) or getattr(config, "num_attention_heads", None)
    groups = getattr(attention, "num_key_value_groups", None) or 1
    qk = getattr(attention, "head_dim", None) or getattr(attention, "qk_head_dim", None)
    v = getattr(attention, "v_head_dim", None) or qk
    if not all(isinstance(x, int) for x in (heads, qk, v)) or heads % groups:
        raise RuntimeError("the attention's heads or head sizes are not read")
    return heads, heads // groups, qk, v


def _one_call(fn: Any, attention: torch.nn.Module, dtype: torch.dtype, s: int) -> tuple[int, int, int]:  # noqa: ANN401
    """``(saved, forward peak, backward peak)`` bytes of one eager call at ``s`` tokens (the inputs, the mask and the
    output's incoming gradient made outside the count)."""
    heads, kv_heads, qk_dim, v_dim = _heads(attention)
    probe = _Probe(attention, dtype)

    def ramp(n: int, width: int, flip: int) -> torch.Tensor:  # no random draw: the caller's generator stays
        steps = torch.linspace(-1.0, 1.0, s * width, device="cpu").reshape(1, 1, s, width).flip(flip) * 0.5
        return steps.expand(1, n, s, width).to(dtype).contiguous().requires_grad_()

    q, k, v = ramp(heads, qk_dim, 0), ramp(kv_heads, qk_dim, -1), ramp(kv_heads, v_dim, -2)
    mask = torch.full((s, s), torch.finfo(dtype).min, dtype=dtype, device="cpu").triu(1)[None, None]
    kwargs: dict[str, Any] = {"dropout": 0.0, "scaling": getattr(attention, "scaling", qk_dim**-0.5)}
    params = inspect.signature(fn).parameters
    if "softcap" in params:  # Gemma 2's module passes its attn_logit_softcapping
        kwargs["softcap"] = getattr(attention, "attn_logit_softcapping", None)
    if "sinks" in params and isinstance(getattr(attention, "sink_proj", None), torch.nn.Module):
        kwargs["sinks"] = ramp(heads, 1, 0)  # Inkling 2's per-token sinks: [B, heads, S, 1], an extra logit per query
    # the returned weights dropped: what the backward keeps stays alive through the graph
    return live_moments(lambda: fn(probe, q, k, v, mask, **kwargs)[0])


def _measure(fn: Any, attention: torch.nn.Module, dtype: torch.dtype) -> EagerScores:  # noqa: ANN401
    heads = _heads(attention)[0]
    s = _LENGTHS[0]
    small, large = (_one_call(fn, attention, dtype, n) for n in _LENGTHS)
    per_score = [max(b - 2 * a, 0) / (2 * heads * s * s) for a, b in zip(small, large, strict=True)]
    saved, forward, backward = (round(x * 4) / 4 for x in per_score)  # quarter bytes: the fits are exact
    return EagerScores(saved, max(forward, saved), max(backward, saved))


def eager_scores(attention: torch.nn.Module) -> tuple[EagerScores, EagerScores] | None:
    """``(fp32, bf16)`` :class:`EagerScores` of ``attention``'s own eager function (measured on the CPU, cached per
    class and scalar settings), or ``None`` where it has none or the probe cannot run it."""
    fn = eager_function(attention)
    if fn is None:
        return None
    key = (type(attention), _state_key(attention), pins_fp32(attention))
    if key not in _CACHE:
        try:
            with torch.device("cpu"), torch.enable_grad():  # whatever the caller's context (a meta-device model_dims)
                _CACHE[key] = (_measure(fn, attention, torch.float32), _measure(fn, attention, torch.bfloat16))
        except Exception:  # noqa: BLE001 - a function the probe cannot run: the planner's formula stays
            _CACHE[key] = None
    return _CACHE[key]


_CACHE: dict[tuple, Any] = {}
