"""``distributed.cp_method: thd``: packed documents in TE's partition, K/V all-gathered per layer.

Every document of a packed row is padded to a multiple of ``2*cp_size`` and split into ``2*cp``
chunks; rank r holds chunks r and 2W-1-r of every document. Each attention layer all-gathers K/V of
the whole row and computes exact per-document causal attention (the portable kernel on any device;
flash-attn varlen or Transformer Engine on CUDA); the backward re-gathers K/V and reduce-scatters
dK/dV. Exact for full causal attention; each layer picks its kernel (:mod:`automodel.distributed.cp.layers`):
sliding windows and attention chunks shorter than the longest document, sinks and logit softcapping
(transformers hands the kernel ``softcap`` only where the model applies it) run the halo kernel
(only the K/V each layer reaches is exchanged, never across a document); MLA value heads run on
zero-padded V; Llama 4's query temperature is taken at the in-document position. Linear / state-space
mixers: the state chained across the ranks where :mod:`~automodel.distributed.cp.layers.linear_support`
lists a kernel, refused otherwise.
"""

from __future__ import annotations

from typing import Any

from automodel.distributed.cp.gathered_method import THD_CP_COMM_TYPES, THD_KERNELS, GatheredKVMethod
from automodel.distributed.cp.method import BatchFn, standard_problem
from automodel.distributed.cp.profile import LayerSpec

__all__ = ["ThdMethod", "THD_KERNELS", "THD_CP_COMM_TYPES"]


class ThdMethod(GatheredKVMethod):
    name = "thd"
    summary = "packed documents (TE partition per document), K/V all-gathered, exact per-document causal attention"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, windows_checked_at_call=True, alibi=True,
        )

    def _switch(self) -> tuple[Any, str]:
        from automodel.distributed.cp.thd.attention import THD_ATTN_NAME, set_thd_attention

        return set_thd_attention, THD_ATTN_NAME

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx

        return make_thd_batch_and_ctx

    # ------------------------------------------------------------------ memory plan and dry run
    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """The whole row's K/V, all-gathered per layer (and its rank-major -> global reorder copy); in the
        backward K/V again plus the global dK/dV and its rank-major copy before the reduce-scatter; plus
        the fp32 output / LSE of the rank's queries. Not kept across layers (re-gathered in backward)."""
        c, tp = r.compute_bytes, r.tp
        kv = d.kv_heads * d.head_dim / tp
        row_tokens = r.local_batch * r.seq  # every rank sees the K/V of the whole row
        fwd = 4 * kv * c * row_tokens
        bwd = 8 * kv * c * row_tokens
        partial = r.local_tokens * (d.heads * d.head_dim / tp + d.heads / tp) * 4  # fp32 output ([N, heads x D]), LSE
        from automodel.distributed.cp.block_sets import packed_call_bytes  # torch: imported only to plan

        # cuDNN: the prefix and diagonal blocks in packed-row calls (block_sets), their copies at the backward
        packed = packed_call_bytes(kv, d.heads * d.head_dim / tp, row_tokens, r.local_tokens, c,
                                   getattr(r, "attention_kernel", ""), getattr(r, "cudnn_packed_blocks", True))  # fmt: skip
        return max(fwd, bwd + packed) + partial, (
            f"thd: K/V of the whole row ({row_tokens} tokens) all-gathered per layer; backward: K/V again + dK/dV "
            "before the reduce-scatter" + ("; the packed-row calls' key copies and dK/dV" if packed else "")
        )
