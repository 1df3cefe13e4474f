"""``distributed.cp_method: usp``: hybrid Ulysses x ring CP (``distributed.ulysses_size`` x ``cp_size / ulysses_size``).

The CP group is factored into Ulysses sub-groups of ``U = distributed.ulysses_size`` consecutive CP ranks
(the innermost dimension: one node) and ring sub-groups of ``R = cp_size / U`` ranks (across nodes).
Documents are placed across the ring sub-group as ``cp_method: thd`` places them across the CP group
(head-tail per document), each ring rank's share cut into ``U`` contiguous slices; attention trades
heads for tokens with an all-to-all inside the Ulysses sub-group and runs THD attention (K/V
all-gathered, exact per-document causal) across the ring sub-group for ``H/U`` heads
(:mod:`automodel.distributed.cp.usp.attention`). The heads need only ``num_attention_heads % U == 0``,
not ``% cp_size`` as with Ulysses; fewer KV heads than ``U`` are replicated.

Exact, on packed rows too, for every attention layer kind thd computes: after the head all-to-all each
layer runs thd's per-layer kernel (:func:`automodel.distributed.cp.layers.strategy.run_layer`) across the
ring sub-group on the rank's ``H/U`` heads: sliding windows and attention chunks shorter than the longest
document, sinks (the rank's heads' sink logits) and logit softcapping run the halo kernel over the ring
sub-group (never across a document); MLA value heads run on zero-padded V; Llama 4's query temperature is
taken at the in-document position. Refused: linear / state-space mixers without a usp kernel
(:mod:`automodel.distributed.cp.layers.linear_support`). Every packed document is padded to a multiple of
``2 * cp_size`` by the batch function, not by the data, so packed rows are the same at every ``cp_size`` and
under every method that does not pad in the data (thd_docs, ulysses, cp_size 1).
"""

from __future__ import annotations

import math
from typing import Any

from automodel.distributed.cp.gathered_method import GatheredKVMethod
from automodel.distributed.cp.head_chunks import head_chunked_exchange
from automodel.distributed.cp.method import BatchFn, CPMethod, ExchangeTerm, PreparedModel, standard_problem
from automodel.distributed.cp.profile import LayerSpec
from automodel.distributed.cp.subgroups import ulysses_size_problem as _ulysses_size_problem

__all__ = ["UspMethod"]


def _chunks(r: Any) -> int:
    """``distributed.ulysses_head_chunks`` of a memory-plan / cost shape (1 where it carries none)."""
    return max(1, int(getattr(r, "head_chunks", 1) or 1))


def _head_chunks_option(cfg: Any) -> dict[str, Any]:
    chunks = getattr(cfg.distributed, "ulysses_head_chunks", 1)
    return {"head_chunks": chunks} if isinstance(chunks, int) and chunks > 1 else {}


class UspMethod(GatheredKVMethod):
    """USP; ``ulysses_size`` bound by :meth:`configured` (the registered instance has none)."""

    name = "usp"
    summary = "Ulysses all-to-all inside a node x thd K/V all-gather across nodes, packed documents"
    option_keys = ("ulysses_size",)
    layout_option = "ulysses_size"  # plan layouts: cp64.usp8
    pads_documents_in_data = False  # make_usp_batch_and_ctx pads each document (exact): rows as at cp_size 1

    def __init__(self, ulysses_size: int | None = None) -> None:
        self.ulysses_size = ulysses_size

    # ------------------------------------------------------------------ exactness
    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        """What thd computes (``standard_problem`` with thd's flags): each layer's kernel is chosen at the
        call on the ring sub-group's layout after the head all-to-all (:mod:`.attention`), so a window is
        judged there against the longest document, like thd's, when the row length is not known here."""
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, windows_checked_at_call=True, alibi=True,
        )

    # ------------------------------------------------------------------ model and batch
    def _switch(self) -> tuple[Any, str]:
        from automodel.distributed.cp.usp.attention import USP_ATTN_NAME, set_usp_attention

        return set_usp_attention, USP_ATTN_NAME

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx

        return make_usp_batch_and_ctx

    def batch_function(self, prepared: PreparedModel | None = None, **options: Any) -> BatchFn:
        if self.ulysses_size is not None:
            options = {"ulysses_size": self.ulysses_size, **options}
        return super().batch_function(prepared, **options)

    def recipe_batch_options(self, cfg: Any) -> dict[str, Any]:
        return {
            **super().recipe_batch_options(cfg),
            "ulysses_size": cfg.distributed.ulysses_size,
            "document_multiple": self.document_multiple(cfg)[0],  # the batch function pads packed documents
            **_head_chunks_option(cfg),
        }

    def head_chunk_ranks(self, cp_size: int) -> int | None:
        return self.ulysses_size if self.ulysses_size else cp_size

    # ------------------------------------------------------------------ config
    def configured(self, cfg: Any) -> CPMethod:
        d = cfg.distributed
        if _ulysses_size_problem(d.ulysses_size, d.cp_size) is not None:
            return self
        return UspMethod(d.ulysses_size)

    def key_problems(self, cfg: Any) -> list[str]:
        d = cfg.distributed
        if d.ulysses_size is None:
            return []
        if d.cp_method != self.name:
            return [
                f"distributed.ulysses_size={d.ulysses_size} is read only by distributed.cp_method=usp (hybrid Ulysses x "
                f"ring), but distributed.cp_method={d.cp_method}; remove distributed.ulysses_size or set "
                "distributed.cp_method=usp"
            ]
        problem = _ulysses_size_problem(d.ulysses_size, max(1, d.cp_size))
        return [problem] if problem is not None else []

    def config_problems(self, cfg: Any, cuda_available: bool | None) -> list[str]:
        d = cfg.distributed
        problems = super().config_problems(cfg, cuda_available)
        if d.ulysses_size is None and d.cp_size > 1:
            divisors = [k for k in range(1, d.cp_size + 1) if d.cp_size % k == 0]
            problems.append(
                f"distributed.cp_method=usp needs distributed.ulysses_size, the size of the Ulysses sub-group (a "
                f"divisor of distributed.cp_size={d.cp_size}: one of {divisors}; usually the processes per node, "
                "so that the all-to-all stays inside a node and only the ring crosses nodes)"
            )
        return problems

    def head_split_problem(self, num_attention_heads: int | None, cp_size: int, tp_size: int = 1) -> str | None:
        u, tp_size = self.ulysses_size, max(1, tp_size)
        if u is None or u <= 1 or cp_size <= 1 or num_attention_heads is None or num_attention_heads % tp_size:
            return None
        local = num_attention_heads // tp_size
        if local % u == 0:
            return None
        fits = [k for k in range(1, cp_size + 1) if cp_size % k == 0 and local % k == 0]
        per_tp = f", {local} per TP rank (distributed.tp_size={tp_size})," if tp_size > 1 else ","
        return (
            f"distributed.cp_method=usp splits the attention heads over the Ulysses sub-group, but the model has "
            f"num_attention_heads={num_attention_heads}{per_tp} which is not divisible by distributed.ulysses_size={u}; "
            f"set distributed.ulysses_size to one of {fits} (divisors of both cp_size={cp_size} and the heads)"
        )

    # ------------------------------------------------------------------ layout, memory plan and dry run
    def token_ranges(self, seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
        """The ring rank's head-tail chunks (``2R`` per row), then the Ulysses rank's contiguous ``1/U`` of them."""
        u = self.ulysses_size
        if u is None or u <= 1 or cp_size <= 1 or cp_size % u:
            return super().token_ranges(seq_len, cp_size, cp_rank)
        ring_rank, uly_rank = divmod(cp_rank, u)
        share = CPMethod.token_ranges(self, seq_len, cp_size // u, ring_rank)
        n = sum(b - a for a, b in share) // u
        lo, hi, out, seen = uly_rank * n, (uly_rank + 1) * n, [], 0
        for a, b in share:  # cut [lo, hi) of the concatenated share into ranges of the row
            s, e = max(lo, seen), min(hi, seen + b - a)
            if s < e:
                out.append((a + s - seen, a + e - seen))
            seen += b - a
        return out

    def cp_sub_groups(self, cp_size: int) -> list[tuple[str, int, bool]]:
        u = self.ulysses_size
        if u is None or cp_size <= 1 or cp_size % u:
            return []
        return [("cp ulysses (all-to-all)", u, True), ("cp ring (K/V all-gather)", cp_size // u, False)]

    def kernel_call_tokens(self, d: Any, r: Any) -> tuple[int, int, int, int]:
        """After the all-to-all: ``H / U`` query heads for ``U`` ranks' queries, against the gathered K/V of the row
        (``U = 1`` without a bound ``ulysses_size``: an upper bound)."""
        u, g = self.ulysses_size or 1, _chunks(r)
        kv_local = max(1, d.kv_heads // r.tp)
        kv_seen = max(1, kv_local * (u // math.gcd(kv_local, u)) // u)
        return max(1, d.heads // r.tp // u // g), max(1, kv_seen // g), u * r.local_tokens // r.local_batch, r.seq

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """thd's terms for ``H/U`` heads (each rank gathers K/V of the whole row for its heads), plus the
        all-to-all buffers of q, k, v and the output. Without a bound ``ulysses_size`` (the memory planner
        reads only the method's name) ``U = 1`` is taken for the gather: an upper bound."""
        u = self.ulysses_size or 1
        c, tp, n = r.compute_bytes, r.tp, r.local_tokens
        kv_local = max(1, d.kv_heads // tp)
        kv_heads = kv_local * (u // math.gcd(kv_local, u)) / u  # after replication, per Ulysses rank
        row_tokens = r.local_batch * r.seq
        gather = 8 * kv_heads * d.head_dim * c * row_tokens  # backward: K/V again + dK/dV
        from automodel.distributed.cp.block_sets import packed_call_bytes  # torch: imported only to plan

        # cuDNN: thd's prefix and diagonal blocks in packed-row calls (block_sets), their copies at the backward
        gather += packed_call_bytes(kv_heads * d.head_dim, d.heads / tp / u * d.head_dim, row_tokens, u * n, c,
                                    getattr(r, "attention_kernel", ""), getattr(r, "cudnn_packed_blocks", True))  # fmt: skip
        q = d.heads * d.head_dim / tp  # the query heads' width (the hidden size only where head_dim = h / heads)
        partial = r.local_tokens * (q + d.heads / tp) * 4
        kv_sent = kv_local * (u // math.gcd(kv_local, u)) * d.head_dim
        a2a = 2 * (2 * q + 2 * kv_sent) * c * n
        what = f"ulysses {u} x ring" if self.ulysses_size else "ulysses x ring (upper bound: ulysses_size 1)"
        g = _chunks(r)
        if g > 1:  # one head group's buffers at a time; the local q, k, v gradient the groups' are stacked into
            stacked = (q + 2 * kv_sent) * c * n
            return (gather + partial + a2a) / g + stacked, (
                f"usp ({what}), 1 of {g} head groups at a time: all-to-all buffers of q, k, v and the output; K/V "
                "of the whole row for its heads all-gathered, dK/dV before the reduce-scatter; the q, k, v gradient "
                "the groups' are stacked into"
            )
        return gather + partial + a2a, (
            f"usp ({what}): all-to-all buffers of q, k, v and the output; K/V of the whole row for H/U heads "
            "all-gathered per layer, dK/dV before the reduce-scatter"
        )

    def exchange_terms(self, d: Any, r: Any, packed: bool = False) -> list[ExchangeTerm]:
        """The all-to-all of q, k, v and the output inside the Ulysses sub-group (``U`` consecutive ranks), then
        the K/V all-gather of the ring sub-group (``R`` ranks strided over the whole CP group) for ``H/U``
        heads; without a bound ``ulysses_size``, the default (one group over ``cp_size``)."""
        u = self.ulysses_size
        if u is None or u <= 1 or r.cp <= 1 or r.cp % u:
            return super().exchange_terms(d, r, packed)
        ring, c, n = r.cp // u, r.compute_bytes, r.local_tokens
        kv_local = max(1, d.kv_heads // r.tp)
        kv_sent = kv_local * (u // math.gcd(kv_local, u)) * d.head_dim  # KV heads replicated up to U
        a2a = 2 * (u - 1) / u * n * (2 * d.heads // r.tp * d.head_dim + 2 * kv_sent) * c
        g = _chunks(r)
        q = d.heads // r.tp * d.head_dim
        out = [ExchangeTerm(f"all-to-all of q, k, v and the output (ulysses {u})", u, u, a2a / 2, a2a / 2)]
        out = [head_chunked_exchange(out[0], g, (q + 2 * kv_sent) / (2 * q + 2 * kv_sent))]
        if ring > 1:  # after the all-to-all: u * n tokens for kv_sent / u heads, K and V of the other ring ranks
            gather = (ring - 1) * n * 2 * kv_sent * c  # forward; backward: K/V again + dK/dV reduce-scattered
            term = ExchangeTerm(f"K and V of the other ring ranks' tokens (ring {ring})", ring, r.cp, gather, 2 * gather)
            out.append(head_chunked_exchange(term, g, 1.0, collectives=1) if g > 1 else term)
        return out

    def sparse_exchange_terms(self, widths: tuple[int, int], r: Any) -> list[ExchangeTerm]:
        """A DSA layer's state all-gathered over the Ulysses sub-group (``U`` consecutive ranks), then over the
        ring sub-group (``R`` ranks strided over the CP group): the gradient of the latent KV back the same
        way."""
        u = self.ulysses_size
        if u is None or u <= 1 or r.cp <= 1 or r.cp % u:
            return super().sparse_exchange_terms(widths, r)
        latent, index = widths
        ring, c, n = r.cp // u, r.compute_bytes, r.local_tokens
        inner = (u - 1) * n * c
        out = [ExchangeTerm(f"latent KV and indexer keys (DSA, ulysses {u})", u, u, inner * (latent + index),
                            inner * latent)]  # fmt: skip
        if ring > 1:
            outer = (ring - 1) * u * n * c
            out.append(ExchangeTerm(f"latent KV and indexer keys (DSA, ring {ring})", ring, r.cp,
                                    outer * (latent + index), outer * latent))  # fmt: skip
        return out

    def options(self) -> dict[str, Any]:
        return {} if self.ulysses_size is None else {"ulysses_size": self.ulysses_size}

    def with_options(self, **options: Any) -> CPMethod:
        unknown = set(options) - {"ulysses_size"}
        if unknown:
            raise ValueError(f"cp_method usp takes ulysses_size only, got {sorted(unknown)}")
        return UspMethod(options.get("ulysses_size", self.ulysses_size))

    def auto_configs(self, cp_size: int, ranks_per_node: int | None) -> list[tuple[CPMethod, dict[str, Any]]]:
        """Every proper factoring ``cp_size = ulysses_size x ring`` (both > 1): ``ulysses_size`` 1 or ``cp_size``
        is plain thd or Ulysses, which ``auto`` tries under their own names."""
        return [(UspMethod(u), {"ulysses_size": u}) for u in range(2, cp_size) if cp_size % u == 0]

    def describe(self, seq: int, cp_size: int) -> str:
        u = self.ulysses_size
        if cp_size <= 1 or u is None or cp_size % u:
            return super().describe(seq, cp_size)
        ring = cp_size // u
        return (
            f"cp_method usp ({self.summary}): cp_size {cp_size} = ulysses_size {u} x ring {ring}; each document of a "
            f"row of {seq} tokens is split into {2 * ring} chunks (head-tail) over the ring, each ring rank's share "
            f"into {u} contiguous slices over its Ulysses sub-group"
        )

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        u = self.ulysses_size
        if u is None or cp_size % u:
            return super().describe_attention(b, heads, kv, head_dim, seq, cp_size, attn)
        ring = cp_size // u
        kv_sent = kv * (u // math.gcd(kv, u))
        return [
            f"  all-to-all (ulysses {u}) q / k,v -> [1, {heads // u}, {b * seq // ring}, {head_dim}] / "
            f"[1, {kv_sent // u}, {b * seq // ring}, {head_dim}]: the ring rank's share for H/{u} heads",
            f"  all-gather (ring {ring})   k,v -> [{b * seq}, {kv_sent // u}, {head_dim}] per layer (dK/dV "
            "reduce-scattered in backward); each query attends within its document",
        ]
