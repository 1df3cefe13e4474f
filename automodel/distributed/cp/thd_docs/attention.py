"""Attention for the document placement (``distributed.cp_method: thd_docs``): whole documents stay local.

Each CP rank computes the tokens :func:`~automodel.distributed.cp.thd_docs.placement.plan_documents` gave it,
as one row ``[1, T_r]`` (``T_r`` may differ between ranks) with the tokens' global per-document
``position_ids``. The attention registered here (:data:`DOC_ATTN_NAME`) computes, for every local piece:

- a **whole document**: causal attention over its own tokens, one block
  (:mod:`automodel.distributed.cp.blocks`: the CPU flash kernel on CPU, exact math blocks elsewhere), no
  communication at all;
- a **chunk of a split document** (head-tail over the ``k`` ranks of its span): the chunk's diagonal
  block (causal) and its prefix in the document (no mask), merged with their log-sum-exp
  (:mod:`automodel.distributed.cp.blocks`), as ring attention does. The prefix's K/V are lent by the
  other ranks of the span point to point (:mod:`automodel.distributed.cp.exchange.p2p`):
  each sends its head chunk to every other span rank and its tail chunk only to the span ranks before
  it (only they attend to it). No other rank takes part.

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
from automodel.distributed.cp.blocks import block_backward, block_forward, blocked_attention, merge
from automodel.distributed.cp.exchange.p2p import give_back, lend
from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.cp.layout import head_tail_pair
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
# the kernel


def _heads(x: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:, :n_kv], x[:, n_kv:]


def _forward(q, kv, n_kv, plan: DocPlan, got, scale):
    out = torch.empty_like(q)
    lse = None
    for q_off, n, doc, start in plan.blocks:
        sl = slice(q_off, q_off + n)
        k, v = _heads(kv[:, :, sl], n_kv)
        o, lse_b = block_forward(q[:, :, sl], k, v, causal=True, scale=scale)
        if doc is not None and start > 0:
            pk, pv = _heads(torch.cat([t for _, t in plan.prefix(doc, start, kv, got)], 2), n_kv)
            op, lp = block_forward(q[:, :, sl], pk, pv, scale=scale)
            o, lse_b = merge(op, lp, o, lse_b)
        if lse is None:
            lse = q.new_empty(q.shape[:3], dtype=lse_b.dtype)
        out[:, :, sl] = o
        lse[:, :, sl] = lse_b
    return out, lse


def _backward(dout, q, kv, n_kv, out, lse, plan: DocPlan, got, scale):
    dq = torch.zeros_like(q)
    dkv = torch.zeros_like(kv)
    lent: dict[tuple[int, int], torch.Tensor] = {}
    for q_off, n, doc, start in plan.blocks:
        sl = slice(q_off, q_off + n)
        args = (dout[:, :, sl].contiguous(), q[:, :, sl])
        tail = (out[:, :, sl].contiguous(), lse[:, :, sl].contiguous())
        k, v = _heads(kv[:, :, sl], n_kv)
        g = block_backward(*args, k, v, *tail, causal=True, scale=scale)
        dq[:, :, sl] += g[0]
        dkv[:, :, sl] += torch.cat(g[1:], 1)
        if doc is None or start == 0:
            continue
        parts = plan.prefix(doc, start, kv, got)
        pk, pv = _heads(torch.cat([t for _, t in parts], 2), n_kv)
        g = block_backward(*args, pk, pv, *tail, scale=scale)
        dq[:, :, sl] += g[0]
        dp, at = torch.cat(g[1:], 1), 0
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


class _DocScheme:
    """Document-placement attention as a :class:`~automodel.distributed.cp.blocks.BlockScheme`: the split
    documents' K/V lent in the forward and again in the backward, dK/dV of borrowed chunks given back."""

    def __init__(self, plan: DocPlan) -> None:
        self.plan = plan

    def forward(self, q, k, v, scale):
        kv = torch.cat([k, v], 1)  # [1, 2*Hkv, T_r, D]: one message per peer
        return _forward(q, kv, k.shape[1], self.plan, lend(self.plan, kv), scale)

    def backward(self, dout, q, k, v, out, lse, scale):
        kv, n_kv = torch.cat([k, v], 1), k.shape[1]
        dq, dkv = _backward(dout, q, kv, n_kv, out, lse, self.plan, lend(self.plan, kv), scale)
        return dq, dkv[:, :n_kv], dkv[:, n_kv:]


def doc_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: DocPlan, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention of this rank's tokens within their documents under ``plan``.

    Args:
        query: ``[1, Hq, T_r, D]``; key/value: ``[1, Hkv, T_r, D]`` (``Hq % Hkv == 0``), this rank's tokens in
            the order :func:`make_doc_batch_and_ctx` lays them out.
        scale: softmax scale (``None``: ``1/sqrt(D)``).

    Returns:
        ``[1, Hq, T_r, D]``, differentiable w.r.t. query, key and value.
    """
    hf_attention.check_local_row(query, key, plan.local_tokens, "document-placement attention", "make_doc_batch_and_ctx")
    return blocked_attention(query, key, value, _DocScheme(plan), scale)


def _doc_call(call: hf_attention.AttentionCall) -> tuple[torch.Tensor, None]:
    """:func:`doc_attention` with transformers' attention-function signature (registered as ``"thd_docs"``).

    Returns ``([1, T_r, Hq, D], None)``. Refuses (``ValueError`` / ``CPUnsupportedError``) a mask, dropout,
    a non-causal module, a window shorter than the longest document, sinks / biases and softcapping.
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
    window = kwargs.get("sliding_window")
    refused = None
    if window is not None and window < plan.max_seqlen:
        refused = (
            f"uses a sliding window of {window} tokens, shorter than the longest document ({plan.max_seqlen})"
        )
    elif (
        kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None or hasattr(call.module, "sinks")
    ):
        refused = "uses attention biases or sinks"
    elif kwargs.get("softcap") is not None:
        refused = "uses logit softcapping"
    if refused:
        raise CPUnsupportedError(
            f"distributed.cp_method={DOC_ATTN_NAME}: {name} {refused}, which document-placement attention does not "
            "apply; use distributed.cp_method=ulysses for this model (docs/support_matrix.md)"
        )
    out = doc_attention(call.query, call.key, call.value, plan, call.scaling)
    return out.transpose(1, 2), None


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
        "automodel.distributed.doc_attention.doc_attention from your own attention module",
    )
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp(DOC_ATTN_NAME, cached_profile(model), seq_len=None)
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers

    install_linear_mixers(model, cached_profile(model), DOC_ATTN_NAME)  # docs/linear_mixers.md
    return hf_attention.switch_attention(
        model, DOC_ATTN_NAME, doc_attention_forward, DOC_ATTN_NAME, alternative=": use distributed.cp_method=ulysses"
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
