"""The shared CP kernels of every :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel`.

- :func:`run_documents`: the core on whole documents held by this process, from zeros at every document
  (one process; Ulysses after its head shard; thd_docs' whole documents).
- :func:`head_shard` / :func:`head_unshard`: Ulysses' all-to-all from a sequence shard ``[B, S/W, H, d]`` to
  a head shard ``[B, S, H/W, d]`` and back (heads repeated first where ``H % W != 0``).
- :func:`run_chain` (:class:`ChainedCore`): the core over documents split across ranks, the state passed
  in sequence order (docs/linear_mixers.md "the chain").

**The chain.** A :class:`Chain` lists, per document, its pieces in sequence order as ``(owner rank, local
offset, length)`` (offsets matter only on the owner). Documents whose pieces visit the same rank sequence
form one *group*; group ``g``'s step ``j`` runs on rank ``ranks[j]`` for all its documents at once, and
passes one message (every document's state, documents major) to step ``j+1``'s rank, or none when both
steps are on the same rank (head-tail's turnaround). Every rank walks the groups in one global order
(sorted rank sequences) and each group's steps in sequence order, so the blocking sends and receives
pair up without deadlock: the earliest unfinished step, in that order, always has its predecessor done.
The backward walks the same steps in reverse and sends each received state's gradient back to its sender.
A piece of length 0 passes its state on unchanged; a document's first piece starts from ``None``.

The forward keeps the inner autograd graph of every step, outside activation checkpointing's saved-tensor
hooks, so that a checkpoint recompute cannot stop half-way through the chain on one rank (its peer would
wait for a message forever).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel.distributed.cp.exchange.state import recv_state, send_state
from automodel.distributed.cp.layers.mixer_kernel import HeadShard, MixerKernel
from automodel.distributed.sp.all_to_all import all_to_all

__all__ = [
    "Chain",
    "ChainedCore",
    "head_shard",
    "head_unshard",
    "join_unread",
    "row_segments",
    "run_chain",
    "run_documents",
    "chain_bytes_per_rank",
    "kept_bytes",
    "state_message_bytes",
]

Piece = tuple[int, int, int]  # (owner rank, local offset on the owner, length)


@dataclass
class Chain:
    """Documents split across the ranks of ``group``, as this rank (``rank``) sees them.

    Attributes:
        group: the process group the states travel on; ranks below are ranks of this group.
        rank: this rank in ``group``.
        documents: per document, its pieces in sequence order ``(owner, local_offset, length)``; every rank
            must list the same documents in the same order with the same owners (offsets: own pieces only).
    """

    group: Any
    rank: int
    documents: list[list[Piece]] = field(default_factory=list)

    def groups(self) -> list[tuple[tuple[int, ...], list[int]]]:
        """``(rank sequence, document indices)`` of every group, in the one global order."""
        by: dict[tuple[int, ...], list[int]] = {}
        for i, pieces in enumerate(self.documents):
            by.setdefault(tuple(owner for owner, _, _ in pieces), []).append(i)
        return sorted(by.items())

    def involves_me(self) -> bool:
        return any(owner == self.rank for pieces in self.documents for owner, _, _ in pieces)

    @classmethod
    def head_tail(cls, group: Any, rank: int, world: int, docs: Sequence[tuple[int, int]]) -> Chain:
        """Every document split into ``2W`` equal chunks, rank ``r`` holding chunks ``r`` and ``2W-1-r`` at
        local offsets ``off`` and ``off + c`` (``docs``: ``(off, c)`` per document; thd, ring, usp)."""
        order = [*range(world), *reversed(range(world))]
        documents = []
        for off, c in docs:
            pieces = []
            for j, owner in enumerate(order):
                pieces.append((owner, off if j < world else off + c, c) if owner == rank else (owner, -1, c))
            documents.append(pieces)
        return cls(group, rank, documents)


def row_segments(document_ids: torch.Tensor | None, row: int, seq_len: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of one document id in ``document_ids[row]`` (the whole row without documents)."""
    if document_ids is None:
        return [(0, seq_len)]
    ids = document_ids[row]
    cuts = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, seq_len]
    return list(zip(bounds[:-1], bounds[1:]))


def _piece(seq: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    return {k: v[:, start:end] for k, v in seq.items()}


class _JoinUnread(torch.autograd.Function):
    """``out`` unchanged, with a zero gradient for each of ``unread`` (:func:`join_unread`)."""

    @staticmethod
    def forward(ctx, out, *unread):  # type: ignore[override]
        ctx.like = [(t.shape, t.dtype, t.device) for t in unread]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like))


def join_unread(out: torch.Tensor, params: dict) -> torch.Tensor:
    """``out`` (the core's output, unchanged) joined to every empty parameter slice of ``params``
    (:meth:`MixerKernel.core_params` of a head shard that holds none of a parameter's rows: ZAYA's CCA rank whose
    heads are all delayed values reads no conv weight), so that the parameter gets a zero gradient on this rank,
    not none. Every rank must have gradients for the same parameters: FSDP2 reduce-scatters the gradients a rank
    has, so one rank without them sent a smaller buffer (ZAYA under Ulysses at cp 4: a collective size mismatch on
    gloo; on NCCL a hang or a garbled sum)."""
    unread = [t for t in params.values() if isinstance(t, torch.Tensor) and t.requires_grad and t.numel() == 0]
    return _JoinUnread.apply(out, *unread) if unread else out


def run_documents(
    kernel: MixerKernel,
    mixer: torch.nn.Module,
    params: dict,
    seq: dict[str, torch.Tensor],
    documents: torch.Tensor | list[tuple[int, int]] | None,
    shard: HeadShard | None = None,
) -> torch.Tensor:
    """The core on whole documents, each from zeros: ``seq`` ``[B, S, ...]``; ``documents``: ``[B, S]`` ids
    (a new document wherever the id changes), or ``[(start, end)]`` shared by every row, or ``None`` (one
    document per row). Returns ``[B, S, H_out, d]``."""
    any_t = next(iter(seq.values()))
    bsz, n = any_t.shape[:2]
    if documents is None or isinstance(documents, list):
        spans = documents if documents is not None else [(0, n)]
        out = torch.cat([kernel.core(mixer, params, _piece(seq, s, e), None, shard)[0] for s, e in spans if e > s],
                        dim=1)
    else:
        rows = []
        for i in range(bsz):
            row = {k: v[i : i + 1] for k, v in seq.items()}
            rows.append(torch.cat([kernel.core(mixer, params, _piece(row, s, e), None, shard)[0]
                                   for s, e in row_segments(documents, i, n)], dim=1))
        out = torch.cat(rows, dim=0)
    return join_unread(out, params)


# ---------------------------------------------------------------------------------------------------------
# the head shard


def head_shard(
    kernel: MixerKernel, mixer: torch.nn.Module, seq: dict[str, torch.Tensor], group: Any, shard: HeadShard,
    seq_len: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every core input ``[B, n, H, d]`` -> ``[B, N, H*f/W, d]`` (``N``: the group's tokens, ``seq_len`` or
    ``n*W``; ``f`` :meth:`HeadShard.factor`) with one all-to-all each over ``group`` (autograd-aware)."""
    counts = kernel.seq_heads(mixer)
    out = {}
    for name, x in seq.items():
        f = shard.factor(counts.get(name, 1))  # "mask": one head
        if f > 1:
            x = x.repeat_interleave(f, dim=2)
        out[name] = all_to_all(x, group, scatter_dim=2, gather_dim=1, gather_size=seq_len)
    return out


def head_unshard(out: torch.Tensor, group: Any) -> torch.Tensor:
    """The core's output ``[B, N, H/W, d]`` -> ``[B, N/W, H, d]`` (one all-to-all over ``group``)."""
    return all_to_all(out, group, scatter_dim=1, gather_dim=2)


# ---------------------------------------------------------------------------------------------------------
# the chain


def run_chain(
    kernel: MixerKernel,
    mixer: torch.nn.Module,
    params: dict,
    seq: dict[str, torch.Tensor],
    chain: Chain,
    shard: HeadShard | None = None,
    local: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The core on this rank's tokens ``seq [B, n, ...]``: the pieces of ``chain``'s split documents chained
    across ranks, and ``local`` whole documents ``[(start, end)]`` (from zeros, no exchange). Tokens in no
    piece get a zero output. Returns ``[B, n, H_out, d]`` (autograd-aware: gradients reach ``seq`` and
    ``params``)."""
    seq_names, param_names = list(seq), [k for k, v in params.items() if v is not None]
    tensors = [seq[k] for k in seq_names] + [params[k] for k in param_names]
    spec = _Spec(kernel, mixer, params, seq_names, param_names, chain, shard, local or [])
    return join_unread(ChainedCore.apply(spec, *tensors), params)


@dataclass
class _Spec:
    kernel: MixerKernel
    mixer: torch.nn.Module
    params: dict
    seq_names: list[str]
    param_names: list[str]
    chain: Chain
    shard: HeadShard | None
    local: list[tuple[int, int]]


class ChainedCore(torch.autograd.Function):
    """The core over a :class:`Chain` (module docstring); inputs: the spec, then the core inputs and the
    core parameters as flat tensors; output ``[B, n, H_out, d]``."""

    @staticmethod
    def forward(ctx, spec: _Spec, *tensors):  # type: ignore[override]
        kernel, mixer, chain = spec.kernel, spec.mixer, spec.chain
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
        n_seq = len(spec.seq_names)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            seq = dict(zip(spec.seq_names, leaves[:n_seq]))
            params = dict(spec.params)
            params.update(zip(spec.param_names, leaves[n_seq:]))
            any_t = leaves[0]
            bsz, n = any_t.shape[:2]
            like = kernel.state_like(mixer, params, bsz, any_t.dtype, spec.shard)
            outputs: list[tuple[int, int, torch.Tensor]] = []  # (offset, length, out)
            for s, e in spec.local:
                if e > s:
                    outputs.append((s, e - s, kernel.core(mixer, params, _piece(seq, s, e), None, spec.shard)[0]))
            steps = []  # per step of this rank: (inputs (leaves or None per doc), outputs (state per doc), peer info)
            for ranks, docs in chain.groups():
                carried: list[list[torch.Tensor] | None] | None = None  # states handed on inside this rank
                for j, owner in enumerate(ranks):
                    if owner != chain.rank:
                        continue
                    if j == 0:
                        inits = [None] * len(docs)
                    elif ranks[j - 1] == chain.rank:
                        inits = [[t.detach().requires_grad_(True) for t in st] for st in carried]
                    else:
                        got = recv_state(chain.group, _batched(like, len(docs)), ranks[j - 1], any_t.device)
                        inits = _split_docs([t.requires_grad_(True) for t in got], len(docs))
                    finals, outs = [], []
                    for d, init in zip(docs, inits):
                        _, off, length = chain.documents[d][j]
                        if length == 0:
                            state = init if init is not None else [
                                torch.zeros(shape, dtype=dtype, device=any_t.device) for shape, dtype in like]
                        else:
                            out, state = kernel.core(mixer, params, _piece(seq, off, off + length), init, spec.shard)
                            outputs.append((off, length, out))
                            outs.append(out)
                        finals.append(state)
                    steps.append((ranks, docs, j, inits, finals, outs))
                    carried = finals
                    last = j == len(ranks) - 1
                    if not last and ranks[j + 1] != chain.rank:
                        send_state(chain.group, _join_docs(finals), ranks[j + 1])
        if outputs:
            h, d = outputs[0][2].shape[2:]
            result = outputs[0][2].new_zeros(bsz, n, h, d)
            for off, length, out in outputs:
                result[:, off : off + length] = out.detach()
        else:
            result = any_t.new_zeros(bsz, n, kernel.out_heads(mixer), 0)
        ctx.spec, ctx.leaves, ctx.outputs, ctx.steps, ctx.like = spec, leaves, outputs, steps, like
        return result

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        spec, leaves, outputs, steps, like = ctx.spec, ctx.leaves, ctx.outputs, ctx.steps, ctx.like
        ctx.spec = ctx.leaves = ctx.outputs = ctx.steps = None
        chain = spec.chain
        wanted = [t for t in leaves if t.requires_grad]
        totals: dict[int, torch.Tensor] = {}
        out_grads = {id(o): grad_out[:, off : off + length] for off, length, o in outputs}
        pending: dict[int, torch.Tensor] = {}  # id(state tensor) -> its gradient

        def run(tensors, grads, extra):
            pairs = [(t, g) for t, g in zip(tensors, grads) if g is not None and t.requires_grad]
            if not pairs:
                return [None] * len(extra)
            got = torch.autograd.grad([t for t, _ in pairs], wanted + extra, [g for _, g in pairs], allow_unused=True)
            for t, g in zip(wanted, got[: len(wanted)]):
                if g is not None:
                    totals[id(t)] = totals[id(t)] + g if id(t) in totals else g
            return list(got[len(wanted) :])

        # every piece's output gets its slice of grad_out; a step's final states get the gradient of the
        # next step's inputs (received, or from the later step on this rank); whole local documents last
        in_steps: set[int] = set()
        for ranks, docs, j, inits, finals, piece_outs in reversed(steps):
            n = len(docs)
            last = j == len(ranks) - 1
            tensors, grads = [], []
            if not last:
                if ranks[j + 1] != chain.rank:
                    got = recv_state(chain.group, _batched(like, n), ranks[j + 1], grad_out.device)
                    for st, g in zip(finals, _split_docs(got, n)):
                        tensors += list(st)
                        grads += list(g)
                else:
                    for st in finals:
                        tensors += list(st)
                        grads += [pending.pop(id(t), None) for t in st]
            for o in piece_outs:
                in_steps.add(id(o))
            tensors += piece_outs
            grads += [out_grads[id(o)] for o in piece_outs]
            extra = [t for st in inits if st is not None for t in st]
            got = run(tensors, grads, extra)
            if j > 0:
                got_by_doc, at = [], 0
                for st in inits:
                    got_by_doc.append([_or_zeros(g, t) for g, t in zip(got[at : at + len(st)], st)])
                    at += len(st)
                if ranks[j - 1] != chain.rank:
                    send_state(chain.group, _join_docs(got_by_doc), ranks[j - 1])
                else:  # the previous step is here: its finals are these inputs' sources
                    prev_finals = next(f for r, d, jj, _, f, _ in steps if r == ranks and d == docs and jj == j - 1)
                    for st_src, st_g in zip(prev_finals, got_by_doc):
                        for t, g in zip(st_src, st_g):
                            pending[id(t)] = g
        rest = [o for o in outputs if id(o[2]) not in in_steps]
        if rest:
            run([o for _, _, o in rest], [out_grads[id(o)] for _, _, o in rest], [])
        result = [totals.get(id(t)) if t.requires_grad else None for t in leaves]
        return (None, *result)


def _batched(like, n_docs: int):
    return [((n_docs * shape[0], *shape[1:]), dtype) for shape, dtype in like]


def _join_docs(states: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Per document a state (list of ``[B, ...]``) -> per state tensor ``[n_docs * B, ...]`` (documents major)."""
    return [torch.cat(parts) for parts in zip(*states)]


def _split_docs(tensors: list[torch.Tensor], n_docs: int) -> list[list[torch.Tensor]]:
    return [list(parts) for parts in zip(*(t.chunk(n_docs, dim=0) for t in tensors))]


def _pack(t: torch.Tensor) -> torch.Tensor:
    """The inner graph's saved tensors, kept as they are (the innermost hooks: activation checkpointing's do not
    apply), as detached aliases: a node's saved output holding the output itself (with the node as its grad_fn)
    would be a reference cycle through the C++ graph that no garbage collection frees, and every step's inner graphs
    would stay alive (a live-tensor count of OLMo-Hybrid under ring cp 2 grew by 18 of the delta rule's chunk
    tensors per step)."""
    alias = t.detach()
    if _KEPT is not None:  # kept_bytes is counting
        _KEPT.append(weakref.ref(alias))
    return alias


#: weak references to what :func:`_pack` keeps while :func:`kept_bytes` counts (``None``: not counting)
_KEPT: list[weakref.ref] | None = None


def kept_bytes(kernel: MixerKernel, mixer: torch.nn.Module, seq: dict[str, torch.Tensor]) -> int:
    """Bytes one rank's :class:`ChainedCore` keeps from its forward to its backward for ``seq`` (the core's inputs
    ``[B, n, H_i, d_i]`` of one row, ``n`` even): the distinct storages of its inner graph's saved tensors, its
    inputs, the pieces' outputs and the states, less ``mixer``'s parameters and buffers. The row runs as two equal
    chunks on this rank, each started from a state (a zero-length first piece hands the second its zeros), as every
    rank but the first holds its two head-tail chunks of a row (the first starts its head chunk from nothing, which
    some cores keep less for: Jamba's Mamba keeps its start-state terms per chunk started from a state). No messages:
    run it on the meta device, where nothing is computed.
    Activation checkpointing does not recompute these (module docstring), so every chained layer keeps them through
    the step; the memory planner counts them (:mod:`automodel.training.chain_memory`). Nothing is mutated."""
    global _KEPT
    n = next(iter(seq.values())).shape[1]
    if n % 2:
        raise ValueError(f"kept_bytes runs a row as two equal chunks, got {n} tokens")
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in seq.items()}
    params = kernel.core_params(mixer, None)
    chain = Chain(None, 0, [[(0, 0, 0), (0, 0, n // 2), (0, n // 2, n // 2)]])
    _KEPT = []
    try:
        out = run_chain(kernel, mixer, params, leaves, chain)
        ctx = out.grad_fn
        kept = [r() for r in _KEPT] + list(ctx.leaves) + [o for _, _, o in ctx.outputs]
        for *_, inits, finals, _outs in ctx.steps:
            kept += [t for st in (*inits, *finals) if st is not None for t in st]
        skip = {t.untyped_storage()._cdata for t in (*mixer.parameters(), *mixer.buffers())}
        alive = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in kept
                 if t is not None and t.untyped_storage()._cdata not in skip}  # fmt: skip
        return sum(alive.values())
    finally:
        _KEPT = None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


# ---------------------------------------------------------------------------------------------------------
# what the chain sends


def state_message_bytes(kernel: MixerKernel, mixer: torch.nn.Module, batch: int = 1,
                        shard: HeadShard | None = None) -> int:
    """Bytes of one document's state in one chain message (``batch`` rows; sent as fp64): independent of the
    sequence length."""
    like = kernel.state_like(mixer, kernel.core_params(mixer, shard), batch, torch.float32, shard)
    return 8 * sum(int(torch.Size(shape).numel()) for shape, _ in like)


def chain_bytes_per_rank(kernel: MixerKernel, mixer: torch.nn.Module, world: int, rank: int, n_docs: int = 1,
                         batch: int = 1, shard: HeadShard | None = None) -> int:
    """Bytes rank ``rank`` of ``world`` sends in one forward + backward of one layer when ``n_docs`` documents
    are each split head-tail over all ``world`` ranks (thd, ring, usp's ring sub-group): per direction one
    message to the next rank (head chunks) unless last, one to the previous rank (tail chunks) unless first;
    the backward sends as many. No term grows with the sequence length."""
    if world <= 1:
        return 0
    messages = (rank < world - 1) + (rank > 0)
    return 2 * messages * n_docs * state_message_bytes(kernel, mixer, batch, shard)
