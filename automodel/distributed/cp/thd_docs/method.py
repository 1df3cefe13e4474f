"""``distributed.cp_method: thd_docs``: packed documents placed whole by cost, only long ones split.

Every batch is planned by :func:`~automodel.distributed.cp.thd_docs.placement.plan_documents` with the model's
cost model: short documents go whole onto one rank (their attention needs no communication), a document
too long to balance is split head-tail over a subset of the ranks, and only those ranks exchange its K/V
(point to point). Rows need no padding for CP, so a packed dataset yields the same rows at every
``cp_size``. Exact for every attention layer kind that ``thd`` computes, each layer choosing its kernel at
the call (:mod:`automodel.distributed.cp.layers.strategy`): full causal attention, sliding windows and
attention chunks (the halo kernel: nothing exchanged for a whole document, only the keys a window reaches
for a split one), sinks (in the log-sum-exp merge), softcapping (where the eager reference applies it),
MLA value heads, Llama 4's query temperature (at the in-document position). Linear / state-space mixers:
as :mod:`~automodel.distributed.cp.layers.linear_support` lists them for ``thd_docs``. Refused: sequence
parallelism.
``cp_method: thd`` keeps Transformer Engine's partition (every document split over every rank).
"""

from __future__ import annotations

from typing import Any

from automodel.distributed.cp.method import (
    AttentionSwitchingMethod,
    BatchFn,
    ExchangeTerm,
    PreparedModel,
    standard_problem,
)
from automodel.distributed.cp.profile import LayerSpec
from automodel.distributed.cp.thd_docs.placement import CostModel, Placement, plan_documents, sample_lengths

__all__ = ["ThdDocsMethod", "SAMPLE_MEDIAN", "model_cost"]

#: median document length of the dry run's sample batch (lognormal, sigma 1, seed 0)
SAMPLE_MEDIAN = 256


#: attention FLOPs are this much slower than matmul FLOPs on CPU (fp32 flash kernel; scripts/bench_packed.py)
CPU_ATTENTION_WEIGHT = 2.5


def model_cost(model: Any) -> CostModel:
    """The placement's :class:`CostModel` of a transformers model: its profile, sizes and device."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.profile import text_config

    config = text_config(model.config)
    param = next(iter(model.parameters()), None)
    on_cpu = param is None or param.device.type == "cpu"
    inter = getattr(config, "intermediate_size", None)
    if isinstance(inter, (list, tuple)):  # per layer (Gemma 3n): the cost model takes one size
        inter = max(inter, default=None)
    return CostModel.from_profile(
        cached_profile(model),
        getattr(config, "hidden_size", None),
        inter,
        getattr(config, "vocab_size", None),
        attention_weight=CPU_ATTENTION_WEIGHT if on_cpu else 1.0,
    )


class ThdDocsMethod(AttentionSwitchingMethod):
    name = "thd_docs"
    summary = "packed documents placed whole on one rank by cost, long ones split head-tail over a few ranks"
    attn_implementations = ("sdpa", "eager")  # the cp=1 reference; at cp>1 the model runs thd_docs attention
    supports_packed = True
    supports_vlm = False
    chunks_per_rank = 1  # no row multiple: the placement cuts documents anywhere
    layout = "contiguous"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, windows_checked_at_call=True, alibi=True,
        )

    def row_multiple(
        self, cp_size: int, tp_size: int = 1, sequence_parallel: bool = False
    ) -> tuple[int, str]:
        """1: rows need no padding for this method (sequence parallelism is refused)."""
        return 1, "1"

    def _switch(self) -> tuple[Any, str]:
        from automodel.distributed.cp.thd_docs.attention import DOC_ATTN_NAME, set_doc_attention

        return set_doc_attention, DOC_ATTN_NAME

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx

        return make_doc_batch_and_ctx

    def batch_function(self, prepared: PreparedModel | None = None, **options: Any) -> BatchFn:
        """The batch function with the prepared model's cost model bound (``cost=``, :func:`model_cost`)."""
        if prepared is not None and prepared.switched and "cost" not in options:
            options = {"cost": model_cost(prepared.module), **options}
        return super().batch_function(prepared, **options)

    def config_problems(self, cfg: Any, cuda_available: bool | None) -> list[str]:
        d, problems = cfg.distributed, []
        if d.cp_size > 1 and d.sequence_parallel and d.tp_size > 1:
            problems.append(
                f"distributed.cp_method={self.name} gives each CP rank a different number of tokens, which "
                "sequence parallelism cannot split over the TP ranks; set distributed.sequence_parallel=false or "
                "distributed.cp_method=thd"
            )
        if d.thd_kernel != "portable":
            problems.append(
                f"distributed.thd_kernel={d.thd_kernel} is a kernel of distributed.cp_method=thd; {self.name} runs its "
                "own (portable) kernel; set distributed.cp_method=thd for that kernel, or distributed.thd_kernel=portable"
            )
        return problems

    # ------------------------------------------------------------------ the dry run's sample batch
    def sample_placement(self, seq: int, cp_size: int, rows: int = 1, width: int = 256) -> Placement:
        """The placement of a sample batch: ``rows`` rows of ``seq`` tokens of lognormal documents (median
        :data:`SAMPLE_MEDIAN`, sigma 1, seed 0), full attention of ``width = heads * head_dim``."""
        return plan_documents(sample_lengths(seq, SAMPLE_MEDIAN, rows=rows), cp_size, CostModel.for_width(width))

    def exchange_terms(self, d: Any, r: Any, packed: bool = False) -> list[ExchangeTerm]:
        """K and V (and dK/dV) of split documents only, point to point among the ranks each spans: the busiest
        rank of the dry run's sample batch (packed: lognormal documents, median :data:`SAMPLE_MEDIAN`; else
        one document per row, split over every rank)."""
        cp = r.cp
        if cp <= 1 or not d.heads:  # no attention layer (Mamba): no K and V to exchange
            return []
        rows = max(1, r.local_batch)
        lengths = sample_lengths(r.seq, SAMPLE_MEDIAN, rows=rows) if packed else [r.seq] * rows
        plan = plan_documents(lengths, cp, CostModel.for_width(d.heads * d.head_dim))
        kv = d.kv_heads // r.tp * d.head_dim
        busiest = max(range(cp), key=plan.step_tokens)
        per_token = 2 * kv * r.compute_bytes
        forward = sum(plan.exchange_tokens(busiest)) * per_token  # backward: the same again + borrowed dK/dV
        backward = plan.step_tokens(busiest) * per_token - forward
        return [ExchangeTerm("K and V of split documents only", cp, cp, forward, backward)]

    def token_ranges(self, seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
        """The row's token ranges rank ``cp_rank`` holds in the dry run's sample batch (real batches differ)."""
        if cp_size <= 1:
            return [(0, seq_len)]
        plan = self.sample_placement(seq_len, cp_size)  # a 256-wide model's cost
        starts = [sum(plan.lengths[:d]) for d in range(len(plan.lengths))]
        return [(starts[p.doc] + p.start, starts[p.doc] + p.end) for p in plan.ranks[cp_rank]]

    def describe(self, seq: int, cp_size: int) -> str:
        if cp_size == 1:
            return super().describe(seq, cp_size)
        return (
            f"cp_method {self.name} ({self.summary}); each batch is planned anew (token ranges below: a sample row "
            f"of lognormal documents, median {SAMPLE_MEDIAN}; the placement line under the shapes: a sample batch)"
        )

    def describe_attention(
        self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str
    ) -> list[str]:
        if cp_size <= 1:
            return []
        plan = self.sample_placement(seq, cp_size, rows=b, width=heads * head_dim)
        per_token = 2 * kv * head_dim * 2  # K and V, bf16 bytes per token per layer
        sent = ", ".join(f"{plan.step_tokens(r) * per_token / 2**10:.1f}" for r in range(cp_size))
        return [
            f"  placement (thd_docs)   sample batch of {b} x {seq} tokens (lognormal documents, median {SAMPLE_MEDIAN}): "
            f"{plan.describe()}",
            f"                         K/V KiB sent per rank per layer and step (bf16; forward, backward again, dK/dV "
            f"back): [{sent}]; whole documents exchange nothing",
        ]

    # ------------------------------------------------------------------ memory plan
    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """The rank's K/V packed for the exchange, the borrowed chunks of split documents and their prefix
        (at most the row) and the fp32 output / LSE of the rank's queries; doubled in the backward (dK/dV)."""
        c, tp = r.compute_bytes, r.tp
        kv = d.kv_heads * d.head_dim / tp
        local = r.local_tokens
        borrowed = r.local_batch * r.seq - local  # worst case: every document split over every rank
        fwd = 2 * kv * c * (local + 2 * borrowed)
        partial = local * (d.heads * d.head_dim / tp + d.heads / tp) * 4  # fp32 output ([N, heads x D]) and LSE
        from automodel.distributed.cp.block_sets import packed_call_bytes  # torch: imported only to plan

        # cuDNN: the prefix and diagonal blocks in packed-row calls (block_sets) on a key stream of the local and the
        # borrowed K/V (a copy, and its gradient: one more row's worth of keys)
        packed = packed_call_bytes(kv, d.heads * d.head_dim / tp, 2 * (local + borrowed), local, c,
                                   getattr(r, "attention_kernel", ""), getattr(r, "cudnn_packed_blocks", True))  # fmt: skip
        return 2 * fwd + packed + partial, (
            f"{self.name}: the rank's K/V and, for split documents only, the chunks borrowed from their span "
            "(worst case: the whole row); whole documents need none"
            + ("; the packed-row calls' key stream, copies and dK/dV" if packed else "")
        )
