"""Linear-attention mixers under CP: Gated DeltaNet exact under Ulysses, thd and ring.

:func:`install_linear_mixers` (called by ``set_ulysses_attention`` / ``set_thd_attention``, hence by the
methods' ``prepare_model``, and for ring at the model's first forward inside ``make_cp_batch_and_ctx``'s
context, which also makes the ring's :class:`~automodel.distributed.cp.layout.TokenLayout` active) gives every Gated DeltaNet layer the model profile lists a forward that looks
at the active CP context on every call (:func:`uninstall_linear_mixers` removes it). Outside a CP context
(the self-check's reference run, generation) it runs the layer's own forward, except on packed rows (the
model's ``position_ids`` restart): there it restarts the state and the conv at every document, as the CP
kernels do. transformers' torch kernel ignores document boundaries, so a model without this forward
carries the state from one packed document into the next.
The layer is split as :mod:`automodel.distributed.cp.layers.gated_deltanet` describes: token-local projections, a
sequence core (causal conv + gated delta rule), token-local output.

**Ulysses** (a :class:`~automodel.distributed.cp.ulysses.attention.UlyssesContext` is active): the projections run on
the rank's slice; q, k, v (before the conv), b and a go through one all-to-all each from a sequence shard
``[B, S/W, H, d]`` to a head shard ``[B, S, H/W, d]`` (:func:`automodel.distributed.all_to_all.all_to_all`);
the depthwise conv is per channel, so the rank takes its heads' rows of the conv weight and its heads'
``A_log`` / ``dt_bias``; the unchanged recurrence runs on the whole row for those heads, restarted at every
document (``document_ids`` of the context: packed lengths or ``position_ids`` resets); the output goes back
with one more all-to-all, and the gated norm and ``out_proj`` run on the slice. Needs
``linear_num_key_heads % cp_size == 0``.

**thd** (a :class:`~automodel.distributed.cp.gathered_attention.THDPlan` is active) and **ring** (a
head-tail :class:`~automodel.distributed.cp.layout.TokenLayout`): rank r holds chunks r and 2W-1-r of every document (thd) or of every row (ring). The state is passed as a **chain** in sequence order, not as a scan of per-shard
transition summaries: the delta rule's state update is affine in the state, but its summary over a shard
is a ``dk x dk`` matrix per head that transformers' kernel does not produce; a scan would need a second
kernel and a second pass over every shard, while the chain runs the unchanged kernel once per shard and
sends ``Hv*dk*dv + C*(K-1)`` numbers per document per hop. Its cost is that the shards of one document run
one after the other (Ulysses runs all heads in parallel and is the faster choice for these layers).

The chain visits chunks in sequence order, which with head-tail placement is the rank order
``0, 1, ..., W-1`` for chunks ``0..W-1`` and back ``W-1, ..., 1, 0`` for chunks ``W..2W-1``::

    forward   rank r: recv head state from r-1 | run chunk r | send to r+1
                      (rank W-1 feeds chunk W-1's state to its own chunk W, no message)
                      recv tail state from r+1 | run chunk 2W-1-r | send to r-1
    backward  the reverse: tail gradients travel 0 -> W-1, head gradients W-1 -> 0

Every message carries all documents at once (one state and one conv halo per document: the conv halo is
the last ``K-1`` conv inputs before the chunk); chunk 0 of every document starts from zeros, which is the
document reset. 2(W-1) messages per layer in each direction. The backward runs inside one autograd
function (:class:`_ChainedCore`) so that its sends and receives (:mod:`automodel.distributed.cp.exchange.state`)
happen in a fixed order on every rank.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from automodel.distributed.cp.active import innermost
from automodel.distributed.cp.exchange.state import per_document, recv_state, send_state
from automodel.distributed.cp.layers.gated_deltanet import CoreParams, core_params, finish, project, run_core
from automodel.distributed.cp.layers.linear_support import GATED_DELTANET_MIXERS, LINEAR_METHODS
from automodel.distributed.cp.profile import LINEAR
from automodel.distributed.sp.all_to_all import all_to_all
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
    """Give every supported linear mixer of ``profile``'s ``linear_mixer`` layers the CP forward (mutates
    ``model``; idempotent). The forward runs ``method``'s kernel while a context of that method is the
    innermost one on :mod:`automodel.distributed.cp.active` (a ``UlyssesContext``, ``THDPlan`` or ring
    ``TokenLayout``). ``method=None`` (cp_size 1): no CP, only the per-document restart on packed rows.
    Returns how many modules carry the forward."""
    if method is not None and method not in LINEAR_METHODS:
        raise ValueError(f"no linear-mixer kernel for cp_method {method!r}; kernels: {', '.join(LINEAR_METHODS)}")
    holder = getattr(model, _HOLDER, None)
    if holder is None:
        holder = _Positions()
        holder.hook = model.register_forward_pre_hook(_record_positions, with_kwargs=True)
        setattr(model, _HOLDER, holder)
    wanted = {layer.mixer for layer in profile.layers if layer.kind == LINEAR and layer.mixer in GATED_DELTANET_MIXERS}
    count = 0
    for module in model.modules():
        if type(module).__name__ in wanted:
            if not getattr(module, _MARK, False):
                module.forward = types.MethodType(linear_mixer_forward, module)
                setattr(module, _MARK, True)
            if module is not model:
                setattr(module, _HOLDER, holder)
            count += 1
    return count


def uninstall_linear_mixers(model: torch.nn.Module) -> None:
    """Give every mixer :func:`install_linear_mixers` changed its class's forward back (mutates ``model``)."""
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


def linear_mixer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                         attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The installed forward of a Gated DeltaNet module: CP when a Ulysses or thd context is active, else
    the class's own forward. ``hidden_states [B, n, D]`` -> ``[B, n, D]``."""
    active = _active()
    if active is None:
        documents = _packed_documents(self, hidden_states) if cache is None else None
        if documents is None:
            return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        return _per_document_forward(self, hidden_states, attention_mask, documents)
    method, ctx = active
    if cache is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {type(self).__name__} got a cache; CP runs training forwards only "
            "(call the model with use_cache=False)"
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == hidden_states.shape[:2]:
        hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
    if method == "ulysses":
        return _ulysses_forward(self, hidden_states, ctx)
    if method == "ring":
        return _ring_forward(self, hidden_states, ctx)
    return _thd_forward(self, hidden_states, ctx)


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


def _per_document_forward(mixer: torch.nn.Module, hidden: torch.Tensor, attention_mask: Any,
                          documents: torch.Tensor) -> torch.Tensor:
    """The mixer on one process with the state and conv restarted at every document of packed rows (what
    the CP kernels compute; transformers' torch kernel ignores the boundaries and carries the state on)."""
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape == hidden.shape[:2]:
        hidden = hidden * attention_mask[..., None].to(hidden.dtype)
    mixed, z, b, a = project(mixer, hidden)
    return finish(mixer, _documents_core(core_params(mixer), mixed, b, a, documents), z)


def _documents_core(params: CoreParams, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                    documents: torch.Tensor | None) -> torch.Tensor:
    """The core on whole rows ``[B, S, ...]``, from zeros at every document (``documents [B, S]`` ids; ``None``:
    one document per row)."""
    if documents is None:
        return run_core(params, mixed, b, a, None, None)[0]
    rows = []
    for i in range(mixed.shape[0]):
        pieces = [run_core(params, mixed[i : i + 1, s:e], b[i : i + 1, s:e], a[i : i + 1, s:e], None, None)[0]
                  for s, e in _segments(documents, i, mixed.shape[1])]
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0)


# ---------------------------------------------------------------------------------------------------------
# Ulysses: head shard


def _segments(document_ids: torch.Tensor | None, row: int, seq_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of one document id in ``document_ids[row]`` (the whole row without documents)."""
    if document_ids is None:
        return [(0, seq_len)]
    ids = document_ids[row]
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, seq_len]
    return list(zip(bounds[:-1], bounds[1:]))


def _ulysses_forward(mixer: torch.nn.Module, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
    world, rank, group = ctx.world_size, ctx.rank, ctx.group
    hk, hv = mixer.num_k_heads, mixer.num_v_heads
    if hk % world:
        raise CPUnsupportedError(
            f"distributed.cp_method=ulysses: {type(mixer).__name__} has linear_num_key_heads={hk}, not divisible by "
            f"cp_size={world}; Ulysses shards the linear-attention heads: set cp_size to a divisor of {hk}, or use "
            "distributed.cp_method=thd"
        )
    if ctx.padding_mask is not None:
        hidden = hidden * ctx.shard(ctx.padding_mask.to(hidden.device), 1)[..., None].to(hidden.dtype)
    mixed, z, b, a = project(mixer, hidden)
    bsz, n = mixed.shape[:2]
    kd = mixer.key_dim
    q, k, v = torch.split(mixed, [kd, kd, mixer.value_dim], dim=-1)
    heads = [q.reshape(bsz, n, hk, -1), k.reshape(bsz, n, hk, -1), v.reshape(bsz, n, hv, -1), b, a]
    seq = ctx.seq_len
    q, k, v, b, a = (all_to_all(x, group, scatter_dim=2, gather_dim=1, gather_size=seq) for x in heads)
    mixed = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)  # [B, S, C/W]
    lk, lv = hk // world, hv // world
    params = core_params(mixer, slice(rank * lk, (rank + 1) * lk), slice(rank * lv, (rank + 1) * lv))
    out = _documents_core(params, mixed, b, a, ctx.document_ids)  # [B, S, Hv/W, dv]
    out = all_to_all(out, group, scatter_dim=1, gather_dim=2)  # [B, S/W, Hv, dv]
    return finish(mixer, out, z)


# ---------------------------------------------------------------------------------------------------------
# thd: the state chain


def _thd_forward(mixer: torch.nn.Module, hidden: torch.Tensor, plan: Any) -> torch.Tensor:
    if hidden.shape[0] != 1 or hidden.shape[1] != plan.local_tokens:
        raise ValueError(
            f"{type(mixer).__name__} under thd expects this rank's {plan.local_tokens} tokens as one row, got "
            f"{tuple(hidden.shape[:2])}; feed the model the batch returned by make_thd_batch_and_ctx"
        )
    if mixer.conv1d.bias is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method=thd: {type(mixer).__name__} has a conv bias, which the chained kernel does not "
            "differentiate; use distributed.cp_method=ulysses"
        )
    mixed, z, b, a = project(mixer, hidden)
    if plan.world_size == 1:  # one rank: every document whole, from zeros
        params = core_params(mixer)
        pieces = [run_core(params, mixed[:, off : off + c], b[:, off : off + c], a[:, off : off + c], None, None)[0]
                  for _, c, off in plan.documents()]
        return finish(mixer, torch.cat(pieces, dim=1), z)
    docs = [(off, c) for _, c, off in plan.documents()]
    out = _ChainedCore.apply(mixed, b, a, mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer, plan, docs)
    return finish(mixer, out, z)


def _ring_forward(mixer: torch.nn.Module, hidden: torch.Tensor, layout: Any) -> torch.Tensor:
    if mixer.conv1d.bias is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method=ring: {type(mixer).__name__} has a conv bias, which the chained kernel does "
            "not differentiate; use distributed.cp_method=ulysses"
        )
    if hidden.shape[1] % 2:
        raise ValueError(f"ring CP holds two equal chunks per rank, got {hidden.shape[1]} local tokens")
    mixed, z, b, a = project(mixer, hidden)
    docs = [(0, hidden.shape[1] // 2)]
    out = _ChainedCore.apply(mixed, b, a, mixer.conv1d.weight, mixer.A_log, mixer.dt_bias, mixer, layout, docs)
    return finish(mixer, out, z)


class _ChainedCore(torch.autograd.Function):
    """The sequence core of every local chunk, chained across the ranks in sequence order (module docstring).

    Inputs: ``mixed [B, T/W, C]``, ``b``, ``a`` ``[B, T/W, Hv]``, the conv weight ``[C, 1, K]``, ``A_log`` and
    ``dt_bias`` ``[Hv]``; ``docs``: ``(local_offset, chunk)`` per document (this rank's chunk r at
    ``[off, off+c)``, chunk 2W-1-r at ``[off+c, off+2c)``; thd: B = 1 and one entry per packed document; ring: B rows of one document each).
    Output ``[B, T/W, Hv, dv]``; messages hold ``[n_docs * B, ...]``, documents major.
    """

    @staticmethod
    def forward(ctx, mixed, b, a, weight, A_log, dt_bias, mixer, plan, docs):  # type: ignore[override]
        world, rank = plan.world_size, plan.rank
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (mixed, b, a, weight, A_log, dt_bias)]
        # The inner graph keeps its own tensors: activation checkpointing's hooks must not see them, or its
        # recompute could stop inside this function on one rank and leave the peer waiting for a message.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            m, bb, aa, w, al, dt = leaves
            params = CoreParams(mixer, w.squeeze(1), mixer.conv1d.bias, al, dt, mixer.key_dim, mixer.value_dim)
            n_docs, rows = len(docs), m.shape[0]
            like = [((n_docs * rows, params.channels, params.kernel - 1), m.dtype),
                    ((n_docs * rows, mixer.num_v_heads, params.dk, params.dv), torch.float64)]

            def stage(offsets, inits):
                outs, halos, states = [], [], []
                for (off, c), (halo, state) in zip(offsets, inits):
                    o, h, s = run_core(params, m[:, off : off + c], bb[:, off : off + c], aa[:, off : off + c], halo, state)
                    outs.append(o)
                    halos.append(h)
                    states.append(s)
                return outs, halos, states

            def received(src):
                halo, state = (t.requires_grad_(True) for t in recv_state(plan.group, like, src, m.device))
                return halo, state, list(zip(per_document(halo, n_docs), per_document(state, n_docs)))

            head_in = None
            if rank > 0:
                head_in = received(rank - 1)
                inits = head_in[2]
            else:
                inits = [(None, None)] * n_docs
            head_out, head_halo, head_state = stage([(off, c) for off, c in docs], inits)
            tail_in = None
            if rank < world - 1:
                send_state(plan.group, [torch.cat(head_halo), torch.cat(head_state)], rank + 1)
                tail_in = received(rank + 1)
                inits = tail_in[2]
            else:  # chunk W-1 and chunk W are both here: the state passes without a message
                inits = list(zip(head_halo, head_state))
            tail_out, tail_halo, tail_state = stage([(off + c, c) for off, c in docs], inits)
            if rank > 0:
                send_state(plan.group, [torch.cat(tail_halo), torch.cat(tail_state)], rank - 1)
        out = torch.cat([t for pair in zip(head_out, tail_out) for t in pair], dim=1) if docs else m.new_zeros(0)
        ctx.saved = (leaves, head_in, tail_in, head_out, tail_out, head_halo, head_state, tail_halo, tail_state)
        ctx.plan, ctx.docs, ctx.like = plan, docs, like
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        leaves, head_in, tail_in, head_out, tail_out, head_halo, head_state, tail_halo, tail_state = ctx.saved
        ctx.saved = None
        plan, docs, like = ctx.plan, ctx.docs, ctx.like
        world, rank = plan.world_size, plan.rank
        n_docs = len(docs)
        wanted = [t for t in leaves if t.requires_grad]
        totals: dict[int, torch.Tensor] = {}

        def grad_slices(offsets):
            return [grad_out[:, off : off + c] for off, c in offsets]

        def run(outputs, grads, extra):
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            inputs = wanted + extra
            got = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
            for t, g in zip(wanted, got[: len(wanted)]):
                if g is not None:
                    totals[id(t)] = totals[id(t)] + g if id(t) in totals else g
            return got[len(wanted) :]

        head_offsets = [(off, c) for off, c in docs]
        tail_offsets = [(off + c, c) for off, c in docs]
        device = grad_out.device
        tail_grads = [None] * (2 * n_docs)
        if rank > 0:  # the gradient of the tail state this rank sent to rank - 1
            g_halo, g_state = recv_state(plan.group, like, rank - 1, device)
            tail_grads = per_document(g_halo, n_docs) + per_document(g_state, n_docs)
        tail_outputs = tail_out + (tail_halo + tail_state if rank > 0 else [])
        tail_grad_list = grad_slices(tail_offsets) + (tail_grads if rank > 0 else [])
        if rank < world - 1:
            extra = [tail_in[0], tail_in[1]]
            g_halo, g_state = run(tail_outputs, tail_grad_list, extra)
            send_state(plan.group, [_or_zeros(g_halo, tail_in[0]), _or_zeros(g_state, tail_in[1])], rank + 1)
            g_halo, g_state = recv_state(plan.group, like, rank + 1, device)
            head_outputs = head_out + head_halo + head_state
            head_grad_list = grad_slices(head_offsets) + per_document(g_halo, n_docs) + per_document(g_state, n_docs)
        else:  # the last rank: head and tail are one graph
            head_outputs = head_out + tail_outputs
            head_grad_list = grad_slices(head_offsets) + tail_grad_list
        extra = [head_in[0], head_in[1]] if rank > 0 else []
        got = run(head_outputs, head_grad_list, extra)
        if rank > 0:
            send_state(plan.group, [_or_zeros(got[0], head_in[0]), _or_zeros(got[1], head_in[1])], rank - 1)
        result = [totals.get(id(t)) if t.requires_grad else None for t in leaves]
        return (*result, None, None, None)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad
