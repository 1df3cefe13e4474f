"""Head-grouped attention without CP (``model.attention_head_chunks: G``, ``cp_size`` 1).

Headwise Ulysses (:mod:`automodel.distributed.cp.head_chunks`) runs a CP rank's attention one head group at a time;
without CP there is no Ulysses, and one attention call over all heads holds, in its backward, the kernel's buffers
for every head (cuDNN's fp32 dQ accumulator: 16 KiB per token for 32 heads of 128) and the full-row kernel output
and LSE it saved. Here the model's attention function (whatever ``model.attn_implementation`` runs: sdpa, eager,
flex, flash, or the document-aware attention a CP method runs on the one rank for packed rows) is called on ``G``
groups of whole KV heads with their query heads, one group after another:

- **forward** (no grad): group ``g`` takes query heads ``[g H/G, (g+1) H/G)`` and KV heads ``[g Hkv/G, (g+1) Hkv/G)``
  (whole KV groups: every query head finds its KV head), runs the attention function on them and writes its output
  into the ``[B, S, H, Dv]`` output; what the kernel saves for its backward is not kept. Saved: q, k, v (the layer
  keeps them anyway).
- **backward**: each group is recomputed with gradients on and back-propagated alone (the per-tile loop of the tiled
  MLP and the tiled layer, :func:`automodel.models.tile_backward.tile_gradients`, with head groups as the tiles): its
  dq, dk, dv are written into the whole gradients, its recomputed output, LSE and kernel buffers freed before the
  next group. This is what each group under a non-reentrant checkpoint does in
  :func:`~automodel.distributed.cp.head_chunks.run_head_groups`, without the step where that function's ``unbind``
  views take their gradients back: autograd's unbind backward stacks the groups' gradients once all have arrived,
  so the pieces and the stacked copy would both exist (at cp 1 the pieces are full-row dq, dk, dv; under Ulysses
  they are the rank's local share, which is why it is cheap there).

Exact: each head's attention is the same computation on the same values; a KV head's gradient sums over its query
heads, all in its group. The cost: one more attention forward per layer in the backward (with activation
checkpointing, the layer's recomputed forward runs the groups' forwards too).

Refused (with the reason): attention dropout in training (each group would draw other masks), per-head sinks
(``s_aux``), masks with a head dimension (ALiBi folded into the mask), a count that does not divide the KV heads.
The function is a ``torch._dynamo.disable`` region: under ``model.compile`` the attention runs eagerly.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from automodel.config.attention_head_chunks_rules import (
    ATTENTION_HEAD_CHUNKS_KEY,
    attention_head_chunks_problem,
)
from automodel.distributed.cp.head_chunks import HeadGroupCounts
from automodel.errors import UserInputError
from automodel.models.tile_backward import tile_gradients

__all__ = [
    "ATTENTION_HEAD_GROUP_COUNTS",
    "GROUPED_ATTN_NAME",
    "apply_attention_head_chunks",
    "check_attention_head_chunks_for_model",
    "check_attention_head_chunks_for_model_config",
    "head_groups_layer_problem",
    "remove_attention_head_chunks",
]

logger = logging.getLogger(__name__)

#: the attention implementation name the model is switched to: ``automodel_head_groups_<inner>`` (:func:`_register`)
GROUPED_ATTN_NAME = "automodel_head_groups"
#: what the grouped attention did in this process since its ``reset`` (the run log's technique line)
ATTENTION_HEAD_GROUP_COUNTS = HeadGroupCounts()
_MARK = "_automodel_head_groups"  # on each attention module: (groups, the inner attention implementation name)


def head_groups_layer_problem(profile: Any) -> str | None:
    """Why a model of ``profile`` (:class:`automodel.distributed.cp.profile.ModelProfile`) cannot run its attention
    in head groups (``None``: it can): a layer kind other than full, sliding-window or chunked attention, per-head
    sink logits or an ALiBi bias."""
    from automodel.distributed.cp.profile import CHUNKED, FULL, LINEAR, MLP_ONLY, SLIDING

    for i, layer in enumerate(profile.layers):
        if layer.kind in (LINEAR, MLP_ONLY) and not getattr(layer, "hybrid_attention", False):
            continue
        why = None
        if layer.kind not in (FULL, SLIDING, CHUNKED):
            why = f"its {layer.kind} layer is not proven in head groups"
        elif layer.sinks:
            why = "its attention has per-head sink logits"
        elif layer.alibi:
            why = "its attention adds a per-head ALiBi bias"
        if why is not None:
            return f"{profile.architecture} layer {i}: {why}"
    return None


def check_attention_head_chunks_for_model(model: nn.Module, chunks: Any) -> None:
    """Refuse, before any weight loads (``model`` may be on the meta device), a model whose attention cannot run in
    ``chunks`` head groups: the count against its heads, and :func:`head_groups_layer_problem`.

    Raises:
        UserInputError: with the reason and the fix.
    """
    if chunks is None or chunks == 1:
        return
    from automodel.distributed.cp.guard import cached_profile

    key = ATTENTION_HEAD_CHUNKS_KEY
    profile = cached_profile(model)
    problem = attention_head_chunks_problem(chunks, profile.num_attention_heads,
                                            profile.num_key_value_heads or profile.num_attention_heads)  # fmt: skip
    if problem is not None:
        raise UserInputError(problem)
    why = head_groups_layer_problem(profile)
    if why is not None:
        raise UserInputError(f"{key}={chunks}: {why}; set {key}=null (or 1)")


def check_attention_head_chunks_for_model_config(model_cfg: Any, resolved: Any, *, attn_implementation: str,
                                                 seed: int) -> None:  # fmt: skip
    """The recipe's check of ``model.attention_head_chunks`` before any weight loads (the model on the meta
    device); ``auto`` is checked for the layer kinds only (its count comes from the plan)."""
    chunks = model_cfg.attention_head_chunks
    if chunks is None or chunks == 1:
        return
    from automodel.models.loader import build_model

    model = build_model(model_cfg, resolved, attn_implementation=attn_implementation, seed=seed, meta=True)
    check_attention_head_chunks_for_model(model, None if chunks == "auto" else chunks)
    if chunks == "auto":
        from automodel.distributed.cp.guard import cached_profile

        why = head_groups_layer_problem(cached_profile(model))
        if why is not None:
            raise UserInputError(f"{ATTENTION_HEAD_CHUNKS_KEY}=auto: {why}; set {ATTENTION_HEAD_CHUNKS_KEY}=null")


def _inner_function(module: nn.Module, name: str | None):  # noqa: ANN202
    """The attention function ``name`` names for ``module`` (eager: its module's ``eager_attention_forward``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    default = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if name in (None, "eager"):
        if default is None:
            raise ValueError(
                f"{ATTENTION_HEAD_CHUNKS_KEY}: {type(module).__name__} runs eager attention but its module defines no "
                f"eager_attention_forward; set {ATTENTION_HEAD_CHUNKS_KEY}=null"
            )
        return default
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, default)


def _cut(x: torch.Tensor, chunks: int, a: int, b: int, dim: int = 1) -> torch.Tensor:
    """Head groups ``[a, b)`` of ``x`` along ``dim`` (``chunks`` equal groups; a view)."""
    per = x.shape[dim] // chunks
    return x.narrow(dim, a * per, (b - a) * per)


class _HeadGroups(torch.autograd.Function):
    """``[B, H, S, D]`` q, ``[B, Hkv, S, D]`` k/v -> ``[B, S, H, Dv]``: ``run(g, q_g, k_g, v_g)`` per head group."""

    @staticmethod
    def forward(ctx: Any, run: Any, chunks: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.run, ctx.chunks = run, chunks
        ctx.save_for_backward(q, k, v)
        out = None
        for g in range(chunks):
            o = run(g, _cut(q, chunks, g, g + 1), _cut(k, chunks, g, g + 1), _cut(v, chunks, g, g + 1))
            if out is None:
                out = o.new_empty(*o.shape[:2], o.shape[2] * chunks, *o.shape[3:])
            _cut(out, chunks, g, g + 1, dim=2).copy_(o)
            del o
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        chunks = ctx.chunks
        needs = list(ctx.needs_input_grad[2:5])
        with torch.enable_grad():
            grad_xs, _ = tile_gradients(
                [(g, g + 1) for g in range(chunks)], [q, k, v], [grad], needs, [], [],
                lambda x, _k, a, b: _cut(x, chunks, a, b),
                lambda g_, _j, a, b: _cut(g_, chunks, a, b, dim=2),
                lambda a, leaves: [ctx.run(a, *leaves)],
            )  # fmt: skip
        return (None, None, *grad_xs)


@torch._dynamo.disable(reason="automodel: head-grouped attention runs its groups eagerly")
def grouped_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: the inner attention (the one the model ran before
    :func:`apply_attention_head_chunks`) one head group at a time (see the module docstring).

    Args:
        query: ``[B, H, S, D]``; key, value: ``[B, Hkv, S, D]`` / ``[B, Hkv, S, Dv]``.
    Returns:
        ``([B, S, H, Dv], None)`` (no attention weights).
    """
    chunks, inner_name = getattr(module, _MARK, (1, None))
    inner = _inner_function(module, inner_name)
    if chunks <= 1:
        return inner(module, query, key, value, attention_mask, **kwargs)
    key_ = ATTENTION_HEAD_CHUNKS_KEY
    if query.shape[1] % chunks or key.shape[1] % chunks:
        raise ValueError(
            f"{key_}={chunks} does not divide the {query.shape[1]} query / {key.shape[1]} KV heads of "
            f"{type(module).__name__}'s attention call; set {key_} to a divisor of the KV heads"
        )
    if float(kwargs.get("dropout", 0.0) or 0.0) > 0.0:
        raise ValueError(
            f"{key_}={chunks}: {type(module).__name__} runs attention dropout {kwargs['dropout']} in training; each "
            f"head group (and its recomputation) would draw other masks; set the model's attention_dropout=0 or "
            f"{key_}=null"
        )
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(f"{key_}={chunks}: {type(module).__name__} has per-head sink logits; set {key_}=null")
    mask_heads = getattr(attention_mask, "shape", (1, 1))[1] if getattr(attention_mask, "ndim", 0) == 4 else 1
    if mask_heads != 1:
        raise ValueError(
            f"{key_}={chunks}: {type(module).__name__}'s attention mask has a head dimension ({mask_heads}); "
            f"set {key_}=null"
        )

    def run(g: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        counts.group_runs += 1  # again when the backward recomputes the group
        return inner(module, q, k, v, attention_mask, **kwargs)[0]

    counts = ATTENTION_HEAD_GROUP_COUNTS
    counts.calls += 1
    counts.groups += chunks
    counts.max_groups = max(counts.max_groups, chunks)
    return _HeadGroups.apply(run, chunks, query, key, value), None


def _register(inner: str | None) -> str:
    """Register the grouped attention for the inner implementation ``inner`` as ``automodel_head_groups_<inner>``
    (global, idempotent): the attention function, and where ``inner`` is a mask implementation (sdpa, eager, flex,
    flash) its mask function under the same name, so transformers builds the same masks (padding, packed documents
    from ``position_ids``) as for ``inner``; the name keeps ``inner``'s (``"flash" in name`` selects transformers'
    flash paths). Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from automodel.distributed.torch_internals import ALL_MASK_ATTENTION_FUNCTIONS

    base = inner or "eager"
    name = f"{GROUPED_ATTN_NAME}_{base}"
    AttentionInterface.register(name, grouped_attention_forward)
    mapping = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    if base in mapping:
        AttentionMaskInterface.register(name, mapping[base])
    return name


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call an attention function: those with a ``config`` and ``num_key_value_groups`` (transformers'
    attention modules of the layer kinds :func:`head_groups_layer_problem` allows)."""
    out = []
    for m in model.modules():
        if hasattr(m, "config") and getattr(m, "num_key_value_groups", None) is not None:
            out.append(m)
    return out


def apply_attention_head_chunks(model: nn.Module, chunks: int | None) -> int:
    """Run ``model``'s attention in ``chunks`` head groups (mutates it; idempotent). Call after the CP method bound
    at cp_size 1 (its packed-rows attention is the inner function then) and before compiling the blocks. Returns
    the attention modules grouped (0 for ``None`` / 1).

    Mutates: each attention module gets the groups and the inner implementation name; the model's attention
    implementation becomes ``automodel_head_groups_<inner>`` (:func:`_register`; :func:`remove_attention_head_chunks`
    undoes it).

    Raises:
        UserInputError: as :func:`check_attention_head_chunks_for_model`, or the model refused the switch.
    """
    if chunks is None or chunks == 1:
        return 0
    check_attention_head_chunks_for_model(model, chunks)
    current = model.config._attn_implementation
    grouped = isinstance(current, str) and current.startswith(GROUPED_ATTN_NAME)
    # already grouped (again, or a config shared with a grouped model): the inner name is the suffix
    inner = current[len(GROUPED_ATTN_NAME) + 1:] if grouped else current
    modules = _attention_modules(model)
    if not modules:
        raise UserInputError(
            f"{ATTENTION_HEAD_CHUNKS_KEY}={chunks}: {type(model).__name__} has no attention module with "
            f"num_key_value_groups to group; set {ATTENTION_HEAD_CHUNKS_KEY}=null"
        )
    for m in modules:
        setattr(m, _MARK, (chunks, inner))
    if not grouped:
        name = _register(inner)
        try:
            model.set_attn_implementation(name)
        except (ValueError, TypeError, KeyError, NotImplementedError) as err:
            raise UserInputError(
                f"{ATTENTION_HEAD_CHUNKS_KEY}={chunks}: {type(model).__name__} refused its attention switched to "
                f"head groups ({err}); set {ATTENTION_HEAD_CHUNKS_KEY}=null"
            ) from err
        if model.config._attn_implementation != name:
            raise UserInputError(
                f"{ATTENTION_HEAD_CHUNKS_KEY}={chunks}: {type(model).__name__} kept attn_implementation="
                f"{model.config._attn_implementation!r} (its attention is not dispatched through transformers' "
                f"AttentionInterface); set {ATTENTION_HEAD_CHUNKS_KEY}=null"
            )
    logger.info(
        "%s=%d: %d attention module(s) run %r in %d head groups of whole KV heads, one at a time "
        "(the backward recomputes each group's forward)",
        ATTENTION_HEAD_CHUNKS_KEY, chunks, len(modules), inner, chunks,
    )  # fmt: skip
    return len(modules)


def remove_attention_head_chunks(model: nn.Module) -> int:
    """Undo :func:`apply_attention_head_chunks` (in place); returns the attention modules ungrouped."""
    count = 0
    for m in model.modules():
        if hasattr(m, _MARK):
            delattr(m, _MARK)
            count += 1
    current = str(model.config._attn_implementation)
    if current.startswith(GROUPED_ATTN_NAME):
        model.set_attn_implementation(current[len(GROUPED_ATTN_NAME) + 1:])
    return count
