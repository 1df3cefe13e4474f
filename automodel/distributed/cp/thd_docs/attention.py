"""Attention for the document placement (``distributed.cp_method: thd_docs``): whole documents stay local.

Each CP rank computes the tokens :func:`~automodel.distributed.cp.thd_docs.placement.plan_documents` gave it,
as one row ``[1, T_r]`` (``T_r`` may differ between ranks) with the tokens' global per-document
``position_ids``. The attention registered here (:data:`DOC_ATTN_NAME`) computes, for every local piece:

- a **whole document**: causal attention over its own tokens, one block
  (:mod:`automodel.distributed.cp.blocks`: the CPU flash kernel on CPU, torch's fused kernels on CUDA), no
  communication at all;
- a **chunk of a split document** (head-tail over the ``k`` ranks of its span): the chunk's diagonal
  block (causal) and its prefix in the document (no mask), merged with their log-sum-exp
  (:mod:`automodel.distributed.cp.blocks`), as ring attention does. On CUDA all diagonal blocks and all prefix
  blocks of a call each run as ONE packed-row cuDNN call where torch runs that call
  (:mod:`automodel.distributed.cp.block_sets`; the key stream is the local K/V followed by the borrowed chunks). The prefix's K/V are lent by the
  other ranks of the span point to point (:mod:`automodel.distributed.cp.exchange.p2p`):
  each sends its head chunk to every other span rank and its tail chunk only to the span ranks before
  it (only they attend to it). No other rank takes part.

Every layer kind that ``thd`` computes runs here too, chosen per call by the shared router
(:func:`~automodel.distributed.cp.layers.strategy.run_layer`): per-head sinks join the merged log-sum-exp
once (:func:`~automodel.distributed.cp.blocks.merge_sinks`), softcapping (where the eager reference applies
it) and MLA's unequal value heads run in the same blocks; a sliding window or attention chunk shorter than
the longest document runs the halo kernel (:func:`~automodel.distributed.cp.layers.masked_attention.
halo_attention`) on the placement's token layout (:meth:`DocPlan.token_layout`): a whole document is
computed on its rank with nothing exchanged, a split one receives only the keys its window or chunk
reaches, point to point from the ranks of its span; Llama 4's query temperature is taken at the
in-document position.

The autograd function saves only local tensors (q, k, v, out, LSE: memory ``O(T_r)``, no ``S^2``
term); the backward exchanges the split documents' K/V again, runs each block's kernel backward with
the merged output and LSE (exact), and returns the dK/dV of borrowed chunks to their owners.

Used like THD attention (:mod:`automodel.distributed.cp.thd.attention`): ``set_doc_attention(model)`` once
(``cp.thd_docs.model_cost(model)`` gives the placement's cost model), then per step
``ctx_factory, local = make_doc_batch_and_ctx(device_mesh, batch, cost=cost)`` and the forward / backward
inside ``with ctx_factory():``; the ranks hold different token counts, so normalise the loss by the
global label count and all-reduce (SUM) the parameter gradients over the CP group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from automodel.distributed.cp import active, hf_attention
from automodel.distributed.cp.batch_forms import check_batch_forms
from automodel.distributed.cp.block_sets import BlockSet, sets_backward, sets_forward
from automodel.distributed.cp.blocks import block_backward, block_forward, merge, merge_sinks
from automodel.distributed.cp.exchange.p2p import give_back, lend
from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.cp.layers.strategy import NATIVE_MLA, NATIVE_SINKS, NATIVE_SOFTCAP, run_layer
from automodel.distributed.cp.layout import TokenLayout, head_tail_pair
from automodel.distributed.cp.thd_docs.placement import CostModel, Placement, plan_documents, split_chunks
from automodel.errors import CPUnsupportedError

__all__ = [
    "DOC_ATTN_NAME",
    "DocPlan",
    "batch_documents",
    "current_doc_plan",
    "doc_attention",
    "doc_attention_forward",
    "doc_context",
    "make_doc_batch_and_ctx",
    "register_doc_attention",
    "set_doc_attention",
]

#: The name under which document-placement attention is registered in transformers' ``AttentionInterface``.
DOC_ATTN_NAME = "thd_docs"
_METHOD = "thd_docs"
_SEQ_LENS_PAD = -1000

# A block of local queries: (q_off, n, doc, start): local tokens [q_off, q_off + n) are the document's
# tokens [start, start + n); doc is None for a whole local document (its keys are the same local tokens).
Block = tuple[int, int, "int | None", int]


@dataclass
class DocPlan:
    """One step's placement as one CP rank sees it.

    Attributes:
        group, world_size, rank: the CP group (``None`` at world size 1), its size, this rank.
        placement: the :class:`Placement` of the batch's documents (identical on every CP rank).
        max_seqlen: the longest document.
        calls: attention calls run under this plan (the forgotten-switch check).
    """

    group: ProcessGroup | None
    world_size: int
    rank: int
    placement: Placement
    max_seqlen: int
    calls: int = 0
    blocks: list[Block] = field(default_factory=list, repr=False)
    # split documents this rank spans: doc -> (chunks, own chunk index -> local offset)
    split: dict[int, tuple[list[tuple[int, int]], dict[int, int]]] = field(default_factory=dict, repr=False)
    _layout: TokenLayout | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        at = 0
        for piece in self.placement.ranks[self.rank]:
            if piece.doc in self.placement.spans:
                span = self.placement.spans[piece.doc]
                chunks, own = self.split.setdefault(
                    piece.doc, (split_chunks(self.placement.lengths[piece.doc], len(span)), {})
                )
                own[chunks.index((piece.start, piece.end))] = at
                self.blocks.append((at, piece.length, piece.doc, piece.start))
            else:
                self.blocks.append((at, piece.length, None, 0))
            at += piece.length
        self.local_tokens = at
        for doc, (_, own) in self.split.items():  # an empty tail chunk still has a (zero-size) place
            span = self.placement.spans[doc]
            for c in head_tail_pair(span.index(self.rank), len(span)):
                own.setdefault(c, 0)

    # ---- the lend table (automodel.distributed.cp.exchange.p2p): the same rule on both ends of every message
    def messages(self, sender: int, receiver: int) -> list[tuple[int, int]]:
        """``(doc, chunk index)`` that ``sender`` lends ``receiver`` per K/V exchange, in message order: its head
        chunk of every split document they share, and its tail chunk if ``sender`` comes later in the span."""
        out = []
        for doc in sorted(self.placement.spans):
            span = self.placement.spans[doc]
            if sender in span and receiver in span and sender != receiver:
                j, i, k = span.index(sender), span.index(receiver), len(span)
                head, tail = head_tail_pair(j, k)
                out.append((doc, head))
                if j > i:
                    out.append((doc, tail))
        return out

    def token_layout(self) -> TokenLayout:
        """The placement as a :class:`~automodel.distributed.cp.layout.TokenLayout` (cached): a document's tokens
        are numbered from its offset in the batch (documents in batch order), each rank's ids in its local
        order; the halo kernel of windows and chunks runs on it, and its halo travels point to point between
        the ranks of a split document's span only (``halo_transport="p2p"``)."""
        if self._layout is None:
            lengths = torch.tensor(self.placement.lengths, dtype=torch.int64)
            offsets = torch.cumsum(lengths, 0) - lengths
            rank_ids = [
                torch.cat([torch.arange(p.start, p.end) + int(offsets[p.doc]) for p in pieces])
                if pieces else torch.empty(0, dtype=torch.int64)
                for pieces in self.placement.ranks
            ]
            doc_start = torch.repeat_interleave(offsets, lengths)
            self._layout = TokenLayout(
                self.group, self.world_size, self.rank, rank_ids, doc_start, halo_transport="p2p"
            )
        return self._layout

    def peers(self) -> list[int]:
        return sorted({r for doc in self.split for r in self.placement.spans[doc] if r != self.rank})

    def size(self, key: tuple[int, int]) -> int:
        a, b = self.split[key[0]][0][key[1]]
        return b - a

    def offset(self, key: tuple[int, int]) -> int:
        return self.split[key[0]][1][key[1]]

    def prefix(
        self, doc: int, start: int, kv: torch.Tensor, got: dict
    ) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """The chunks ``[(key, [1, H, n, D])]`` of document ``doc`` before token ``start``, in order."""
        chunks, own = self.split[doc]
        out = []
        for c, (a, b) in enumerate(chunks):
            if b > start:
                break
            if b > a:
                out.append(((doc, c), kv[:, :, own[c] : own[c] + b - a] if c in own else got[(doc, c)]))
        return out




def current_doc_plan() -> DocPlan | None:
    """The innermost active :class:`DocPlan`, or ``None``."""
    return active.current(_METHOD)


def doc_context(plan: DocPlan, *, require_attention: bool = True) -> contextlib.AbstractContextManager[DocPlan]:
    """Make ``plan`` active for document-placement attention inside the block; with ``require_attention``
    a block that ran no such attention call raises ``RuntimeError`` on exit (the model was not switched)."""
    return active.activate(
        _METHOD, plan, require_attention=require_attention,
        message=(
            "no document-placement attention ran inside its context: the model still uses another attention "
            "implementation, so each CP rank attended only within its own tokens. Call set_doc_attention(model) "
            f"(attn implementation {DOC_ATTN_NAME!r}) before the forward pass"
        ),
    )


# ---------------------------------------------------------------------------------------------------------
# the kernel: full causal attention per document (whole ones local, split ones over their span)


def _split(kv: torch.Tensor, dqk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``[1, Hkv, n, Dqk + Dv]`` (concatenated on the last dim: one message per peer, MLA too)."""
    return kv[..., :dqk], kv[..., dqk:]


def _stream(kv: torch.Tensor, got: dict, plan: DocPlan):
    """The key stream of the packed calls: the local ``kv`` then every borrowed chunk (token-major
    ``[T_r + lent, Hkv, Dqk + Dv]``), each borrowed chunk's ``(key, start)`` in it, and the two
    :class:`~automodel.distributed.cp.block_sets.BlockSet` (prefix blocks, diagonal blocks) on it."""
    at, where = kv.shape[2], {}
    for key, t in got.items():
        where[key] = at
        at += t.shape[2]
    prefix, diag = [], []
    for q_off, n, doc, start in plan.blocks:
        diag.append((q_off, n, [(q_off, n)]))
        if doc is None or start == 0:
            continue
        chunks, own = plan.split[doc]
        runs = []
        for c, (a, b) in enumerate(chunks):
            if b > start:
                break
            if b > a:
                runs.append((own[c] if c in own else where[(doc, c)], b - a))
        prefix.append((q_off, n, runs))
    stream = torch.cat([kv, *got.values()], 2)[0].transpose(0, 1) if got else kv[0].transpose(0, 1)
    sets = [BlockSet.of(False, prefix, kv.device), BlockSet.of(True, diag, kv.device)]
    return stream, where, sets


def _packed_forward(q, kv, dqk, plan: DocPlan, got, scale, softcap):
    """The prefix and the diagonal blocks each in one packed-row call (:mod:`~automodel.distributed.cp.block_sets`),
    or ``None`` where no packed call applies."""
    if softcap or kv.shape[-1] != 2 * dqk:  # no packed call takes soft-capping or unequal value heads (MLA)
        return None
    stream, _, sets = _stream(kv, got, plan)
    got_ = sets_forward(q[0].transpose(0, 1), stream[..., :dqk], stream[..., dqk:], sets, scale)
    if got_ is None:
        return None
    return got_[0].transpose(0, 1).unsqueeze(0), got_[1].transpose(0, 1).unsqueeze(0).contiguous()


def _packed_backward(dout, q, kv, dqk, out, lse, plan: DocPlan, got, scale, softcap):
    """:func:`_packed_forward`'s backward: ``(dq, dkv)`` with the borrowed chunks' dK/dV given back, or ``None``."""
    if softcap or kv.shape[-1] != 2 * dqk:
        return None
    stream, where, sets = _stream(kv, got, plan)
    tok = [x[0].transpose(0, 1) for x in (dout, q, out)]
    grads = sets_backward(tok[0], tok[1], stream[..., :dqk], stream[..., dqk:], tok[2], lse[0].transpose(0, 1), sets,
                          scale)  # fmt: skip
    if grads is None:
        return None
    dstream = torch.cat(grads[1:], -1).transpose(0, 1).unsqueeze(0)  # [1, Hkv, T_r + lent, Dqk + Dv]
    t = kv.shape[2]
    lent = {key: dstream[:, :, at : at + got[key].shape[2]].contiguous() for key, at in where.items()}
    dkv = dstream[:, :, :t].contiguous()
    give_back(plan, lent, dkv)  # adds what the peers return for this rank's lent chunks into dkv
    return grads[0].transpose(0, 1).unsqueeze(0).contiguous(), dkv


def _forward(q, kv, dqk, plan: DocPlan, got, scale, softcap):
    packed = _packed_forward(q, kv, dqk, plan, got, scale, softcap)
    if packed is not None:
        b, h, t, _ = q.shape
        out = q.new_empty((b, t, h, kv.shape[-1] - dqk)).transpose(1, 2)  # transformers' [B, T, H, Dv] underneath
        out.copy_(packed[0])
        return out, packed[1]
    b, h, t, _ = q.shape
    out = q.new_empty((b, t, h, kv.shape[-1] - dqk)).transpose(1, 2)  # transformers' [B, T, H, Dv] underneath
    lse = None
    for q_off, n, doc, start in plan.blocks:
        sl = slice(q_off, q_off + n)
        k, v = _split(kv[:, :, sl], dqk)
        o, lse_b = block_forward(q[:, :, sl], k, v, causal=True, scale=scale, softcap=softcap)
        if doc is not None and start > 0:
            pk, pv = _split(torch.cat([t for _, t in plan.prefix(doc, start, kv, got)], 2), dqk)
            op, lp = block_forward(q[:, :, sl], pk, pv, scale=scale, softcap=softcap)
            o, lse_b = merge(op, lp, o, lse_b)
        if lse is None:
            lse = q.new_empty(q.shape[:3], dtype=lse_b.dtype)
        out[:, :, sl] = o
        lse[:, :, sl] = lse_b
    return out, lse


def _backward(dout, q, kv, dqk, out, lse, plan: DocPlan, got, scale, softcap):
    packed = _packed_backward(dout, q, kv, dqk, out, lse, plan, got, scale, softcap)
    if packed is not None:
        return packed
    dq = torch.zeros_like(q)
    dkv = torch.zeros_like(kv)
    lent: dict[tuple[int, int], torch.Tensor] = {}
    for q_off, n, doc, start in plan.blocks:
        sl = slice(q_off, q_off + n)
        args = (dout[:, :, sl].contiguous(), q[:, :, sl])
        tail = (out[:, :, sl].contiguous(), lse[:, :, sl].contiguous())
        k, v = _split(kv[:, :, sl], dqk)
        g = block_backward(*args, k, v, *tail, causal=True, scale=scale, softcap=softcap)
        dq[:, :, sl] += g[0]
        dkv[:, :, sl] += torch.cat(g[1:], -1)
        if doc is None or start == 0:
            continue
        parts = plan.prefix(doc, start, kv, got)
        pk, pv = _split(torch.cat([t for _, t in parts], 2), dqk)
        g = block_backward(*args, pk, pv, *tail, scale=scale, softcap=softcap)
        dq[:, :, sl] += g[0]
        dp, at = torch.cat(g[1:], -1), 0
        own = plan.split[doc][1]
        for key, t in parts:
            m = t.shape[2]
            if key[1] in own:
                dkv[:, :, own[key[1]] : own[key[1]] + m] += dp[:, :, at : at + m]
            else:
                lent[key] = lent[key] + dp[:, :, at : at + m] if key in lent else dp[:, :, at : at + m]
            at += m
    for key, t in got.items():  # every borrowed chunk gets an answer, zero where nobody attended to it
        lent.setdefault(key, torch.zeros_like(t))
    give_back(plan, lent, dkv)
    return dq, dkv


def _sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``[Hq]``: the sinks' gradient from the final (sink-merged) ``out`` / ``lse``: the sink is a key with a
    zero value, so ``d sink_h = -sum_i exp(sink_h - lse_i) * rowsum(dout_i * out_i)``."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    p = torch.exp(sinks.to(lse.dtype).reshape(1, -1, 1) - lse)
    return -(p * delta).sum((0, 2)).to(sinks.dtype)


class _DocAttention(torch.autograd.Function):
    """The document blocks of one call; saves only this rank's q, k, v, sinks, the output and the LSE (the split
    documents' K/V are lent again in the backward, their dK/dV given back)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: DocPlan, scale, softcap):  # type: ignore[override]
        dqk = k.shape[-1]
        kv = torch.cat([k, v], -1)  # [1, Hkv, T_r, Dqk + Dv]: one message per peer
        out, lse = _forward(q, kv, dqk, plan, lend(plan, kv), scale, softcap)
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)  # the sink: one more softmax column, in the LSE
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.plan, ctx.scale, ctx.softcap = plan, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, sinks, out, lse = ctx.saved_tensors
        dqk, plan = k.shape[-1], ctx.plan
        kv = torch.cat([k, v], -1)
        dq, dkv = _backward(dout, q, kv, dqk, out, lse, plan, lend(plan, kv), ctx.scale, ctx.softcap)
        dsinks = _sink_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dkv[..., :dqk], dkv[..., dqk:], dsinks, None, None, None


def doc_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: DocPlan,
    scale: float | None = None,
    *,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Exact causal attention of this rank's tokens within their documents under ``plan``.

    Args:
        query: ``[1, Hq, T_r, Dqk]``; key: ``[1, Hkv, T_r, Dqk]``; value: ``[1, Hkv, T_r, Dv]`` (``Hq % Hkv == 0``;
            ``Dv`` may differ: MLA), this rank's tokens in the order :func:`make_doc_batch_and_ctx` lays them out.
        scale: softmax scale (``None``: ``1/sqrt(Dqk)``).
        sinks: ``[Hq]`` per-head sink logits (gpt-oss), merged once into every query's log-sum-exp.
        softcap: logits soft-capped as ``softcap * tanh(s / softcap)`` (Gemma 2).

    Returns:
        ``[1, Hq, T_r, Dv]``, differentiable w.r.t. query, key, value and sinks.
    """
    hf_attention.check_local_row(query, key, plan.local_tokens, "document-placement attention", "make_doc_batch_and_ctx")
    return _DocAttention.apply(query, key, value, sinks, plan, scale, softcap)


#: what the document blocks apply themselves on full layers (the rest runs the halo kernel: cp/layers)
_NATIVE_APPLIES = frozenset({NATIVE_SINKS, NATIVE_SOFTCAP, NATIVE_MLA})


def _doc_call(call: hf_attention.AttentionCall) -> tuple[torch.Tensor, None]:
    """One transformers attention call under the active :class:`DocPlan` (registered as ``"thd_docs"``).

    Returns ``([1, T_r, Hq, Dv], None)``. Each layer runs the kernel of its kind (:func:`~automodel.distributed.cp.layers.
    strategy.run_layer`): full layers (sinks, softcapping and MLA value heads included) the document blocks
    above; sliding windows and attention chunks shorter than the longest document the halo kernel on the
    placement's :class:`~automodel.distributed.cp.layout.TokenLayout` (a whole local document needs no halo;
    a split one exchanges only the keys its window reaches, point to point within its span); Llama 4's query
    temperature at the in-document position. Refuses (``ValueError`` / ``CPUnsupportedError``) a mask,
    dropout, a non-causal module and attention biases.
    """
    plan = hf_attention.enter_call(_METHOD, DOC_ATTN_NAME, "its context", "make_doc_batch_and_ctx")
    name, kwargs = call.module_name, call.kwargs
    if call.attention_mask is not None:
        raise ValueError(
            "document-placement attention received an attention mask; document boundaries come from the packed "
            "layout (seq_lens / seq_lens_padded). Do not pass attention_mask to the model"
        )
    if call.dropout:
        raise ValueError(
            f"document-placement attention does not implement attention dropout (got {call.dropout}); set the model's attention_dropout to 0"
        )
    if call.is_causal is False or getattr(call.module, "is_causal", True) is False:
        raise ValueError(f"{name} is not causal; document-placement attention computes causal attention only")
    if kwargs.get("position_bias") is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method={DOC_ATTN_NAME}: {name} uses attention biases, which document-placement "
            "attention does not apply, nor do ulysses and thd (they refuse such biases too); train this model with "
            "distributed.cp_size=1 (docs/support_matrix.md)"
        )

    def native(q, k, v, scale, sinks=None, softcap=None):
        return doc_attention(q, k, v, plan, scale, sinks=sinks, softcap=softcap).transpose(1, 2).contiguous()

    out = run_layer(
        call.module, call.query, call.key, call.value, kwargs, layout=plan.token_layout(), native=native,
        method=_METHOD, scaling=call.scaling, dropout=call.dropout, apply_softcap=True, native_applies=_NATIVE_APPLIES,
    )
    return out, None


doc_attention_forward = hf_attention.hf_attention_function(_doc_call, "doc_attention_forward")


def register_doc_attention(name: str = DOC_ATTN_NAME) -> str:
    """Register :func:`doc_attention_forward` in transformers' ``AttentionInterface`` (idempotent; not as a
    mask implementation, so transformers builds no mask and passes ``attention_mask=None``)."""
    return hf_attention.register_attention(name, doc_attention_forward)


def set_doc_attention(model: torch.nn.Module, device_mesh: Any = None) -> str:
    """Switch an HF model to document-placement attention (mutates it); returns the previous implementation.

    Raises:
        CPUnsupportedError: a layer kind it does not compute exactly (the message names the layers and the
            methods that would), or a model whose attention cannot be swapped.
        ValueError: not a transformers model.
    """
    del device_mesh
    hf_attention.require_hf_model(
        model,
        f", so its attention cannot be swapped for {DOC_ATTN_NAME!r}; call "
        "automodel.distributed.cp.thd_docs.attention.doc_attention from your own attention module",
    )
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp(DOC_ATTN_NAME, cached_profile(model), seq_len=None)
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
    from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention

    install_linear_mixers(model, cached_profile(model), DOC_ATTN_NAME)  # docs/linear_mixers.md
    install_sparse_attention(model, cached_profile(model))  # DSA: latent KV and indexer keys gathered
    from automodel.distributed.cp.layers.alibi import dispatch_alibi_layers

    if dispatch_alibi_layers(model, {_METHOD: DOC_ATTN_NAME}):  # BLOOM, MPT: their ALiBi layers, inside a context
        register_doc_attention()
        return model.config._attn_implementation
    return hf_attention.switch_attention(
        model, DOC_ATTN_NAME, doc_attention_forward, DOC_ATTN_NAME, alternative=": use distributed.cp_method=ring (unpacked rows)"
    )


# ---------------------------------------------------------------------------------------------------------
# the batch


def batch_documents(
    batch: dict[str, Any], seq_lens_padding_value: int = _SEQ_LENS_PAD
) -> tuple[list[int], list[int], list[int]]:
    """``(lengths, starts, real)`` of every document of a BSHD batch in the flattened ``[B*S]`` token stream.

    Packed rows give their documents by ``seq_lens_padded`` ``[B, P]`` (a document's pad slots and the
    row's trailing padding stay with it: they sit after its real tokens) and their real lengths by
    ``seq_lens``; a row without ``seq_lens_padded`` is one document of ``S`` tokens whose real ones are
    ``attention_mask``'s (right padding), else all of them.

    Raises:
        ValueError: a row whose ``seq_lens_padded`` do not add up to ``S``, a negative length, a real length
            outside ``[0, padded]``.
    """
    bsz, seq = batch["input_ids"].shape
    padded, lens, mask = batch.get("seq_lens_padded"), batch.get("seq_lens"), batch.get("attention_mask")
    lengths, starts, real = [], [], []
    for b in range(bsz):
        if padded is None:
            row = [seq]
            row_real = [int(mask[b].sum()) if isinstance(mask, torch.Tensor) else seq]
        else:
            keep = [j for j, n in enumerate(padded[b].tolist()) if n != seq_lens_padding_value]
            row = [int(padded[b, j]) for j in keep]
            row_real = [int(lens[b, j]) for j in keep] if lens is not None else list(row)
        if any(n < 0 for n in row) or sum(row) != seq:
            raise ValueError(
                f"row {b}: seq_lens_padded {row} must be non-negative and add up to the row length {seq}; the "
                "collator adds a row's trailing padding to its last document"
            )
        if any(not 0 <= r <= n for r, n in zip(row_real, row)):
            raise ValueError(f"row {b}: seq_lens {row_real} must lie in [0, seq_lens_padded] = {row}")
        at = b * seq
        for n, r in zip(row, row_real):
            if n:
                lengths.append(n)
                starts.append(at)
                real.append(r)
            at += n
    return lengths, starts, real


def _pads_carry_no_loss(batch: dict[str, Any], lengths: list[int], starts: list[int], real: list[int]) -> bool:
    """Whether every pad slot has label -100 (and ``loss_mask`` 0): then pads can be left out exactly (nothing
    real attends to them: they sit after their document's real tokens)."""
    labels = batch.get("labels")
    if not isinstance(labels, torch.Tensor) or sum(real) == sum(lengths):
        return False
    pad = torch.zeros(labels.numel(), dtype=torch.bool)
    for n, s, r in zip(lengths, starts, real):
        pad[s + r : s + n] = True
    pad = pad.to(labels.device)
    if bool((labels.reshape(-1)[pad] != -100).any()):
        return False
    loss_mask = batch.get("loss_mask")
    return not (isinstance(loss_mask, torch.Tensor) and bool(loss_mask.reshape(-1)[pad].bool().any()))


def make_doc_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    cost: CostModel | None = None,
    tolerance: float = 1.02,
    inner_attn: str | None = None,
    seq_lens_padding_value: int = _SEQ_LENS_PAD,
) -> tuple[Callable[[], contextlib.AbstractContextManager[DocPlan]], dict[str, Any]]:
    """Place a BSHD batch's documents on the CP ranks and return this rank's tokens and the attention context.

    Args:
        device_mesh: DeviceMesh with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None``.
        batch: identical on every CP rank: ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` (already
            shifted, -100 = ignore), optional ``position_ids`` ``[B, S]`` (or mRoPE ``[n, B, S]``; default: the
            position inside each document), ``loss_mask`` ``[B, S]``, packed rows ``seq_lens`` /
            ``seq_lens_padded`` ``[B, P]`` (``-1000`` = unused; no padding to any multiple is needed). Without
            ``seq_lens_padded`` each row is one document; ``attention_mask`` ``[B, S]``, if given, must be
            right padding (pads after the real tokens never reach a real token under causal attention).
        cost: the placement's cost model (default: :class:`CostModel` full attention with a per-token term for
            a model of 256-wide layers; the recipe passes the model's).
        tolerance: the placement's accepted imbalance (max rank cost / mean).
        inner_attn: accepted (the recipe binds the model's previous implementation) and unused.

    Returns:
        ``(ctx_factory, local)``: ``local`` holds ``input_ids``, ``labels``, ``position_ids``, ``loss_mask`` (if
        given), each ``[1, T_r]`` (mRoPE ``[n, 1, T_r]``), this rank's tokens in placement order, and
        ``placement`` (the :class:`Placement` of the documents' tokens). Pad slots (after ``seq_lens`` /
        ``attention_mask``'s real tokens) are left out when all their labels are -100 (and ``loss_mask`` 0):
        they change no loss and no real token attends to them; otherwise they are placed with their
        document. ``batch`` is not mutated.

    Raises:
        ValueError: ``input_ids`` missing, inconsistent ``seq_lens_padded``, left / inner padding in
            ``attention_mask``, fewer tokens than CP ranks.
    """
    check_batch_forms("thd_docs", batch)  # refuse what thd_docs does not compute exactly (docs/batch_forms.md)
    del inner_attn
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"the batch needs 'input_ids' [B, S]; got keys {sorted(batch)}")
    group, world, rank = resolve_cp_group(device_mesh)
    lengths, starts, real = batch_documents(batch, seq_lens_padding_value)
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.cat([torch.arange(n) for n in lengths]).to(ids.device).view(ids.shape)
    if sum(real) >= world and _pads_carry_no_loss(batch, lengths, starts, real):
        # pad slots predict nothing and no real token sees them: leave them out (no compute, no placement)
        kept = [(r, s) for r, s in zip(real, starts) if r > 0]
        lengths, starts = [r for r, _ in kept], [s for _, s in kept]
    placement = plan_documents(lengths, world, cost or _DEFAULT_COST, tolerance=tolerance)
    index = torch.cat(
        [torch.arange(starts[p.doc] + p.start, starts[p.doc] + p.end) for p in placement.ranks[rank]]
    ).to(ids.device)
    local: dict[str, Any] = {}
    for key in ("input_ids", "labels", "loss_mask"):
        if isinstance(batch.get(key), torch.Tensor):
            local[key] = batch[key].reshape(-1).index_select(0, index).unsqueeze(0)
    if pos.dim() == 3:  # mRoPE [n, B, S]
        local["position_ids"] = pos.reshape(pos.shape[0], -1).index_select(1, index).unsqueeze(1)
    else:
        local["position_ids"] = pos.expand(ids.shape).reshape(-1).index_select(0, index).unsqueeze(0)
    local["placement"] = placement
    plan = DocPlan(group, world, rank, placement, max(lengths))

    def ctx_factory() -> contextlib.AbstractContextManager[DocPlan]:
        return doc_context(plan)

    return ctx_factory, local


#: the own loop's default cost model: full attention of width 256 (set ``cost=`` for your model)
_DEFAULT_COST = CostModel.for_width(256)
