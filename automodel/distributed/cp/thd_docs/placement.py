"""Document-aware placement of one packed batch over the CP ranks: a pure function of the lengths.

:func:`plan_documents` decides which rank computes which tokens of which document:

- short documents go **whole** onto one rank (no communication at all for them), balanced by their
  attention cost with a longest-processing-time greedy placement (largest first, onto the rank with
  the least cost so far);
- a document too long to balance that way is **split head-tail over a subset** of ``k`` ranks: it is
  cut into ``2k`` chunks of ``L // 2k`` or ``L // 2k + 1`` tokens (no padding), and the ``i``-th rank
  of its span holds chunks ``i`` and ``2k-1-i`` (for causal attention each pair costs the same);
- documents are split one at a time, largest first, while the plan's imbalance (max rank cost / mean)
  is above ``tolerance``, its token imbalance (max rank tokens / mean: memory) above ``token_tolerance``
  or a rank holds no token; the first plan within both is returned (the fewest splits, so the least
  communication), else the best one found. A rank's load for the greedy placement is the larger of
  its relative cost and its relative tokens.

The cost of a document comes from :class:`CostModel`: per token (projections, MLP, LM head) plus per
visible (query, key) pair for every attention layer: ``L(L+1)/2`` pairs under full causal attention,
about ``L*w`` under a window ``w``, none for a linear / state-space mixer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from automodel.distributed.cp.layout import head_tail_chunks as split_chunks
from automodel.distributed.cp.layout import head_tail_pair

__all__ = ["CostModel", "Piece", "Placement", "plan_documents", "sample_lengths", "split_chunks"]


def _full_pairs(n: int) -> float:
    """Causal (query, key) pairs of the first ``n`` queries of a document: ``n(n+1)/2``."""
    return n * (n + 1) / 2


def _window_pairs(n: int, w: int) -> float:
    return _full_pairs(n) if n <= w else _full_pairs(w) + (n - w) * w


def _chunk_pairs(n: int, c: int) -> float:
    q, r = divmod(n, c)
    return q * _full_pairs(c) + _full_pairs(r)


@dataclass(frozen=True)
class CostModel:
    """Compute cost of the tokens ``[a, b)`` of one document (arbitrary units, e.g. forward FLOPs).

    Attributes:
        token: cost per token of everything but the attention scores (projections, MLP, LM head).
        pair: cost per visible (query, key) pair in one attention layer (``4 * heads * head_dim`` FLOPs).
        full_layers: number of full causal attention layers.
        windows: window of every sliding-window layer; ``chunks``: chunk of every chunked-attention layer.
    """

    token: float = 0.0
    pair: float = 1.0
    full_layers: int = 1
    windows: tuple[int, ...] = ()
    chunks: tuple[int, ...] = ()

    def prefix(self, n: int) -> float:
        """Cost of a document's first ``n`` tokens (each query with all its visible keys)."""
        pairs = self.full_layers * _full_pairs(n)
        pairs += sum(_window_pairs(n, w) for w in self.windows)
        pairs += sum(_chunk_pairs(n, c) for c in self.chunks)
        return self.token * n + self.pair * pairs

    def span(self, start: int, end: int) -> float:
        """Cost of the queries ``[start, end)`` of a document."""
        return self.prefix(end) - self.prefix(start)

    @classmethod
    def for_width(cls, width: int, layers: int = 1) -> CostModel:
        """``layers`` full-attention layers of ``width = heads * head_dim`` (see :meth:`from_profile`)."""
        return cls(token=24.0 * width * width * layers, pair=4.0 * width, full_layers=layers)

    @classmethod
    def from_profile(
        cls,
        profile: Any,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        vocab_size: int | None = None,
        attention_weight: float = 1.0,
    ) -> CostModel:
        """The cost model of a :class:`~automodel.distributed.cp.profile.ModelProfile`, in forward FLOPs.

        Per token and layer ``2 * (2 h (Hq + Hkv) d + 3 h i)`` (q/k/v/o projections, a gated MLP of width
        ``i``; ``h`` = ``hidden_size``, default ``Hq * d``; ``i`` default ``4 h``) plus ``2 h V`` for the LM
        head; per visible pair and attention layer ``4 Hq d`` times ``attention_weight`` (how much slower the
        attention kernel runs per FLOP than the matmuls: about 2.5 for the fp32 CPU flash kernel, measured
        with scripts/bench_packed.py's model; 1 on GPUs).
        """
        heads = profile.num_attention_heads or 1
        kv = profile.num_key_value_heads or heads
        head_dim = profile.head_dim or 64
        hidden = hidden_size or heads * head_dim
        inter = intermediate_size or 4 * hidden
        full, windows, chunks = 0, [], []
        for layer in profile.layers:
            if layer.kind in ("full_attention", "sparse_attention"):  # DSA: its indexer scores every pair
                full += 1
            elif layer.kind == "sliding_window" and layer.window:
                windows.append(int(layer.window))
            elif layer.kind == "chunked_attention" and layer.chunk:
                chunks.append(int(layer.chunk))
        per_layer = 2 * (2 * hidden * (heads + kv) * head_dim + 3 * hidden * inter)
        return cls(
            token=per_layer * max(1, len(profile.layers)) + 2 * hidden * (vocab_size or 0),
            pair=4.0 * heads * head_dim * attention_weight,
            full_layers=full,
            windows=tuple(windows),
            chunks=tuple(chunks),
        )


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of document ``doc`` (offsets inside the document)."""

    doc: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Placement:
    """Which tokens of which document each CP rank computes (:func:`plan_documents`).

    Attributes:
        lengths: the documents' lengths, in batch order.
        ranks: per rank its pieces, in local order (document order; a split document's head chunk
            before its tail chunk).
        spans: split document -> its ranks, in span order (the ``i``-th holds chunks ``i`` and ``2k-1-i``).
        costs: per rank its cost under the cost model used.
    """

    lengths: tuple[int, ...]
    ranks: tuple[tuple[Piece, ...], ...]
    spans: dict[int, tuple[int, ...]] = field(default_factory=dict)
    costs: tuple[float, ...] = ()

    @property
    def cp_size(self) -> int:
        return len(self.ranks)

    @property
    def tokens(self) -> list[int]:
        """Tokens per rank."""
        return [sum(p.length for p in pieces) for pieces in self.ranks]

    @property
    def token_imbalance(self) -> float:
        """Max rank tokens over the mean (memory balance)."""
        tokens = self.tokens
        return max(tokens) * len(tokens) / max(1, sum(tokens))

    @property
    def imbalance(self) -> float:
        """Max rank cost over the mean (1.0 = perfectly balanced)."""
        mean = sum(self.costs) / max(1, len(self.costs))
        return max(self.costs) / mean if mean > 0 else 1.0

    def chunk_of(self, doc: int, rank: int) -> tuple[int, int]:
        """``(i, k)``: ``rank`` is the ``i``-th of the ``k`` ranks that split document ``doc``."""
        span = self.spans[doc]
        return span.index(rank), len(span)

    def exchange_tokens(self, rank: int) -> list[int]:
        """Tokens ``rank`` sends to each rank per K/V exchange: its head chunk of every split document
        to every other rank of the span, and its tail chunk to the ranks before it in the span (only
        they attend to it). The dK/dV returned in the backward are the same counts reversed."""
        out = [0] * self.cp_size
        for doc, span in self.spans.items():
            if rank not in span:
                continue
            i, k = span.index(rank), len(span)
            chunks = split_chunks(self.lengths[doc], k)
            head, tail = (chunks[j] for j in head_tail_pair(i, k))
            for j, peer in enumerate(span):
                if peer != rank:
                    out[peer] += (head[1] - head[0]) + ((tail[1] - tail[0]) if j < i else 0)
        return out

    def step_tokens(self, rank: int) -> int:
        """Tokens of K/V (and dK/dV) ``rank`` sends per attention layer and training step: its exchange in
        the forward, again in the backward, and the dK/dV of the chunks it borrowed, back to their owners."""
        back = sum(self.exchange_tokens(peer)[rank] for peer in range(self.cp_size) if peer != rank)
        return 2 * sum(self.exchange_tokens(rank)) + back

    def describe(self) -> str:
        """One line: imbalance, tokens per rank, split documents."""
        split = ", ".join(
            f"doc {d} ({self.lengths[d]} tokens) over ranks {list(s)}" for d, s in self.spans.items()
        )
        return (
            f"{len(self.lengths)} documents, imbalance {self.imbalance:.3f} (max rank cost / mean), tokens per "
            f"rank {self.tokens} ({self.token_imbalance:.3f}); split: {split or 'none (every document whole on one rank)'}"
        )


def _assign(lengths: Sequence[int], cp: int, cost: CostModel, split: dict[int, int]) -> Placement:
    costs = [0.0] * cp
    tokens = [0] * cp
    pieces: list[list[Piece]] = [[] for _ in range(cp)]
    spans: dict[int, tuple[int, ...]] = {}
    doc_cost = {d: cost.prefix(n) for d, n in enumerate(lengths)}
    # a rank's load: the larger of its cost and its tokens (memory), each relative to the mean
    mean_cost = max(sum(doc_cost.values()) / cp, 1e-30)
    mean_tokens = max(sum(lengths) / cp, 1e-30)

    def load(r: int, c: float = 0.0, t: int = 0) -> tuple[float, float, int]:
        return (max((costs[r] + c) / mean_cost, (tokens[r] + t) / mean_tokens), costs[r] + c, r)

    # split documents first, largest first, each over the k least-loaded ranks
    for d in sorted(split, key=lambda d: (-doc_cost[d], d)):
        k = split[d]
        span = tuple(sorted(sorted(range(cp), key=load)[:k]))
        chunks = split_chunks(lengths[d], k)
        for i, r in enumerate(span):
            for a, b in (chunks[j] for j in head_tail_pair(i, k)):
                if b > a:
                    pieces[r].append(Piece(d, a, b))
                    costs[r] += cost.span(a, b)
                    tokens[r] += b - a
        spans[d] = span
    # whole documents: longest processing time first, onto the rank whose load grows least
    for d in sorted((d for d in range(len(lengths)) if d not in split), key=lambda d: (-doc_cost[d], d)):
        if lengths[d] == 0:
            continue
        r = min(range(cp), key=lambda r: load(r, doc_cost[d], lengths[d]))
        pieces[r].append(Piece(d, 0, lengths[d]))
        costs[r] += doc_cost[d]
        tokens[r] += lengths[d]
    ranks = tuple(tuple(sorted(p, key=lambda x: (x.doc, x.start))) for p in pieces)
    return Placement(tuple(lengths), ranks, spans, tuple(costs))


def plan_documents(
    lengths: Sequence[int],
    cp_size: int,
    cost: CostModel | None = None,
    *,
    tolerance: float = 1.02,
    token_tolerance: float = 1.04,
    max_splits: int | None = None,
) -> Placement:
    """Place the documents of one packed batch on ``cp_size`` ranks (see the module docstring).

    Args:
        lengths: every document's length in tokens (``>= 0``), in batch order.
        cp_size: the number of CP ranks.
        cost: the cost model (default: full causal attention only, ``CostModel()``).
        tolerance: accept the first plan whose imbalance (max rank cost / mean) is at most this ...
        token_tolerance: ... and whose token imbalance (max rank tokens / mean: memory) is at most this.
        max_splits: at most this many documents are split (default: no limit).

    Returns:
        the :class:`Placement`; every rank holds at least one token.

    Raises:
        ValueError: ``cp_size < 1``, a negative length, or fewer tokens than ranks.
    """
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    total = sum(lengths)
    if total < cp_size:
        raise ValueError(
            f"the batch holds {total} tokens, fewer than cp_size={cp_size} ranks: every CP rank needs at least one "
            "token; use longer rows (data.seq_len) or a smaller distributed.cp_size"
        )
    cost = cost or CostModel()
    if cp_size == 1:
        return _assign(lengths, 1, cost, {})
    target = sum(cost.prefix(n) for n in lengths) / cp_size
    limit = len(lengths) if max_splits is None else max_splits
    by_size = sorted(range(len(lengths)), key=lambda d: (-lengths[d], d))

    def score(plan: Placement) -> tuple:
        empty = sum(1 for t in plan.tokens if t == 0)
        sent = sum(sum(plan.exchange_tokens(r)) for r in plan.spans and range(cp_size) or ())
        worst = max(plan.imbalance / tolerance, plan.token_imbalance / token_tolerance, 1.0)
        return (empty, round(worst, 6), sent)

    def search(widen_all: bool) -> tuple[tuple, Placement]:
        split: dict[int, int] = {}
        plan = _assign(lengths, cp_size, cost, split)
        current = score(plan)
        best_plan, best_score, patience = plan, current, 2 * cp_size
        while current[0] or current[1] > 1.0:
            # best improvement: split (or widen) one of the largest documents
            trials = []
            for d in by_size[: 2 * cp_size]:
                k, widest = split.get(d, 1), min(cp_size, lengths[d])
                if k >= widest or (d not in split and len(split) >= limit):
                    continue
                options = {k + 1, widest} if widen_all else {k + 1}  # one rank more (or every rank it can span)
                if d not in split:
                    options |= {2, min(widest, max(2, math.ceil(cost.prefix(lengths[d]) / target)))}
                for k_new in options:
                    trial = {**split, d: k_new}
                    candidate = _assign(lengths, cp_size, cost, trial)
                    trials.append((score(candidate), len(trial), d, k_new, trial, candidate))
            if not trials:
                break
            step = min(trials, key=lambda t: t[:4])
            current, split, plan = step[0], step[4], step[5]
            if current < best_score:
                best_plan, best_score = plan, current
            else:
                patience -= 1  # a split that does not help alone may enable the next one, for a while
                if patience <= 0:
                    break
        return best_score, best_plan

    # small steps first (fewest bytes); only if they cannot reach the tolerance, also spread whole documents
    # over every rank they can span, and keep the better plan
    found = search(widen_all=False)
    if found[0][0] or found[0][1] > 1.0:
        found = min(found, search(widen_all=True), key=lambda f: f[0])
    return found[1]


def sample_lengths(
    seq_len: int, median: float = 256, *, rows: int = 1, sigma: float = 1.0, seed: int = 0
) -> list[int]:
    """SFT-like document lengths: lognormal (``median``, ``sigma``) drawn with ``seed``, packed greedily into
    ``rows`` rows of ``seq_len`` tokens; each row's last document takes the row's remainder (a row's trailing
    padding stays with its last document). The dry run's sample batch and the benchmark's rows."""
    import random

    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(rows):
        used = 0
        while used < seq_len:
            n = min(seq_len - used, max(1, int(rng.lognormvariate(math.log(median), sigma))))
            out.append(n)
            used += n
    return out
