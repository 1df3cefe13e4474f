"""``distributed.cp_method: ulysses``: all-to-all around the model's own attention kernel.

Each rank holds a contiguous slice of every row; an all-to-all before attention trades it for all
tokens of ``H / cp`` heads, the unchanged inner kernel (sdpa, eager, flex) runs on the whole row with
the global mask (causal, padding, documents, the layer's sliding window), and a second all-to-all
trades back. Exact for full and sliding-window attention, chunked attention (the global mask, chunks
counted from each document's first token; on rows packed by restarting ``position_ids`` as the installed
transformers cuts them), per-head sinks (sharded with the heads), softcapping (eager), MLA head sizes,
Llama 4's query temperature (at the global position), packed documents, and the linear / state-space
mixers :mod:`~automodel.distributed.cp.layers.linear_support` lists (head-sharded). Needs
``num_attention_heads % cp_size == 0``.
"""

from __future__ import annotations

import math
from typing import Any

from automodel.distributed.cp.head_chunks import head_chunked_exchange
from automodel.distributed.cp.method import AttentionSwitchingMethod, BatchFn, ExchangeTerm, standard_problem
from automodel.distributed.cp.profile import LayerSpec

__all__ = ["UlyssesMethod"]


def _chunks(r: Any) -> int:
    """``distributed.ulysses_head_chunks`` of a memory-plan / cost shape (1 where it carries none)."""
    return max(1, int(getattr(r, "head_chunks", 1) or 1))


def _head_chunks_option(cfg: Any) -> dict[str, Any]:
    chunks = getattr(cfg.distributed, "ulysses_head_chunks", 1)
    return {"head_chunks": chunks} if isinstance(chunks, int) and chunks > 1 else {}


class UlyssesMethod(AttentionSwitchingMethod):
    name = "ulysses"
    summary = "all-to-all: each rank runs the unchanged attention kernel on the whole row for H/cp heads"
    attn_implementations = ("sdpa", "eager", "flex_attention")  # the inner kernel, on the whole row
    supports_packed = True  # the global mask keeps document boundaries
    supports_vlm = True
    chunks_per_rank = 1
    layout = "contiguous"
    splits_heads = True

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, alibi=True,
        )

    def head_chunk_ranks(self, cp_size: int) -> int | None:
        return cp_size

    def recipe_batch_options(self, cfg: Any) -> dict[str, Any]:
        """``head_chunks``: ``distributed.ulysses_head_chunks`` (``auto`` resolved by the trainer before binding)."""
        return {**super().recipe_batch_options(cfg), **_head_chunks_option(cfg)}

    def _switch(self) -> tuple[Any, str]:
        from automodel.distributed.cp.ulysses.attention import ULYSSES_ATTN_NAME, set_ulysses_attention

        return set_ulysses_attention, ULYSSES_ATTN_NAME

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx

        return make_ulysses_batch_and_ctx

    def attention_extent(self, d: Any, r: Any) -> tuple[int, int, int]:
        return d.heads // r.tp // r.cp, r.seq, r.seq  # H/cp heads over the whole row

    def mask_scope(self, packed: bool) -> str | None:
        """The whole row's mask per layer kind for the inner kernel (``UlyssesContext.global_mask``); packed rows
        run one kernel call per document block, without a mask."""
        return None if packed else "global"

    def runs_halo_kernel(self) -> bool:
        """Every layer runs the inner kernel over the whole row (ALiBi: SDPA with its bias as a float mask)."""
        return False

    def kernel_path(self, packed: bool) -> str:
        """The inner ``sdpa`` kernel runs through torch's SDPA dispatch; packed rows run the block kernels per
        document (``doc_blocks``)."""
        return "blocks" if packed else "sdpa"

    def kernel_call_tokens(self, d: Any, r: Any) -> tuple[int, int, int, int]:
        """``H / cp`` query heads over the whole row; KV heads replicated up to ``cp`` where it does not divide them;
        with ``distributed.ulysses_head_chunks`` G, one call sees ``1/G`` of them."""
        g = _chunks(r)
        kv_local = max(1, d.kv_heads // r.tp)
        kv_seen = max(1, kv_local * (r.cp // math.gcd(kv_local, r.cp)) // r.cp)
        return max(1, d.heads // r.tp // r.cp // g), max(1, kv_seen // g), r.seq, r.seq

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """What the attention's backward holds beyond the layer's activations (which count the received q, k, v
        and output the kernel saves): the full-row gradients of the output, q, k and v for the rank's heads before
        their all-to-alls, ``(2 q + 2 kv') c n`` (``q``: the query heads' width, ``heads x head_dim``, which is the
        hidden size only where ``head_dim = hidden / heads``; ``kv'``: KV heads replicated up to ``cp``). With head
        chunks ``G`` those of one group (``/ G``), and the local q, k, v gradients of the groups done, waiting to be
        stacked (up to ``(G-1)/G (q + 2 kv') c n``, :func:`~automodel.distributed.cp.head_chunks.run_head_groups`).
        Measured on CPU at cp 2 (``scripts/bench_memory.py --headwise only``). Counted at the hidden size, Gemma 4's
        512-wide full-attention heads (2048 query channels on a hidden size of 64) read 12% under at cp 2
        (``scripts/bench_plan_families_cp.py``), and Qwen3-30B-A3B's 4096 query channels on 2048 would be half."""
        n, c, tp, g = r.local_tokens, r.compute_bytes, r.tp, _chunks(r)
        q = d.heads * d.head_dim / tp
        kv_local = max(1, d.kv_heads // tp)
        kv_sent = kv_local * (r.cp // math.gcd(kv_local, r.cp)) * d.head_dim
        grads = (2 * q + 2 * kv_sent) * c * n
        if g == 1:
            return grads, "ulysses: the full-row gradients of the output, q, k and v around their all-to-alls"
        waiting = (g - 1) / g * (q + 2 * kv_sent) * c * n
        return grads / g + waiting, (
            f"ulysses, 1 of {g} head groups at a time: the group's full-row gradients of the output, q, k and v "
            "around their all-to-alls, and the local q, k, v gradients of the groups done"
        )

    def exchange_terms(self, d: Any, r: Any, packed: bool = False) -> list[ExchangeTerm]:
        """The all-to-all of q, k, v and the output (:meth:`CPMethod.exchange_terms`); with head chunks ``G`` one
        per group, and the backward's recomputation of each group's q, k, v all-to-all
        (:func:`~automodel.distributed.cp.head_chunks.head_chunked_exchange`)."""
        terms = super().exchange_terms(d, r, packed)
        g = _chunks(r)
        if g == 1 or not terms:
            return terms
        kv_local = max(1, d.kv_heads // r.tp)
        kv = kv_local * d.head_dim
        q = d.heads // r.tp * d.head_dim
        return [head_chunked_exchange(t, g, (q + 2 * kv) / (2 * q + 2 * kv)) for t in terms]

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        kv_sent = kv * (cp_size // math.gcd(kv, cp_size))  # kv heads are replicated when cp does not divide them
        return [
            f"  all-to-all (ulysses)   q / k,v -> [{b}, {heads // cp_size}, {seq}, {head_dim}] / "
            f"[{b}, {kv_sent // cp_size}, {seq}, {head_dim}]: the inner kernel {attn!r} sees the whole row"
        ]
