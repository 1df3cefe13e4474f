"""Hybrid Ulysses x ring context parallelism (USP) for unmodified Hugging Face models, packed or not.

The CP group of ``W = U * R`` ranks is factored into ``R`` Ulysses sub-groups of ``U`` consecutive CP
ranks and ``U`` ring sub-groups of ``R`` ranks (:mod:`automodel.distributed.cp.subgroups`; CP rank
``c = ring_rank * U + ulysses_rank``).

Placement. The rows of a batch are flattened into one stream of documents (a plain row is one
document) and placed across the **ring** sub-group exactly as ``cp_method: thd`` places them across the
whole CP group (:func:`automodel.distributed.cp.gathered_attention.shard_batch`: every document of
padded length ``L`` cut into ``2R`` chunks, ring rank ``r`` holding chunks ``r`` and ``2R-1-r``). Ring
rank ``r``'s share (``T/R`` tokens) is then cut into ``U`` contiguous slices, one per Ulysses rank. The
model runs on ``[1, T/W]`` tokens with their global per-document ``position_ids``.

Attention (registered as :data:`USP_ATTN_NAME`):

1. q/k/v ``[1, H, T/W, D]`` -> ``[1, H/U, T/R, D]`` with one all-to-all each over the Ulysses sub-group
   (:func:`automodel.distributed.sp.all_to_all.all_to_all`): the Ulysses sub-group now holds ring rank
   ``r``'s whole share for ``H/U`` heads each. With fewer KV heads than ``U`` (or ``U`` not dividing
   them) each KV head is first replicated ``U / gcd(Hkv, U)`` times, as Ulysses does; the copies'
   gradients are summed back by autograd.
2. thd's attention call across the ring sub-group (:func:`automodel.distributed.cp.gathered_attention.gathered_layer`
   with a ring-sized :class:`~automodel.distributed.cp.gathered_attention.THDPlan`) on the ``H/U`` heads: each
   layer's kernel is chosen there (:func:`automodel.distributed.cp.layers.strategy.run_layer` on the ring
   sub-group's :class:`~automodel.distributed.cp.layout.TokenLayout`): full causal attention is the
   gathered-K/V kernel (K/V all-gathered over the ring, dK/dV reduce-scattered); windows and chunks shorter
   than the longest document, sinks and softcapping the halo kernel (only the K/V each layer reaches crosses
   the ring, never a document); MLA value heads the gathered kernel on zero-padded V. Two things depend on
   the head split and are handed over: the per-head sink logits are cut to this rank's ``H/U`` heads, and
   Llama 4's query temperature, which transformers took at each Ulysses rank's local index, is corrected
   from that index (``arange(T/W)`` per Ulysses slice) to the in-document position.
3. The output ``[1, T/R, H/U, Dv]`` goes back to ``[1, T/W, H, Dv]`` with one more all-to-all.

At ``U == 1`` this is ``cp_method: thd``; at ``U == W`` it is Ulysses on the thd placement. Exact for
every attention layer kind thd computes; linear / state-space mixers without a usp kernel are refused.

Used like THD attention (:mod:`automodel.distributed.cp.thd.attention`): ``set_usp_attention(model)``
once, then per step ``ctx_factory, local = make_usp_batch_and_ctx(device_mesh, batch, ulysses_size=2)`` and
the forward / backward inside ``with ctx_factory():``; all-reduce (SUM) the parameter gradients over the
CP group.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from automodel.distributed.cp import active, hf_attention
from automodel.distributed.cp.batch_forms import check_batch_forms
from automodel.distributed.cp.gathered_attention import THDPlan, gathered_layer, pad_documents, shard_batch
from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.cp.head_chunks import head_chunks_problem, run_head_groups
from automodel.distributed.cp.usp.groups import UspGroups, usp_process_groups
from automodel.distributed.sp.all_to_all import all_to_all

__all__ = [
    "USP_ATTN_NAME",
    "UspContext",
    "usp_context",
    "current_usp_context",
    "usp_attention_forward",
    "register_usp_attention",
    "set_usp_attention",
    "make_usp_batch_and_ctx",
]

#: The name under which USP attention is registered in transformers' ``AttentionInterface``.
USP_ATTN_NAME = "usp"
_METHOD = "usp"
#: Local-batch keys that hold one value per token ``[..., T/R]`` of the ring share (cut per Ulysses rank).
_TOKEN_KEYS = ("input_ids", "labels", "loss_mask", "padding_mask", "position_ids")


@dataclass
class UspContext:
    """What USP attention needs beyond the layer inputs.

    Attributes:
        groups: this rank's Ulysses / ring sub-groups (:class:`~automodel.distributed.cp.usp.groups.UspGroups`).
        plan: the ring sub-group's :class:`~automodel.distributed.cp.gathered_attention.THDPlan`.
        calls: attention calls run under this context (for the forgotten-switch check).
        head_chunks: head groups per attention call, run one at a time (``distributed.ulysses_head_chunks``,
            :mod:`automodel.distributed.cp.head_chunks`).
    """

    groups: UspGroups
    plan: THDPlan
    calls: int = 0
    head_chunks: int = 1
    head_group_runs: int = 0  # head groups run so far (forward, and each recomputation in the backward)


def current_usp_context() -> UspContext | None:
    """The innermost active :class:`UspContext`, or ``None``."""
    return active.current(_METHOD)


def usp_context(ctx: UspContext, *, require_attention: bool = True) -> contextlib.AbstractContextManager[UspContext]:
    """Make ``ctx`` active; a block that ran no USP attention call raises ``RuntimeError`` on exit (the model
    was not switched with :func:`set_usp_attention`)."""
    return active.activate(
        _METHOD, ctx, require_attention=require_attention,
        message=active.not_switched_message("USP", "set_usp_attention", USP_ATTN_NAME),
    )


def _replicate_kv(x: torch.Tensor, ulysses_size: int) -> torch.Tensor:
    """``[1, Hkv, n, D]`` -> ``[1, Hkv * f, n, D]`` with ``f = U / gcd(Hkv, U)`` copies of each head in place,
    so that the Ulysses rank holding query heads ``[u H/U, (u+1) H/U)`` receives the KV heads they use."""
    n_kv = x.shape[1]
    f = ulysses_size // math.gcd(n_kv, ulysses_size)
    return x if f == 1 else x.repeat_interleave(f, dim=1)


def _own_head_sinks(call: hf_attention.AttentionCall, n_q: int, u: int, ulysses_rank: int) -> torch.Tensor | None:
    """The per-head sink logits (``s_aux`` or the module's ``sinks``, ``[Hq]``) of the ``Hq / U`` query heads this
    Ulysses rank holds after the all-to-all (heads ``[u Hq/U, (u+1) Hq/U)``), or ``None``. A view: the other heads'
    sink gradients come from the other Ulysses ranks (summed over the CP group with every parameter's)."""
    sinks = call.kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(call.module, "sinks", None), torch.Tensor):
        sinks = call.module.sinks
    if sinks is None:
        return None
    if sinks.shape[-1] != n_q:
        raise ValueError(f"{call.module_name} has {sinks.shape[-1]} sink logits for {n_q} query heads")
    per = n_q // u
    return sinks.narrow(-1, ulysses_rank * per, per)


def _usp_call(call: hf_attention.AttentionCall) -> tuple[torch.Tensor, None]:
    """USP attention with transformers' attention-function signature (registered as ``"usp"``).

    ``query`` ``[1, Hq, T/W, D]``, ``key``/``value`` ``[1, Hkv, T/W, D]`` (this rank's tokens); returns
    ``([1, T/W, Hq, D], None)``. ``attention_mask`` must be ``None`` (documents come from the plan).
    """
    ctx = hf_attention.enter_call(_METHOD, USP_ATTN_NAME, "a USP context", "make_usp_batch_and_ctx")
    g = ctx.groups
    u = g.ulysses_size
    query, key, value = call.query, call.key, call.value
    n_q, n_kv = query.shape[1], key.shape[1]
    if n_q % u:
        raise ValueError(
            f"distributed.cp_method=usp splits the attention heads over the Ulysses sub-group: {n_q} query heads "
            f"are not divisible by distributed.ulysses_size={u}; set ulysses_size to a divisor of {n_q}"
        )
    if n_q % n_kv:
        raise ValueError(f"query heads ({n_q}) must be a multiple of key/value heads ({n_kv})")
    chunks = ctx.head_chunks
    problem = head_chunks_problem(chunks, n_q, n_kv, u, f"distributed.ulysses_size={u}")
    if problem is not None:
        raise ValueError(problem)
    sinks, local_index = None, None
    slopes = call.kwargs.get("alibi_slopes")  # [Hq] fp32: ALiBi (cp/layers/alibi.py)
    if slopes is not None and u > 1:  # this rank's heads' slopes
        per = n_q // u
        slopes = slopes.narrow(0, g.ulysses_rank * per, per)
    if u > 1:
        key, value = _replicate_kv(key, u), _replicate_kv(value, u)
        sinks = _own_head_sinks(call, n_q, u, g.ulysses_rank)
        # transformers scaled each query by a function of its index in ITS rank's T/W tokens (Llama 4)
        local_index = torch.arange(call.query.shape[2], device=query.device).repeat(u)
    elif chunks > 1:
        sinks = _own_head_sinks(call, n_q, 1, 0)

    def heads_attention(j: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # head group j (all heads when chunks == 1): the Ulysses all-to-all, thd's call across the ring, and back
        kwargs = dict(call.kwargs)
        ctx.head_group_runs += 1
        if u > 1:
            # every Ulysses rank holds T/W tokens: the gathered sequence is the ring rank's share, in order
            query, key, value = (all_to_all(x, g.ulysses_group, scatter_dim=1, gather_dim=2) for x in (query, key, value))
        if sinks is not None:
            per = sinks.shape[-1] // chunks
            kwargs["s_aux"] = sinks.narrow(-1, j * per, per)
        if slopes is not None:  # group j's heads' slopes
            per = slopes.shape[0] // chunks
            kwargs["alibi_slopes"] = slopes.narrow(0, j * per, per)
        out = gathered_layer(
            call.replace(query=query, key=key, value=value, kwargs=kwargs), ctx.plan, local_index=local_index,
            method=_METHOD,
        )
        # out: [1, T/R, h_j, D]
        if u > 1:
            out = all_to_all(out, g.ulysses_group, scatter_dim=1, gather_dim=2)
        return out

    # distributed.ulysses_head_chunks: one head group at a time, the backward too (head_chunks.py)
    return run_head_groups(heads_attention, query, key, value, u, chunks), None


usp_attention_forward = hf_attention.hf_attention_function(_usp_call, "usp_attention_forward")


def register_usp_attention(name: str = USP_ATTN_NAME) -> str:
    """Register :func:`usp_attention_forward` in transformers' ``AttentionInterface`` (idempotent).

    Deliberately not registered as a mask implementation: transformers then builds no (local, wrong)
    mask and passes ``attention_mask=None``. Returns ``name``.
    """
    return hf_attention.register_attention(name, usp_attention_forward)


def set_usp_attention(model: torch.nn.Module, device_mesh: Any = None) -> str:
    """Switch an HF model to USP attention (mutates the model); returns the previous implementation name.

    Raises:
        CPUnsupportedError: a layer kind USP does not compute exactly (the message names the layers and the
            methods that would), or a model whose attention is not dispatched through ``AttentionInterface``.
        ValueError: not a transformers ``PreTrainedModel``.
    """
    del device_mesh  # the sub-groups and the Ulysses size come with every batch (make_usp_batch_and_ctx)
    hf_attention.require_hf_model(
        model,
        f", so its attention cannot be swapped for USP attention ({USP_ATTN_NAME!r} in transformers' AttentionInterface)",
    )
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp("usp", cached_profile(model), seq_len=None)
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
    from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention

    install_linear_mixers(model, cached_profile(model), "usp")  # docs/linear_mixers.md
    install_sparse_attention(model, cached_profile(model))  # DSA: latent KV and indexer keys gathered
    from automodel.distributed.cp.layers.alibi import dispatch_alibi_layers

    if dispatch_alibi_layers(model, {_METHOD: USP_ATTN_NAME}):  # BLOOM, MPT: their ALiBi layers, inside a context
        register_usp_attention()
        return model.config._attn_implementation
    return hf_attention.switch_attention(model, USP_ATTN_NAME, usp_attention_forward, "usp")


def make_usp_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    ulysses_size: int,
    kernel: str = "portable",
    cp_comm_type: str = "p2p",
    inner_attn: str | None = None,
    seq_lens_padding_value: int = -1000,
    document_multiple: int | None = None,
    head_chunks: int = 1,
) -> tuple[Callable[[], contextlib.AbstractContextManager[UspContext]], dict[str, Any]]:
    """Shard a BSHD batch (packed or not) for USP and build the context its attention calls need.

    Args:
        device_mesh: DeviceMesh with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None``.
        batch: as for ``make_thd_batch_and_ctx`` (identical on every
            CP rank; ``input_ids`` / ``labels`` ``[B, S]``, packed rows add ``position_ids`` and ``seq_lens`` /
            ``seq_lens_padded`` ``[B, P]``). Packed documents are padded to a multiple of ``2 * cp_size`` here
            (:func:`~automodel.distributed.cp.gathered_attention.pad_documents`, exact); plain rows must be.
        ulysses_size: ``U``, the Ulysses sub-group size; it divides the CP size (the ring size is ``cp / U``).
        kernel, cp_comm_type: the THD kernel across the ring sub-group (``distributed.thd_kernel``).
        inner_attn: accepted (the recipe binds the model's previous implementation) and unused.
        seq_lens_padding_value: sentinel of unused ``seq_lens`` entries.
        document_multiple: what each packed document is padded to (``None``: ``2 * cp_size``; the recipe passes
            ``2 * cp_size * tp_size`` with sequence parallelism); a multiple of ``2 * cp_size``.
        head_chunks: ``distributed.ulysses_head_chunks``: the heads after the Ulysses all-to-all run in this many
            groups, one after another, forward and backward (:mod:`automodel.distributed.cp.head_chunks`; exact);
            it divides the KV heads a Ulysses rank holds (checked at the first attention call).

    Returns:
        ``(ctx_factory, local)``: ``local`` holds ``input_ids``, ``labels``, ``position_ids`` (global
        per-document positions), ``loss_mask`` / ``padding_mask`` if present, each ``[1, T/W]`` (this rank's
        Ulysses slice of its ring rank's thd share), plus ``cu_seqlens``, ``cu_seqlens_padded``,
        ``max_seqlen`` of the whole stream. ``batch`` is not mutated. Every member of the CP group must
        call this together (the first call builds the sub-groups).

    Raises:
        ValueError: ``ulysses_size`` not dividing the CP size, a ring share not divisible by ``ulysses_size``
            (plain rows not padded to ``2 * cp_size``), anything ``make_thd_batch_and_ctx`` rejects.
    """
    check_batch_forms("usp", batch)  # refuse what usp does not compute exactly (docs/batch_forms.md)
    del inner_attn
    group, world, rank = resolve_cp_group(device_mesh)
    # packed documents are padded here, not by the data: packing is the same at every cp_size (and as thd_docs')
    multiple = document_multiple or 2 * world
    if multiple % (2 * world):
        raise ValueError(f"document_multiple={multiple} is not a multiple of 2*cp_size = {2 * world}")
    batch = pad_documents(batch, multiple, seq_lens_padding_value)
    groups = usp_process_groups(group, world, rank, ulysses_size)
    ring_group, ring_size, ring_rank = resolve_cp_group(groups.ring_group)
    plan, ring_local = shard_batch(
        ring_group, ring_size, ring_rank, batch, kernel, cp_comm_type, seq_lens_padding_value
    )
    share = ring_local["input_ids"].shape[-1]  # T/R
    if share % ulysses_size:
        raise ValueError(
            f"the ring rank's share of {share} tokens does not split over distributed.ulysses_size={ulysses_size}: "
            f"pad the rows to a multiple of 2*cp_size = {2 * world}"
        )
    n = share // ulysses_size
    start = groups.ulysses_rank * n
    local = {
        k: (v.narrow(-1, start, n).contiguous() if k in _TOKEN_KEYS and isinstance(v, torch.Tensor) else v)
        for k, v in ring_local.items()
    }
    problem = head_chunks_problem(head_chunks, None, None, ulysses_size)
    if problem is not None or head_chunks == "auto":
        raise ValueError(problem or "head_chunks='auto' is resolved by the recipe from the plan; pass an integer")
    ctx = UspContext(groups=groups, plan=plan, head_chunks=head_chunks)

    def ctx_factory() -> contextlib.AbstractContextManager[UspContext]:
        return usp_context(ctx)

    return ctx_factory, local

