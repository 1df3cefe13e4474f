"""The strategy base of the head-tail gathered-K/V methods (``thd`` and ``usp``): their recipe keys.

Both methods place packed documents head-tail (Transformer Engine's partition, every document padded to
a multiple of ``2 * cp_size``) and run the gathered-K/V kernel (:mod:`.gathered_attention`) with the
``distributed.thd_kernel`` / ``distributed.thd_cp_comm_type`` keys. :class:`GatheredKVMethod` holds what
they share; each method package subclasses it. Import-free (no torch.distributed, no transformers):
the config rules import it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from automodel.distributed.cp.method import AttentionSwitchingMethod

__all__ = ["GatheredKVMethod", "THD_CP_COMM_TYPES", "THD_KERNELS"]

#: Values of ``kernel=`` (config key ``distributed.thd_kernel``).
THD_KERNELS = ("portable", "flash_attn", "te")
#: Transformer Engine context-parallel communication types (``distributed.thd_cp_comm_type``).
THD_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


class GatheredKVMethod(AttentionSwitchingMethod):
    """Packed documents head-tail over the ranks, K/V all-gathered per layer (subclassed by thd and usp)."""

    attn_implementations = ("sdpa", "eager")  # the cp=1 reference; at cp>1 the model runs the method's attention
    supports_packed = True  # per-document causal attention from seq_lens_padded
    supports_vlm = False  # the vision path hands merged inputs_embeds to ring / ulysses batch functions only
    chunks_per_rank = 2  # TE's partition: chunks r and 2W-1-r of EVERY document (padded to 2*cp)
    layout = "head_tail"
    #: the data pads every packed document to :meth:`document_multiple` (thd: Transformer Engine's kernel reads
    #: that padding); ``False``: the batch function pads them itself, so packing is the same at every cp_size
    pads_documents_in_data = True

    def kernel_call_tokens(self, d: Any, r: Any) -> tuple[int, int, int, int]:
        """The rank's chunks (``local_tokens / local_batch`` queries) against the gathered K/V of the whole row
        (a later chunk sees up to all of it)."""
        return d.heads // r.tp, max(1, d.kv_heads // r.tp), r.local_tokens // r.local_batch, r.seq

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
            not self.pads_documents_in_data
            or cfg.distributed.cp_size <= 1
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
        for key in ("dataset", "validation_dataset") if self.pads_documents_in_data else ():
            node = getattr(cfg.data, key)
            if node is None or node.get("pack") is not True:
                continue
            m = node.get("seq_pad_multiple")
            if isinstance(m, int) and m % multiple:
                problems.append(
                    f"data.{key}.seq_pad_multiple={m} is not a multiple of {what}: "
                    f"distributed.cp_method={self.name} splits every packed document into {multiple} equal chunks; "
                    f"remove data.{key}.seq_pad_multiple (thd then pads to {multiple}) or set it to a multiple of {multiple}"
                )
        return problems

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        return [
            f"  all-gather (thd)       k,v -> [{b * seq}, {kv}, {head_dim}] per layer (the whole row; dK/dV "
            f"reduce-scattered in backward); each rank's queries attend within their documents"
        ]
