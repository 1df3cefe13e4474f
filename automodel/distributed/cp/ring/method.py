"""``distributed.cp_method: ring``: torch's ring attention (``context_parallel``) around SDPA.

Rows are split head-tail (rank r holds chunks r and 2W-1-r of 2W); q stays, K/V shards rotate around
the CP ranks and the partial outputs merge by log-sum-exp. Exact for plain causal attention over the
whole row with ``sdpa`` (on CPU through :mod:`automodel.distributed.cp.ring.cpu_ring`). Each layer picks its
kernel at the call (:mod:`automodel.distributed.cp.ring.router`): sliding windows and chunks shorter than the
row and sinks run the halo kernel, MLA value heads the ring on zero-padded V, Llama 4's query temperature
is taken at the global position. ``eager`` models run too: inside the ring context they are switched to the
routed eager attention (torch's ring for plain causal layers, the halo kernel for the rest, with eager's
logit softcapping). Refused: flex attention (ring replaces only SDPA: its kernel would attend within each
rank's shard), linear / state-space mixers without a ring kernel, packed rows.
"""

from __future__ import annotations

from typing import Any

from automodel.distributed.cp.method import BatchFn, CPMethod, ExchangeTerm, standard_problem
from automodel.distributed.cp.profile import LayerSpec

__all__ = ["RingMethod", "SDPA_GQA_MAX_HEAD_DIM"]

#: transformers' ``sdpa`` attention passes ``enable_gqa`` (K/V at the KV heads) only up to this head size; above it
#: it repeats K/V to the query heads (``use_gqa_in_sdpa``, 5.17 to 5.25)
SDPA_GQA_MAX_HEAD_DIM = 256


class RingMethod(CPMethod):
    name = "ring"
    summary = "torch ring attention: k/v shards rotate around the CP ranks (SDPA); windowed layers exchange halos"
    # torch's context_parallel replaces SDPA with ring attention; an eager model is routed (ring/router.py)
    attn_implementations = ("sdpa", "eager")
    supports_packed = False  # ring attention is causal over the whole row
    supports_vlm = True
    chunks_per_rank = 2
    layout = "head_tail"
    workspace_holds_qkv_grads = True  # torch's ring accumulates dq, dk, dv in its workspace (attention_workspace)

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(
            self.name, layer, seq_len, windows=True, chunks=True, sinks=True, softcap=True, mla=True,
            position_scaled=True, alibi=True,
        )

    def config_problems(self, cfg: Any, cuda_available: bool | None) -> list[str]:
        d = cfg.distributed
        if d.cp_size > 1 and d.enable_compiled_autograd and cfg.model.attn_implementation == "eager":
            return [
                "distributed.enable_compiled_autograd=true with distributed.cp_method=ring and "
                "model.attn_implementation=eager: compiled autograd isolates the attention by its registered name, "
                "and ring routes an eager model's layers only inside each step's context; set "
                "distributed.enable_compiled_autograd=false, model.attn_implementation=sdpa (where the model has it), "
                "or distributed.cp_method=ulysses"
            ]
        return []

    def _batch_function(self) -> BatchFn:
        from automodel.distributed.cp.ring.batch import make_cp_batch_and_ctx

        return make_cp_batch_and_ctx

    def mask_scope(self, packed: bool) -> str | None:
        """The model keeps its attention implementation (torch's ring replaces SDPA underneath): transformers
        builds its mask from the rank's tokens."""
        return "local"

    def saves_repeated_kv(self, packed: bool, head_dim: int = 0) -> bool:
        """Full layers run torch's ring attention through transformers' ``sdpa`` function. That function repeats K/V
        to the query heads only where it cannot pass ``enable_gqa`` (``use_gqa_in_sdpa``, transformers 5.17 to 5.25:
        a mask, or K/V head sizes unequal or above :data:`SDPA_GQA_MAX_HEAD_DIM`); the ring drops the plain causal
        mask (``ring/router.py``), so torch's ring ops (the CPU flash op here, flash / cuDNN on CUDA, each taking
        grouped K/V) save K and V at the KV heads: live-tensor snapshots of ``scripts/bench_memory.py``'s ring rows
        (torch 2.13 CPU, transformers 5.25) show ``[B, Hkv, n, D]`` saved. ``head_dim``: the model's (0: unknown)."""
        return head_dim > SDPA_GQA_MAX_HEAD_DIM

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """Per local token, what torch's ring attention (``_templated_ring_attention`` and its backward) holds beyond
        the layer's activations. K/V blocks at the KV heads (``2 kv c`` each): on CPU (this package's synchronous
        rotation, ``cpu_ring._SyncRotater``) the received block, the next one being sent and the one being received,
        ``min(cp, 3)`` of them; on CUDA torch's default ``allgather`` rotation holds every rank's K/V at once plus
        the block being sent, ``cp + 1`` (at least the ``alltoall`` rotation's 3). Forward: those and the fp32
        partial output and LSE being merged (``2 (q + heads) 4``). Backward: those, the fp32 dq accumulator
        (``q 4``), dK/dV in fp32 three times (the accumulator, the block being sent and the one being received:
        ``6 kv 4``), and the kernel's dq, dk, dv of two ring steps (the previous step's are still referenced while
        the next call allocates: ``2 (q + 2 kv) c``); the kernel's own buffers are the attention kernel term. Measured
        on CPU at cp 2 with the ring's internal allocations tracked (``scripts/bench_memory.py --tiled-layer only``).
        """
        from automodel.distributed.cp.attention_kernels import CPU_KERNEL

        n, c, tp = r.local_tokens, r.compute_bytes, r.tp
        q, kv, heads = d.heads * d.head_dim / tp, d.kv_heads * d.head_dim / tp, d.heads / tp
        if self.saves_repeated_kv(False, d.head_dim):  # transformers repeated K/V to the query heads: the ring's are
            kv = q  # theirs (Gemma 4's 512-wide full layers: planned -27% at ring cp 2 with the KV heads' blocks)
        cpu = getattr(r, "attention_kernel", CPU_KERNEL) == CPU_KERNEL
        blocks = min(r.cp, 3) if cpu else max(r.cp + 1, 3)
        kv_blocks = blocks * 2 * kv * c
        fwd = kv_blocks + 2 * (q + heads) * 4
        bwd = kv_blocks + q * 4 + 6 * kv * 4 + 2 * (q + 2 * kv) * c
        rotation = "the synchronous rotation (CPU)" if cpu else "the all-gathered K/V of every rank (CUDA)"
        return n * max(fwd, bwd), (f"ring: {blocks} K/V blocks in flight ({rotation}), the fp32 dq accumulator, dK/dV "
                                   "in fp32 (accumulated, sent, received) and two ring steps' dq, dk, dv")

    def exchange_terms(self, d: Any, r: Any, packed: bool = False) -> list[ExchangeTerm]:
        """The default K/V bytes, split by what each overlaps: torch's ring (the recipe's default ``allgather``
        rotater) all-gathers K/V once per forward and again in backward while the rank's own diagonal block
        runs (``1/cp`` of that pass's attention), and rotates dK/dV point to point under the backward's other
        blocks (the remaining ``1 - 1/cp`` of it)."""
        cp = r.cp
        if cp <= 1:
            return []
        (kv,) = super().exchange_terms(d, r, packed)  # forward: K/V; backward: K/V again + dK/dV
        unit = kv.forward_bytes
        return [
            ExchangeTerm("K and V of the other ranks' tokens (all-gathered)", cp, cp, unit, unit, 1 / cp, 1 / cp),
            ExchangeTerm("dK and dV back around the ring", cp, cp, 0.0, unit, 0.0, 1 - 1 / cp),
        ]

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        return [f"  ring attention           k,v rotate around the ring of {cp_size} (cp_size - 1 exchanges per layer)"]
