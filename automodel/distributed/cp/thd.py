"""``distributed.cp_method: thd``: packed documents in TE's partition, K/V all-gathered per layer.

Every document of a packed row is padded to a multiple of ``2*cp_size`` and split into ``2*cp``
chunks; rank r holds chunks r and 2W-1-r of every document. Each attention layer all-gathers K/V of
the whole row and computes exact per-document causal attention (the portable kernel on any device;
flash-attn varlen or Transformer Engine on CUDA); the backward re-gathers K/V and reduce-scatters
dK/dV. Exact for full causal attention; each layer picks its kernel (:mod:`automodel.distributed.cp.kernels`):
sliding windows and attention chunks shorter than the longest document, sinks and logit softcapping
(transformers hands the kernel ``softcap`` only where the model applies it) run the halo kernel
(only the K/V each layer reaches is exchanged, never across a document); MLA value heads run on
zero-padded V; Llama 4's query temperature is taken at the in-document position. Refused:
linear / state-space mixers.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from automodel.distributed.cp.method import AttentionSwitchingMethod, BatchFn, standard_problem
from automodel.distributed.cp.profile import LayerSpec

__all__ = ["ThdMethod", "THD_KERNELS", "THD_CP_COMM_TYPES"]

# Mirrors automodel.distributed.thd_attention (kept import-free: the config rules import this module)
THD_KERNELS = ("portable", "flash_attn", "te")
THD_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class ThdMethod(AttentionSwitchingMethod):
    name = "thd"
    summary = "packed documents (TE partition per document), K/V all-gathered, exact per-document causal attention"
    attn_implementations = ("sdpa", "eager")  # the cp=1 reference; at cp>1 the model runs THD attention
    supports_packed = True  # per-document causal attention from seq_lens_padded
    supports_vlm = False  # the vision path hands merged inputs_embeds to ring / ulysses batch functions only
    chunks_per_rank = 2  # TE's partition: chunks r and 2W-1-r of EVERY document (padded to 2*cp)
    layout = "head_tail"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, windows_checked_at_call=True,
        )

    def _switch(self) -> tuple[Any, str]:
        from automodel.distributed.thd_attention import THD_ATTN_NAME, set_thd_attention

        return set_thd_attention, THD_ATTN_NAME

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.thd_attention import make_thd_batch_and_ctx

        return make_thd_batch_and_ctx

    # ------------------------------------------------------------------ recipe keys
    def recipe_batch_options(self, cfg: Any) -> dict[str, Any]:
        return {"kernel": cfg.distributed.thd_kernel, "cp_comm_type": cfg.distributed.thd_cp_comm_type}

    def document_multiple(self, cfg: Any) -> tuple[int, str]:
        """What every packed document is padded to: ``2*cp_size`` (TE's partition), ``*tp_size`` with
        sequence parallelism (each TP rank an equal share of the rank's tokens)."""
        d = cfg.distributed
        return self.row_multiple(d.cp_size, d.tp_size, d.sequence_parallel)

    def dataset_options(self, cfg: Any, node: Any) -> dict[str, Any]:
        """``{"seq_pad_multiple": 2*cp}`` for a packed dataset node without its own value, else {}."""
        if (
            cfg.distributed.cp_size <= 1
            or node is None
            or node.get("pack") is not True
            or node.get("seq_pad_multiple") is not None
        ):
            return {}
        return {"seq_pad_multiple": self.document_multiple(cfg)[0]}

    def key_problems(self, cfg: Any) -> list[str]:
        d, problems = cfg.distributed, []
        if d.thd_kernel not in THD_KERNELS:
            problems.append(f"distributed.thd_kernel={d.thd_kernel!r} is not one of {' | '.join(THD_KERNELS)}")
        if d.thd_cp_comm_type not in THD_CP_COMM_TYPES:
            problems.append(
                f"distributed.thd_cp_comm_type={d.thd_cp_comm_type!r} is not one of {' | '.join(THD_CP_COMM_TYPES)}"
            )
        return problems

    def config_problems(self, cfg: Any, cuda_available: bool | None) -> list[str]:
        d, problems = cfg.distributed, []
        if d.cp_size <= 1:
            return problems
        on_cpu = cuda_available is False or d.backend == "gloo"
        if d.thd_kernel in ("flash_attn", "te"):
            package = "flash_attn" if d.thd_kernel == "flash_attn" else "transformer_engine"
            if on_cpu:
                problems.append(
                    f"distributed.thd_kernel={d.thd_kernel} needs CUDA, but this run is on CPU; set "
                    "distributed.thd_kernel=portable (exact on every device)"
                )
            elif importlib.util.find_spec(package) is None:
                problems.append(
                    f"distributed.thd_kernel={d.thd_kernel} needs the {package!r} package, which is not installed; "
                    "install it or set distributed.thd_kernel=portable"
                )
        multiple, what = self.document_multiple(cfg)
        for key in ("dataset", "validation_dataset"):
            node = getattr(cfg.data, key)
            if node is None or node.get("pack") is not True:
                continue
            m = node.get("seq_pad_multiple")
            if isinstance(m, int) and m % multiple:
                problems.append(
                    f"data.{key}.seq_pad_multiple={m} is not a multiple of {what}: "
                    f"distributed.cp_method=thd splits every packed document into {multiple} equal chunks; "
                    f"remove data.{key}.seq_pad_multiple (thd then pads to {multiple}) or set it to a multiple of {multiple}"
                )
        return problems

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
        partial = r.local_tokens * (d.hidden / tp + d.heads / tp) * 4
        return max(fwd, bwd) + partial, (
            f"thd: K/V of the whole row ({row_tokens} tokens) all-gathered per layer; backward: K/V again + dK/dV "
            "before the reduce-scatter"
        )

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        return [
            f"  all-gather (thd)       k,v -> [{b * seq}, {kv}, {head_dim}] per layer (the whole row; dK/dV "
            f"reduce-scattered in backward); each rank's queries attend within their documents"
        ]
