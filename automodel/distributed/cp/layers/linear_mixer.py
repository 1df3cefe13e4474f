"""Linear-attention and state-space mixers under CP: the installed forward and its dispatch per method.

:func:`install_linear_mixers` (called by the methods' ``set_*_attention`` / ``prepare_model``, and for ring at
the model's first forward inside ``make_cp_batch_and_ctx``'s context) gives every mixer the model profile
lists, whose class has a registered :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel`, a
forward that looks at the active CP context on every call (:func:`uninstall_linear_mixers` removes it).
Outside a CP context (the self-check's reference run, generation) it runs the layer's own forward, except on
packed rows (the model's ``position_ids`` restart): there it restarts the state and the conv at every
document, as the CP kernels do (transformers' torch kernels ignore document boundaries and carry the state
from one packed document into the next).

Per method (docs/linear_mixers.md; the shared kernels are :mod:`automodel.distributed.cp.layers.state_chain`):

- **ulysses**: the core's inputs go from a sequence shard to a head shard (all-to-all), the core runs on the
  whole row for the rank's heads, restarted at every document, and the output comes back;
- **thd**, **ring**: rank r holds chunks r and 2W-1-r of every document (thd) or row (ring); the state is
  chained across the ranks in sequence order;
- **thd_docs**: a document whole on this rank runs locally from zeros (no exchange); a split document chains
  its state among the ranks of its span;
- **usp**: the head shard over the Ulysses sub-group, then the chain across the ring sub-group.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch

from automodel.distributed.cp.active import innermost

# the kernel modules register their mixer classes on import
from automodel.distributed.cp.layers import mixers as _mixers  # noqa: F401
from automodel.distributed.cp.layers.linear_support import LINEAR_METHODS
from automodel.distributed.cp.layers.mixer_kernel import HeadShard, MixerKernel, kernel_for
from automodel.distributed.cp.layers.rwkv import TOKEN_SHIFT_OWNERS, TokenShift
from automodel.distributed.cp.layers.state_chain import (
    Chain,
    head_shard,
    head_unshard,
    run_chain,
    run_documents,
)
from automodel.distributed.cp.profile import LINEAR
from automodel.errors import CPUnsupportedError

__all__ = [
    "install_linear_mixers",
    "linear_mixer_forward",
    "uninstall_linear_mixers",
]

_MARK = "_automodel_cp_linear_mixer"
_HOLDER = "_automodel_cp_positions"


def install_linear_mixers(
    model: torch.nn.Module, profile: Any, method: str | None = None
) -> int:
    """Give every mixer of ``profile``'s ``linear_mixer`` layers that has a registered kernel the CP forward
    (mutates ``model``; idempotent). The forward runs ``method``'s kernel while a context of that method is
    the innermost one on :mod:`automodel.distributed.cp.active`. ``method=None`` (cp_size 1): no CP, only the
    per-document restart on packed rows. Returns how many modules carry the forward."""
    if method is not None and method not in LINEAR_METHODS:
        raise ValueError(f"no linear-mixer kernel for cp_method {method!r}; kernels: {', '.join(LINEAR_METHODS)}")
    holder = getattr(model, _HOLDER, None)
    if holder is None:
        holder = _Positions()
        holder.hook = model.register_forward_pre_hook(_record_positions, with_kwargs=True)
        setattr(model, _HOLDER, holder)
    listed = {layer.mixer for layer in profile.layers if layer.kind == LINEAR}
    _install_token_shifts(model, listed)
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name in listed and kernel_for(name) is not None:
            if not getattr(module, _MARK, False):
                module.forward = types.MethodType(linear_mixer_forward, module)
                setattr(module, _MARK, True)
            if module is not model:
                setattr(module, _HOLDER, holder)
            count += 1
    return count


def _install_token_shifts(model: torch.nn.Module, listed: set[str]) -> None:
    """Replace the one-token ``time_shift`` of every module of :data:`TOKEN_SHIFT_OWNERS` (RWKV's time mixing and
    its feed-forward) by a :class:`TokenShift`, which the loop below gives the CP forward, when the profile lists
    a mixer of that model (RWKV's ``RwkvSelfAttention``). Mutates ``model``; idempotent."""
    if not listed & set(TOKEN_SHIFT_OWNERS):
        return
    for module in list(model.modules()):
        attr = TOKEN_SHIFT_OWNERS.get(type(module).__name__)
        current = getattr(module, attr, None) if attr else None
        if isinstance(current, torch.nn.Module) and not isinstance(current, TokenShift):
            setattr(module, attr, TokenShift(current, module.config.hidden_size))
    listed.add(TokenShift.__name__)


def uninstall_linear_mixers(model: torch.nn.Module) -> None:
    """Give every mixer :func:`install_linear_mixers` changed its class's forward back (mutates ``model``)."""
    for module in list(model.modules()):
        attr = TOKEN_SHIFT_OWNERS.get(type(module).__name__)
        shift = getattr(module, attr, None) if attr else None
        if isinstance(shift, TokenShift):
            setattr(module, attr, shift.original)
    for module in model.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
        holder = vars(module).pop(_HOLDER, None)
        if holder is not None and module is model:
            holder.hook.remove()


def _active() -> tuple[str, Any] | None:
    """The innermost active CP context of a method with a linear-mixer kernel: ``(method, context)``, else
    ``None`` (no CP context, or one of a method without a kernel: the model's own forward)."""
    top = innermost()
    return top if top is not None and top[0] in LINEAR_METHODS else None


def linear_mixer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The installed forward of a mixer with a registered kernel: CP when a context of a method with a kernel
    is active, else the class's own forward (per document on packed rows). ``hidden_states [B, n, D]`` ->
    ``[B, n, D]`` (what the class's forward returns)."""
    cache, attention_mask = _call_arguments(self, hidden_states, args, kwargs)
    kernel = kernel_for(self)
    active = _active()
    if active is None:
        documents = _packed_documents(self, hidden_states) if cache is None else None
        if documents is None:
            return type(self).forward(self, hidden_states, *args, **kwargs)
        hidden = _masked(hidden_states, attention_mask)
        proj = _with_mask(kernel, kernel.project(self, hidden), attention_mask, hidden)
        out = run_documents(kernel, self, kernel.core_params(self, None), proj.seq, documents)
        return kernel.finish(self, out, proj.local)
    method, ctx = active
    if cache is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {type(self).__name__} got a cache; CP runs training forwards only "
            "(call the model with use_cache=False)"
        )
    hidden_states = _masked(hidden_states, attention_mask)
    # a CP kernel ran: the context's "nothing was switched" check must not fire for a model of mixers only
    ctx.calls += 1
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    return _METHODS[method](kernel, self, hidden_states, ctx, mask)


# "state": RWKV's and xLSTM's recurrent state passed in (a cache by another name)
_CACHE_NAMES = ("cache", "cache_params", "past_key_values", "past_key_value", "state")
_SIGNATURES: dict[type, inspect.Signature] = {}


def _call_arguments(mixer: torch.nn.Module, hidden: torch.Tensor, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``(cache, attention_mask)`` of a call of the class's forward, whatever its parameter names."""
    cls = type(mixer)
    if cls not in _SIGNATURES:
        _SIGNATURES[cls] = inspect.signature(cls.forward)
    bound = _SIGNATURES[cls].bind_partial(mixer, hidden, *args, **kwargs).arguments
    extra = bound.get("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
    cache = next((v for n in _CACHE_NAMES for v in (bound.get(n), extra.get(n)) if v is not None), None)
    mask = bound.get("attention_mask", extra.get("attention_mask"))
    return cache, mask if mask is not None else bound.get("conv_mask", extra.get("conv_mask"))  # ZAYA's, Inkling's


def _with_mask(kernel: MixerKernel, proj: Any, mask: Any, hidden: torch.Tensor) -> Any:
    """Add ``seq["mask"]`` ``[B, n, 1, 1]`` for a kernel that masks after its conv (``mask [B, n]``, 1 = real)."""
    if kernel.masks_after_conv and isinstance(mask, torch.Tensor) and mask.shape == hidden.shape[:2]:
        proj.seq["mask"] = mask[:, :, None, None].to(hidden.dtype)
    return proj


def _project(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, mask: Any) -> Any:
    """:meth:`MixerKernel.project` plus the call's padding mask ``[B, n]`` where the kernel needs it."""
    return _with_mask(kernel, kernel.project(mixer, hidden), mask, hidden)


def _masked(hidden: torch.Tensor, attention_mask: Any) -> torch.Tensor:
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == hidden.shape[:2]:
        return hidden * attention_mask[..., None].to(hidden.dtype)
    return hidden


# ---------------------------------------------------------------------------------------------------------
# one process: packed rows restart the state at every document, as under CP

class _Positions:
    """The ``position_ids`` ``[B, S]`` of the latest forward of the model that carries the CP forward (kept
    until its next forward, so that activation checkpointing's recompute sees the same rows)."""

    value: torch.Tensor | None = None
    hook: Any = None


def _record_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    positions = kwargs.get("position_ids")
    holder = getattr(module, _HOLDER)
    holder.value = positions if isinstance(positions, torch.Tensor) and positions.dim() == 2 else None


def _packed_documents(mixer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """``[B, S]`` document ids of packed rows from the model's ``position_ids`` (transformers' rule: a new
    document wherever the position does not grow by 1), ``None`` for rows of one document each."""
    holder = getattr(mixer, _HOLDER, None)
    positions = None if holder is None else holder.value
    if positions is None or positions.shape[-1] != hidden.shape[1]:
        return None
    from automodel.distributed.torch_internals import find_packed_sequence_indices

    return find_packed_sequence_indices(positions.expand(hidden.shape[0], -1))


def _refuse(kernel: MixerKernel, mixer: torch.nn.Module, method: str, heads_world: int) -> None:
    problem = kernel.problem(mixer, method, heads_world)
    if problem:
        raise CPUnsupportedError(problem)


# ---------------------------------------------------------------------------------------------------------
# the methods


def _ulysses_forward(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, ctx: Any,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    world, rank, group = ctx.world_size, ctx.rank, ctx.group
    _refuse(kernel, mixer, "ulysses", world)
    if ctx.padding_mask is not None:
        mask = ctx.shard(ctx.padding_mask.to(hidden.device), 1)
        hidden = hidden * mask[..., None].to(hidden.dtype)
        attention_mask = mask if attention_mask is None else attention_mask
    if world > 1 and type(kernel).contiguous_shard is not MixerKernel.contiguous_shard:
        # a kernel that exchanges a halo of its contiguous slice instead (RWKV's token shift)
        out = kernel.contiguous_shard(mixer, hidden, group, rank, world, _local_starts(ctx, hidden))
        if out is not None:
            return out
    proj = _project(kernel, mixer, hidden, attention_mask)
    shard = HeadShard(rank, world)
    if world == 1:  # one rank (CP size 1): every token and head is here; no all-to-all (None is the world group)
        out = run_documents(kernel, mixer, kernel.core_params(mixer, shard), proj.seq, ctx.document_ids, shard)
        return kernel.finish(mixer, out, proj.local)
    seq = head_shard(kernel, mixer, proj.seq, group, shard, seq_len=ctx.seq_len)
    out = run_documents(kernel, mixer, kernel.core_params(mixer, shard), seq, ctx.document_ids, shard)
    return kernel.finish(mixer, head_unshard(out, group), proj.local)


def _local_starts(ctx: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` bool: this Ulysses rank's tokens that start a document (the row's first token; with packed rows
    every token whose document id differs from the token before it)."""
    bsz = hidden.shape[0]
    ids = ctx.document_ids
    first = torch.zeros(bsz, ctx.seq_len, dtype=torch.bool)
    first[:, 0] = True
    if ids is not None:
        ids = ids.cpu()
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return ctx.shard(first.expand(bsz, -1), 1).to(hidden.device)


def _check_one_row(mixer: torch.nn.Module, hidden: torch.Tensor, plan: Any, method: str, batch_fn: str) -> None:
    """``hidden`` must be this rank's ``plan.local_tokens`` tokens as one row (``[1, n, D]``)."""
    if hidden.shape[0] != 1 or hidden.shape[1] != plan.local_tokens:
        raise ValueError(
            f"{type(mixer).__name__} under {method} expects this rank's {plan.local_tokens} tokens as one row, got "
            f"{tuple(hidden.shape[:2])}; feed the model the batch returned by {batch_fn}"
        )


def _thd_forward(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, plan: Any,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    _check_one_row(mixer, hidden, plan, "thd", "make_thd_batch_and_ctx")
    proj = _project(kernel, mixer, hidden, attention_mask)
    return kernel.finish(mixer, _plan_core(kernel, mixer, proj.seq, plan, None), proj.local)


def _plan_core(kernel: MixerKernel, mixer: torch.nn.Module, seq: dict, plan: Any, shard: HeadShard | None):
    """The core on a :class:`~automodel.distributed.cp.gathered_attention.THDPlan`'s local tokens."""
    params = kernel.core_params(mixer, shard)
    if plan.world_size == 1:  # one rank: every document whole, from zeros
        return run_documents(kernel, mixer, params, seq, [(off, off + c) for _, c, off in plan.documents()], shard)
    chain = Chain.head_tail(plan.group, plan.rank, plan.world_size, [(off, c) for _, c, off in plan.documents()])
    return run_chain(kernel, mixer, params, seq, chain, shard)


def _ring_forward(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, layout: Any,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    if hidden.shape[1] % 2:
        raise ValueError(f"ring CP holds two equal chunks per rank, got {hidden.shape[1]} local tokens")
    proj = _project(kernel, mixer, hidden, attention_mask)
    params = kernel.core_params(mixer, None)
    if layout.world_size == 1:
        out = run_documents(kernel, mixer, params, proj.seq, None)
    else:
        chain = Chain.head_tail(layout.group, layout.rank, layout.world_size, [(0, hidden.shape[1] // 2)])
        out = run_chain(kernel, mixer, params, proj.seq, chain)
    return kernel.finish(mixer, out, proj.local)


def _thd_docs_forward(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, plan: Any,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    _check_one_row(mixer, hidden, plan, "thd_docs", "make_doc_batch_and_ctx")
    proj = _project(kernel, mixer, hidden, attention_mask)
    params = kernel.core_params(mixer, None)
    local = [(off, off + n) for off, n, doc, _ in plan.blocks if doc is None]
    chain = Chain(plan.group, plan.rank, _doc_chain(plan))
    if plan.world_size == 1 or not chain.documents:
        out = run_documents(kernel, mixer, params, proj.seq, local)
    else:
        out = run_chain(kernel, mixer, params, proj.seq, chain, local=local)
    return kernel.finish(mixer, out, proj.local)


def _doc_chain(plan: Any) -> list[list[tuple[int, int, int]]]:
    """The split documents of a thd_docs ``DocPlan`` as chain pieces ``(owner, local offset, length)``: the
    ``2k`` head-tail chunks of a document spanning ``k`` ranks, chunk ``j`` on span rank ``j`` (``j < k``)
    or ``2k-1-j``."""
    from automodel.distributed.cp.layout import head_tail_chunks

    documents = []
    placement = plan.placement
    for doc in sorted(placement.spans):
        span = placement.spans[doc]
        k = len(span)
        chunks = head_tail_chunks(placement.lengths[doc], k)
        own = plan.split[doc][1] if doc in plan.split else {}
        pieces = []
        for j, (a, b) in enumerate(chunks):
            owner = span[j] if j < k else span[2 * k - 1 - j]
            pieces.append((owner, own.get(j, -1) if owner == plan.rank else -1, b - a))
        documents.append(pieces)
    return documents


def _usp_forward(kernel: MixerKernel, mixer: torch.nn.Module, hidden: torch.Tensor, ctx: Any,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    g, plan = ctx.groups, ctx.plan
    u = g.ulysses_size
    _refuse(kernel, mixer, "usp", u)
    proj = _project(kernel, mixer, hidden, attention_mask)
    if u == 1:
        return kernel.finish(mixer, _plan_core(kernel, mixer, proj.seq, plan, None), proj.local)
    shard = HeadShard(g.ulysses_rank, u)
    seq = head_shard(kernel, mixer, proj.seq, g.ulysses_group, shard, seq_len=plan.local_tokens)
    out = _plan_core(kernel, mixer, seq, plan, shard)
    return kernel.finish(mixer, head_unshard(out, g.ulysses_group), proj.local)


_METHODS = {
    "ulysses": _ulysses_forward,
    "thd": _thd_forward,
    "ring": _ring_forward,
    "thd_docs": _thd_docs_forward,
    "usp": _usp_forward,
}
