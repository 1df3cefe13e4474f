"""Predicted per-rank memory of a training run, term by term, and the cheapest change that fits a budget.

``recipe.dry_run=true`` prints :func:`memory_plan_lines`; ``scripts/bench_memory.py`` (CP, chunked
loss, checkpointing) and ``scripts/bench_tp.py`` (tensor parallelism, loss parallel) check the
prediction against measurement. Two figures, reported separately because they are measured separately:

* **persistent state**: what lives between optimizer steps on each rank: the FSDP2 shard of the
  parameters (master dtype) and of the AdamW states (two per trainable parameter, master dtype).
  Gradients do not persist (the trainer zeroes them with ``set_to_none=True``).
* **step peak**: the most one step (forward, loss, backward, optimizer step of one micro-batch) holds
  *above* that state at any moment. It is the largest of four phases, each a sum of terms; a phase with
  several moments is the largest of them (:attr:`MemoryPlan.by_moment`, measured by ``scripts/bench_plan_cases.py``):

  - ``forward``: the last decoder layer in flight: the activations kept so far and the layer's own in flight,
    at its MLP (:func:`_mlp_moments`) or at its attention (with the CP workspace), FSDP2's root and two layers
    gathered (the current one and the prefetched next: :func:`_comm_in_forward`), no gradient yet; or the final
    norm's forward after every layer's (:func:`_final_norm_moments`);
  - ``loss``: end of forward / start of backward: the saved activations, the logits-and-loss
    peak, the FSDP2 buffers live then (the root module gathered; the layers are resharded), the
    gradients of earlier micro-batches (grad_acc > 1); no attention buffers (every layer's attention is done);
  - ``recompute`` (activation checkpointing) / ``backward`` (without): backward through one layer (the recomputed
    one; without checkpointing the last): the saved layer inputs and the layer's activations, the FSDP2 buffers
    and the gradients written so far (the LM head's and the layers' reached; :func:`_grads_in_backward`), at two
    moments: the MLP's backward (its gradients, no CP workspace: backward reaches the attention after the MLP)
    and the attention's (the MLP's tensors freed; the CP attention workspace and the attention kernel's backward
    buffers); and two norms' backward moments: one of the layer's hidden-size norms, the MLP's tensors freed
    (:func:`_layer_norm_moment`: the recomputed layer's peak where the MLP is tiled), and the final norm's, before
    any layer's (without checkpointing every layer's saved tensors beside it: :func:`_final_norm_moments`); for a
    layer of several residual streams (Gemma 3n's AltUp, hyper-connections) its residual structure's backward,
    first in the layer's, with every tensor the layer saved alive (``residual streams``:
    :attr:`ModelDims.residual_backward_extra`);
  - ``optimizer``: all gradients and the optimizer's temporaries (FSDP2 has freed its buffers by then).

Terms (bytes per rank; ``N`` = local tokens of one micro-batch = ``local_batch_size * seq / cp``, the
same on every rank of a TP group; ``h`` hidden, ``I`` MLP width, ``kv`` = kv_heads * head_dim, ``V``
vocab, ``c`` compute-dtype bytes, ``tp`` = ``distributed.tp_size``):

* parameters, AdamW states: ``P / fsdp`` and ``2 * P_trainable / fsdp`` master-dtype values, where
  ``fsdp = dp_shard * cp`` (FSDP2 shards over ``dp_shard_cp``, see ``automodel.models.parallelize``)
  and ``P`` is what one TP rank holds: the parameters the TP plan shards (q/k/v/o, gate/up/down,
  embedding, LM head: :func:`automodel.distributed.tensor_parallel.tp_plan`) ``/ tp``, the rest
  (RMSNorm weights, a row-parallel bias) whole. FSDP2 then shards all of it over ``dp_shard_cp``.
* gradients: ``P_trainable / fsdp`` in the master dtype (FSDP2 keeps sharded gradients).
* activations, per decoder layer and local token (HF Llama-style block under sdpa, counted tensor by
  tensor from what autograd saves): ``(9 h + 2 kv + 4 I) c`` without checkpointing and CP, i.e. two RMSNorm
  outputs each (4 h), q after RoPE (h), k after RoPE and v as the attention kernel is given them: at the KV heads
  (2 kv: torch's SDPA with ``enable_gqa``, torch's ring ops and the block kernels) or repeated to all heads in their
  place (2 q: transformers' sdpa where it cannot pass ``enable_gqa``, above head size 256 or given a mask; eager; ring
  above head size 256, ``CPMethod.saves_repeated_kv``; never both, as repeat_kv and RoPE keep no input), the
  attention output (h; torch's CPU SDPA returns it token-major for a q that is a transposed view of its projection,
  so the output projection's input is a view of it) and, where the output is head-major (eager, layers in their own
  code, a partial RoPE's concatenated q: :attr:`ModelDims.attn_output_copy`) and under CP, its transposed copy (h
  more: :func:`_output_copies`; with head groups only the copy, and no LSE), the residual (h), and
  gate, up, silu(gate), silu(gate) * up (4 I; a gated block that saves more, what it saves, counted on the meta device:
  :attr:`ModelDims.mlp_saved_extra`); measured within 10% on CPU (see docs/recipe.md, "Memory plan"); plus
  ``(h + 3 h) c`` outside the layers (embedding output, final norm), the ids/labels/positions (24 B) and
  RoPE's cos and sin (``2 head_dim c``). Per-head q/k norms (Qwen3, Gemma 3) save their input and normalized
  output: ``2 (h + kv) c`` more per layer; each hidden-size norm beyond two (Gemma's four) ``2 h c``. In bf16 / fp16
  a norm that computes in fp32 saves its input's fp32 copy too: transformers' RMSNorm ``h c`` more (the copy is
  ``2 h c``, and its bf16 input is no longer what it saves), Gemma's ``2 h c``, ``nn.LayerNorm`` nothing; measured per
  norm class (:mod:`automodel.training.norm_memory`, :attr:`ModelDims.norm_half_extra`). The MLP's
  moments (what the forward holds in flight, what its backward holds) are :func:`_mlp_moments`'s.
  With activation checkpointing only each layer's input (``h c``) is kept; backward recomputes one
  layer at a time and holds its activations plus the gradients at its output and input (``2 h c``)
  and, at the MLP's backward, the MLP's gradients. At a layer's attention (its forward; its backward, once the MLP's
  and the post-attention norm's backward have run) the residual stream holds only the input norm's ``2 h``: the
  residual add and the later norms are not made yet / freed (``3 h`` fewer than the whole layer: live-tensor
  snapshots of ``scripts/bench_memory.py``'s Ulysses and ring rows). Without CP the attention's backward holds the
  output projection's input gradient and SDPA's dq, dk, dv besides (``2 q`` + K/V as saved; eager's moment, before
  dq and dk, ``q`` + V's): the step's peak where q is wide next to the MLP (the 4 / 2 heads of 320 of
  ``scripts/bench_memory.py --structures only``); under CP the method's workspace counts them.
  A looped model (Dory, Inkling2-loop, HRM: :mod:`automodel.models.layer_calls`) runs some layers more than once a
  forward: ``L`` above is then its layer calls with autograd (:attr:`ModelDims.calls`; each saves its layer's
  activations, or checkpointed its input), and each pass beyond the first keeps one more ``h c`` between the passes
  (:attr:`ModelDims.loop_restarts`). With checkpoint groups of ``k`` (``model.checkpoint_group_layers``,
  :mod:`automodel.models.checkpoint_groups`) only each group's first input is kept, ``ceil(L / k)``; a group's
  backward holds its ``k`` inputs (the others rebuilt): ``ceil(L / k) + k - 1`` at the backward's moments, or
  offloaded ``k + 1`` (with the previous group's prefetched) and ``ceil(L / k)`` on the host (:func:`_kept_inputs`).
  Activations divide by ``cp`` (the local tokens). Tensor parallelism divides the per-head and MLP
  ones (q, k, v or the repeated K/V, the attention output and its copy, the four MLP tensors, the LSE)
  by ``tp``; the residual stream (the two norms' ``4 h``, the residual ``h``, the embedding output
  and final norm, the layer inputs kept under checkpointing) stays whole on every TP rank unless
  ``distributed.sequence_parallel`` splits it ``/ tp`` too; then the attention block and the MLP
  block each all-gather their input once and the projections save that gathered ``[N, h]``:
  ``+ 2 h c`` per layer, and the LM head's gathered input ``+ h c`` outside.
* the tiled layer (``model.tiled_layer``, tp 1): a layer keeps its input and the attention core's tensors (q, k, v,
  the kernel's output and the post part's copy: ``3 q + 2 kv``, plus ring's repeated K/V and the LSE; with head
  groups no kernel output nor LSE); the norms, q/k norms, projections, residuals and MLP exist for one tile; the post
  part's backward holds the output's, the attention output's and the input's gradients (``2 h + q``), the
  attention's backward (the post part's copy freed) the input's and the attention output's gradients and dq, dk, dv
  (``h + 2 q + 2 kv``) beside the CP workspace and the kernel's buffers (:func:`_tiled_layer_terms`; measured by
  ``scripts/bench_memory.py --tiled-layer only``: ring +0%, Ulysses +0%, with 2 head groups +9%; ring's dq, dk, dv
  are its workspace's: ``CPMethod.workspace_holds_qkv_grads``). Without CP
  with ``model.attention_head_chunks=G`` (``RunShape.head_chunks`` at cp 1) no kernel output nor LSE is saved either,
  and the attention's backward adds one group's recomputed output and LSE, its output gradient made contiguous and its
  dq, dk, dv (``((3 q + 2 kv) c + 4 heads) / G``; ``scripts/bench_memory.py --head-groups only``: within 5%); the
  untiled layer's terms stay as without groups (one token-major output saved: -2% there).
* attention workspace: ring (torch's ring loop, :meth:`~automodel.distributed.cp.ring.RingMethod.attention_workspace`):
  the K/V blocks in flight at the KV heads (``2 kv c`` each: ``min(cp, 3)`` under the CPU's synchronous rotation,
  ``cp + 1`` under CUDA's all-gather), and in the forward the fp32 partial output and LSE being merged
  (``2 (q + heads) 4``), in the backward the fp32 dq accumulator (``q 4``), dK/dV in fp32 three times (``6 kv 4``)
  and two ring steps' kernel gradients (``2 (q + 2 kv) c``); measured on CPU with the ring's own allocations counted
  (``scripts/live_tensors.tracked_inside``). Ulysses: the backward's full-row gradients of the
  output, q, k and v around their all-to-alls (``(2 q + 2 kv') c``, ``q`` = heads x head_dim, ``kv'`` the kv heads
  sent; the received q, k, v and output the kernel saves are activations), ``/ G`` with
  ``distributed.ulysses_head_chunks=G`` plus the groups' local q, k, v gradients waiting to be stacked
  (``(G-1)/G (q + 2 kv') c``); at the
  attention's moments (forward and backward), not beside the MLP's. ``eager`` attention saves
  its ``[heads, S_q, S_k]`` probabilities per layer, the fp32 softmax and (2-byte compute) its cast (an S² term of
  ``4 + c`` bytes per score; shown under activations), and holds two fp32 score tensors more at the layer's attention
  (:func:`_eager_score_bytes`); layers in their own code (GPT-Neo) hand q, k, v to the CP method: none under CP.
  Without CP, SDPA given a boolean mask keeps a float copy of it per layer
  (:func:`.layer_kind_memory.sdpa_mask_copy`: sliding-window layers, Falcon).
* attention masks (:func:`.layer_kind_memory.mask_bytes`): transformers' materialised masks where the method's
  path builds them (:meth:`automodel.distributed.cp.CPMethod.mask_scope`) and the halo kernel's per-block key
  masks, from the forward to the end of the backward (and under Ulysses, at an ALiBi layer's forward attention, the two
  boolean ``[B, S, S]`` masks it builds its bias mask from: :func:`.layer_kind_memory.alibi_mask_build`). Layer kinds
  beyond the Llama-style block add to the attention
  workspace at the attention's moments: ALiBi's score blocks on the halo kernel
  (:func:`.layer_kind_memory.alibi_workspace`) and a gathered-state kernel's tensors
  (:func:`.layer_kind_memory.gathered_workspace`, declared per kernel in
  :mod:`automodel.distributed.cp.layers.gathered_state`); the largest over the model's layer kinds.
* attention kernel: what the CUDA attention kernel the run uses (``RunShape.attention_kernel``, from
  ``model.attention_backend`` and, for ``auto``, the GPU: :func:`planned_kernel`) allocates in one call's
  backward beyond its gradients, e.g. flash's fp32 dQ accumulator and, under GQA, dK/dV for every query head
  (:func:`automodel.distributed.cp.attention_kernels.kernel_buffers`, cited per buffer in docs/long_context.md);
  0 for the CPU kernels the activations are calibrated on. Without CP, ``model.attention_head_chunks=G`` makes it one
  head group's call (``heads / G``, ``kv_heads / G``).
* mixture-of-experts layers: the MLP's saved tensors are each routed copy's (``k (2 h + 4 I_e)``), the shared
  experts' (``4 I_s``) and the router's fp32 probabilities (``4 E + 16 k`` bytes) per token (:func:`_mlp_moments`).
* logits and loss: plain: the fp32 log-softmax output, the incoming gradient and the logits
  gradient alive together in backward, ``3 N V 4``, plus the hidden-state gradient ``N h c``.
  Under TP without loss parallel the LM head's output is gathered: the same ``3 N V 4`` on every TP
  rank. With ``distributed.enable_loss_parallel`` each rank holds ``[N, V / tp]``, and torch's fused
  vocabulary-parallel backward keeps four of them: ``4 N (V / tp) 4`` (see :func:`_plain_logits`).
  The chunked loss does not compose with TP (rejected by the config rules).
  Chunked (``loss.chunk_tokens = n``): the larger of ``2 n V 4`` (one chunk's fp32 logits and their softmax; the
  loop frees each chunk before the next) and, in a bf16 / fp16 backward, ``n V (4 + c) + V h c`` (the softmax, its cast
  and their ``[V, h]`` weight-gradient product before it is added; fp32 adds it in place), beside the fp32 LM-head
  gradient accumulator ``V h 4`` and ``N h c`` (:func:`_loss_term`).
* communication buffers (FSDP2, when ``fsdp > 1`` or the compute dtype differs from the master
  dtype): the root module (embeddings, final norm, LM head) stays gathered from forward to
  backward (``reshard_after_forward=False``), two decoder layers gathered at a time (the current one
  and the prefetched next; all of them when ``fsdp.reshard_after_forward=false``) and one layer's
  unsharded gradient before its reduce-scatter; under TP each of them is the rank's TP shard.
* attention workspace under TP: the same terms on ``heads / tp`` heads (``h / tp``, ``kv / tp``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from automodel.distributed.cp.profile import text_config
from automodel.models.layer_calls import layer_calls

# the names transformers gives per-head (or whole-projection) query and key norms (ModelDims.qk_norm)
from automodel.models.tiled_mlp import QK_NORM_NAMES as _QK_NORM_NAMES
from automodel.models.tiled_mlp import builds_experts, is_hidden_norm, mlp_tile_width
from automodel.training.layer_kind_memory import (
    HALO_BLOCK,
    alibi_mask_build,
    alibi_saved_per_layer,
    alibi_workspace,
    dynamic_mask_bytes,
    gathered_state_bytes,
    gathered_workspace,
    halo_math_scores,
    halo_math_workspace,
    indexer_bytes,
    mask_bytes,
    position_bias_bytes,
    sdpa_mask_copy,
)
from automodel.training.norm_memory import RMS_NORM_PEAKS, NormPeaks

__all__ = [
    "ModelDims",
    "RunShape",
    "MemoryTerm",
    "MemoryPlan",
    "model_dims",
    "plan_memory",
    "suggest_changes",
    "memory_plan_lines",
    "tp_lines",
    "run_shape_from_config",
    "DEFAULT_CHUNK_TOKENS",
    "AUTO_LOSS_SHARE",
    "host_bytes",
    "loss_auto_choice",
    "resolve_chunk_tokens",
    "resolve_head_chunks",
    "head_chunks_auto_choice",
    "resolve_attention_head_chunks",
    "head_chunk_options",
    "checkpoint_group_auto_choice",
    "resolve_checkpoint_group",
]

DEFAULT_CHUNK_TOKENS = 1024  # what a suggestion (and ``loss.chunk_tokens: auto``) turns the chunked loss on with
#: ``loss.chunk_tokens: auto`` turns the chunked loss on when the plain logits-and-loss term is more than this
#: share of the step peak (:func:`loss_auto_choice`)
AUTO_LOSS_SHARE = 0.25
_GIB = 2**30


#: a gated MLP's ``(saved, forward peak, backward peak)`` per token in ``[N, I]`` units (:func:`_mlp_moments`)
GATED_MLP_MOMENTS = (4.0, 3.0, 6.0)
#: a grouped_mm mixture of experts' forward and backward peaks per routed copy of a token, ``(h, I_e)`` units, beyond
#: its input, its output and their gradients: a probe of one Qwen3-MoE block (transformers 5.25, fp32, 4096 tokens;
#: ``h, I_e, k`` = 64, 32, 2 / 64, 256, 2 / 256, 32, 2 / 256, 32, 4) fitted between -1% and +6% of each measured peak, the
#: larger of the fits where they differ (:func:`_mlp_moments`)
MOE_GROUPED_FORWARD = (3.8, 4.0)
MOE_GROUPED_BACKWARD = (4.6, 5.0)


@dataclass(frozen=True)
class ModelDims:
    """The sizes the planner needs from a decoder-only causal LM (see :func:`model_dims`)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # unique parameters (tied weights once)
    trainable: int  # parameters with requires_grad (LoRA: the adapters)
    layer_params: int  # parameters of the largest decoder layer
    root_params: int  # parameters outside the decoder layers (embeddings, final norm, LM head)
    # of the above, those the tensor-parallel plan shards over tp (0: the model has no TP plan)
    tp_params: int = 0
    tp_trainable: int = 0
    tp_layer_params: int = 0  # of the largest decoder layer
    tp_root_params: int = 0
    # the input-embedding table when the LM head does not share it: looked up, never multiplied (step estimate)
    lookup_params: int = 0
    # a mixture of experts (0: dense): routed experts per layer, experts per token, one expert's MLP width and
    # the shared experts' total width (Qwen-MoE / DeepSeek style; 0: none). ``intermediate`` is then the width
    # of a dense layer's MLP where the model mixes both, else the expert width.
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    #: the per-token MLP width the tiled MLP cuts its tiles by (:func:`automodel.models.tiled_mlp.mlp_intermediate_width`:
    #: a mixture's ``top_k`` experts and shared experts where wider than the dense MLP, ``4 h`` where the config names
    #: none); an MLP no wider than ``h`` runs as one tile. 0: ``intermediate`` (a ModelDims built by hand)
    tile_width: int = 0
    #: how transformers runs the routed experts (``config._experts_implementation``): ``"grouped_mm"`` (one
    #: ``torch._grouped_mm`` over the tokens sorted by expert, transformers >= 5.2x) or ``"eager"`` (the expert loop)
    experts_impl: str = "eager"
    #: ``(fp32, bf16)``: ``[k N, I_e]`` units per routed copy that the experts' gate keeps beyond SiLU's
    #: ``act(gate) * up`` (:func:`automodel.training.mlp_memory.experts_gate_saved`, measured on the meta device:
    #: MiniMax-M3's clamped, sigmoid-gated activation 3); 0 elsewhere
    experts_gate_extra: tuple[float, float] = (0.0, 0.0)
    #: ``(fp32 run, bf16 run)``: bytes per token and MoE layer that the router keeps beyond the router term's
    #: ``4 E + 16 k`` (:func:`automodel.training.mlp_memory.router_saved`, measured on the meta device): a router that
    #: scores in fp32 (DeepSeek-V3's, GLM-4-MoE's, Solar Open's) keeps an fp32 copy of its ``[N, h]`` input in a bf16
    #: run, ``4 h``; 0 elsewhere
    router_saved_extra: tuple[float, float] = (0.0, 0.0)
    #: per-head query/key norms (Qwen3, Gemma 3, OLMo 2: ``q_norm`` / ``k_norm``): they save their input and
    #: normalized output, ``2 (h + kv)`` more per token and layer
    qk_norm: bool = False
    #: hidden-size norms per decoder layer (Llama: 2; Gemma 2/3: 4, around each block)
    layer_norms: int = 2
    #: ``[N, h]`` units (compute dtype) a decoder layer's norms save in bf16 / fp16 beyond their fp32 count: the fp32
    #: copy of the input that transformers' RMSNorm makes (1 per norm; Gemma's 2; ``nn.LayerNorm`` 0), measured by
    #: :func:`automodel.training.norm_memory.half_precision_extra`; and the same for the norms outside the layers
    norm_half_extra: float = 0.0
    final_norm_half_extra: float = 0.0
    #: the same for the per-head q/k norms, in units of the q and k they normalize (``[N, q + kv]``): Qwen3's RMSNorm
    #: 1, Gemma 3's 2 (:func:`_norm_fields`)
    qk_norm_half_extra: float = 0.0
    #: the final norm's peaks ``(fp32, bf16 / fp16)`` in ``[N, h]`` units of the compute dtype, whole and in token tiles,
    #: its input and the incoming gradient counted (:func:`_final_norm_moments`), measured by
    #: :func:`automodel.training.norm_memory.norm_peaks`; transformers' RMSNorm's by default
    final_norm_peaks: tuple[NormPeaks, NormPeaks] = RMS_NORM_PEAKS
    #: the tiled MLP or layer tiles the final norm (:func:`automodel.models.tiled_mlp.find_final_norms` finds it)
    final_norm_tiles: bool = True
    #: the same peaks for a decoder layer's hidden-size norms (the largest of the first layer's): their backward's
    #: temporaries (:func:`_layer_norm_moment`)
    layer_norm_peaks: tuple[NormPeaks, NormPeaks] = RMS_NORM_PEAKS
    #: ``(fp32, bf16 / fp16)``: the most ``[N, h]`` units a layer's hidden-size norm saves beyond its input
    #: (:func:`automodel.training.norm_memory.saved_beyond_input`; transformers' RMSNorm 1 and 3)
    layer_norm_saved: tuple[float, float] = (1.0, 3.0)
    #: the tiled MLP runs every one of those norms in token tiles too
    #: (:func:`automodel.models.tiled_mlp.tile_layer_norms` finds each of the first layer's): :func:`_layer_norm_tile`
    layer_norm_tiles: bool = True
    #: a final transform of the LM head's output that the chunked loss cannot compute (``"a prediction head before its
    #: output Linear"``; "" none: no transform, or one it computes per chunk, a soft-cap or a scale:
    #: :func:`automodel.training.logit_transform.chunkable_transform`): ``loss.chunk_tokens: auto`` then plans and runs
    #: the plain loss
    logit_transform: str = ""
    #: the logits are soft-capped after the LM head (``final_logit_softcapping``: Gemma 2 / 3, NanoChat): the plain
    #: loss's ``tanh`` keeps its ``[N, V]`` output, in the compute dtype, for its backward (:func:`_plain_logits`)
    logit_softcap: bool = False
    #: the largest decoder-layer MLP block's trainable parameters (:func:`automodel.models.tiled_mlp.find_mlps`; 0: none
    #: found): :attr:`mlp_weights`
    mlp_params: int = 0
    #: the distinct attention kinds of the layers, ``(limit, layers)``: limit 0 full causal (and DSA), else the
    #: sliding window or attention chunk in tokens (transformers builds one mask per kind: :mod:`.layer_kind_memory`);
    #: a kind of 0 layers: a mask the model builds for no layer (Qwen2-MoE's sliding one: :func:`_unused_window_mask`)
    attention_kinds: tuple[tuple[int, int], ...] = ()
    #: the model builds its mask whatever the kernel (``allow_is_causal_skip=False``): its heads (1: DeepSeek sparse
    #: attention's indexer; ``heads``: Falcon's ALiBi folded into the mask); 0: transformers' rules
    forced_mask_heads: int = 0
    #: layers that add ALiBi's bias in their own code (BLOOM, MPT, Falcon with ``alibi=True``)
    alibi_layers: int = 0
    #: ``(limit, layers, forward scores, backward scores)`` of the attention layers a CP method that runs the halo
    #: kernel gives it for their soft-capped scores or sinks (Gemma 2, gpt-oss), whose blocks a CPU runs in exact math
    #: (limit 0: the full prefix, else the window or chunk), with the score blocks such a block holds at its forward's
    #: and its backward's peak: :func:`automodel.training.layer_kind_memory.halo_math_workspace`
    halo_math: tuple[tuple[int, int, int, int], ...] = ()
    #: the eager attention caps its scores (``tanh(scores / cap) * cap``: Gemma 2's and VaultGemma's
    #: ``attn_logit_softcapping``; the profile's ``LayerSpec.softcap``, which the CP methods read too) and keeps the
    #: tanh's output for its backward: in fp32 one more ``[heads, S_q, S_k]``
    #: score per layer; in bf16 / fp16 it takes the place of the probabilities' cast (:func:`_eager_score_bytes`)
    attn_softcapping: bool = False
    #: compressed KV entries a query's eager scores cover beyond the row's keys, as a fraction of the row: DeepSeek-V4's
    #: compressed layers append one entry per ``compress_rate`` tokens (``config.compress_rates`` by layer type: CSA 4,
    #: HCA 128) to the window's keys, and extend the mask to them per layer (the largest over the layers); 0 elsewhere
    compressed_keys: float = 0.0
    #: layers of DeepSeek sparse attention whose own code folds the indexer's top-k into the mask under eager and
    #: sdpa (``index_mask``: DeepSeek-V3.2, GLM-5, HY-V4, AXK2): at cp 1 each holds a ``[B, 1, S, S]`` boolean index
    #: mask and the combined mask (the compute dtype under eager, boolean under sdpa) at its attention
    index_mask_layers: int = 0
    #: the model's layer loop keeps a layer's returned attention probabilities while the next layer runs (BLOOM:
    #: ``outputs = block(...)``, its own eager code returns them): under checkpointing, where nothing else keeps
    #: them, one ``[heads, S, S]`` in the compute dtype beside the next layer's attention in the forward
    keeps_returned_probs: bool = False
    #: the query heads of each decoder layer whose attention builds a learned relative-position bias ``[B, heads, S,
    #: S]`` per call (Inkling 1, 2 and 2-loop: each query's states over the key distances up to ``rel_extent``,
    #: gathered; :func:`.layer_kind_memory.position_bias_bytes`); empty elsewhere
    position_bias_heads: tuple[int, ...] = ()
    #: int64 ``[S, S]`` query-key distance tables the model builds once per forward for those layers (Inkling 2: one
    #: per attention kind, ``get_relative_distance`` in its text model's forward); Inkling builds them per layer
    position_bias_tables: int = 0
    #: decoder layers whose attention builds a dynamic mask from its value states and hands it to the kernel with its
    #: gradient (Doge's ``prepare_dynamic_mask``: a float ``[B, kv, S, S]`` repeated to the query heads;
    #: :func:`.layer_kind_memory.dynamic_mask_bytes`), and their ``keep_window_size`` (a longer row keeps the keys
    #: outside each query's top ``W`` as a boolean mask too); 0 elsewhere
    dynamic_mask_layers: int = 0
    dynamic_mask_window: int = 0
    #: layers whose attention selects its keys with a weightless indexer that scores ``[queries, keys]`` in fp32
    #: chunks of at most ``indexer_chunk`` scores (Kolibri-1.1's ``Kolibri1_1Indexer``, a reference implementation,
    #: ``max_scores``), and how many of them build a pool of candidate keys that a later layer is handed (``[B, S, S]``
    #: booleans the model passes along its layers up to the next ``is_pool_source``, which starts from none):
    #: :func:`.layer_kind_memory.indexer_bytes`; 0 elsewhere
    indexer_layers: int = 0
    indexer_chunk: int = 0
    indexer_pools: int = 0
    #: linear-attention layers whose mixer sits where a layer holds its attention and mixes the tokens in its own code
    #: (MiniMax's lightning attention, transformers' torch implementation on every device), and ``(fp32, bf16)``: the
    #: ``q`` units per token each keeps beyond the attention terms the plan counts for every layer
    #: (:func:`automodel.training.attention_memory.mixer_saved_extra`); 0 elsewhere
    mixer_layers: int = 0
    mixer_saved_extra: tuple[float, float] = (0.0, 0.0)
    #: linear-mixer layers whose modeling file names a kernel package that runs their token mixing on a GPU (fla,
    #: causal-conv1d, mamba-ssm: Qwen3-Next, Kimi Linear, Mamba, ...). Where their torch code runs (the CPU, a GPU
    #: without the package here) and under the state chain their cores are measured (``core_*``, ``chain_*``); on a GPU
    #: where the package runs them they are planned with their heads' attention terms, and the plan's note says so
    kernel_mixer_layers: int = 0
    #: elements of the largest parameter of an MoE block whose expert loop indexes its stacked weights per expert
    #: (``self.gate_up_proj[expert_idx]`` under ``experts_implementation="eager"``; JetMoE's ``self.weight[i]``, DBRX's
    #: ``w1.view(...)[expert_idx]``): the backward makes each expert's gradient full-size (``select_backward``) and the
    #: autograd engine sums them out of place, so three copies of the weight's gradient exist at once, two beyond the
    #: one the plan counts (a probe of one stacked weight: 3.0 x its bytes); 0 elsewhere (grouped_mm's and Llama 4's
    #: bmm compute the whole gradient at once)
    expert_loop_param: int = 0
    #: linear-mixer layers whose torch code runs on every device, not held where a layer holds its attention
    #: (RecurrentGemma's RG-LRU, xLSTM's mLSTM): measured with the other cores (``core_*``, ``chain_*``) where they have
    #: a CP kernel; otherwise planned with their heads' attention terms (noted)
    torch_mixer_layers: int = 0
    #: linear-mixer layers whose mixer the CP methods run (``linear_support.STATE_MIXERS``, ZAYA's convolutional
    #: attention included): those ring, thd, thd_docs and usp chain across their ranks (what that keeps:
    #: ``chain_kept_per_token``)
    chained_mixer_layers: int = 0
    #: ``(fp32, bf16)`` bytes per token of a rank's row, and per row, that the state chain keeps through the step of
    #: all the chained layers together (:func:`automodel.training.chain_memory.chain_kept`: measured on the meta
    #: device); 0 where there are none or they cannot be measured (the plan's note then says they are not counted)
    chain_kept_per_token: tuple[float, float] = (0.0, 0.0)
    chain_kept_per_row: tuple[float, float] = (0.0, 0.0)
    #: ``(fp32, bf16)`` bytes per token one linear-mixer layer's core saves outside the chain (run as one of two Ulysses
    #: ranks runs it: the whole row for half the heads, per token of the rank's share), and the most it holds in its
    #: forward (its output included) and its backward (what it saved included): the classes' largest, the same
    #: measurement
    core_saved_per_token: tuple[float, float] = (0.0, 0.0)
    core_forward_per_token: tuple[float, float] = (0.0, 0.0)
    core_backward_per_token: tuple[float, float] = (0.0, 0.0)
    #: of the chained layers, those whose cores the plan counts outside the chain too (one process, Ulysses) from
    #: ``core_*_per_token``, where their torch code runs: on a CPU every one
    #: (``core_layers``: all but ZAYA's CCA, inside its probed attention, and MiniMax's measured lightning layers), on a
    #: GPU those whose kernel package is not installed here or that have none (``gpu_torch_core_layers``:
    #: :func:`automodel.training.chain_memory.torch_code_on_gpu`)
    core_layers: int = 0
    gpu_torch_core_layers: int = 0
    #: ``[N, h]`` hidden states a decoder layer takes (what checkpointing keeps and offload moves per layer): Gemma
    #: 3n's AltUp passes its ``altup_num_inputs`` predictions stacked, ``[K, B, S, h]``; hyper-connections (DeepSeek-V4's
    #: and HY-V4's ``hc_mult``, Qwen4-Exp's ``hc_count``) pass that many residual streams, ``[B, S, K, h]``; 1 elsewhere
    layer_input_copies: int = 1
    #: the model hands its decoder layers their hidden states in fp32 whatever its dtype (ZAYA's ``residual_in_fp32``
    #: residual stream; :func:`automodel.training.residual_memory.residual_fp32`, measured on the meta device): in a
    #: bf16 run checkpointing keeps, and activation offload moves, fp32 layer inputs (:func:`_layer_input_bytes`)
    residual_fp32: bool = False
    #: ``(fp32, bf16)``: ``[N, h]`` units per token and layer call that a hyper-connected layer's residual structure
    #: saves beyond a plain pre-norm layer's (its norms and residual add, which the stream term counts): its ``K``
    #: input streams, which its norm keeps, and its mixing (:func:`automodel.training.residual_memory.residual_saved`,
    #: measured on the meta device: DeepSeek-V4's real layer ~18 in fp32, ~48 in bf16); for an fp32 residual stream
    #: (``residual_fp32``) its fp32 scalings and casts (ZAYA: 4 in fp32, 6 in bf16); 0 for one compute-dtype stream
    residual_saved_extra: tuple[float, float] = (0.0, 0.0)
    #: ``((untiled, norms tiled) in fp32, (the same) in bf16)``: ``[N, h]`` units per token that such a layer's
    #: residual structure's backward holds beyond what the layer saved and the two gradients every layer counts: its
    #: ``K`` streams' gradients and its residual structure's backward (Gemma 3n's AltUp correction: ``[K, N, h]``
    #: gradients of its product, innovation and predictions at once), with its norms' fp32 temporaries where they run
    #: whole (:func:`automodel.training.residual_memory.residual_backward_extra`, measured on the meta device); the
    #: moment ``bwd_residual`` of :func:`_activation_terms`, first in the layer's backward; 0 for a plain layer
    residual_backward_extra: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    #: ``(fp32, bf16)``: ``q`` units (``heads x head_dim``) per token and layer that an attention module calling its
    #: kernel more than once keeps beyond a Llama attention's (DiffLlama's two calls on the halves of V, their outputs'
    #: concatenation, difference and group norm: ~4.6 in fp32, ~5.7 in bf16), or one that convolves its projections
    #: (ZAYA's convolutional q/k mixing: ~5.4; Inkling's short convolutions of k and v: ~1.1), or one that routes its
    #: heads through experts (JetMoE: its experts' gathered inputs and outputs, K and V repeated: ~8.5), less its q/k norms'
    #: terms, which the attention term counts (:func:`automodel.training.attention_memory.attention_saved_extra`);
    #: 0 elsewhere
    attention_saved_extra: tuple[float, float] = (0.0, 0.0)
    #: ``(fp32, bf16)`` bytes per ``[heads, S_q, S_k]`` score that the model's own eager attention function keeps and
    #: holds at its peaks (:func:`automodel.training.eager_memory.eager_scores`, measured on the CPU: Granite-SWA's
    #: sinks through a log-sum-exp keep the masked scores too); ``None``: not measured, the formula
    #: (:func:`_eager_score_bytes`) stands
    eager_scores: tuple[Any, Any] | None = None
    #: layers that compute their attention in their own code (the ALiBi ones, GPT-Neo, GPT-NeoX-Japanese, OpenAI GPT,
    #: XGLM): under CP they hand q, k, v to the method (``cp/layers/alibi.py``) and the model keeps its attention
    #: implementation, so its mask is built from the rank's tokens
    own_code_layers: int = 0
    #: the model builds one mask for all its layers whatever their kinds (GPT-Neo: its layers cut their local window
    #: out of their own buffer)
    single_mask: bool = False
    #: gathered-state kernels' layers, ``(layers, GatheredState)`` per declaration
    #: (:mod:`automodel.distributed.cp.layers.gathered_state`: DeepSeek sparse attention's latent KV and indexer keys)
    gathered: tuple[tuple[int, Any], ...] = ()
    #: the dense MLP: gated (``down(act(gate) * up)``, three matrices) or plain (``fc2(act(fc1))``, two: GPT-2,
    #: GPT-NeoX, Falcon, Phi, BLOOM), read from the modules (:func:`automodel.training.mlp_memory.mlp_shape`)
    mlp_gated: bool = True
    #: a plain MLP's ``(saved, forward peak, backward peak)`` per token in ``[N, I]`` units, measured with its own
    #: activation (:func:`automodel.training.mlp_memory.plain_mlp_moments`: GELU 2, 2, 3.1; the tanh formula 5, 5, 7.1)
    mlp_moments: tuple[float, float, float] = GATED_MLP_MOMENTS
    #: ``(fp32, bf16 / fp16)``: ``[N, I]`` units a gated dense MLP block saves beyond the ``4 I`` of
    #: :data:`GATED_MLP_MOMENTS`, measured on the meta device (:func:`automodel.training.mlp_memory.dense_mlp_saved`):
    #: Beam's and BitNet's SwiGLU in fp32 in a bf16 model, Dory's and BitNet's norm over ``I``; 0 where it saves
    #: ``4 I`` or less (a smaller count is not taken: the moments' peaks are not measured)
    mlp_saved_extra: tuple[float, float] = (0.0, 0.0)
    #: ``((forward, backward) fp32, (forward, backward) bf16)``: how much higher a gated block's forward and backward
    #: peaks are than Llama's SwiGLU's beyond ``mlp_saved_extra``, ``[N, I]`` units
    #: (:func:`automodel.training.mlp_memory.dense_mlp_peaks`, measured on the meta device: BitNet's fp32 norm over
    #: ``I`` 6 at its backward in bf16); 0 elsewhere
    mlp_peak_extra: tuple[tuple[float, float], tuple[float, float]] = ((0.0, 0.0), (0.0, 0.0))
    #: bytes of the model's buffers of 1 MiB or more (GPT-Neo's ``[P, P]`` boolean causal or local-window mask in every
    #: attention layer, ``P = max_position_embeddings``): whole on every rank, FSDP2 does not shard buffers
    buffer_bytes: int = 0
    #: the attention output is head-major where the output projection needs it token-major, so a layer keeps a
    #: transposed copy of it beside the kernel's (:func:`_output_copies`): a query made contiguous head-major before
    #: the kernel (a partial RoPE concatenating its rotated and passed parts: GPT-NeoX, Phi, StableLM) or layers in
    #: their own code (:func:`_attn_output_copy`); ``False`` where q is a transposed view of its projection (Llama,
    #: Qwen, Gemma, Falcon, GPT-2: torch's CPU SDPA then returns the output token-major and no copy is made)
    attn_output_copy: bool = True
    #: one projection makes q, k and v (Phi-3's ``qkv_proj``, GPT-NeoX's and Falcon's ``query_key_value``, DBRX's
    #: ``Wqkv``) and RoPE replaces q and k: v, a view of that output, keeps all of it alive where the kernel saves v
    #: (``q + kv`` more per token and layer; :func:`_fused_qkv`)
    fused_qkv: bool = False
    #: ``[N, q]`` units an attention output gate saves per layer (:func:`_attn_output_gate`): ``out * sigmoid(g)`` with
    #: ``g = gate_proj(x)`` of ``q`` (AFMoE, Beam, HRM, Dory, HY-V4) or the second half of the query projection's
    #: output (Qwen3-Next, Qwen3.5, Qwen4-Exp: :attr:`query_gate`) keeps the sigmoid's output and the product, 2; a
    #: gate per head (Laguna's ``g_proj``, dots3's) the product and ``heads / q``; 0: no gate found
    attn_output_gate: float = 0.0
    #: the output gate is the second half of ``q_proj``'s ``[N, 2 q]`` output (Qwen3-Next, Qwen3.5, Qwen4-Exp): where
    #: the per-head q norm saves its input as it is (fp32: its ``x.float()`` is ``x``), that view keeps the whole
    #: projection alive, ``q`` more per token and layer; in bf16 / fp16 it saves its fp32 copy and the projection is
    #: freed (measured: Qwen3.5 with every layer full attention, hidden 256, 2048 tokens, without checkpointing: fp32
    #: -7.3% with neither, -1.0% with the gate, +2.1% with both; bf16 -5.9% -> -0.9% with the gate)
    query_gate: bool = False
    #: decoder-layer calls per forward that autograd records, where a looped model runs some layers more than once
    #: (Dory's recurrent slice, Inkling2-loop's loop, HRM's cycles: :mod:`automodel.models.layer_calls`); each saves
    #: its layer's activations (checkpointed: its input) again. 0: each of the ``layers`` once (:attr:`calls`)
    layer_calls: int = 0
    #: calls under ``torch.no_grad`` (HRM's early L cycles): a forward's FLOPs, nothing saved
    no_grad_layer_calls: int = 0
    #: parameters the repeated calls multiply again: over the layers, ``(grad calls - 1) x`` the layer's parameters
    #: (the step estimate's ``6 N`` and the recompute's ``2 N_layers`` count them once more per call)
    looped_params: int = 0
    #: over the layers, ``no_grad calls x`` the layer's parameters (``2 N`` each: a forward)
    no_grad_params: int = 0
    #: a looped model's passes with autograd beyond the first: each keeps one more ``[N, h]`` outside the layers
    #: (:attr:`automodel.models.layer_calls.LayerCalls.restarts`)
    loop_restarts: int = 0

    @property
    def calls(self) -> int:
        """Decoder-layer forwards per model forward that save activations: :attr:`layer_calls` or :attr:`layers`."""
        return self.layer_calls or self.layers

    @property
    def matmul_params(self) -> int:
        """``N`` of the step estimate's ``6 N`` FLOPs per token: every parameter but the input-embedding lookup
        table (a tied table counts: the LM head multiplies by it). Norm weights and biases are counted too
        (well under 0.1% of a decoder); a mixture of experts counts every expert (an over-estimate)."""
        return self.params - self.lookup_params

    @property
    def layer_matmul_params(self) -> int:
        """The decoder layers' share of :attr:`matmul_params` (what activation checkpointing recomputes);
        all of it for a model that does not name its layers."""
        inside = self.params - self.root_params
        return inside if inside > 0 else self.matmul_params

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of the dense MLP (of each expert): 3 gated (``down(act(gate) * up)``; experts are counted
        so), 2 plain (``fc2(act(fc1))``: GPT-2, GPT-NeoX, Falcon)."""
        return 3 if self.mlp_gated or self.experts else 2

    @property
    def mlp_weights(self) -> int:
        """Weight elements of one decoder layer's MLP block whose gradients its backward makes: what the tiled MLP's
        (and the tiled layer's) backward holds a tile's gradient of, beside their running sum. The largest block's
        trainable parameters where the model was read (:attr:`mlp_params`: a mixture of experts' every expert, its
        shared experts and router, as the tiled backward differentiates the whole block per tile); else the dense
        MLP's ``mats h I``."""
        return self.mlp_params or self.mlp_matrices * self.hidden * self.intermediate

    @property
    def tp_capable(self) -> bool:
        """Whether ``distributed.tp_size > 1`` can shard this model (a TP plan exists, no LoRA)."""
        return self.tp_params > 0 and self.trainable == self.params

    def local_params(self, tp: int) -> float:
        """Unique parameters one TP rank holds before FSDP2: the TP-sharded ones ``/ tp``, the rest whole."""
        return self.params - self.tp_params + self.tp_params / tp

    def local_trainable(self, tp: int) -> float:
        return self.trainable - self.tp_trainable + self.tp_trainable / tp


@dataclass(frozen=True)
class RunShape:
    """How one rank runs: parallel sizes, sequence, dtypes and the memory switches of the config."""

    local_batch: int  # rows per micro-batch (step_scheduler.local_batch_size)
    seq: int  # padded global row length
    cp: int = 1
    tp: int = 1
    dp_shard: int = 1
    cp_method: str = "ring"  # a registered CP method (its memory terms: automodel.distributed.cp)
    attn: str = "sdpa"
    activation_checkpointing: bool = False
    chunk_tokens: int | None = None
    master_bytes: int = 4
    compute_bytes: int = 4
    reduce_bytes: int = 4
    grad_acc: int = 1
    reshard_after_forward: bool = True
    loss_parallel: bool = False  # distributed.enable_loss_parallel (tp > 1): logits stay [N, V / tp]
    sequence_parallel: bool = False  # distributed.sequence_parallel (tp > 1): residual stream [N / tp, h]
    fsdp_enabled: bool = True  # fsdp.enabled=false: every rank holds the whole model (replicated)
    tiled_mlp: bool | int = False  # model.tiled_mlp: the MLP over tiles of T tokens (True: resolve_tile_tokens)
    #: model.tiled_layer: the layer but its attention core over tiles (True: resolve_layer_tile_tokens)
    tiled_layer: bool | int = False
    activation_offload: bool = False  # model.activation_offload: checkpointed layer inputs on the host
    #: model.checkpoint_group_layers: only every k-th layer input kept (automodel.models.checkpoint_groups)
    checkpoint_group: int = 1
    offload: bool | str = False  # fsdp.offload: False | "optimizer" | "all"
    cp_options: tuple[tuple[str, Any], ...] = ()  # the method's distributed.<key> values (usp: ulysses_size)
    #: attention heads in this many groups, one at a time: distributed.ulysses_head_chunks (ulysses, usp) or, at
    #: cp 1, model.attention_head_chunks (automodel.models.attention_head_chunks)
    head_chunks: int = 1
    packed: bool = False  # rows hold several documents (data.dataset.pack)
    #: the attention kernel planned for (automodel.distributed.cp.attention_kernels: "cpu" = torch's CPU kernels,
    #: which the activations are calibrated on; a CUDA kernel adds what its backward allocates)
    attention_kernel: str = "cpu"
    attention_kernel_rule: str = ""  # why that kernel (model.attention_backend, or auto's rule for the GPU)
    #: model.cudnn_packed_blocks: thd's, thd_docs' and usp's block sets in cuDNN's packed-row calls where the torch
    #: the plan runs under takes them (automodel.distributed.cp.block_sets.packed_call_bytes)
    cudnn_packed_blocks: bool = True

    @property
    def method(self):  # noqa: ANN201 - a CPMethod
        """The CP method with its options bound (:func:`automodel.distributed.cp.get_cp_method`)."""
        from automodel.distributed.cp import get_cp_method

        return get_cp_method(self.cp_method, **dict(self.cp_options))

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp if self.fsdp_enabled else 1

    @property
    def local_tokens(self) -> int:
        """Tokens of one micro-batch on this rank: ``local_batch * seq / cp`` (every TP rank of a group
        processes the same tokens; sequence parallel splits only the residual stream between them)."""
        return self.local_batch * self.seq // self.cp

    @property
    def activation_offloaded(self) -> bool:
        """Activation offload applies to what checkpointing keeps (it needs ``activation_checkpointing``)."""
        return self.activation_offload and self.activation_checkpointing

    @property
    def group(self) -> int:
        """Layers per checkpoint group (1: every layer keeps its input; groups act only under checkpointing)."""
        return self.checkpoint_group if self.activation_checkpointing else 1

    @property
    def kernel_path(self) -> str:
        """``"sdpa"`` (torch's SDPA dispatch: no CP, or a method's inner sdpa kernel) or ``"blocks"`` (the CP block
        kernels): :meth:`automodel.distributed.cp.CPMethod.kernel_path`."""
        return self.method.kernel_path(self.packed) if self.cp > 1 else "sdpa"

    @property
    def stream_split(self) -> int:
        """What the residual stream (norms, layer inputs, embedding output) is divided by: tp under SP, else 1."""
        return self.tp if self.sequence_parallel else 1


@dataclass(frozen=True)
class MemoryTerm:
    name: str  # one of TERMS
    bytes: float
    note: str = ""


# step terms in print order; a phase sums a subset of them
TERMS = (
    "gradients",
    "activations",
    "attention masks",
    "attention workspace",
    "attention kernel",
    "logits and loss",
    "communication buffers",
    "optimizer temporaries",
)


@dataclass
class MemoryPlan:
    """Per-rank prediction. ``phases`` maps a phase name to ``{term: bytes}``; the peak is the largest."""

    persistent: list[MemoryTerm]
    terms: dict[str, MemoryTerm]
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    host: list[MemoryTerm] = field(default_factory=list)  # pinned host memory per rank (offload), see host_bytes
    #: the moment a phase's figure is taken at, where it has several: ``"MLP"`` or ``"attention"`` of a layer
    moments: dict[str, str] = field(default_factory=dict)
    #: every moment of those phases, ``{phase: {moment: {term: bytes}}}``; the phase is its largest
    by_moment: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def host_bytes(self) -> float:
        return sum(t.bytes for t in self.host)

    @property
    def persistent_bytes(self) -> float:
        return sum(t.bytes for t in self.persistent)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def step_peak_bytes(self) -> float:
        return sum(self.phases[self.peak_phase].values())

    @property
    def total_bytes(self) -> float:
        return self.persistent_bytes + self.step_peak_bytes

    @property
    def dominant(self) -> str:
        """The largest single term of the total: a persistent term or a term of the peak phase."""
        cands = {t.name: t.bytes for t in self.persistent} | self.phases[self.peak_phase]
        return max(cands, key=cands.get)


def _mlp_tile(d: ModelDims, r: RunShape) -> int | None:
    """Tokens per MLP tile of ``r`` (``None``: the MLP is not tiled; a tile of every local token is one tile, which
    the model still runs through its recomputing Function): :func:`automodel.models.tiled_mlp.resolve_tile_tokens`,
    the rule the model tiles with."""
    if r.tiled_mlp is False or r.tiled_mlp is None:
        return None
    from automodel.models.tiled_mlp import resolve_tile_tokens

    tile = resolve_tile_tokens(r.tiled_mlp, d.hidden, max((d.tile_width or d.intermediate) // r.tp, 1), r.local_tokens)
    return None if tile is None else min(tile, max(r.local_tokens, 1))


def _layer_tile(d: ModelDims, r: RunShape) -> int | None:
    """Tokens per tile of the tiled layer (``model.tiled_layer``; ``None``: off): the rule the model tiles with,
    :func:`automodel.models.tiled_layer.resolve_layer_tile_tokens` (one tile still runs the layer in its parts)."""
    if r.tiled_layer is False or r.tiled_layer is None or not d.heads:
        return None
    from automodel.models.tiled_layer import resolve_layer_tile_tokens

    return resolve_layer_tile_tokens(r.tiled_layer, d.hidden, r.local_tokens)


def _tiled_layer_terms(d: ModelDims, r: RunShape, tile: int) -> _Activations:
    """The activations at each moment of a step with ``model.tiled_layer`` (:class:`_Activations`; tp 1).

    Per local token, in the compute dtype ``c``: what a layer keeps between its forward and its backward is the
    attention core's: q, k, v (``q + 2 kv``, ``q = heads x head_dim``; ring's SDPA also the K/V repeated to the
    query heads), the kernel's output and its transposed copy the post part saves (``2 q``), the fp32 LSE; and its
    input ``h`` (the checkpoint's, or without checkpointing the post part's and the pre part's, one tensor); with
    head groups (``ulysses_head_chunks > 1``) the kernel's output and LSE are not saved (each group is
    checkpointed). The
    norms, their fp32 copies, the q/k norms, the output projection, the residuals and the MLP exist for one tile.
    The backward of the post part holds the output gradient (``h``) and the gradients it writes for the attention
    output (``q``) and the input (``h``); the attention's backward (the post part's saved copy of the attention
    output freed by then) the attention output's and the input's gradients and dq, dk, dv (``q + 2 kv``) beside
    the CP workspace and the kernel's buffers. One tile of ``t``
    tokens: the untiled layer's tensors but the attention's, its gradients and the tile's weight gradients
    (``h q + 3 h I`` for the output projection and the MLP). Measured: scripts/bench_memory.py --tiled-layer only.
    """
    n, c = r.local_tokens, r.compute_bytes
    h, kv, q = d.hidden, d.kv_heads * d.head_dim, d.heads * d.head_dim
    repeated = 2 * q * _repeated_kv_share(d, r)
    # head groups (distributed.ulysses_head_chunks=G > 1): each group runs under a checkpoint, so the kernel's
    # output and LSE are not saved (automodel.distributed.cp.head_chunks); the local output the post part saves is
    # model.attention_head_chunks=G at cp 1 likewise (automodel.models.attention_head_chunks)
    grouped = r.head_chunks > 1
    lse = 0 if grouped else d.heads * 4
    kernel_out = 0 if grouped else q
    body = (q + repeated + 2 * kv + kernel_out + q) * c + lse  # the attention core's saved tensors
    # at the attention's backward the post part's backward is done: its saved attention output (q) is freed
    body_in_attn_bwd = body - q * c
    mlp = _mlp_moments(d, c)
    stream = (2 * d.layer_norms + 1) * h + (2 * (h + kv) if d.qk_norm else 0)
    if c < 4:  # a tile's norms' fp32 copies in bf16 / fp16 (_activation_terms)
        stream += d.norm_half_extra * h + (d.qk_norm_half_extra * (q + kv) if d.qk_norm else 0.0)
    t = min(tile, n)
    tile_bwd = t * (stream + 2 * h + mlp.backward + 3 * h) * c + mlp.router * t + (h * q + d.mlp_weights) * c
    if c < 4 and t < n:  # the running sums of the post part's weight gradients in fp32 (automodel.models.tile_backward)
        tile_bwd += (h * q + d.mlp_weights) * (4 - c)
    tile_fwd = t * (stream + mlp.forward) * c + mlp.router * t
    post_grads = (2 * h + q) * c  # the output's gradient, the attention output's and the input's
    # the input's and the attention output's gradients, dq, dk, dv (those three in the CP workspace where the method
    # accumulates them there: ring, CPMethod.workspace_holds_qkv_grads)
    qkv_grads = 0 if r.cp > 1 and _method(r).workspace_holds_qkv_grads else q + 2 * kv
    attn_grads = (h + q + qkv_grads) * c
    if grouped and r.cp <= 1:  # cp 1 in head groups: one group's recomputed output and LSE, its output gradient
        # made contiguous for the kernel and its dq, dk, dv before they are written into the whole ones
        attn_grads += ((3 * q + 2 * kv) * c + d.heads * 4) / r.head_chunks
    embed = 0.0 if r.activation_offloaded else h * c
    rope = 2 * d.head_dim * c
    final = _final_saved(d, r)
    always = 24 + rope + d.loop_restarts * h * c  # a looped model's hidden states kept between its passes
    s2 = 0.0
    if _keeps_eager_scores(d, r):
        extent = (d.heads, r.seq, r.seq * (1 + d.compressed_keys))  # DeepSeek-V4's compressed entries widen the keys
        heads_local, s_q, s_k = _method(r).attention_extent(d, r) if r.cp > 1 else extent
        s2 = r.local_batch * heads_local * s_q * s_k * _eager_moments(d, c)[0]
    tiled = f"; layer tiled end to end, {t} tokens per tile ({_fmt(tile_bwd)} per tile in backward)"
    if r.activation_checkpointing:
        kept, kept_at_loss = (x * _layer_input_bytes(d, c) for x in _kept_inputs(d, r))
        saved = n * (kept_at_loss + final + always)
        fwd_m = n * (kept_at_loss + always + body + h * c) + tile_fwd + s2
        fwd_a = n * (kept_at_loss + always + body) + s2
        bwd_m = n * (kept + always + body + post_grads) + tile_bwd + s2
        bwd_a = n * (kept + always + body_in_attn_bwd + attn_grads) + s2
        note = _kept_inputs_note(d, r)
        note += f"; one layer recomputed in backward: {_fmt(bwd_a - n * (kept + always))} (its attention's backward){tiled}"
        fwd_f, bwd_f = _final_norm_moments(d, r, n * (kept_at_loss + always))
        return _Activations(saved, fwd_m, fwd_a, bwd_m, bwd_a, note, fwd_f, bwd_f)
    layer = h * c + body + s2 / max(n, 1)
    before = n * ((d.calls - 1) * layer + always)
    saved = n * (d.calls * layer + final + always)
    fwd_m = before + n * (body + 2 * h * c) + tile_fwd + s2
    fwd_a = before + n * (body + h * c) + s2
    bwd_m = before + n * (body + h * c + post_grads) + tile_bwd + s2
    bwd_a = before + n * (body_in_attn_bwd + h * c + attn_grads) + s2
    note = f"{_layer_count(d)} x {_fmt(n * layer)}{tiled}"
    del embed
    fwd_f, bwd_f = _final_norm_moments(d, r, n * (d.calls * layer + always))
    return _Activations(saved, fwd_m, fwd_a, bwd_m, bwd_a, note, fwd_f, bwd_f)


def model_dims(model) -> ModelDims:  # noqa: ANN001 (an HF PreTrainedModel, possibly on the meta device)
    """Read :class:`ModelDims` from an HF causal LM (meta tensors are fine: only shapes are read).

    The sizes come from the model's profile (:func:`~automodel.distributed.cp.guard.cached_profile`, read
    once per model), the parameter counts from its parameters."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.models.parallelize import decoder_layers
    from automodel.training.logit_transform import chunkable_transform
    from automodel.training.residual_memory import residual_fp32

    c = cached_profile(model)
    heads = c.num_attention_heads or 0  # 0: a model without attention (Mamba, RWKV, xLSTM): no attention terms
    kv = c.num_key_value_heads or heads
    head_dim = (c.head_dim or c.hidden_size // heads) if heads else 0
    if heads:  # a larger head on some layers (Gemma 4's full-attention layers, global_head_dim): _widest_head
        head_dim = max(head_dim, _widest_head(c))
    inter = c.intermediate_size
    if isinstance(inter, (list, tuple)):  # a width per layer (Gemma 3n): the widest
        inter = max(inter)
    unique = {id(p): p for p in model.parameters()}.values()
    try:
        layers = decoder_layers(model)
    except ValueError:  # a model that does not name its blocks: every parameter counts as root
        layers = []
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    sharded = _tp_sharded_params(model)
    tp_unique = [p for p in unique if id(p) in sharded]
    mlp = _mlp_fields(model, layers[0] if layers else None, c.hidden_size)
    if "intermediate" in mlp and not isinstance(c.intermediate_size, (list, tuple)):
        inter = mlp.pop("intermediate")  # the modules' width (GPT-2's n_inner, Falcon's ffn_hidden_size)
    mlp.pop("intermediate", None)
    kinds = _layer_kinds(model, c)
    blocks = _mlp_blocks(model)  # the MLP blocks the tiled MLP finds: their parameters, a shared MLP no key names
    loops = _layer_call_fields(model, layers)
    attention = _first_attention_layer(layers, c)  # a hybrid's first layers may be linear attention or convolutions
    fp32_stream = residual_fp32(model, layers)
    norms = _norm_fields(model, layers, attention, c.hidden_size, head_dim)
    qk_norm = attention is not None and any(n.rsplit(".", 1)[-1] in _QK_NORM_NAMES for n, _ in attention.named_modules())
    # the q/k norms' share of a probed attention's extra, which the attention term counts itself (2 (q + kv), and
    # their fp32 copies in bf16), in q units
    qk_share = ((2 * (heads + kv) / heads, (2 + norms["qk_norm_half_extra"]) * (heads + kv) / heads)
                if qk_norm and heads else (0.0, 0.0))  # fmt: skip
    return ModelDims(
        # a looped model's layers are its modules (HRM's num_hidden_layers counts its cache slots, one per call)
        layers=len(layers) if loops else c.num_hidden_layers,
        hidden=c.hidden_size,
        intermediate=inter or 4 * c.hidden_size,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        vocab=c.vocab_size,
        params=sum(p.numel() for p in unique),
        trainable=sum(p.numel() for p in unique if p.requires_grad),
        layer_params=max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
        root_params=sum(p.numel() for p in unique if id(p) not in in_layers),
        tp_params=sum(p.numel() for p in tp_unique),
        tp_trainable=sum(p.numel() for p in tp_unique if p.requires_grad),
        tp_layer_params=max(
            (sum(p.numel() for p in layer.parameters() if id(p) in sharded) for layer in layers), default=0
        ),
        tp_root_params=sum(p.numel() for p in tp_unique if id(p) not in in_layers),
        lookup_params=_lookup_params(model),
        layer_norms=_layer_norms(layers[0], c.hidden_size) if layers else 2,
        **norms,
        qk_norm=qk_norm,
        logit_transform=chunkable_transform(model)[1],
        logit_softcap=_logit_softcap(model),
        mlp_params=_mlp_params(blocks),
        expert_loop_param=_expert_loop_param(blocks),
        attn_softcapping=any(layer.softcap for layer in c.layers if layer.is_attention),
        eager_scores=None if kinds["own_code_layers"] else _eager_scores(layers),
        **_moe_sizes(model, blocks),
        **kinds,
        attn_output_copy=_attn_output_copy(model, kinds["own_code_layers"]),
        fused_qkv=_fused_qkv(model, attention, heads * head_dim, kv * head_dim),
        **_attn_output_gate(attention, c.hidden_size, heads * head_dim, heads),
        tile_width=mlp_tile_width(getattr(model, "config", None)) or 0,
        residual_fp32=fp32_stream,
        **_residual_extras(model, layers, kinds["layer_input_copies"], fp32_stream),
        attention_saved_extra=_attention_saved_extra(model, layers, attention, c.hidden_size, heads, kv, head_dim,
                                                     qk_share),  # fmt: skip
        position_bias_heads=_position_bias_heads(layers),
        position_bias_tables=_position_bias_tables(model, layers),
        **_dynamic_mask_fields(layers),
        **_indexer_fields(layers),
        **_mixer_fields(model, layers, c, c.hidden_size, heads, kv, head_dim, attention),
        **loops,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers() if b.numel() * b.element_size() >= 2**20),
        **mlp,
    )


#: the names an attention module gives the projection of its output gate (``out * sigmoid(gate_proj(x))``)
_OUTPUT_GATE_NAMES = ("gate_proj", "g_proj")


#: config keys naming how many ``[N, h]`` hidden states a decoder layer takes (:attr:`ModelDims.layer_input_copies`):
#: Gemma 3n's AltUp predictions, DeepSeek-V4's / HY-V4's and Qwen4-Exp's hyper-connection streams
_LAYER_INPUT_COPIES_KEYS = ("altup_num_inputs", "hc_mult", "hc_count")


def _layer_input_copies(text) -> int:  # noqa: ANN001
    """:attr:`ModelDims.layer_input_copies` from the (text) config: the largest of :data:`_LAYER_INPUT_COPIES_KEYS`
    it sets, else 1."""
    return max([1] + [v for v in (getattr(text, k, None) for k in _LAYER_INPUT_COPIES_KEYS) if isinstance(v, int)])


def _residual_extras(model, layers: list, streams: int, fp32_stream: bool) -> dict[str, tuple]:  # noqa: ANN001
    """:attr:`ModelDims.residual_saved_extra` and :attr:`ModelDims.residual_backward_extra`: for a layer of several
    residual streams (hyper-connections, Gemma 3n's AltUp) or of an fp32 residual stream (ZAYA), what its residual
    structure saves beyond a plain pre-norm layer of its norms
    (:func:`~automodel.training.residual_memory.residual_saved`: what the stream term counts is subtracted there) and
    its input's ``K - 1`` further streams, and how much higher its backward peak is beyond that
    (:func:`~automodel.training.residual_memory.residual_backward_extra`); 0 for one stream of the compute dtype, and
    where the probe cannot run the layer (counted as one stream then)."""
    from automodel.training.residual_memory import residual_backward_extra, residual_saved

    if (streams <= 1 and not fp32_stream) or not layers:
        return {}
    text = text_config(getattr(model, "config", None))
    out = {}
    saved = residual_saved(layers[0], text, streams, fp32_stream)
    if saved is not None:
        out["residual_saved_extra"] = tuple(max(0.0, m + streams - 1) for m in saved)
        backward = residual_backward_extra(layers[0], text, streams, fp32_stream)
        if backward is not None:
            out["residual_backward_extra"] = backward
    return out


def _attention_saved_extra(model, layers: list, layer, hidden: int, heads: int, kv: int, head_dim: int,  # noqa: ANN001
                           qk_share: tuple[float, float]) -> tuple[float, float]:
    """:attr:`ModelDims.attention_saved_extra`: for an attention module that calls its kernel more than once
    (DiffLlama), convolves its projections (ZAYA, Inkling) or routes its heads through experts (JetMoE), what it
    keeps beyond a Llama attention of its widths
    (:func:`~automodel.training.attention_memory.attention_saved_extra`), less ``qk_share`` (``(fp32, bf16)``, ``q``
    units: what the attention term counts for its q/k norms); 0 elsewhere and where it cannot be probed."""
    from automodel.training.attention_memory import attention_module, attention_saved_extra

    module = attention_module(layer) if layer is not None and heads else None
    if module is None:
        return (0.0, 0.0)
    index = next((i for i, x in enumerate(layers) if x is layer), 0)
    text = text_config(getattr(model, "config", None))
    measured = attention_saved_extra(module, text, index, hidden, heads, kv, head_dim)
    if measured is None or not any(measured):
        return (0.0, 0.0)
    return tuple(round(max(0.0, m - share), 2) for m, share in zip(measured, qk_share))


def _first_attention_layer(layers: list, profile) -> Any:  # noqa: ANN001
    """The first decoder layer the profile marks as softmax attention (Qwen3-Next's fourth: its first three are
    linear attention), else the first layer; ``None`` without layers."""
    for layer, kind in zip(layers, profile.layers):
        if kind.is_attention:
            return layer
    return layers[0] if layers else None


def _attn_output_gate(layer, hidden: int, q: int, heads: int) -> dict[str, Any]:  # noqa: ANN001
    """:attr:`ModelDims.attn_output_gate` and :attr:`ModelDims.query_gate` from a decoder layer's attention module
    (its class named like ``...Attention``):
    - a ``Linear`` named as a gate (:data:`_OUTPUT_GATE_NAMES`) from the hidden size to the query width (2: the
      sigmoid's output and the gated product, each ``[N, q]``) or to one value per head (1 + ``heads / q``);
    - else a ``q_proj`` (or ``q_gate_proj``: MiniCPM5-MoE) of ``2 q`` outputs beside ``k_proj`` and ``v_proj``
      (Qwen3-Next, Qwen3.5, Qwen4-Exp: each head's query and gate, split after the projection): 2, and
      ``query_gate``. MLA's modules, whose query head is wider than its value head, have no ``k_proj`` and are not
      read as gated (AXK2's ``q_gate_proj`` of MLA widths neither);
    - 0 otherwise."""
    import torch

    for module in (layer.modules() if layer is not None and q else ()):
        if not type(module).__name__.endswith("Attention"):
            continue
        for name in _OUTPUT_GATE_NAMES:
            gate = getattr(module, name, None)
            if isinstance(gate, torch.nn.Linear) and gate.in_features == hidden:
                if gate.out_features == q:
                    return {"attn_output_gate": 2.0}
                if gate.out_features == heads:
                    return {"attn_output_gate": 1.0 + heads / q}
        for query in ("q_proj", "q_gate_proj"):
            proj = [getattr(module, name, None) for name in (query, "k_proj", "v_proj")]
            if all(isinstance(p, torch.nn.Linear) for p in proj) and proj[0].out_features == 2 * q:
                return {"attn_output_gate": 2.0, "query_gate": True}
    return {"attn_output_gate": 0.0}


def _layer_call_fields(model, layers: list) -> dict[str, int]:  # noqa: ANN001
    """The looped-call fields of :class:`ModelDims` (``layer_calls``, ``no_grad_layer_calls``, ``looped_params``,
    ``no_grad_params``, ``loop_restarts``) from :func:`automodel.models.layer_calls.layer_calls`; empty where each
    layer runs once."""
    calls = layer_calls(text_config(getattr(model, "config", None)), len(layers))
    if calls is None:
        return {}
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    return {
        "layer_calls": calls.total,
        "no_grad_layer_calls": calls.total_no_grad,
        "looped_params": sum((g - 1) * n for g, n in zip(calls.grad, sizes)),
        "no_grad_params": sum(g * n for g, n in zip(calls.no_grad, sizes)),
        "loop_restarts": calls.restarts,
    }


def _eager_scores(layers: list) -> tuple[Any, Any] | None:
    """:attr:`ModelDims.eager_scores`: over the decoder layers' attention classes (one module per class: the first
    named like ``...Attention`` whose modeling file has an eager function), the most each keeps and holds per score;
    ``None`` where none is measured."""
    from automodel.training.eager_memory import eager_function, eager_scores

    found, seen = [], set()
    for layer in layers:
        for module in layer.modules():
            cls = type(module)
            if cls in seen or not cls.__name__.endswith("Attention") or eager_function(module) is None:
                continue
            seen.add(cls)
            measured = eager_scores(module)
            if measured is not None:
                # an attention that may hand its function fp32 scores in a bf16 model: the larger of the two counts
                found.append((measured[0], _larger(*measured)) if _attention_in_fp32(module) else measured)
    if not found:
        return None
    return tuple(_larger(*(f[i] for f in found)) for i in (0, 1))


def _larger(*scores):  # noqa: ANN002, ANN202 - EagerScores
    """Field by field, the largest of :class:`~automodel.training.eager_memory.EagerScores`."""
    return type(scores[0])(*(max(getattr(x, k) for x in scores) for k in ("saved", "forward", "backward")))


def _attention_in_fp32(attention) -> bool:  # noqa: ANN001
    """Whether ``attention`` may hand its eager function fp32 scores whatever the model's dtype: it holds norms with
    fp32 weights while its largest weight is in a lower precision (DeepSeek-V4 pins its ``q_a_norm`` and ``kv_norm``
    to fp32: its bf16 run holds fp32 scores, planned -50% at cp 1 with bf16 figures; in transformers 5.21-5.25 its
    norms cast back to bf16 and its scores turn fp32 where they meet its fp32 sinks, which the probe keeps in fp32
    since: 6 bytes kept per score, the fp32 probabilities and their bf16 cast, where the fp32 figures said 4). Where
    so, the planner takes the larger of the fp32 and the bf16 figures. Read off the parameters' dtypes, which a meta
    model built in the run's dtype carries."""
    import torch

    from automodel.training.eager_memory import pins_fp32

    return pins_fp32(attention) and any(
        "norm" in type(m).__name__.lower() and getattr(getattr(m, "weight", None), "dtype", None) == torch.float32
        for m in attention.modules())  # fmt: skip


def _widest_head(profile) -> int:  # noqa: ANN001 - a ModelProfile
    """The widest head of the model's attention layers whose queries, keys and values are one size (0: none read).

    The plan counts every attention tensor at one head size (``ModelDims.head_dim``). Where some layers' heads are
    wider than the config's ``head_dim`` it takes the widest: an over-count on the narrower layers, never an
    under-count. Gemma 4's full-attention layers (``global_head_dim``: 512 beside 16 in the tiny config, 512 beside 256
    in the released ones) were planned at the sliding layers' size: -82% at cp 1 with checkpointing
    (``scripts/bench_plan_families.py``), now +6%. MLA's layers (queries and keys wider than values: DeepSeek-V3) keep
    the config's size, which the CP methods' rows are measured with (``scripts/bench_plan_cases.py``'s DSA case:
    +0.7%; at their query width +12%); at cp 1 a CPU cannot measure them (its SDPA runs them through the math kernel)."""
    return max(
        (layer.qk_head_dim or 0 for layer in profile.layers if layer.is_attention and not layer.mla), default=0
    )


def _mlp_fields(model, layer, hidden: int) -> dict[str, Any]:  # noqa: ANN001
    """The dense MLP's fields of :class:`ModelDims` (``intermediate``, ``mlp_gated``, ``mlp_moments``,
    ``mlp_saved_extra``) from the first decoder layer's modules (:func:`automodel.training.mlp_memory.mlp_shape`; a
    gated block's saved tensors measured on the meta device, :func:`~automodel.training.mlp_memory.dense_mlp_saved`);
    empty when they are not read (no layer, experts, a structure it does not know: the config's width and the gated
    count stay)."""
    from automodel.training.mlp_memory import dense_mlp_of, dense_mlp_peaks, dense_mlp_saved, mlp_shape

    if layer is None:
        return {}
    text = text_config(getattr(model, "config", None))
    shape = mlp_shape(layer, hidden, text)
    if shape is None:
        return {}
    out = {"intermediate": shape.width, "mlp_gated": shape.gated, "mlp_moments": shape.moments}
    saved = dense_mlp_saved(dense_mlp_of(layer), hidden) if shape.gated else None
    if saved is not None:
        out["mlp_saved_extra"] = tuple(round(max(0.0, s / shape.width - GATED_MLP_MOMENTS[0]), 2) for s in saved)
    peaks = dense_mlp_peaks(dense_mlp_of(layer), hidden, shape.width) if shape.gated else None
    if peaks is not None:
        out["mlp_peak_extra"] = peaks
    return out


def _attn_output_copy(model, own_code_layers: int) -> bool:  # noqa: ANN001
    """:attr:`ModelDims.attn_output_copy` from the (text) config: layers in their own code merge their heads with a
    copy; a partial rotary embedding (``partial_rotary_factor`` in the rope parameters, of any layer type, or the
    config: GPT-NeoX, Phi, StableLM, Persimmon) is applied to a slice of q and concatenated with the rest, so q reaches
    the kernel contiguous head-major (GPT-NeoX concatenates at any factor). Otherwise transformers' models give the
    kernel q as a transposed view of its projection and the output needs no copy (a snapshot of the tensors alive at
    the loss: ``scripts/bench_memory.py --structures only``)."""
    if own_code_layers:
        return True
    text = text_config(getattr(model, "config", None))
    if getattr(text, "partial_rotary_factor", None) is not None or getattr(text, "rotary_pct", None) is not None:
        return True
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict):
        return False
    per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]  # Gemma 3: a dict per layer type
    return any(p.get("partial_rotary_factor") is not None for p in per_type)


def _layer_count(d: ModelDims) -> str:
    """``"32 layers"``, or for a looped model ``"56 layer calls (36 layers, some run again)"``."""
    if not d.layer_calls:
        return f"{d.layers} layers"
    return f"{d.layer_calls} layer calls ({d.layers} layers, some run again)"


def _layer_input_bytes(d: ModelDims, compute_bytes: int) -> float:
    """Bytes per token of one decoder layer's input (what checkpointing keeps and activation offload moves per layer):
    its ``layer_input_copies`` ``[N, h]`` hidden states in the compute dtype, or in fp32 where the model keeps its
    residual stream so (:attr:`ModelDims.residual_fp32`)."""
    return d.hidden * d.layer_input_copies * (max(compute_bytes, 4) if d.residual_fp32 else compute_bytes)


def _kept_inputs(d: ModelDims, r: RunShape) -> tuple[int, int]:
    """``(at the layers' moments, at the loss)``: how many ``[N, h]`` layer inputs are on the device under checkpointing.

    Without groups: all ``L`` (offloaded: 2, the one in use and the one in flight). With checkpoint groups of ``k``
    (``model.checkpoint_group_layers``) only the ``ceil(L / k)`` groups' first inputs are kept; the backward through
    a group holds the group's ``k`` inputs (its first one brought back, the others rebuilt), so ``ceil(L / k) + k - 1``
    on the device, or offloaded ``k + 1`` (the previous group's first input prefetched); the forward and the loss
    hold the kept ones (offloaded: 2)."""
    from automodel.models.checkpoint_groups import group_starts

    k = min(r.group, max(d.calls, 1))
    starts = group_starts(d.calls, k)
    if r.activation_offloaded:
        return min(k + 1, d.calls), min(2, d.calls)
    return min(starts + k - 1, d.calls), starts


def _kept_inputs_note(d: ModelDims, r: RunShape) -> str:
    """The plan's words for where the checkpointed layer inputs live."""
    from automodel.models.checkpoint_groups import group_starts

    during, _ = _kept_inputs(d, r)
    if r.group > 1:
        starts = group_starts(d.calls, r.group)
        where = "offloaded" if r.activation_offloaded else "kept"
        return (f"checkpoint groups of {r.group}: {starts} of {d.calls} layer inputs {where}, {during} on the device "
                f"in a group's backward (the others rebuilt)")  # fmt: skip
    if r.activation_offloaded:
        return f"{min(2, d.calls)} of {d.calls} layer inputs on the device (the others on the host)"
    return f"{d.calls} layer inputs kept" + (f" (one per call: {d.layers} layers, some run again)" if d.layer_calls else "")


def _layer_kinds(model, profile) -> dict[str, Any]:  # noqa: ANN001
    """The layer-kind fields of :class:`ModelDims` from the model's profile (:mod:`.layer_kind_memory` plans them).

    A model that always builds its mask: DeepSeek sparse attention's models (``create_causal_mask(...,
    allow_is_causal_skip=False)``, for the indexer's causality) and Falcon with ``alibi=True`` (the same flag, then
    its ALiBi bias folded into a ``[B, heads, q, k]`` mask: ``FalconModel.forward``)."""
    from automodel.distributed.cp.layers.gathered_state import gathered_state
    from automodel.distributed.cp.profile import CHUNKED, SLIDING, SPARSE

    text = text_config(getattr(model, "config", None))
    kinds: dict[int, int] = {}
    gathered: dict[Any, int] = {}
    halo_math: dict[tuple[int, int, int], int] = {}
    for layer in profile.layers:
        if not layer.is_attention:
            continue
        limit = (layer.window or 0) if layer.kind == SLIDING else (layer.chunk or 0) if layer.kind == CHUNKED else 0
        kinds[limit] = kinds.get(limit, 0) + 1
        state = gathered_state(layer, text)
        if state is not None:
            gathered[state] = gathered.get(state, 0) + 1
        elif not layer.alibi and (layer.softcap or layer.sinks):  # a gathered-state kernel's layer (DeepSeek-V4's
            key = (limit, *halo_math_scores(bool(layer.softcap), layer.sinks))  # sinks) is not on the halo kernel
            halo_math[key] = halo_math.get(key, 0) + 1
    unused = _unused_window_mask(model, text, kinds)
    if unused is not None:
        kinds.setdefault(unused, 0)
    alibi = sum(1 for layer in profile.layers if layer.alibi)
    own = sum(1 for layer in profile.layers if layer.is_attention and getattr(layer, "own_code", False))
    heads = profile.num_attention_heads or 0
    forced = 0
    if any(layer.kind == SPARSE for layer in profile.layers):
        forced = 1
    if profile.model_type == "falcon":  # allow_is_causal_skip=False with or without ALiBi: [B, 1, q, k] boolean without
        forced = heads if getattr(text, "alibi", False) else 1
    rates, types = getattr(text, "compress_rates", None), getattr(text, "layer_types", None) or ()
    compressed = max((1 / rates[t] for t in types if isinstance(rates, dict) and rates.get(t)), default=0.0)
    return {"attention_kinds": tuple(sorted(kinds.items())), "forced_mask_heads": forced, "alibi_layers": alibi,
            "compressed_keys": compressed, "index_mask_layers": _index_mask_layers(model, profile),
            "halo_math": tuple(sorted((k[0], n, k[1], k[2]) for k, n in halo_math.items())),
            "own_code_layers": own, "single_mask": profile.model_type == "gpt_neo",
            "keeps_returned_probs": profile.model_type == "bloom",
            "layer_input_copies": _layer_input_copies(text),
            "gathered": tuple((count, state) for state, count in gathered.items())}  # fmt: skip


def _position_bias_heads(layers: list) -> tuple[int, ...]:
    """:attr:`ModelDims.position_bias_heads`: per decoder layer whose attention module holds a learned
    relative-position bias (a child with a ``rel_extent`` and a ``proj`` parameter of ``rel_extent`` columns: Inkling's
    ``InklingRelativeLogits``, Inkling 2's ``Inkling2RelativePositionBias``), that attention's query heads."""
    import torch

    heads = []
    for layer in layers:
        for module in layer.modules():
            found = [child for child in module.children() if isinstance(getattr(child, "rel_extent", None), int)
                     and isinstance(getattr(child, "proj", None), torch.Tensor)
                     and child.proj.shape[-1] == child.rel_extent]  # fmt: skip
            if found and isinstance(getattr(module, "num_heads", None), int):
                heads.append(module.num_heads)
                break
    return tuple(heads)


def _dynamic_mask_fields(layers: list) -> dict[str, int]:
    """:attr:`ModelDims.dynamic_mask_layers` and ``dynamic_mask_window``: the decoder layers whose attention module
    builds a dynamic mask (a ``prepare_dynamic_mask`` method: Doge's ``DogeAttention``), and its
    ``keep_window_size``."""
    from automodel.training.attention_memory import attention_module

    found = [m for m in (attention_module(layer) for layer in layers)
             if m is not None and callable(getattr(m, "prepare_dynamic_mask", None))]  # fmt: skip
    if not found:
        return {}
    window = getattr(found[0], "keep_window_size", 0)
    return {"dynamic_mask_layers": len(found), "dynamic_mask_window": window if isinstance(window, int) else 0}


def _mixer_fields(model, layers: list, profile, hidden: int, heads: int, kv: int, head_dim: int,  # noqa: ANN001
                  first_attention=None) -> dict[str, Any]:  # noqa: ANN001
    """:attr:`ModelDims.mixer_layers` and ``mixer_saved_extra``: the layers the profile marks as linear mixers whose
    mixer is found where a layer holds its attention, calls no attention function and has no kernel package to run
    instead of its torch code (MiniMax's lightning attention: ``attention_memory.torch_only``), and what the first of
    them keeps per token beyond the plan's attention terms; empty where there are none or the probe cannot run them.
    Kimi Linear's and Bailing-hybrid's delta rules (fla's kernels where installed; their torch fallback keeps
    ~600 ``q`` per token at 64 tokens), Qwen3-Next's ``linear_attn`` and the Mamba mixers are not read here: they
    are counted in :attr:`ModelDims.kernel_mixer_layers` (the linear layers whose mixer's modeling file names a
    kernel package); :attr:`ModelDims.chained_mixer_layers` counts every linear layer whose mixer the CP methods run
    (``linear_support.STATE_MIXERS``), and their cores are measured through their CP kernels
    (:func:`automodel.training.chain_memory.chain_kept`: ``chain_*`` and ``core_*``, ``core_layers`` and
    ``gpu_torch_core_layers``)."""
    from automodel.distributed.cp.layers.linear_support import STATE_MIXERS
    from automodel.distributed.cp.profile import LINEAR
    from automodel.training.attention_memory import (
        attention_module,
        calls_attention_function,
        mixer_saved_extra,
        probed,
        torch_only,
    )
    from automodel.training.chain_memory import chain_kept, torch_code_on_gpu

    # the attention class the attention probe measures (ModelDims.attention_saved_extra: the first attention layer's)
    measured_cls = type(attention_module(first_attention)) if first_attention is not None else None

    mixers, found = [], []  # each linear layer's mixer (unless the attention probe covers it); the probeable ones
    # each layer whose mixer the CP methods run: (index, its mixer, whether another probe measures its core)
    chained_layers: list[tuple[int, Any, bool]] = []
    for index, (layer, spec) in enumerate(zip(layers, profile.layers)):
        if spec.kind != LINEAR:
            continue
        mixer = next((m for m in layer.modules() if type(m).__name__ == spec.mixer), None)
        attention = attention_module(layer)
        inside = attention is not None and type(attention) is measured_cls and probed(attention) \
            and any(m is mixer for m in attention.modules())  # fmt: skip
        if spec.mixer in STATE_MIXERS:
            chained_layers.append((index, mixer, inside))
        mixers.append(None if inside else mixer)  # ZAYA's CCA projection: inside its probed attention
        if heads and attention is not None and not calls_attention_function(attention) and torch_only(attention):
            found.append((index, attention))
    packaged = sum(1 for m in mixers if m is not None and not torch_only(m))
    measured = None
    if found:
        index, mixer = found[0]
        measured = mixer_saved_extra(mixer, text_config(getattr(model, "config", None)), index, hidden, heads, kv,
                                     head_dim)  # fmt: skip
    counted = len(found) if measured is not None and any(m > 0 for m in measured) else 0
    unread = sum(1 for m in mixers if m is not None) - packaged - counted
    out: dict[str, Any] = {"kernel_mixer_layers": packaged, "torch_mixer_layers": unread,
                           "chained_mixer_layers": len(chained_layers)}  # fmt: skip
    found_mixers = all(m is not None for _, m, _ in chained_layers)
    kept = chain_kept([(i, m) for i, m, _ in chained_layers], hidden) if found_mixers else None
    if kept is not None:
        # outside the chain, the same cores' tensors where their torch code runs: all but those another probe
        # measures (ZAYA's CCA inside its probed attention, MiniMax's lightning layers)
        measured_at = {i for i, _ in found} if counted else set()
        own = [m for i, m, inside in chained_layers if not inside and i not in measured_at]
        out.update(chain_kept_per_token=kept.per_token, chain_kept_per_row=kept.per_row,
                   core_saved_per_token=kept.saved, core_forward_per_token=kept.forward,
                   core_backward_per_token=kept.backward, core_layers=len(own),
                   gpu_torch_core_layers=sum(1 for m in own if torch_code_on_gpu(m)))  # fmt: skip
    if counted:
        out.update(mixer_layers=counted, mixer_saved_extra=tuple(round(max(0.0, m), 2) for m in measured))
    return out


def _indexer_fields(layers: list) -> dict[str, int]:
    """:attr:`ModelDims.indexer_layers`, ``indexer_chunk`` and ``indexer_pools``: the decoder layers whose attention
    module holds a weightless ``indexer`` that bounds its score chunks (an int ``max_scores``: Kolibri-1.1's), the
    largest bound, and those of them that build a new pool of candidate keys (``is_pool_source``) that the next layer
    is handed."""
    from automodel.training.attention_memory import attention_module

    found = [(at, i) for at, i in enumerate(getattr(attention_module(layer), "indexer", None) for layer in layers)
             if isinstance(getattr(i, "max_scores", None), int) and callable(getattr(i, "parameters", None))
             and not any(True for _ in i.parameters())]  # fmt: skip
    if not found:
        return {}
    # the model hands a pool to every layer up to the next source (which starts from none): a checkpointed layer
    # keeps the pool it was handed, so a pool counts where the layer after its source is not a source itself
    sources = {at for at, i in found if getattr(i, "is_pool_source", False)}
    handed = sum(1 for at in sources if at + 1 < len(layers) and at + 1 not in sources)
    return {"indexer_layers": len(found), "indexer_chunk": max(i.max_scores for _, i in found),
            "indexer_pools": handed}


def _position_bias_tables(model, layers: list) -> int:  # noqa: ANN001
    """:attr:`ModelDims.position_bias_tables`: the ``get_relative_distance(`` calls in the forward of the module that
    holds the decoder ``layers`` (Inkling 2's text model: one per attention kind)."""
    from automodel.distributed.cp.profile import _forward_source
    from automodel.models.block_call import layers_owner

    owner, _ = layers_owner(model, layers)
    return _forward_source(type(owner)).count("get_relative_distance(") if owner is not None else 0


def _index_mask_layers(model, profile) -> int:  # noqa: ANN001
    """:attr:`ModelDims.index_mask_layers`: the sparse-attention layers whose module's ``forward`` builds an
    ``index_mask`` (read off its source, as :mod:`automodel.distributed.cp.layers.sparse_attention` reads the
    indexer's)."""
    from automodel.distributed.cp.profile import SPARSE, _forward_source

    mixers = {layer.mixer for layer in profile.layers if layer.kind == SPARSE and layer.mixer}
    folding = {type(m).__name__ for m in model.modules()
               if type(m).__name__ in mixers and "index_mask" in _forward_source(type(m))}  # fmt: skip
    return sum(1 for layer in profile.layers if layer.kind == SPARSE and layer.mixer in folding)


def _unused_window_mask(model, text, kinds: dict[int, int]) -> int | None:  # noqa: ANN001
    """The window of a sliding-window mask the model builds though none of its layers is sliding, else ``None``.

    Some decoders build their ``"sliding_attention"`` mask in every forward, whatever their layer types (Qwen2-MoE
    with ``use_sliding_window=False``: its config's window becomes 0 and the mask is still built, ``[B, 1, S, S]``
    boolean under sdpa, for no layer; planned 49% under at cp 1 with the tiled MLP): read off the decoder's
    ``forward`` (it calls ``create_sliding_window_causal_mask`` with no ``has_sliding_layers`` guard). The mask kind
    joins :attr:`ModelDims.attention_kinds` with no layers (a window of 0 counted as 1: any window shorter than the
    row makes the same ``[S, S]`` mask)."""
    import re

    from automodel.distributed.cp.profile import _forward_source
    from automodel.training.step import base_decoder

    if any(limit for limit in kinds):
        return None
    source = _forward_source(type(base_decoder(model)))

    def built(fn: str) -> bool:  # called in the forward, not wrapped in a lambda built on first use (Dots1, Laguna)
        return re.search(rf"(?<!lambda: ){fn}\(", source) is not None

    # both masks built, the sliding one unguarded (DeepSeek-V4 builds its sliding mask alone, for every layer)
    if not (built("create_sliding_window_causal_mask") and built("create_causal_mask")) or "has_sliding_layers" in source:
        return None
    window = getattr(text, "sliding_window", None)
    return max(int(window), 1) if isinstance(window, int) else None


def _hidden_norms(module, hidden: int, skip: set[int] = frozenset(), *, layer: bool = False) -> list:  # noqa: ANN001
    """The modules under ``module`` (itself included) that normalize over the hidden size
    (:func:`automodel.models.tiled_mlp.is_hidden_norm`, the tiled layer norms' rule; ``layer``: ``module`` is a decoder
    layer, whose own parameter-free norms count); q/k norms are not (``q_norm`` / ``k_norm``, counted by
    :attr:`ModelDims.qk_norm`, even where they normalize the whole projection, OLMo 2's of ``heads x head_dim =
    hidden``); those inside ``skip`` (module ids: the decoder layers) and below them left out."""
    out = []

    def walk(m, name: str = "", depth: int = 0) -> None:  # noqa: ANN001
        if id(m) in skip or name in _QK_NORM_NAMES:
            return
        if is_hidden_norm(m, hidden, held_by_layer=layer and depth == 1):
            out.append(m)
        for child_name, child in m.named_children():
            walk(child, child_name, depth + 1)

    walk(module)
    return out


def _layer_norms(layer, hidden: int) -> int:  # noqa: ANN001
    """Norms over the hidden size in one decoder layer (per-head q/k norms are not counted); at least 2."""
    return max(len(_hidden_norms(layer, hidden, layer=True)), 2)


def _norm_fields(model, layers: list, attention, hidden: int, head_dim: int) -> dict[str, Any]:  # noqa: ANN001
    """:class:`ModelDims`' norm fields, measured on CPU copies of the model's own norms
    (:mod:`automodel.training.norm_memory`): ``norm_half_extra`` (the first decoder layer's hidden-size norms),
    ``final_norm_half_extra`` (those outside the layers) and ``qk_norm_half_extra`` (the q/k norms of ``attention``,
    the first attention layer: :func:`_first_attention_layer`): what they save in
    bf16 / fp16 beyond their fp32 count (a parameter-free q/k norm probed at ``head_dim``: NanoChat's normalize each
    head); ``layer_norm_peaks`` / ``layer_norm_saved`` (the layer's norms) and
    ``final_norm_peaks`` (the final norm the tiled MLP or layer tiles, ``final_norm_tiles`` where there is one; else
    the norms outside the layers): their forward and backward peaks, whole and tiled, and what they save beyond their
    input."""
    from automodel.models.tiled_mlp import find_final_norms, find_layer_norms
    from automodel.training.norm_memory import half_precision_extra, norm_peaks, saved_beyond_input

    if not layers:
        return {}
    final = [m for _, m in find_final_norms(model)]  # the one the tiled MLP or layer tiles
    outside = _hidden_norms(model, hidden, skip={id(layer) for layer in layers})
    outside += [m for m in final if all(m is not o for o in outside)]  # a parameter-free final norm (NanoChat's)
    inside = _hidden_norms(layers[0], hidden, layer=True)
    tiled = {id(m) for _, m in find_layer_norms(model)}  # the ones the tiled MLP tiles
    # the per-head q/k norms: their weight's size is the width they normalize over (a head, or OLMo 2's whole q); a
    # parameter-free one (NanoChat's) normalizes each head
    qk: dict[Any, int] = {}
    for name, m in attention.named_modules():
        weight = getattr(m, "weight", None)
        if name.rsplit(".", 1)[-1] not in _QK_NORM_NAMES:
            continue
        if getattr(weight, "dim", lambda: 0)() == 1:
            qk[m] = weight.shape[0]
        elif not list(m.parameters()):
            qk[m] = head_dim
    return {"norm_half_extra": half_precision_extra(inside, hidden),
            "layer_norm_peaks": norm_peaks(inside, hidden), "layer_norm_saved": saved_beyond_input(inside, hidden),
            "final_norm_half_extra": half_precision_extra(outside, hidden),
            "qk_norm_half_extra": max((half_precision_extra([m], width) for m, width in qk.items()), default=0.0),
            "final_norm_peaks": norm_peaks(final or outside, hidden), "final_norm_tiles": bool(final),
            "layer_norm_tiles": bool(inside) and all(id(m) in tiled for m in inside)}  # fmt: skip


def _mlp_blocks(model) -> list:  # noqa: ANN001
    """The decoder layers' MLP blocks as the tiled MLP finds them (:func:`automodel.models.tiled_mlp.find_mlps`; empty:
    none found)."""
    from automodel.errors import UserInputError
    from automodel.models.tiled_mlp import find_mlps

    try:
        return [m for _, m in find_mlps(model)]
    except UserInputError:
        return []


def _mlp_params(blocks: list) -> int:
    """The largest of ``blocks``' (:func:`_mlp_blocks`) trainable parameters (0: none)."""
    return max((sum(p.numel() for p in m.parameters() if p.requires_grad) for m in blocks), default=0)


#: a parameter indexed per expert in a forward's source: ``self.<name>[<index>]``, or of a view of it
_PER_EXPERT_INDEX = r"self\.[\w.]+(?:\.view\([^()]*\))?\[\s*(?:expert_idx|expert_id|expert|idx|i|e)\s*\]"


def _expert_loop_param(blocks: list) -> int:
    """:attr:`ModelDims.expert_loop_param`: the largest parameter (elements) of a block among ``blocks`` one of whose
    modules indexes its parameters per expert in its ``forward`` (:data:`_PER_EXPERT_INDEX`, read off the source) and
    runs that loop (its experts' implementation is not ``grouped_mm``: the config's ``_experts_implementation``,
    which transformers' decorated experts dispatch on); 0 where none does."""
    import re

    from automodel.distributed.cp.profile import _forward_source

    found = 0
    for block in blocks:
        loops = [m for m in block.modules() if re.search(_PER_EXPERT_INDEX, _forward_source(type(m)))
                 and any(p.ndim >= 2 for p in m.parameters())]  # fmt: skip
        impl = getattr(getattr(loops[0], "config", None), "_experts_implementation", None) if loops else None
        impl = impl.get("", impl) if isinstance(impl, dict) else impl
        if loops and impl != "grouped_mm":
            found = max(found, max(p.numel() for m in loops for p in m.parameters()))
    return found


#: attribute names of a projection that makes q, k and v at once (:func:`_fused_qkv`)
_FUSED_QKV_NAMES = ("qkv_proj", "query_key_value", "Wqkv", "c_attn", "qkv")


def _fused_qkv(model, layer, q: int, kv: int) -> bool:  # noqa: ANN001
    """Whether ``layer``'s attention (the first attention layer's) makes q, k and v in one projection (a Linear or GPT-2's Conv1D
    named as in :data:`_FUSED_QKV_NAMES`, of ``q + 2 kv`` outputs) and the model applies RoPE, which replaces q and k
    with new tensors: v, a view of the projection's output, then keeps all of it alive (without RoPE q, k and v are
    all views of it: GPT-2, BLOOM, MPT, whose plan counts them as such)."""
    if layer is None or not q:
        return False
    rope = any("rotary" in type(m).__name__.lower() for m in model.modules())
    fused = any(name.rsplit(".", 1)[-1] in _FUSED_QKV_NAMES
                and (getattr(m, "out_features", None) or getattr(m, "nf", None)) == q + 2 * kv
                for name, m in layer.named_modules())  # fmt: skip
    return rope and fused


def _logit_softcap(model) -> bool:  # noqa: ANN001
    """Whether the (text) config soft-caps the logits after the LM head (``final_logit_softcapping`` /
    ``logits_soft_cap`` set: ``tanh(logits / cap) * cap``, whose ``tanh`` keeps its output for the backward)."""
    text = text_config(getattr(model, "config", None))
    return any(getattr(text, k, None) not in (None, 0, 0.0) for k in ("final_logit_softcapping", "logits_soft_cap"))


def _moe_sizes(model, blocks: list) -> dict[str, int]:  # noqa: ANN001
    """The mixture-of-experts sizes of :class:`ModelDims` from the (text) config, and ``blocks`` (the MLP blocks,
    :func:`_mlp_blocks`) for a shared MLP no config key names; empty for a dense model."""
    text = text_config(getattr(model, "config", None))
    if not builds_experts(text):  # Doge names its retrieval experts' sizes but runs a dense MLP unless is_moe is set
        return {}
    experts = next((getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                    if isinstance(getattr(text, k, None), int)), 0)  # fmt: skip
    top_k = next((getattr(text, k) for k in ("num_experts_per_tok", "moe_topk")  # Aria: moe_num_experts, moe_topk
                  if isinstance(getattr(text, k, None), int)), 0)  # fmt: skip
    width = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0) or 0
    ffn = getattr(text, "ffn_config", None)  # DBRX: its experts' sizes in a sub-config, run in its own expert loop
    if not experts and isinstance(getattr(ffn, "moe_num_experts", None), int):
        experts, top_k, width = ffn.moe_num_experts, getattr(ffn, "moe_top_k", 0) or 0, ffn.ffn_hidden_size
    if not experts or not top_k:
        return {}
    shared = getattr(text, "shared_expert_intermediate_size", None) or getattr(text, "shared_intermediate_size", None) or 0
    impl = getattr(text, "_experts_implementation", None)
    impl = impl.get("", impl) if isinstance(impl, dict) else impl
    if getattr(text, "model_type", "") == "llama4_text":
        # transformers' Llama 4 runs every expert on every token in its own bmm (the router's scores, zero but for the
        # top k, scale the E copies of the input: Llama4TextMoe) beside a shared expert of the experts' width: E
        # routed copies (planned with k: -22% at cp 1 with checkpointing)
        top_k, shared, impl = experts, width, "eager"
    count = next((getattr(text, k) for k in ("n_shared_experts", "moe_num_shared_experts", "num_shared_experts")
                  if isinstance(getattr(text, k, None), int)), None)  # fmt: skip
    if not shared and isinstance(count, int):  # shared experts of the routed experts' width (Aria's fused into one)
        shared = count * width
    if not shared:  # a shared MLP no config key names (HunYuan-MoE's shared_mlp, of the dense width): read off the block
        shared = _shared_mlp_width(blocks, getattr(text, "hidden_size", 0) or 0)
    return {"experts": experts, "top_k": top_k, "expert_intermediate": width, "shared_intermediate": shared,
            "experts_impl": "grouped_mm" if impl == "grouped_mm" else "eager",
            "experts_gate_extra": _experts_gate_extra(blocks, width),
            "router_saved_extra": _router_saved_extra(blocks, getattr(text, "hidden_size", 0) or 0, experts, top_k)}  # fmt: skip


def _router_saved_extra(blocks: list, hidden: int, experts: int, top_k: int) -> tuple[float, float]:
    """:attr:`ModelDims.router_saved_extra`: the first MoE block's router measured on the meta device
    (:func:`~automodel.training.mlp_memory.router_saved`), less what the router term counts (``4 E + 16 k`` bytes per
    token); 0 where no block has a router the probe can run."""
    from automodel.training.mlp_memory import router_saved

    saved = next((x for x in (router_saved(block, hidden) for block in blocks) if x is not None), None) if hidden else None
    if saved is None:
        return (0.0, 0.0)
    return tuple(round(max(0.0, x - _router_term(experts, top_k)), 2) for x in saved)


def _router_term(experts: int, top_k: int) -> int:
    """Bytes per token the router term counts: the fp32 probabilities over the ``E`` experts and the top-k weights and
    indices, ``4 E + 16 k``."""
    return 4 * experts + 16 * top_k


def _experts_gate_extra(blocks: list, width: int) -> tuple[float, float]:
    """:attr:`ModelDims.experts_gate_extra`: the first MLP block's experts that has them (a child whose class has
    transformers' ``_apply_gate``) measured on the meta device (:func:`~automodel.training.mlp_memory.experts_gate_saved`), less
    SiLU's count; 0 where none is found or the probe cannot run it."""
    from automodel.training.mlp_memory import DEFAULT_EXPERTS_GATE_SAVED, experts_gate_saved

    experts = next((m for block in blocks for m in block.modules() if callable(getattr(type(m), "_apply_gate", None))),
                   None)  # fmt: skip (the first block may be dense: Beam's, DeepSeek's first layers)
    saved = experts_gate_saved(experts, width) if experts is not None else None
    if saved is None:
        return (0.0, 0.0)
    return tuple(round(max(0.0, x - DEFAULT_EXPERTS_GATE_SAVED), 2) for x in saved)


def _shared_mlp_width(blocks: list, hidden: int) -> int:
    """The total width of the shared experts a MoE block holds as a child named ``shared...`` (HunYuan-MoE's
    ``shared_mlp``), from their parameters (a gated MLP's ``3 h I_s``; a one-output gate such as Qwen2-MoE's
    ``shared_expert_gate`` is not one); 0 where none of ``blocks`` has one."""
    if hidden <= 0:
        return 0
    for block in blocks:  # the first block that holds one (a model's first layers may be dense)
        params = sum(p.numel() for name, child in block.named_children() if name.startswith("shared")
                     for p in child.parameters() if p.dim() == 2 and min(p.shape) > 1)  # fmt: skip
        if params:
            return params // (3 * hidden)
    return 0


def _lookup_params(model) -> int:  # noqa: ANN001
    """Parameters of the input-embedding table unless the output head multiplies by the same tensor."""
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if callable(get_in) else None
    weight = getattr(emb, "weight", None)
    if weight is None:
        return 0
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    return 0 if getattr(head, "weight", None) is weight else weight.numel()


def _tp_sharded_params(model) -> set[int]:  # noqa: ANN001
    """``id`` s of the parameters that :func:`automodel.distributed.tensor_parallel.tp_plan` shards over tp.

    Column-parallel modules shard every parameter (weight and bias, ``Shard(0)``); row-parallel ones
    shard the weight only (``Shard(1)``; a bias stays replicated), and so does the vocabulary-sharded
    embedding. Norms (``SequenceParallel``, per-head ``q_norm``/``k_norm``) stay whole. Empty for a
    model that tensor parallelism does not support (not one of ``TP_MODEL_TYPES``, no plan).
    """
    import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.tensor_parallel import TP_MODEL_TYPES, tp_plan

    if cached_profile(model).model_type not in TP_MODEL_TYPES:  # VLMs included: no plan
        return set()
    try:
        plan = tp_plan(model, loss_parallel=True)
    except ValueError:
        return set()
    out: set[int] = set()
    for name, module in model.named_modules():
        styles = [s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)]
        if any(isinstance(s, ColwiseParallel) for s in styles):
            out.update(id(p) for p in module.parameters(recurse=False))
        elif any(isinstance(s, RowwiseParallel) for s in styles) and getattr(module, "weight", None) is not None:
            out.add(id(module.weight))
    return out


@dataclass(frozen=True)
class _Activations:
    """Activation bytes per rank at each moment of a step (the CP workspace and the kernel's buffers apart).

    ``saved``: at the loss (what the forward keeps for backward); ``fwd_mlp`` / ``fwd_attn``: while the last
    decoder layer's forward runs its MLP / its attention; ``bwd_mlp`` / ``bwd_attn``: while backward runs through
    the MLP / the attention of a layer (with checkpointing: of the recomputed layer; without: of the last layer,
    the first backward reaches); ``fwd_final`` / ``bwd_final``: while the final norm runs its forward / its backward
    (:func:`_final_norm_moments`)."""

    saved: float
    fwd_mlp: float
    fwd_attn: float
    bwd_mlp: float
    bwd_attn: float
    note: str
    fwd_final: float = 0.0
    bwd_final: float = 0.0
    #: while backward runs through one of the layer's hidden-size norms (its fp32 temporaries; the MLP's tensors
    #: freed): :func:`_layer_norm_moment`; 0 where the layer runs in tiles (its norms per tile)
    bwd_norm: float = 0.0
    #: while an indexed layer's chunked indexer selects its keys, before its kernel (Kolibri-1.1:
    #: :func:`.layer_kind_memory.indexer_bytes`), in the forward / in the recomputed layer; 0 without one
    fwd_index: float = 0.0
    bwd_index: float = 0.0
    #: while backward runs through the residual structure of a layer of several streams, first in its backward, with
    #: every tensor the layer saved alive (Gemma 3n's AltUp correction: ModelDims.residual_backward_extra); 0 for a
    #: plain layer
    bwd_residual: float = 0.0


def _eager_moments(d: ModelDims, c: int) -> tuple[float, float, float]:
    """``(saved, forward, backward)``: bytes per ``[heads, S_q, S_k]`` score that eager attention keeps for its
    backward and holds at its forward's and its backward's peaks (the saved ones included), in compute dtype ``c``:
    measured on the model's own eager function where it was (:attr:`ModelDims.eager_scores`; bf16's figures for
    fp16), else :func:`_eager_score_bytes` with two fp32 scores in flight at each peak (the scores and their masked
    copy; the probabilities' gradient and the softmax's)."""
    if d.eager_scores is not None:
        e = d.eager_scores[0 if c >= 4 else 1]
        return e.saved, e.forward, e.backward
    saved = _eager_score_bytes(c, d.attn_softcapping)
    return saved, saved + 8, saved + 8


def _eager_score_bytes(c: int, softcapping: bool = False) -> int:
    """Bytes per ``[heads, S_q, S_k]`` score that eager attention keeps for its backward where the model's own eager
    function was not measured (:func:`_eager_moments`): the softmax in fp32 (4; its output is what the softmax's
    backward reads: transformers' ``softmax(..., dtype=torch.float32)``, GPT-Neo's fp32 scores) and, for a 2-byte
    compute dtype, its cast that the product with V saves (``c``); dropout at p 0 makes no copy. Measured:
    ``scripts/bench_memory.py --structures only``'s GPT-Neo rows (fp32: one ``[1, 4, 2048, 2048]`` fp32 softmax
    output per layer; was planned as two in the compute dtype, the probabilities and a dropout copy). With
    ``softcapping`` (:attr:`ModelDims.attn_softcapping`) the tanh's output too, in the compute dtype (``c``): Gemma 2's
    function keeps 8 bytes per score in fp32 and in bf16 (:mod:`automodel.training.eager_memory`)."""
    return 4 + (c if c < 4 else 0) + (c if softcapping else 0)


def _final_saved(d: ModelDims, r: RunShape) -> float:
    """Bytes per local token the final norm keeps for the backward: its input, normalized tensor and output (``3 h``,
    split by SP), its fp32 copy in bf16 / fp16 (:attr:`ModelDims.final_norm_half_extra`), and under SP the LM head's
    gathered input (``h``). In token tiles (:func:`_final_norm_tile`) its input and its output (which the LM head
    saves): ``2 h``."""
    h, c, s = d.hidden, r.compute_bytes, r.stream_split
    if _final_norm_tile(d, r) is not None:
        return 2 * h * c
    extra = d.final_norm_half_extra if c < 4 else 0.0
    return (3 + extra) * h * c / s + (h * c if r.sequence_parallel and r.tp > 1 else 0.0)


def _final_norm_moments(d: ModelDims, r: RunShape, before: float) -> tuple[float, float]:
    """``(forward, backward)``: the activation bytes while the final norm runs, given ``before``, what every layer
    keeps at that point (without checkpointing all their saved tensors, with it their kept inputs; the final norm's
    own tensors not included).

    The final norm is a moment of its own: its forward comes after every layer's, and without checkpointing its
    backward (the LM head's done) comes before any layer's has freed what it saved. Its peaks in ``[N, h]`` units
    (:attr:`ModelDims.final_norm_peaks`, measured per norm class): the forward holds its input, what it saves and its
    output; the backward its saved tensors (its input where it saves it), the incoming gradient, the temporaries of
    its reduction's gradient and its input's gradient. transformers' RMSNorm: 3 and 6 in fp32, 7 and 12 in bf16
    (five fp32 temporaries, which do not halve): without checkpointing the bf16 step's peak where the MLP is narrow
    (``scripts/bench_memory.py --structures only --structures-dtype bfloat16``, the hidden-512 Llama row). With the
    tiled MLP or layer (tp 1) the final norm runs in token tiles (:func:`_final_norm_tile`): about 3.4 and 3.5 units
    (its input, its output or its gradients) plus one tile's share. Under sequence parallelism the norm runs on
    ``N / tp`` tokens and the LM head's gathered input (``h``) is alive."""
    n, h, c, s = r.local_tokens, d.hidden, r.compute_bytes, r.stream_split
    tile = _final_norm_tile(d, r)
    fwd, bwd = d.final_norm_peaks[0 if c >= 4 else 1].at(None if tile is None else tile / max(n, 1))
    gathered = h * c if r.sequence_parallel and r.tp > 1 else 0.0
    return before + n * (fwd * h * c / s + gathered), before + n * (bwd * h * c / s + gathered)


def _norm_tile(d: ModelDims, r: RunShape, setting: bool | int | None, found: bool) -> int | None:
    """Tokens per tile of a norm the model runs in tiles with ``setting`` (``None``: it runs whole: the setting off,
    under TP, or the norm not ``found``), by the rule the model tiles it with
    (:func:`automodel.models.tiled_mlp.resolve_tile_tokens` at :data:`~automodel.models.tiled_mlp.NORM_TILE_WIDTH`)."""
    if setting in (False, None) or r.tp > 1 or not found:
        return None
    from automodel.models.tiled_mlp import NORM_TILE_WIDTH, resolve_tile_tokens

    return resolve_tile_tokens(setting, d.hidden, NORM_TILE_WIDTH * d.hidden, r.local_tokens)


def _layer_norm_tile(d: ModelDims, r: RunShape) -> int | None:
    """Tokens per tile of a decoder layer's hidden-size norms (``None``: they run whole): with ``model.tiled_mlp`` on,
    tp 1 and every norm of the layer found (:attr:`ModelDims.layer_norm_tiles`), as
    :func:`automodel.models.tiled_mlp.tile_layer_norms` tiles them. The tiled layer's terms (:func:`_tiled_layer_terms`)
    run the norms in its own tiles and do not ask."""
    return _norm_tile(d, r, r.tiled_mlp, d.layer_norm_tiles)


def _layer_norm_moment(d: ModelDims, r: RunShape, attn: float, lse: float, mlp_saved: float = 0.0) -> float:
    """Activation bytes per token of the layer under backward (without checkpointing the last; with it the
    recomputed one) while one of its hidden-size norms runs its backward, its MLP's tensors freed: the attention's
    saved tensors (``attn`` elements and the ``lse`` bytes), the layer's other norms' (what each saves beyond its
    input, :attr:`ModelDims.layer_norm_saved`, and its output, which a projection saves; transformers' RMSNorm 2 in
    fp32, 4 in bf16: its input's fp32 copy; with four norms the residual between them), this norm's backward peak
    (:attr:`ModelDims.layer_norm_peaks`: what it saved, the incoming gradient, its temporaries and its input's
    gradient; transformers' RMSNorm in bf16, 12 ``[N, h]`` units) and the residual stream's gradient beside it
    (``h``). Where the MLP is tiled it is the recomputed layer's peak: measured, a 2-layer Llama of hidden 256 in bf16
    at 16,384 tokens with checkpointing and ``model.tiled_mlp=true`` peaks at the post-attention norm's backward with
    five fp32 ``[N, h]`` temporaries (182 MiB; planned 121 without this moment). With the norms in tiles too
    (:func:`_layer_norm_tile`) each other norm keeps only its input and its output, and this one's backward holds its
    tiled peak (about 3.5 units: its input, the gradients, one tile's temporaries).

    A layer of four norms (Gemma's ``post_feedforward_layernorm``, GLM-4's ``post_mlp_layernorm``) reaches the norm
    after its MLP first, while the MLP's saved tensors (``mlp_saved`` elements; 0 where it is tiled) are alive: GLM-4
    bf16 with checkpointing peaks there (at hidden 256: 42.9 MiB measured, planned 39.4 without them)."""
    h, c, s, n = d.hidden, r.compute_bytes, r.stream_split, r.local_tokens
    tile = _layer_norm_tile(d, r)
    _, backward = d.layer_norm_peaks[0 if c >= 4 else 1].at(None if tile is None else tile / max(n, 1))
    others = max(d.layer_norms - 1, 0)
    gathered = h if r.sequence_parallel and r.tp > 1 else 0
    saved = 0.0 if tile else d.layer_norm_saved[0 if c >= 4 else 1]
    before = ((saved + 1) * others + (1 if d.layer_norms >= 3 else 0)) * h / s
    after_mlp = mlp_saved if d.layer_norms >= 4 else 0.0
    streams = d.layer_input_copies  # the residual streams' gradient (K [N, h] for a layer of K streams)
    return (before + gathered + attn + after_mlp) * c + lse + (backward + streams) * h * c / s


def _final_norm_tile(d: ModelDims, r: RunShape) -> int | None:
    """Tokens per tile of the final norm (``None``: it runs whole): with ``model.tiled_mlp`` (else
    ``model.tiled_layer``) on and tp 1, the rule the model tiles it with
    (:func:`automodel.models.tiled_mlp.tile_final_norms`: the first of the two applied sets it)."""
    setting = r.tiled_mlp if r.tiled_mlp not in (False, None) else r.tiled_layer
    return _norm_tile(d, r, setting, d.final_norm_tiles)


@dataclass(frozen=True)
class _CoreTerms:
    """What linear-mixer cores add to the activations, bytes per rank (:func:`_linear_cores`): ``held`` from the
    layers' forwards on at every later moment, ``forward`` at a layer's mixer in its forward (the layer in flight),
    ``backward`` at a recomputed (without checkpointing: the last) layer's MLP and norm backward moments,
    ``at_mixer`` at its mixer's backward (the attention moment); ``note`` for the activations' note; ``measured``:
    the cores are counted from their measurement (the mixer terms and notes that stood for them are then left out)."""

    held: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    at_mixer: float = 0.0
    note: str = ""
    measured: bool = False


def _linear_cores(d: ModelDims, r: RunShape) -> _CoreTerms:
    """What the plan counts of linear-mixer cores, from the meta-device measurement (``ModelDims.chain_*`` and
    ``core_*``: :func:`automodel.training.chain_memory.chain_kept`).

    - **In the state chain** (cp > 1 under ``linear_support.CHAINED_METHODS``: ring, thd, thd_docs, usp): every chained
      layer keeps its core's graph, inputs, outputs and states from its forward to its backward, outside activation
      checkpointing (``state_chain``); a recomputed layer runs its chain once more, whose graph lives through its
      backward (a snapshot of OLMo-Hybrid under ring: four copies of each chunk tensor of its three chained layers at
      the backward's peak); and the chain holds more in flight in its forward and its backward, at most what the core
      holds beyond its saved tensors on the whole row (the chain's pieces are shorter). Counted for
      every chained layer: transformers' torch code is what is measured, which keeps more than fla's and mamba-ssm's
      CUDA kernels where those run them. Uncounted, OLMo-Hybrid's step was planned 38% and Qwen3-Next's 30% under
      their measured peaks under ring (``scripts/bench_plan_families_cp.py``, hidden 256, 2048 tokens, cp 2).
    - **Outside it** (one process, Ulysses' head shard: the rank's share of the heads on the whole row, the same bytes
      per rank): a core saves what autograd saves, and holds more at its forward's and backward's peaks; with
      checkpointing only the layer in flight, without every such layer keeps what it saved. Counted where the cores'
      torch code runs: on the CPU every layer of :attr:`ModelDims.core_layers`, on a GPU those of
      ``gpu_torch_core_layers`` (no kernel package installed here, or none exists). Planned as attention layers of the
      model's heads, transformers' torch fallbacks read far under: Kimi Linear and Bailing-hybrid -93% to -98% under
      Ulysses at cp 2, Jamba -37%.

    The core is counted beside the attention terms the plan's layer terms give every layer, which stand for a
    linear layer's projections, gates and norms around its core (subtracting them as if they were the core put Mamba2
    layers 5% to 12% under: Falcon-H1, Bamba, Nemotron-H under Ulysses). Nothing where the cores were not measured (the
    notes then name the layers)."""
    from automodel.distributed.cp.attention_kernels import CPU_KERNEL
    from automodel.distributed.cp.layers.linear_support import CHAINED_METHODS

    chained = d.chained_mixer_layers
    if not chained or not any(d.chain_kept_per_token):
        if chained and r.cp > 1 and r.activation_checkpointing and r.cp_method in CHAINED_METHODS:
            return _CoreTerms(note=f"; under {r.cp_method} the {chained} linear-mixer layers' cores run in the state "
                                   "chain, which keeps each one's saved tensors through the step (checkpointing does not "
                                   "recompute them): not counted")  # fmt: skip
        return _CoreTerms()
    at = 1 if r.compute_bytes < 4 else 0
    n = r.local_tokens
    if r.cp > 1 and r.cp_method in CHAINED_METHODS:
        plural = "s" if chained > 1 else ""
        kept = n * d.chain_kept_per_token[at] + r.local_batch * d.chain_kept_per_row[at]
        # in flight beyond what it keeps, at most the whole row's core's (the chain's pieces are shorter)
        saved = n * d.core_saved_per_token[at]
        forward, backward = n * d.core_forward_per_token[at] - saved, n * d.core_backward_per_token[at] - saved
        again = kept / chained if r.activation_checkpointing else 0.0
        note = (f"; under {r.cp_method} the {chained} linear-mixer layer{plural}' cores run in the state chain, which "
                f"keeps {_fmt(kept)} through the step"
                + (" (checkpointing does not recompute them), and a recomputed layer's chain once more in its backward"
                   if again else "")
                + "; measured with transformers' torch code, which keeps more than fla's and mamba-ssm's CUDA kernels "
                  "where those run them")  # fmt: skip
        # a recomputed layer's backward holds its chain's recomputed forward first, then its backward
        return _CoreTerms(kept, forward, again, again + max(forward, backward), note, measured=True)
    cpu = r.attention_kernel == CPU_KERNEL
    layers = d.core_layers if cpu else d.gpu_torch_core_layers
    if not layers:
        return _CoreTerms()
    saved, forward, backward = (n * x[at] for x in (d.core_saved_per_token, d.core_forward_per_token,
                                                     d.core_backward_per_token))  # fmt: skip
    where = "on the CPU" if cpu else "on a GPU here (no kernel package of theirs installed, or none exists)"
    plural = "s" if layers > 1 else ""
    if r.activation_checkpointing:
        note = (f"; the recomputed linear-mixer layer's core, transformers' torch code {where}: "
                f"{_fmt(max(forward, backward))} at its peak (measured on the meta device)")
        # the recomputed layer's backward phase holds its core's recomputed forward first (Falcon-H1's Mamba2 under
        # Ulysses peaks there: the padded chunks beside the head shard's inputs), then its backward
        return _CoreTerms(0.0, forward, saved, max(forward, backward), note, measured=True)
    note = (f"; {layers} linear-mixer layer{plural}' cores, transformers' torch code {where}: {_fmt(saved * layers)} "
            "kept (measured on the meta device)")
    return _CoreTerms(layers * saved, forward - saved, 0.0, backward - saved, note, measured=True)


def _keeps_eager_scores(d: ModelDims, r: RunShape) -> bool:
    """Whether the model's own eager attention function runs and keeps its ``[heads, S_q, S_k]`` scores: ``eager``
    without CP, and under CP only where the method hands the model's attention function its extent (Ulysses' inner
    kernel on unpacked rows: :attr:`RunShape.kernel_path` ``"sdpa"``). Elsewhere the method's kernels run an eager
    model's layers and keep no scores: ring routes them to torch's ring or the halo kernel
    (``distributed/cp/ring/router.py``), thd, thd_docs and usp run their block kernels, as Ulysses does per document
    on packed rows, layers in their own code (GPT-Neo) hand q, k, v to the method, and a gathered-state kernel's
    layers keep its own score blocks under every method. Measured (``scripts/bench_plan_families_cp.py``, hidden 256,
    2048 tokens, cp 2): the eager scores planned for ring's extent (8 heads x 1024 x 2048 fp32, twice: the
    probabilities and the soft-cap's tanh) put Gemma 2's plan at +146% of the step's peak; Ulysses' whole-row scores
    put DeepSeek-V4's and HY-V4's at +205% and +238%."""
    if r.attn != "eager":
        return False
    if r.cp <= 1:
        return True
    # layers a gathered-state kernel runs (DeepSeek-V4, HY-V4, DSA, Doge) keep its score blocks, not the model's
    # eager scores, under every method: where every attention layer is one, none (Kolibri-1.1's run the class's own
    # attention function: theirs are eager scores)
    attention = sum(n for _, n in d.attention_kinds)
    own_kernel = sum(n for n, state in d.gathered if state.own_kernel)
    return r.kernel_path == "sdpa" and not d.own_code_layers and own_kernel < attention


def _repeated_kv_share(d: ModelDims, r: RunShape) -> float:
    """The share of the layers whose attention saves K and V repeated to the query heads (``2 q`` per token in place
    of the KV heads' ``2 kv``).

    Under CP the method says (:meth:`~automodel.distributed.cp.CPMethod.saves_repeated_kv`). Without CP (and without
    head groups, whose checkpointed groups save none) the model's attention function does: ``eager`` always repeats
    them (``repeat_kv`` before its matmuls); ``sdpa`` where transformers' ``use_gqa_in_sdpa`` cannot pass
    ``enable_gqa``: a head size above 256 (every layer) or a mask given (the layers of a sliding-window or chunked kind
    shorter than the row, or every layer of a model that always builds its mask). Measured:
    ``scripts/bench_memory.py --structures only`` (4 heads / 2 KV heads of 320: the repeated copies alive at the loss,
    k after RoPE and v at the KV heads freed)."""
    if not d.heads or d.kv_heads >= d.heads:
        return 0.0
    if r.cp > 1:
        return 1.0 if _method(r).saves_repeated_kv(r.packed, d.head_dim) else 0.0
    if r.head_chunks > 1 or r.attn not in ("sdpa", "eager") or d.kv_heads == 1:
        return 0.0  # one KV head: transformers' repeat_kv is a view of it (expand, then a reshape that needs no copy)
    from automodel.distributed.cp.ring.method import SDPA_GQA_MAX_HEAD_DIM

    if r.attn == "eager" or d.head_dim > SDPA_GQA_MAX_HEAD_DIM or d.forced_mask_heads:
        return 1.0
    total = sum(n for _, n in d.attention_kinds)
    return sum(n for limit, n in d.attention_kinds if 0 < limit < r.seq) / total if total else 0.0


def _output_copies(d: ModelDims, r: RunShape) -> int:
    """How many ``[N, q]`` tensors of the attention output a layer saves: the kernel's output (which its backward
    reads) and the contiguous ``[B, S, H, D]`` copy the output projection is given (transformers'
    ``attn_output.transpose(1, 2).contiguous()``, or a layer's own head merge).

    Without CP the copy is made only where the output is head-major: torch's CPU SDPA
    kernels lay their output out as the query is laid out, so a query that is a transposed view of its projection
    (``view(B, S, H, D).transpose(1, 2)``, RoPE's elementwise products keep that layout: Llama, Qwen, Gemma, Falcon,
    GPT-2) gives an output whose ``.transpose(1, 2).contiguous()`` is a view (1 tensor); a query made contiguous
    head-major before the kernel (a partial RoPE that concatenates the rotated and the passed part: GPT-NeoX, Phi,
    StableLM; :attr:`ModelDims.attn_output_copy`), ``eager`` attention (its ``probs @ v`` is head-major) and layers in
    their own code copy it (2); the CUDA kernels (flash, cuDNN, efficient) return their output token-major whatever
    q's layout, so this errs high there. Measured: ``scripts/bench_memory.py --structures only`` (snapshots of the tensors
    alive at the loss: no copy for the Llama, Gemma-3-like, Falcon and GPT-2 rows, one per layer for GPT-NeoX's and
    GPT-Neo's). Under CP the methods' outputs are counted with their copy (2); with head groups
    (``distributed.ulysses_head_chunks > 1``) only the copy (1: the kernel's output is not saved)."""
    if r.cp > 1:
        return 1 if r.head_chunks > 1 else 2
    # model.attention_head_chunks at cp 1: the groups write into one token-major output, which the output projection
    # saves (their kernels' outputs are not kept): the same count, 1 (on the safe side where the model copies)
    return 2 if r.attn == "eager" or d.attn_output_copy else 1


def _activation_terms(d: ModelDims, r: RunShape) -> _Activations:
    """The activations at each moment of a step, bytes per rank on the device (:class:`_Activations`)."""
    layer_tile = _layer_tile(d, r)
    if layer_tile:  # model.tiled_layer (refused under TP by the config rules)
        return _tiled_layer_terms(d, r, layer_tile)
    n, c, tp, s = r.local_tokens, r.compute_bytes, r.tp, r.stream_split
    h, kv = d.hidden, d.kv_heads * d.head_dim
    # K and V as the attention kernel saves them: repeated to all query heads (2 q) where it is given them so
    # (_repeated_kv_share), else at the KV heads (2 kv; the block kernels and torch's SDPA with enable_gqa). Never
    # both: transformers' repeat_kv (expand, then a reshape that copies) and RoPE (its products save cos and sin) do
    # not keep their inputs, so k after RoPE and v at the KV heads are freed once repeated (snapshots of
    # scripts/bench_memory.py --structures only, 4 / 2 heads of 320: only the [B, 2, 2, S, 320] copies are alive)
    share = _repeated_kv_share(d, r)
    kv_saved = 2 * d.heads * d.head_dim * share + 2 * kv * (1 - share)
    # the residual stream: each hidden-size norm saves its input's normalized copy and its output (2 h; Llama:
    # two norms, Gemma 3: four), and the residual (h); whole on every TP rank unless sequence parallel splits
    # it; then the attention and the MLP block each all-gather their input once, and their projections save
    # that gathered [N, h] for the weight gradients
    # in bf16 / fp16 a norm that computes in fp32 saves its input's fp32 copy too (transformers' RMSNorm: h more per
    # norm in compute-dtype units; measured per norm class, ModelDims.norm_half_extra); the fp32 count stays
    half = r.compute_bytes < 4
    norm_tile = _layer_norm_tile(d, r)
    if norm_tile:  # the norms in tiles (the tiled MLP): each keeps its input; its output is the next projection's
        stream = 2 * d.layer_norms * h / s
    else:
        stream = (2 * d.layer_norms + 1) * h / s + ((d.norm_half_extra * h / s) if half else 0.0)
    stream += d.residual_saved_extra[1 if half else 0] * h / s  # hyper-connections' streams and mixing
    gathered = 2 * h if r.sequence_parallel and tp > 1 else 0
    # per head, split over TP: q after RoPE, K and V as the kernel saves them, the attention output and, where one is
    # made, its transposed copy (_output_copies); per-head q/k norms (Qwen3, Gemma 3) save their input and normalized
    # output (2 (h + kv))
    # q = heads x head_dim: the query heads' width, which is the hidden size only where head_dim = h / heads (Gemma 2's
    # 16 heads of 256 on 3584, the --structures row's 4 of 320 on 128: q, the output and its copy are [N, q])
    q = d.heads * d.head_dim
    qk = 2 * (q + kv) if d.qk_norm and d.heads else 0
    qk += d.qk_norm_half_extra * (q + kv) if qk and half else 0.0  # their fp32 copies in bf16 / fp16
    # head groups (distributed.ulysses_head_chunks=G > 1): each group runs under a checkpoint, so neither the kernel's
    # output nor its LSE is saved (automodel.distributed.cp.head_chunks): the local q/k/v and the output projection's
    # input are (measured: scripts/bench_memory.py --headwise only, 4.25 MiB below one group at 4096 local tokens)
    grouped = r.head_chunks > 1 and r.cp > 1
    # a fused q/k/v projection's output stays whole while v, a view of it, is saved (not where K/V are repeated: the
    # copies are saved and the view is freed): q + kv beyond the v counted (Phi-3 bf16 without checkpointing was
    # planned 6% under at hidden 256: the [N, q + 2 kv] qkv_proj output of every layer alive)
    fused = (q + kv) * (1 - share) if d.fused_qkv else 0.0
    # an output gate (out * sigmoid(gate_proj(x)): AFMoE, Beam, HRM, Dory, HY-V4): the sigmoid's output and the gated
    # product, which the output projection saves in place of the kernel's output (kept too, by the product); a gate
    # made by q_proj beside the query (Qwen3-Next, Qwen3.5) keeps the whole [N, 2 q] projection in fp32, where the q
    # norm saves its input view (ModelDims.query_gate)
    gate = d.attn_output_gate * q + (q if d.query_gate and d.qk_norm and not half else 0.0)
    # an attention module that calls its kernel more than once (DiffLlama), convolves its projections (ZAYA,
    # Inkling) or routes its heads through experts (JetMoE): what it keeps beyond one plain call's terms
    gate += d.attention_saved_extra[1 if half else 0] * q
    attn = (q + kv_saved + _output_copies(d, r) * q + qk + fused + gate) / tp if d.heads else 0.0
    # without CP (and without head groups) the attention's backward holds the output projection's input gradient and
    # SDPA's dq, dk, dv (K and V at the width the kernel was given them) beside the saved tensors: 2 q + kv_saved,
    # the step's peak where q is wide next to the MLP (the 4 / 2 heads of 320: 40 MiB at 2048 tokens, one
    # [B, S, q] gradient and the kernel's three [B, 4, S, 320] outputs). eager's moment (its scores' gradient in
    # flight) comes after dv and before q @ k^T's backward makes dq and dk: q + kv_saved / 2. Under CP the method's
    # workspace holds them (ring: CPMethod.workspace_holds_qkv_grads; Ulysses: the full-row gradients around its
    # all-to-alls)
    attn_bwd = 0.0
    if d.heads and r.cp == 1 and r.head_chunks == 1:
        attn_bwd = (q + kv_saved / 2 if r.attn == "eager" else 2 * q + kv_saved) / tp * c
    lse = 0.0 if grouped else d.heads * 4 / tp  # the kernel's fp32 log-sum-exp
    tile = _mlp_tile(d, r)
    mlp = _mlp_moments(d, c)
    saved_mlp, fwd_mlp, bwd_mlp = (0.0, 0.0, 0.0) if tile else (mlp.saved / tp, mlp.forward / tp, mlp.backward / tp)
    # the router runs inside the tiled MLP's Function with the experts (kept per tile, not per layer: tile_bytes)
    router = 0.0 if tile else mlp.router
    # one tile in backward: its recomputed intermediates and their gradients, and the MLP block's weight gradients
    # twice: the tile's own (``got`` in automodel.models.tiled_mlp), W / tp (ModelDims.mlp_weights: 3 h I for a gated
    # MLP), beside their running sum over the tiles done (``sums``, which becomes the layer's gradient). The gradients
    # term counts the layer's gradient as its FSDP2 shard (1 / fsdp of it), but the sum is whole until the
    # layer's reduce-scatter: W / tp (1 - 1 / fsdp) more (a snapshot of scripts/bench_plan_cases.py's tiled
    # case at fsdp 2 holds both copies whole; scripts/bench_memory.py's wide rows run at fsdp 1)
    # the tile's tensors are the MLP's per-token moments (_mlp_moments: a plain MLP's measured activation, a gated
    # one's, a mixture of experts' routed copies and router) over its tokens; its weight gradients are the whole
    # block's (ModelDims.mlp_weights: every expert of a mixture, which the tiled backward differentiates per tile;
    # planned as one expert's, Mixtral bf16 with checkpointing was 21% under its measured peak at hidden 256)
    weights = d.mlp_weights / tp
    unsharded_sum = weights * (1 - 1 / r.fsdp)
    # in bf16 / fp16 the running sum over several tiles is fp32 (automodel.models.tile_backward): 4 - c bytes more
    widened = weights * (4 - c) if c < 4 and tile and tile < n else 0.0
    tile_bytes = ((mlp.backward * tile / tp + weights + unsharded_sum) * c + mlp.router * tile + widened) if tile else 0.0
    tile_fwd = (mlp.forward * tile / tp * c + mlp.router * tile) if tile else 0.0  # e.g. gate, silu(gate) and up
    # an expert loop that indexes its stacked weights per expert: the experts' full-size gradients summed out of
    # place, two copies of the largest weight's gradient beyond the one counted, at the MLP's backward (per tile too)
    loop_grads = 2 * d.expert_loop_param * c / tp
    # per token, in the compute dtype: the layer but its MLP; the whole layer as the forward saves it
    body = (stream + gathered + attn) * c + lse
    # at the layer's attention (its forward; its backward, the MLP's and the post-attention norm's backward done) the
    # residual stream holds the input norm's two tensors only: the residual add and the later norms come after the
    # attention in the forward and are freed before it in the backward (snapshots of scripts/bench_memory.py's
    # Ulysses rows: 3 h fewer per token than the whole layer's stream); under SP only the attention's gathered input
    body_attn = (2 * h / s + (h if gathered else 0) + attn) * c + lse
    # in the recomputed layer's attention backward with the norms in tiles, the input norm keeps the layer input
    # (counted as kept) and its output (what the q/k/v projections save): h fewer (measured: scripts/bench_memory.py
    # --tiled-layer only, the untiled ring row, 79.1 -> 75.1 MiB with the norms tiled)
    body_attn_bwd = body_attn - (h * c / s if norm_tile and r.activation_checkpointing else 0.0)
    layer = body + saved_mlp * c + router
    # the gradients at the layer's output and input; a layer of K streams (Gemma 3n's AltUp, hyper-connections) holds
    # its streams' gradient, K [N, h], through its backward (its first step and its residual structure's last read them)
    grads = (1 + d.layer_input_copies) * h * c / s
    # and its residual structure's backward, which runs first, with every tensor the layer saved alive, holds more
    # (ModelDims.residual_backward_extra: Gemma 3n's AltUp correction, [K, N, h] gradients of its product, innovation
    # and predictions at once): a moment of its own
    wider = d.residual_backward_extra[1 if half else 0][1 if norm_tile else 0] * h * c / s
    # a norm after the MLP (Gemma 2/3's post_feedforward_layernorm, of four norms per layer) has run its backward and
    # freed its input and normalized copy by the time backward reaches the MLP: 2 h fewer at the MLP's backward
    post_mlp_norm = (1 if norm_tile else 2) * h * c / s if d.layer_norms >= 4 else 0.0  # tiled: its input alone
    # the attention's backward: the MLP's tensors are freed; dq, dk, dv and the attention output's gradient are
    # attn_bwd without CP, the CP workspace's under CP (Ulysses' all-to-all buffers, ring's accumulators)
    # outside the layers: embedding output (h) and final norm (3 h) (split by SP; with SP the LM head gathers its
    # input: h), ids/labels/positions (24 B, every TP rank holds them) and RoPE's cos and sin ([N, head_dim] each,
    # made once per forward, kept for the backward). Offloaded, the embedding output is the first layer's input:
    # on the host with the others.
    # with the norms in tiles (no checkpointing) the embedding output is the first layer's input, which its first
    # norm keeps and its stream counts
    embed = 0.0 if r.activation_offloaded or (norm_tile and not r.activation_checkpointing) else h * c / s
    rope = 2 * d.head_dim * c if d.heads else 0
    final = _final_saved(d, r)  # freed once backward has passed the final norm
    always = 24 + rope + d.loop_restarts * h * c / s  # a looped model's hidden states kept between its passes
    s2 = building = in_flight = returned = 0.0
    if d.alibi_layers and r.cp > 1:
        # ALiBi layers hand q, k, v to the method (cp/layers/alibi.py): the halo kernel recomputes its blocks (no
        # S^2 saved: layer_kind_memory.alibi_workspace); Ulysses saves the bias mask SDPA is given, and its forward
        # holds two boolean [B, S, S] masks while it builds it
        s2 = alibi_saved_per_layer(d, r)
        building = alibi_mask_build(d, r)
    elif _keeps_eager_scores(d, r):
        # what it keeps per [heads, S_q, S_k] score and layer (the fp32 probabilities and their cast to the compute
        # dtype in transformers' common function) and, at the layer's attention (its forward, its backward), what is
        # in flight beside it: the scores and their masked copy, the probabilities' gradient and the scores'
        # (_eager_moments: measured on the model's own eager function, or the GPT-Neo snapshots' three at once)
        # DeepSeek-V4's compressed entries widen the scores and the mask its layers extend to them (in flight at the
        # layer's attention; the row's own mask is counted with the masks)
        extent = (d.heads // tp, r.seq, r.seq * (1 + d.compressed_keys))
        heads_local, s_q, s_k = _method(r).attention_extent(d, r) if r.cp > 1 else extent
        scores = r.local_batch * heads_local * s_q * s_k
        kept_b, forward_b, backward_b = _eager_moments(d, c)
        s2 = scores * kept_b
        # BLOOM's loop holds the previous layer's returned probabilities (ModelDims.keeps_returned_probs), alive beside
        # the next layer's attention where checkpointing keeps nothing else: a snapshot at 2048 tokens, fp32, holds four
        # [heads, S, S] at the second layer's attention (planned -22% with three)
        returned = scores * c if d.keeps_returned_probs and r.cp <= 1 else 0.0
        widened = r.local_batch * s_q * s_k * c if d.compressed_keys and r.cp <= 1 else 0.0
        building += scores * (forward_b - kept_b) + widened
        in_flight = scores * (backward_b - kept_b) + widened
    if d.index_mask_layers and r.cp <= 1 and r.attn in ("eager", "sdpa"):
        # DSA's index mask and the mask it is folded into, in flight at the layer's attention (forward and backward)
        folded = r.local_batch * r.seq * r.seq * (1 + (c if r.attn == "eager" else 1))
        building += folded
        in_flight += folded
    # SDPA given a boolean mask keeps a float copy of it per layer for its backward (layer_kind_memory.sdpa_mask_copy):
    # the layers' average in what they keep, the largest for the layer in flight
    copy_avg, copy_max = sdpa_mask_copy(d, r)
    # a learned relative-position bias per layer (Inkling): what each layer keeps of it beside the masks' copies, and
    # the bias (its folded mask, their gradients) in flight at the layer's attention
    # (and the distance tables the model builds once per forward: held through it, under checkpointing to the end)
    bias_avg, bias_max, bias_fwd, bias_bwd, tables = position_bias_bytes(d, r)
    copy_avg, copy_max = copy_avg + bias_avg, copy_max + bias_max
    building += bias_fwd
    in_flight += bias_bwd
    # a dynamic mask per layer that needs its gradient (Doge): kept beside the layer, built and differentiated at
    # its attention
    dyn_avg, dyn_max, dyn_fwd, dyn_bwd = dynamic_mask_bytes(d, r)
    copy_avg, copy_max = copy_avg + dyn_avg, copy_max + dyn_max
    building = max(building, dyn_fwd) if r.attn == "eager" else building + dyn_fwd  # eager: before the scores
    in_flight += dyn_bwd
    # linear-mixer cores (_linear_cores): what the state chain keeps through the step, or outside it what a core
    # saves and holds at its peaks where its torch code runs
    cores = _linear_cores(d, r)
    chained = cores.held if r.activation_checkpointing else 0.0
    # a linear-attention mixer in the attention's place (MiniMax's lightning attention): what it keeps beyond the
    # attention terms, in its layers (the layers' average in what they keep, one such layer in flight); where the chain
    # runs it, the chain's count is what its layers keep
    mixer = n * d.mixer_saved_extra[1 if half else 0] * q * c / tp if d.mixer_layers and d.heads and not cores.measured else 0.0
    copy_avg, copy_max = copy_avg + mixer * d.mixer_layers / max(1, d.layers), copy_max + mixer
    # a chunked indexer (Kolibri-1.1): its selection at an indexed layer's attention in the forward (and in its
    # recomputation), and under checkpointing the pools of candidate keys the layers' recomputations are handed
    indexer, pools = indexer_bytes(d, r)
    tables += pools
    tiled = f"; MLP tiled, {tile} tokens per tile ({_fmt(tile_bytes)} per tile in backward)" if tile else ""
    if bias_max:  # an S^2 term the layer count does not show
        tiled += f"; a learned position bias per layer: {_fmt(bias_max)} kept, {_fmt(bias_bwd)} in flight"
    if indexer:  # S^2 terms too
        tiled += f"; the indexer's key selection: {_fmt(indexer)} at an indexed layer's attention"
        tiled += f", {_fmt(pools)} of pools of candidate keys kept" if pools else ""
    if mixer:
        tiled += f"; {d.mixer_layers} linear-attention layers keep {_fmt(mixer)} more each"
    # linear mixers the plan does not measure: counted as attention layers of the model's heads (a model without
    # attention heads counts no term for them)
    as_what = "with the attention terms of the model's heads" if d.heads else "with no term of their own"
    if d.kernel_mixer_layers and not cores.measured:  # counted: their note says what was measured
        tiled += (f"; {d.kernel_mixer_layers} linear-mixer layers planned {as_what}, not measured: their CUDA kernels "
                  "(fla, causal-conv1d, mamba-ssm) run them on a GPU; without those packages transformers runs its "
                  "torch fallback, which keeps more (CPU step peaks up to 84% above this plan: docs/benchmarks.md)")
    if d.torch_mixer_layers and not cores.measured:
        tiled += (f"; {d.torch_mixer_layers} linear-mixer layers (torch code on every device) planned {as_what}, "
                  "not measured")
    tiled += cores.note
    tables += chained  # held from the chained layers' forwards to their backwards, like the tables
    tiled += f"; the layers' norms in tiles of {norm_tile} tokens" if norm_tile else ""
    if r.activation_checkpointing:
        # only each layer's input is kept (the embedding output is the first); offloaded, two on the device
        kept, kept_at_loss = (x * _layer_input_bytes(d, c) / s for x in _kept_inputs(d, r))
        saved = n * (kept_at_loss + final + always) + tables
        # forward, in the last layer (not saved: checkpointed): its MLP's input and the residual, and the MLP's
        # intermediates in flight; or its attention's tensors
        fwd_m = n * (kept_at_loss + always + 2 * h * c / s + fwd_mlp * c + router) + tile_fwd + tables
        at_attn = n * (kept_at_loss + always + h * c / s + body_attn) + tables
        fwd_a = at_attn + s2 + building + copy_max + returned
        # an indexed layer's selection comes before its kernel (and SDPA's float copy of its mask)
        fwd_i = at_attn + indexer if indexer else 0.0
        # backward recomputes one layer at a time (the final norm's and the LM head's saved tensors are freed by
        # then): the MLP's backward holds the recomputed attention's tensors, what is left of the MLP's and its
        # gradients (_mlp_moments); the attention's backward the attention's tensors and the eager kernel's S^2
        bwd_m = n * (kept + always + body - post_mlp_norm + bwd_mlp * c + router + grads) + s2 + tile_bytes + copy_max
        bwd_m += loop_grads
        bwd_a = n * (kept + always + body_attn_bwd + grads + attn_bwd) + s2 + copy_max + in_flight
        # the recomputed forward of an indexed layer selects its keys again before its kernel runs (and before SDPA
        # makes its mask's float copy)
        bwd_i = n * (kept + always + body_attn_bwd + grads) + indexer + tables if indexer else 0.0
        bwd_n = n * (kept + always + _layer_norm_moment(d, r, attn, lse, saved_mlp)) + s2 + copy_max
        bwd_m, bwd_a, bwd_n = bwd_m + tables, bwd_a + tables, bwd_n + tables
        # the recomputed layer's core (_linear_cores: in the chain its graph once more), at its mixer's backward with
        # what it holds in flight; the layer in flight's core in the forward
        fwd_a += cores.forward
        bwd_m, bwd_a, bwd_n = bwd_m + cores.backward, bwd_a + cores.at_mixer, bwd_n + cores.backward
        bwd_i += cores.backward if bwd_i else 0.0
        # the recomputed layer's residual structure's backward: all it saved, its output's gradients and what its
        # backward holds more (0 for a plain layer, whose MLP moment is higher)
        bwd_r = n * (kept + always + layer + 2 * h * c / s + wider) + s2 + copy_max + tables if wider else 0.0
        note = _kept_inputs_note(d, r)
        note += f"; one layer recomputed in backward: {_fmt(bwd_m - n * (kept + always))} (its MLP's backward){tiled}"
        fwd_f, bwd_f = _final_norm_moments(d, r, n * (kept_at_loss + always) + chained)  # every chain kept then
        return _Activations(saved, fwd_m, fwd_a, bwd_m, bwd_a, note, fwd_f, bwd_f, bwd_n, fwd_i, bwd_i, bwd_r)
    before = n * ((d.calls - 1) * layer + embed + always) + (d.calls - 1) * (s2 + copy_avg)  # the layers before the last
    saved = n * (d.calls * layer + embed + final + always) + d.calls * (s2 + copy_avg) + tile_bytes
    # every linear-mixer core (chained, or whose torch code runs) keeps its tensors beside its layer's
    # (_linear_cores), the last layer's included from its forward on
    before, saved = before + cores.held, saved + cores.held
    fwd_m = before + n * (body + fwd_mlp * c + router) + s2 + tile_fwd + copy_max + tables
    at_attn = before + n * body_attn + tables
    fwd_a = at_attn + s2 + building + copy_max
    fwd_i = at_attn + indexer if indexer else 0.0  # an indexed layer's selection, before its kernel
    # backward through the last layer (the final norm's saved tensors freed): its MLP's moment (the MLP's saved
    # tensors replaced by what is left and its gradients), then its attention's (the MLP's freed)
    bwd_m = before + n * (body - post_mlp_norm + bwd_mlp * c + router + grads) + s2 + tile_bytes + copy_max + loop_grads
    bwd_a = before + n * (body_attn + grads + attn_bwd) + s2 + copy_max + in_flight
    bwd_n = before + n * _layer_norm_moment(d, r, attn, lse, saved_mlp) + s2 + copy_max
    # the last layer's residual structure's backward, every tensor it saved alive (0 for a plain layer)
    bwd_r = before + n * (layer + 2 * h * c / s + wider) + s2 + copy_max if wider else 0.0
    # the last layer's core in flight beyond what it keeps (_linear_cores), at its mixer
    fwd_a, bwd_a = fwd_a + cores.forward, bwd_a + cores.at_mixer
    note = f"{_layer_count(d)} x {_fmt(n * layer + s2)}" + (" (an S^2 term per layer: eager's probabilities or ALiBi's bias mask)" if s2 else "") + tiled
    if tp > 1:
        note += f"; heads and MLP /tp {tp}, residual stream " + ("/tp (sequence parallel)" if s > 1 else "whole")
    fwd_f, bwd_f = _final_norm_moments(d, r, before + n * layer + s2 + copy_avg)
    return _Activations(saved, fwd_m, fwd_a, bwd_m, bwd_a, note, fwd_f, bwd_f, bwd_n, fwd_index=fwd_i,
                        bwd_residual=bwd_r)


@dataclass(frozen=True)
class _MLPMoments:
    """Per token of one layer's MLP, elements in the compute dtype (``router``: fp32 bytes): what the forward
    saves, what is live at the forward's peak inside the MLP, and at the backward's peak inside it."""

    saved: float
    forward: float
    backward: float
    router: float


def _mlp_moments(d: ModelDims, c: float = 4) -> _MLPMoments:
    """The MLP's saved tensors and its peaks (:class:`_MLPMoments`), per token, elements in the compute dtype.

    Dense (gate, up, silu(gate), silu(gate) * up saved: ``4 I``): the forward peaks with gate, silu(gate) and up
    in flight (``3 I``); in the backward the down projection has freed the product (its input) and the product's
    backward holds its incoming gradient and both of its own beside gate, silu(gate) and up: ``6 I`` (a probe of
    one checkpointed MLP with the live-tensor tracker: 6.0 ``[N, I]`` plus the ``[N, h]`` gradients). A gated block
    that saves more than ``4 I`` (measured on the meta device: :attr:`ModelDims.mlp_saved_extra`; ``c``: the compute
    dtype's bytes, which of its two figures) adds the excess to all three: it is made in the forward and kept to
    the backward.

    Mixture of experts, ``torch._grouped_mm`` (transformers' ``grouped_mm`` experts, the default of 5.17 and
    5.25): each of a token's ``k`` routed copies saves its gathered input (``h``), the fused gate/up output
    (``2 I_e``), silu(gate) and the product (``2 I_e``) and the down projection's output for the routing weight
    (``h``): ``k (2 h + 4 I_e)``. Its peaks hold ``[k N, h]`` buffers beside the ``[k N, I_e]`` ones: the gathered
    input, the down projection's output and its weighted copy, and the scatter back to the tokens (``new_zeros``,
    ``index_put``) with their gradients; :data:`MOE_GROUPED_FORWARD` and :data:`MOE_GROUPED_BACKWARD` in
    ``(h, I_e)`` units per routed copy. The ``h`` terms were folded into ``I_e`` (``k (h + 4 I_e)`` and
    ``k (h + 6 I_e)``, from a probe of one Mixtral block, where ``I_e = 3.5 h``), which under-counted the fine-grained
    experts, narrower than ``h``: Qwen3-MoE's cp=1 peak with checkpointing was planned 17% under the measured one
    (``scripts/bench_plan_families.py``). Shared experts are a dense MLP of their width (``4 I_s`` saved, ``6 I_s`` at their
    backward). The expert loop (``experts_implementation="eager"``) is planned at its bound: everything saved,
    plus ``2 (k I_e + I_s)`` gradients. The router keeps its fp32 probabilities over the ``E`` experts and the
    top-k weights and indices (``4 E + 16 k`` bytes), and what a router scoring in fp32 keeps beyond them
    (:attr:`ModelDims.router_saved_extra`: its input's fp32 copy in bf16, ``4 h``).
    """
    if not d.experts:
        i = d.intermediate
        # fc1 -> act -> fc2: what its activation saves and holds, measured (ModelDims.mlp_moments)
        saved, forward, backward = d.mlp_moments if d.mlp_matrices == 2 else GATED_MLP_MOMENTS
        # a gated block that saves more (an fp32 SwiGLU, a norm over I: ModelDims.mlp_saved_extra), kept through its
        # forward and its backward
        extra = d.mlp_saved_extra[0 if c >= 4 else 1] if d.mlp_matrices == 3 else 0.0
        # and one whose peaks are higher than SwiGLU's beyond that (BitNet's norm over I, its backward in fp32)
        f_x, b_x = d.mlp_peak_extra[0 if c >= 4 else 1] if d.mlp_matrices == 3 else (0.0, 0.0)
        return _MLPMoments((saved + extra) * i, (forward + extra + f_x) * i, (backward + extra + b_x) * i, 0.0)
    k, ie, sh, h = d.top_k, d.expert_intermediate, d.shared_intermediate, d.hidden
    # a gate that keeps more than SiLU's (ModelDims.experts_gate_extra: MiniMax-M3's clamps and sigmoid), from the
    # forward to the backward: in every moment
    gate = k * ie * d.experts_gate_extra[0 if c >= 4 else 1]
    saved = k * (2 * h + 4 * ie) + 4 * sh + gate
    # the router's fp32 probabilities, top-k weights and indices, and what a router scoring in fp32 keeps more (its
    # input's fp32 copy in bf16: ModelDims.router_saved_extra)
    router = _router_term(d.experts, k) + d.router_saved_extra[0 if c >= 4 else 1]
    if d.experts_impl == "grouped_mm":
        forward = k * (MOE_GROUPED_FORWARD[0] * h + MOE_GROUPED_FORWARD[1] * ie) + 4 * sh + gate
        backward = max(k * (MOE_GROUPED_BACKWARD[0] * h + MOE_GROUPED_BACKWARD[1] * ie) + 4 * sh + gate, saved + 2 * sh)
    else:
        forward, backward = saved, saved + 2 * (k * ie + sh)
    return _MLPMoments(saved, forward, backward, router)


def host_bytes(d: ModelDims, r: RunShape) -> list[MemoryTerm]:
    """What one rank keeps in host memory (pinned), term by term (empty without offload).

    * ``model.activation_offload`` (with checkpointing): the ``L`` layer inputs ``[N, h / sp]``, ``L N h c``; with
      checkpoint groups of ``k`` (``model.checkpoint_group_layers``) the groups' first ones, ``ceil(L / k) N h c``.
    * ``fsdp.offload=optimizer``: the AdamW states (``2 T / fsdp`` master-dtype values), the master copy of the
      trainable parameters that the host-side step updates and the gradients it reads (``T / fsdp`` each).
    * ``fsdp.offload=all``: the parameter shard (``P / fsdp``), its gradients (``T / fsdp``) and the AdamW
      states (``2 T / fsdp``), master dtype.
    """
    out: list[MemoryTerm] = []
    if r.activation_offloaded:
        from automodel.models.checkpoint_groups import group_starts

        per = r.local_tokens * _layer_input_bytes(d, r.compute_bytes) / r.stream_split
        n = group_starts(d.calls, r.group)
        groups = f" (checkpoint groups of {r.group})" if r.group > 1 else ""
        out.append(MemoryTerm("offloaded activations", n * per, f"{n} layer inputs of {_fmt(per)}{groups}"))
    shard = 1 / r.fsdp
    params, trainable = d.local_params(r.tp) * shard, d.local_trainable(r.tp) * shard
    mb = r.master_bytes
    if r.offload == "optimizer":
        out.append(MemoryTerm("optimizer (host)", 4 * trainable * mb,
                              "AdamW states, master copy and gradients for the host-side step"))  # fmt: skip
    elif r.offload == "all":
        out.append(MemoryTerm("parameters and optimizer (host)", (params + 3 * trainable) * mb,
                              "parameter shard, its gradients and AdamW states"))  # fmt: skip
    return out


def _attention_workspace(d: ModelDims, r: RunShape) -> tuple[float, float, str]:
    """Per rank, ``(forward, backward, note)``: what one layer's CP attention holds beyond its activations at the
    forward's and the backward's attention moments (TP divides the heads its kernels see): the largest over the
    layer kinds the model has: the CP method's own term for its standard layers, ALiBi's score blocks on the halo
    kernel and a gathered-state kernel's tensors (:mod:`.layer_kind_memory`)."""
    if r.cp == 1:
        return 0.0, 0.0, "no CP"
    alibi = alibi_workspace(d, r)
    g_fwd, g_bwd = gathered_workspace(d, r)
    h_fwd, h_bwd = halo_math_workspace(d, r)
    own = sum(count for count, _ in d.gathered) + (d.alibi_layers if alibi else 0)
    kinds: list[tuple[float, float, str]] = []
    if own < d.layers:
        b, note = _method(r).attention_workspace(d, r)
        kinds.append((b, b, note))
    if alibi:
        heads, _, queries = _method(r).halo_extent(d, r)
        kinds.append((alibi, alibi, f"ALiBi on the halo kernel: a block's [{r.local_batch}, {heads}, "
                      f"{min(HALO_BLOCK, queries)}, {r.seq}] fp32 scores x3 and the row's K/V"))  # fmt: skip
    if g_fwd or g_bwd:
        kinds.append((g_fwd, g_bwd, "gathered state: the row's gathered and expanded state, a query block's scores "
                      "against it, the [B, n, T] masks and top-k slots"))  # fmt: skip
    if h_fwd or h_bwd:
        kinds.append((h_fwd, h_bwd, "soft-capped or sink layers on the halo kernel: a query block's exact-math fp32 "
                      "scores against its keys (three to six at once on a CPU) and the keys and values with the "
                      "halo"))  # fmt: skip
    if not kinds:
        return 0.0, 0.0, "none"
    fwd, bwd = max(k[0] for k in kinds), max(k[1] for k in kinds)
    return fwd, bwd, "; ".join(k[2] for k in kinds)


def _method(r: RunShape):  # noqa: ANN202 - a CPMethod
    return r.method


def _plain_logits(d: ModelDims, r: RunShape, loss_parallel: bool) -> float:
    """The plain loss's peak, bytes per rank, plus the hidden-state gradient ``N h c``.

    Without loss parallel (tp 1, or TP gathering the logits): ``3 N V 4``, the fp32 log-probs, their
    gradient and the logits gradient alive together in backward. With loss parallel each rank holds
    ``V' = V / tp`` columns, but torch's vocabulary-parallel backward (``loss_parallel()``: one fused
    NLL + log-softmax backward, which avoids a gather) holds four ``[N, V']`` fp32 tensors at once: the
    saved log-probs, the one-hot target update, ``update + exp(log-probs)`` and its product with the
    incoming gradient: ``4 N V' 4`` (measured, ``scripts/bench_tp.py``). So loss parallel divides the
    term by ``3 tp / 4`` (tp 2: by 1.5), not by tp.

    A soft-capped model's logits (:attr:`ModelDims.logit_softcap`) add the ``tanh`` output its backward keeps,
    ``N V c`` (``N V' c`` under loss parallel), alive beside those fp32 tensors (measured: NanoChat, bf16, vocabulary
    8192: 14 bytes a logit at the loss's peak, 12 without the soft-cap's).
    """
    n = r.local_tokens
    lp = loss_parallel and r.tp > 1
    cols = d.vocab / r.tp if lp else d.vocab
    softcap = n * cols * r.compute_bytes if d.logit_softcap else 0.0
    return (4 if lp else 3) * n * cols * 4 + softcap + n * d.hidden * r.compute_bytes


def _loss_term(d: ModelDims, r: RunShape) -> tuple[float, str]:
    n, v, h = r.local_tokens, d.vocab, d.hidden
    if r.chunk_tokens is None:
        if r.tp > 1 and r.loss_parallel:
            return _plain_logits(d, r, True), f"loss parallel: 4 x [{n}, {v // r.tp}] fp32 (V / tp {r.tp}) in torch's vocabulary-parallel backward"
        gathered = f" (tp {r.tp} gathers the logits)" if r.tp > 1 else ""
        softcap = f" and the soft-cap's [{n}, {v}] tanh output" if d.logit_softcap else ""
        return _plain_logits(d, r, False), f"plain: [{n}, {v}] fp32 log-probs, their gradient and the logits gradient{softcap}{gathered}"
    rows, c = min(r.chunk_tokens, n), r.compute_bytes
    # one chunk at a time (each freed before the next): its fp32 logits and their softmax; in a bf16 / fp16 backward
    # then the softmax, its cast and their [V, h] weight-gradient product (chunked_loss adds an fp32 one in place)
    softmax = 2 * rows * v * 4
    product = rows * v * (4 + c) + v * h * c if c != 4 else 0.0
    acc = v * h * 4  # the fp32 LM-head gradient (its cast to the weight's dtype comes after the chunks are freed)
    grad_h = n * h * c
    return max(softmax, product) + acc + grad_h, f"chunked: [{rows}, {v}] per chunk + the fp32 LM-head gradient"


def _comm_buffers(d: ModelDims, r: RunShape) -> tuple[float, str]:
    if not r.fsdp_enabled:  # automodel.distributed.replicate: one flat buffer of every gradient
        return d.trainable * r.master_bytes, "replicated: flat gradient all-reduce buffer"
    if r.fsdp == 1 and r.compute_bytes == r.master_bytes and r.offload != "all":
        return 0.0, "no FSDP sharding (fsdp size 1)"
    gathered_layers = 2 if r.reshard_after_forward else d.layers
    root = d.root_params - d.tp_root_params + d.tp_root_params / r.tp  # FSDP2 gathers the TP-local shards
    layer = d.layer_params - d.tp_layer_params + d.tp_layer_params / r.tp
    b = root * r.compute_bytes + layer * (gathered_layers * r.compute_bytes + r.reduce_bytes)
    note = f"root gathered fwd->bwd, {gathered_layers} layers gathered, one layer's gradient before reduce-scatter"
    if r.offload == "all":  # the shard copied from the host before its all-gather, one layer at a time
        b += layer / r.fsdp * r.master_bytes
        note += "; one layer's shard copied from the host"
    return b, note


def _gradient_bytes(d: ModelDims, r: RunShape) -> tuple[float, str]:
    """Gradients on the device through backward: the rank's shard, or (``fsdp.offload=all``: the shards go to
    the host as each reduce-scatter ends) the LM head's unsharded gradient, which the root module keeps until
    the end of backward."""
    trainable = d.local_trainable(r.tp)
    if r.offload == "all":
        head = (d.root_params - d.lookup_params) / r.tp  # the final norm's few weights counted with it
        return head * r.compute_bytes, "offloaded to the host; the LM head's unsharded gradient until the end of backward"
    return trainable / r.fsdp * r.master_bytes, f"1/{r.fsdp} of {trainable / 1e6:.1f}M trainable"


def plan_memory(d: ModelDims, r: RunShape) -> MemoryPlan:
    """Predict one rank's persistent state and step peak (see the module docstring for every term).

    Returns:
        A :class:`MemoryPlan`; nothing is mutated and nothing is allocated.
    """
    shard = 1 / r.fsdp
    params, trainable = d.local_params(r.tp), d.local_trainable(r.tp)
    where = f"1/{r.fsdp} of {d.params / 1e6:.1f}M"
    if r.tp > 1:
        where = f"1/{r.fsdp} of {params / 1e6:.1f}M (tp {r.tp}: {d.tp_params / 1e6:.1f}M sharded /tp, the rest whole)"
    on_device_params = 0.0 if r.offload == "all" else params * shard * r.master_bytes
    on_device_states = 0.0 if r.offload in ("optimizer", "all") else 2 * trainable * shard * r.master_bytes
    persistent = [
        MemoryTerm("parameters", on_device_params, where if r.offload != "all" else "on the host (fsdp.offload=all)"),
        MemoryTerm("optimizer states", on_device_states,
                   "AdamW exp_avg, exp_avg_sq" if r.offload is False else f"on the host (fsdp.offload={r.offload})"),
    ]  # fmt: skip
    if d.buffer_bytes:  # GPT-Neo's per-layer [P, P] masks: whole on every rank (FSDP2 does not shard buffers)
        persistent.append(MemoryTerm("buffers", float(d.buffer_bytes), "the model's buffers of 1 MiB or more, whole"))
    grads, grads_note = _gradient_bytes(d, r)
    acts = _activation_terms(d, r)
    attn, attn_bwd, attn_note = _attention_workspace(d, r)
    attn_state = gathered_state_bytes(d, r)  # the gathered K/V an indexed layer's selection reads (under CP)
    masks, masks_note = mask_bytes(d, r)
    loss, loss_note = _loss_term(d, r)
    comm, comm_note = _comm_buffers(d, r)
    host_step = r.offload in ("optimizer", "all")  # the optimizer step runs on the host
    opt_temp = 0.0 if host_step else grads
    kernel, kernel_note = _kernel_term(d, r)
    earlier_grads = grads if r.grad_acc > 1 and r.offload != "all" else 0.0
    # forward: the last layer in flight, FSDP2's root and layers gathered (the current one and the prefetched
    # next) and no gradient yet; its MLP's moment, or its attention's with the CP workspace
    comm_fwd = _comm_in_forward(d, r)
    forward = {
        "MLP": {"gradients": earlier_grads, "activations": acts.fwd_mlp, "attention masks": masks,
                "communication buffers": comm_fwd},
        "attention": {"gradients": earlier_grads, "activations": acts.fwd_attn, "attention masks": masks,
                      "attention workspace": attn, "communication buffers": comm_fwd},
        "final norm": {"gradients": earlier_grads, "activations": acts.fwd_final, "attention masks": masks,
                       "communication buffers": comm_fwd},
    }  # fmt: skip
    if acts.fwd_index:  # an indexed layer's key selection, before its kernel: the gathered state, no score blocks
        forward["indexer"] = {"gradients": earlier_grads, "activations": acts.fwd_index, "attention masks": masks,
                              "attention workspace": attn_state, "communication buffers": comm_fwd}  # fmt: skip
    # backward through a layer (with checkpointing: the recomputed one; without: the last, the first reached): its
    # MLP's backward, without the CP workspace (backward reaches the attention after the MLP), or its attention's
    # with the workspace and the kernel's backward buffers; the gradients written so far (_grads_in_backward)
    kept_input = r.local_tokens * d.hidden * r.compute_bytes / r.stream_split
    per_input = (0.0 if r.activation_offloaded else kept_input / r.group) if r.activation_checkpointing else float("inf")
    grads_bwd = max(earlier_grads, _grads_in_backward(d, r, per_input))
    backward = {
        "MLP": {"gradients": grads_bwd, "activations": acts.bwd_mlp, "attention masks": masks,
                "communication buffers": comm},
        "attention": {"gradients": grads_bwd, "activations": acts.bwd_attn, "attention masks": masks,
                      "attention workspace": attn_bwd, "attention kernel": kernel, "communication buffers": comm},
        # a layer's norm's backward (its MLP's tensors freed; _layer_norm_moment): its gradients, no CP workspace
        "norm": {"gradients": grads_bwd, "activations": acts.bwd_norm, "attention masks": masks,
                 "communication buffers": comm},
        # the final norm's backward: the LM head's gradient written, no layer's yet (_final_norm_moments)
        "final norm": {"gradients": max(earlier_grads, _head_grads(d, r)), "activations": acts.bwd_final,
                       "attention masks": masks, "communication buffers": comm},
    }  # fmt: skip
    if acts.bwd_residual:  # a layer of several streams: its residual structure's backward, before its MLP's
        backward["residual streams"] = {"gradients": grads_bwd, "activations": acts.bwd_residual,
                                        "attention masks": masks, "communication buffers": comm}  # fmt: skip
    if acts.bwd_index:  # the recomputed indexed layer's key selection
        backward["indexer"] = {"gradients": grads_bwd, "activations": acts.bwd_index, "attention masks": masks,
                               "attention workspace": attn_state, "communication buffers": comm}  # fmt: skip
    bwd_name = "recompute" if r.activation_checkpointing else "backward"
    by_moment = {"forward": forward, bwd_name: backward}
    moments = {phase: max(alts, key=lambda m: sum(alts[m].values())) for phase, alts in by_moment.items()}
    act_peak = max(acts.saved, acts.fwd_mlp, acts.fwd_attn, acts.bwd_mlp, acts.bwd_attn, acts.fwd_final, acts.bwd_final,
                   acts.bwd_norm, acts.fwd_index, acts.bwd_index, acts.bwd_residual)
    terms = {
        "gradients": MemoryTerm("gradients", grads, grads_note),
        "activations": MemoryTerm("activations", act_peak, acts.note),
        "attention masks": MemoryTerm("attention masks", masks, masks_note),
        "attention workspace": MemoryTerm("attention workspace", max(attn, attn_bwd), attn_note),
        "logits and loss": MemoryTerm("logits and loss", loss, loss_note),
        "communication buffers": MemoryTerm("communication buffers", comm, comm_note),
        "optimizer temporaries": MemoryTerm("optimizer temporaries", opt_temp,
                                            "the step runs on the host" if host_step else "one gradient-sized temporary"),
    }  # fmt: skip
    terms["attention kernel"] = MemoryTerm("attention kernel", kernel, kernel_note)
    # at the loss the layers' attention is done and FSDP2 holds only what stays gathered (_comm_at_loss); at the
    # optimizer step FSDP2 has freed its buffers (the replicated model's flat all-reduce buffer stays)
    phases = {
        "forward": forward[moments["forward"]],
        "loss": {
            "gradients": earlier_grads,
            "activations": acts.saved,
            "attention masks": masks,
            "logits and loss": loss,
            "communication buffers": _comm_at_loss(d, r),
        },
        bwd_name: backward[moments[bwd_name]],
        "optimizer": {"gradients": grads if r.offload != "all" else 0.0,
                      "communication buffers": 0.0 if r.fsdp_enabled else comm, "optimizer temporaries": opt_temp},
    }  # fmt: skip
    return MemoryPlan(persistent, terms, phases, host_bytes(d, r), moments, by_moment)


def _grads_in_backward(d: ModelDims, r: RunShape, per_input: float) -> float:
    """The gradients on the device while backward runs through the layers (bytes per rank).

    Backward reaches the layers after the LM head (and final norm): its gradient is there from the first layer
    on; each layer adds its own (FSDP2: its shard, reduce-scattered as the layer ends); the input embedding's
    comes last, after every layer's activations are freed. While layer ``l`` (counted from the last) runs, the
    head's and ``l + 1`` layers' gradients exist and ``l`` layer inputs (``per_input`` bytes each, the kept
    inputs the activations count) are freed: the peak is at the first layer when an input outweighs a layer's
    gradient, else at the last: ``head + layer + max(0, (L - 1) (layer - per_input))``.
    """
    if r.offload == "all":  # the shards go to the host as each reduce-scatter ends; the head's is in grads
        return _gradient_bytes(d, r)[0]
    layer = d.layer_params - d.tp_layer_params + d.tp_layer_params / r.tp
    head_b, layer_b = _head_grads(d, r), layer * _grad_scale(d, r)
    return head_b + layer_b + max(0.0, (d.layers - 1) * (layer_b - per_input))


def _grad_scale(d: ModelDims, r: RunShape) -> float:
    """Gradient bytes per parameter of one rank: its FSDP2 shard, the trainable share (LoRA: only the adapters)."""
    return d.local_trainable(r.tp) / max(d.local_params(r.tp), 1) * r.master_bytes / r.fsdp


def _head_grads(d: ModelDims, r: RunShape) -> float:
    """The gradients backward has written before it reaches the decoder layers (bytes per rank): the LM head's and
    the final norm's (the input embedding's comes last); with ``fsdp.offload=all`` the head's unsharded gradient."""
    if r.offload == "all":
        return _gradient_bytes(d, r)[0]
    head = (d.root_params - d.tp_root_params + d.tp_root_params / r.tp) - d.lookup_params / (r.tp if d.tp_root_params else 1)
    return max(head, 0) * _grad_scale(d, r)


def _comm_in_forward(d: ModelDims, r: RunShape) -> float:
    """FSDP2's buffers while a decoder layer's forward runs: the root module gathered, the current layer gathered
    and the next one's all-gather output (the prefetch; every layer with ``fsdp.reshard_after_forward=false``);
    no gradient yet. ``fsdp.offload=all`` adds the layer's shard copied from the host."""
    if not r.fsdp_enabled or (r.fsdp == 1 and r.compute_bytes == r.master_bytes and r.offload != "all"):
        return 0.0
    root = d.root_params - d.tp_root_params + d.tp_root_params / r.tp
    layer = d.layer_params - d.tp_layer_params + d.tp_layer_params / r.tp
    gathered = 2 if r.reshard_after_forward else d.layers
    extra = layer / r.fsdp * r.master_bytes if r.offload == "all" else 0.0
    return root * r.compute_bytes + gathered * layer * r.compute_bytes + extra


def _comm_at_loss(d: ModelDims, r: RunShape) -> float:
    """FSDP2's buffers live at the loss: the root module stays gathered from forward to backward; the decoder
    layers are resharded after their forward (all of them stay gathered with ``fsdp.reshard_after_forward=false``);
    no gradient waits for its reduce-scatter yet."""
    if not r.fsdp_enabled or (r.fsdp == 1 and r.compute_bytes == r.master_bytes and r.offload != "all"):
        return 0.0
    root = d.root_params - d.tp_root_params + d.tp_root_params / r.tp
    layer = d.layer_params - d.tp_layer_params + d.tp_layer_params / r.tp
    return root * r.compute_bytes + (0 if r.reshard_after_forward else d.layers * layer * r.compute_bytes)


def kernel_call(d: ModelDims, r: RunShape):  # noqa: ANN201 - an attention_kernels.KernelCall
    """One attention kernel call of one rank (:class:`automodel.distributed.cp.attention_kernels.KernelCall`): the
    CP method's :meth:`~automodel.distributed.cp.CPMethod.kernel_call_tokens` (no CP: all heads over the row)."""
    from automodel.distributed.cp.attention_kernels import KernelCall

    if r.cp > 1:
        heads, kv_heads, q, k = r.method.kernel_call_tokens(d, r)
    else:  # model.attention_head_chunks=G: one call per head group
        g = max(1, r.head_chunks)
        heads, kv_heads, q, k = d.heads // r.tp // g, max(1, d.kv_heads // r.tp // g), r.seq, r.seq
    return KernelCall(batch=r.local_batch, q_tokens=q, k_tokens=k, heads=max(heads, 1), kv_heads=kv_heads,
                      head_dim=-(-d.head_dim // 8) * 8, dtype_bytes=r.compute_bytes,
                      native_gqa=r.kernel_path == "sdpa")  # fmt: skip


def _kernel_term(d: ModelDims, r: RunShape) -> tuple[float, str]:
    """What the planned attention kernel's backward allocates for one layer's call, beyond its gradients (the CPU
    kernels, which the activations are calibrated on: nothing): :func:`~automodel.distributed.cp.attention_kernels.kernel_buffers`."""
    from automodel.distributed.cp.attention_kernels import CPU_KERNEL, kernel_buffers, kernel_label

    if r.attention_kernel == CPU_KERNEL or not d.heads:
        return 0.0, f"{kernel_label(r.attention_kernel)}: calibrated in the activations"
    call = kernel_call(d, r)
    bufs = kernel_buffers(r.attention_kernel, call)
    total = sum(b.bytes for b in bufs)
    parts = ", ".join(f"{b.name} {_fmt(b.bytes)}" for b in bufs) or "none beyond its gradients"
    return total, (f"{kernel_label(r.attention_kernel)} backward, one call of [{call.batch}, {call.heads} heads "
                   f"({call.kv_heads} KV), {call.q_tokens} x {call.k_tokens} tokens]: {parts}")  # fmt: skip


def _fmt(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def _heads_split_ok(d: ModelDims, r: RunShape, cp: int, tp: int) -> bool:
    """A head-splitting method (Ulysses) divides each TP rank's ``heads / tp`` heads again over ``cp``."""
    return _method(r).head_split_problem(d.heads, cp, tp) is None


def _tp_sizes_ok(d: ModelDims, r: RunShape, tp: int) -> bool:
    """Whether ``tp`` divides what the TP plan splits, the row (``cp tp`` ulysses, else ``2 cp tp``) and,
    under Ulysses, leaves each TP rank a head count that ``cp`` divides."""
    split = _method(r).chunks_per_rank * r.cp * tp
    sizes = (d.heads, d.kv_heads, d.intermediate, d.vocab)
    return (
        d.tp_capable and all(x % tp == 0 for x in sizes) and r.seq % split == 0 and _heads_split_ok(d, r, r.cp, tp)
    )


def packed_blocks_apply(r: RunShape) -> bool:
    """Whether ``model.cudnn_packed_blocks`` changes ``r``'s plan: it is on, the planned kernel is cuDNN, the method has
    block sets (thd, thd_docs, usp) and the torch the plan runs under runs cuDNN's packed-row call at all
    (``aten_schemas.cudnn_varlen_problem``; ``block_sets.packed_call_bytes`` then counts the calls' copies)."""
    if not r.cudnn_packed_blocks or r.cp <= 1 or r.attention_kernel != "sdpa_cudnn":
        return False
    import torch

    return r.cp_method in ("thd", "thd_docs", "usp") and _release_runs_cudnn_packed_calls(torch.__version__)


@functools.cache
def _release_runs_cudnn_packed_calls(version: str) -> bool:
    """Whether torch ``version`` runs cuDNN's packed-row call at all (``aten_schemas.cudnn_varlen_problem``): once per
    release, not once per plan the search evaluates."""
    from automodel.distributed.cp import aten_schemas

    release = aten_schemas.torch_release(version)
    return aten_schemas.cudnn_varlen_problem(release, aten_schemas.CUDNN_VARLEN_SHORT_MIN_CUDNN, causal=False,
                                             max_q=None) is None  # fmt: skip


def _local_changes(r: RunShape, chunkable: bool = True) -> list[tuple[str, dict, str]]:
    """Changes on the same ranks and sizes, cheapest first: (config overrides, RunShape fields, price).
    ``chunkable``: the model's loss can be chunked (no final transform the chunked loss refuses)."""
    chunk = {"chunk_tokens": DEFAULT_CHUNK_TOKENS}
    ac = {"activation_checkpointing": True}
    out = []
    if packed_blocks_apply(r):
        out.append(("model.cudnn_packed_blocks=false", {"cudnn_packed_blocks": False},
                    "one cuDNN call per block for the block sets, not packed-row calls: more kernel launches"))
    if r.tp > 1 and not r.loss_parallel:
        out.append(("distributed.enable_loss_parallel=true", {"loss_parallel": True},
                    "none: the loss runs on each rank's vocabulary shard"))  # fmt: skip
    chunk_open = chunkable and r.chunk_tokens is None and r.tp == 1  # not with TP (config rules)
    if chunk_open:
        out.append((f"loss.chunk_tokens={DEFAULT_CHUNK_TOKENS}", chunk, "one more LM-head matmul per token"))
    if not r.activation_checkpointing:
        out.append(("model.activation_checkpointing=true", ac, "one more forward of every layer (~+30% time)"))
    if chunk_open and not r.activation_checkpointing:
        out.append((f"loss.chunk_tokens={DEFAULT_CHUNK_TOKENS} model.activation_checkpointing=true", chunk | ac,
                    "both recomputations"))  # fmt: skip
    return out


def _changes(d: ModelDims, r: RunShape, world: int) -> list[tuple[str, RunShape, str]]:
    """Candidate changes, cheapest first: (config overrides, new shape, its price).

    The local changes, then for each factor 2, 4, ...: ``cp_size x factor`` and (a model with a TP
    plan; tp up to 8) ``tp_size x factor`` with loss parallel and the plain loss, each alone and with
    the local changes still open for it.
    """
    chunkable = not d.logit_transform
    out = [(keys, dataclasses.replace(r, **kw), price) for keys, kw, price in _local_changes(r, chunkable)]
    factor = 2
    while r.cp * factor <= 64 or r.tp * factor <= 8:
        for dim in ("cp", "tp"):
            size = getattr(r, dim) * factor
            if dim == "cp" and (size > 64 or r.seq % (2 * size * r.tp) != 0 or not _heads_split_ok(d, r, size, r.tp)):
                continue
            if dim == "tp" and (size > 8 or not _tp_sizes_ok(d, r, size)):
                continue
            kw: dict = {dim: size}
            keys, price = f"distributed.{dim}_size={size}", ""
            if dim == "tp":  # TP needs the plain loss; loss parallel keeps the logits sharded
                kw |= {"chunk_tokens": None, "loss_parallel": True}
                keys += " distributed.enable_loss_parallel=true" + (" loss.chunk_tokens=null" if r.chunk_tokens else "")
                price = "; two all-reduces of [tokens, hidden] per layer (keep tp within a node)"
            if r.dp_shard % factor == 0:
                price = f"same {world} ranks: dp_shard {r.dp_shard} -> {r.dp_shard // factor}, grad_acc x{factor}" + price
                kw |= {"dp_shard": r.dp_shard // factor, "grad_acc": r.grad_acc * factor}
            else:
                price = f"{world * factor} ranks instead of {world}" + price
            shape = dataclasses.replace(r, **kw)
            out.append((keys, shape, price))
            for more, kw2, more_price in _local_changes(shape, chunkable):
                out.append((f"{keys} {more}", dataclasses.replace(shape, **kw2), f"{price}; {more_price}"))
        factor *= 2
    return out


def suggest_changes(
    d: ModelDims, r: RunShape, budget_bytes: float, world: int, source: str = "recipe.memory_budget_gib"
) -> list[str]:
    """Lines saying whether ``r`` fits ``budget_bytes`` per rank and, if not, the cheapest change that does.

    Changes are tried cheapest first: loss parallel (under TP), the chunked loss (without TP: the two do
    not compose), activation checkpointing, both, then doubling ``cp_size`` and (for a model with a TP
    plan, up to 8, where the heads, MLP and vocabulary divide) ``tp_size`` with loss parallel, on the same
    ranks when ``dp_shard`` allows, else on more ranks, alone and with the cheaper changes. ``source``: where the
    budget comes from (words in the first line).
    """
    plan = plan_memory(d, r)
    head = f"budget {_fmt(budget_bytes)} per rank ({source}): predicted {_fmt(plan.total_bytes)}"
    if plan.total_bytes <= budget_bytes:
        return [head + " -> fits"]
    lines = [head + f" -> does NOT fit (over by {_fmt(plan.total_bytes - budget_bytes)})"]
    changes = _changes(d, r, world)
    for keys, shape, price in changes:
        p = plan_memory(d, shape)
        if p.total_bytes <= budget_bytes:
            lines.append(f"cheapest change that fits: {keys} -> {_fmt(p.total_bytes)} per rank ({price})")
            break
    else:
        tried = "chunked loss, activation checkpointing, cp_size up to 64" + (
            ", tp_size up to 8" if any("tp_size" in keys for keys, _, _ in changes) else ""
        )
        lines.append(
            f"no change tried fits ({tried}): the persistent "
            f"state alone is {_fmt(plan.persistent_bytes)}; shard it over more ranks (dp_shard) or shorten data.seq_len"
        )
    return lines


def tp_lines(d: ModelDims, r: RunShape) -> list[str]:
    """What tensor parallelism does to this rank's memory: its parameters, and the logits with and without
    loss parallel (the figure ``distributed.enable_loss_parallel`` saves)."""
    whole = d.params * r.master_bytes / r.fsdp
    mine = d.local_params(r.tp) * r.master_bytes / r.fsdp
    with_lp, without = _plain_logits(d, r, True), _plain_logits(d, r, False)
    current = "on" if r.loss_parallel else "off"
    n = r.local_tokens
    return [
        f"tensor parallel tp {r.tp}: parameters {_fmt(mine)} per rank instead of {_fmt(whole)} at tp 1 "
        f"({d.tp_params / 1e6:.1f}M of {d.params / 1e6:.1f}M are TP-sharded; norms stay whole), then FSDP2 /{r.fsdp}",
        f"tensor parallel logits and loss: {_fmt(with_lp)} with loss parallel ([{n}, {d.vocab // r.tp}] per rank) vs "
        f"{_fmt(without)} without ([{n}, {d.vocab}] gathered); distributed.enable_loss_parallel is {current}",
    ]


#: the dry run's words for a phase's moment (:attr:`MemoryPlan.moments`)
_MOMENT_WORDS = {"MLP": "a layer's MLP", "attention": "a layer's attention", "norm": "a layer's norm's backward",
                 "final norm": "the final norm"}  # fmt: skip


def memory_plan_lines(
    d: ModelDims, r: RunShape, *, budget_gib: float | None = None, world: int = 1,
    budget_source: str = "recipe.memory_budget_gib",
) -> list[str]:
    """The dry run's memory section: persistent state, step terms by phase, peak, dominant term, and with
    ``budget_gib`` whether it fits (:func:`suggest_changes`; ``budget_source`` says where the budget comes from)."""
    plan = plan_memory(d, r)
    out = ["--- predicted memory per rank (automodel.training.memory_plan; CPU-calibrated) ---"]
    out.append(
        f"local tokens per micro-batch {r.local_tokens} (= {r.local_batch} x {r.seq} / cp {r.cp}"
        + (f"; the same on each of the tp {r.tp} ranks" if r.tp > 1 else "")
        + f"); compute {r.compute_bytes} B, master {r.master_bytes} B"
    )
    from automodel.distributed.cp.attention_kernels import kernel_label

    out.append(f"attention kernel planned for: {kernel_label(r.attention_kernel)} ({r.attention_kernel_rule or 'the default'})")
    out.append(f"persistent between steps: {_fmt(plan.persistent_bytes)}")
    for t in plan.persistent:
        out.append(f"  {t.name:<24}{_fmt(t.bytes):>12}  {t.note}")
    if r.tp > 1:
        out.extend(tp_lines(d, r))
    out.append("step terms:")
    for name in TERMS:
        t = plan.terms[name]
        out.append(f"  {name:<24}{_fmt(t.bytes):>12}  {t.note}")
    for phase, parts in plan.phases.items():
        mark = "  <- step peak" if phase == plan.peak_phase else ""
        at = f" (at {_MOMENT_WORDS.get(plan.moments[phase], plan.moments[phase])})" if phase in plan.moments else ""
        out.append(f"  phase {phase:<18}{_fmt(sum(parts.values())):>12}{mark}{at}")
    out.append(
        f"step peak {_fmt(plan.step_peak_bytes)} above the persistent state; total {_fmt(plan.total_bytes)} per "
        f"rank; dominant term: {plan.dominant}"
    )
    if budget_gib is not None:
        out.extend(suggest_changes(d, r, budget_gib * _GIB, world, budget_source))
    return out


def loss_auto_choice(d: ModelDims, r: RunShape) -> tuple[int | None, str]:
    """``loss.chunk_tokens: auto`` for the run of shape ``r``: ``(chunk_tokens or None, the reason, one line)``.

    On (:data:`DEFAULT_CHUNK_TOKENS` tokens per chunk) when the plain loss's ``logits and loss`` term is more than
    :data:`AUTO_LOSS_SHARE` of the step peak that the planner predicts with it, else off. Off under tensor
    parallelism: the chunked loss does not compose with it (``distributed.enable_loss_parallel`` shards the
    logits instead). Pure.
    """
    if r.tp > 1:
        return None, (f"loss.chunk_tokens auto: off (tp_size {r.tp}: the chunked loss does not compose with tensor "
                      "parallelism; distributed.enable_loss_parallel shards the logits instead)")  # fmt: skip
    if d.logit_transform:
        return None, (f"loss.chunk_tokens auto: off (the plain loss): the model's logits are a final transform of its "
                      f"LM head's output that the chunked loss does not compute ({d.logit_transform})")  # fmt: skip
    plain = plan_memory(d, dataclasses.replace(r, chunk_tokens=None))
    loss, peak = plain.terms["logits and loss"].bytes, plain.step_peak_bytes
    share = loss / peak if peak > 0 else 0.0
    what = (f"the plain logits and loss ({_fmt(loss)}) are {share:.0%} of the predicted step peak ({_fmt(peak)}; "
            f"threshold {AUTO_LOSS_SHARE:.0%})")  # fmt: skip
    if share > AUTO_LOSS_SHARE:
        return DEFAULT_CHUNK_TOKENS, f"loss.chunk_tokens auto: on, {DEFAULT_CHUNK_TOKENS} tokens per chunk: {what}"
    return None, f"loss.chunk_tokens auto: off (the plain loss): {what}"


def resolve_chunk_tokens(cfg, dims: ModelDims, sizes: dict[str, int], seq: int, grad_acc: int) -> tuple[int | None, str | None]:  # noqa: ANN001
    """``cfg.loss.chunk_tokens`` with ``auto`` resolved by :func:`loss_auto_choice`: ``(value, reason or None)``.

    ``None`` reason: the config names the value (an int, or null). Nothing is mutated."""
    value = cfg.loss.chunk_tokens
    if value != "auto":
        return value, None
    return loss_auto_choice(dims, run_shape_from_config(cfg, sizes, seq, grad_acc, dims=dims))


#: ``ulysses_head_chunks: auto`` takes more head groups only while they lower the planned peak by more than this
#: share of it (each group costs latency, and the backward recomputes the attention forward)
HEAD_CHUNKS_GAIN = 0.01


def head_chunk_options(d: ModelDims, r: RunShape) -> list[int]:
    """The ``distributed.ulysses_head_chunks`` values the run's method and model allow (``[1]``: none but 1); at cp 1
    (tp 1) the ``model.attention_head_chunks`` values: the divisors of the KV heads."""
    from automodel.distributed.cp.head_chunks import head_chunk_choices

    if r.cp <= 1:
        return head_chunk_choices(d.kv_heads, 1) if d.heads and r.tp == 1 else [1]
    ranks = r.method.head_chunk_ranks(r.cp)
    if not ranks or not d.heads:
        return [1]
    return head_chunk_choices(max(1, d.kv_heads // r.tp), ranks)


def head_chunks_auto_choice(d: ModelDims, r: RunShape) -> tuple[int, str]:
    """``ulysses_head_chunks: auto``: the fewest head groups whose planned per-rank total is within
    :data:`HEAD_CHUNKS_GAIN` of the lowest over every allowed count (:func:`head_chunk_options`), and why."""
    options = head_chunk_options(d, r)
    key = "distributed.ulysses_head_chunks" if r.cp > 1 else "model.attention_head_chunks"
    if options == [1]:
        return 1, f"{key}=auto: 1 (the method or the model allows no other head groups)"
    totals = {g: plan_memory(d, dataclasses.replace(r, head_chunks=g)).total_bytes for g in options}
    best = min(totals.values())
    pick = min(g for g, t in totals.items() if t <= best * (1 + HEAD_CHUNKS_GAIN))
    shown = ", ".join(f"{g}: {_fmt(t)}" for g, t in totals.items())
    return pick, (
        f"{key}=auto: {pick} (planned per-rank totals by head groups {shown}; the fewest "
        f"groups within {HEAD_CHUNKS_GAIN:.0%} of the lowest)"
    )


def resolve_head_chunks(cfg, dims: ModelDims, sizes: dict[str, int], seq: int, grad_acc: int) -> tuple[int, str | None]:  # noqa: ANN001
    """``cfg.distributed.ulysses_head_chunks`` with ``auto`` resolved by :func:`head_chunks_auto_choice`:
    ``(value, reason or None)``. ``cfg`` is not mutated."""
    value = cfg.distributed.ulysses_head_chunks
    if value != "auto":
        return value, None
    r = run_shape_from_config(cfg, sizes, seq, grad_acc, dims=dims)
    if cfg.distributed.cp_size <= 1 or cfg.distributed.cp_method == "auto":
        return 1, "distributed.ulysses_head_chunks=auto: 1 (no head-splitting CP method)"
    return head_chunks_auto_choice(dims, r)


def resolve_attention_head_chunks(cfg, dims: ModelDims, sizes: dict[str, int], seq: int, grad_acc: int) -> tuple[int | None, str | None]:  # noqa: ANN001
    """``cfg.model.attention_head_chunks`` (cp_size 1) with ``auto`` resolved by :func:`head_chunks_auto_choice`:
    ``(value, reason or None)``. ``cfg`` is not mutated."""
    value = cfg.model.attention_head_chunks
    if value != "auto":
        return value, None
    r = run_shape_from_config(cfg, sizes, seq, grad_acc, dims=dims)
    return head_chunks_auto_choice(dims, r)


def checkpoint_group_auto_choice(d: ModelDims, r: RunShape, host_limit_bytes: float) -> tuple[int, str]:
    """``model.checkpoint_group_layers: auto``: the fewest layers per checkpoint group whose planned host memory per
    rank fits ``host_limit_bytes`` (1 when it fits without groups, or nothing is kept on the host), and why."""
    if not r.activation_checkpointing:
        return 1, "model.checkpoint_group_layers=auto: 1 (no activation checkpointing)"
    host = {1: plan_memory(d, dataclasses.replace(r, checkpoint_group=1)).host_bytes}
    limit = _fmt(host_limit_bytes)
    if host[1] <= host_limit_bytes or not r.activation_offloaded:
        return 1, (f"model.checkpoint_group_layers=auto: 1 (planned host memory per rank {_fmt(host[1])} within "
                   f"{limit})")  # fmt: skip
    for k in range(2, max(d.layers, 2) + 1):
        host[k] = plan_memory(d, dataclasses.replace(r, checkpoint_group=k)).host_bytes
        if host[k] <= host_limit_bytes:
            return k, (f"model.checkpoint_group_layers=auto: {k} (planned host memory per rank {_fmt(host[1])} "
                       f"without groups, {_fmt(host[k])} with groups of {k}: the fewest layers per group within {limit})")  # fmt: skip
    k = max(host, key=lambda g: -host[g])
    return k, (f"model.checkpoint_group_layers=auto: {k} (no group size brings the planned host memory per rank within "
               f"{limit}; {_fmt(host[k])} with groups of {k})")  # fmt: skip


def resolve_checkpoint_group(cfg, dims: ModelDims, sizes: dict[str, int], seq: int, grad_acc: int,  # noqa: ANN001
                             host_limit_bytes: float) -> tuple[int, str | None]:  # fmt: skip
    """``cfg.model.checkpoint_group_layers`` with ``auto`` resolved by :func:`checkpoint_group_auto_choice` for a
    host limit per rank: ``(value, reason or None)``. ``cfg`` is not mutated."""
    value = cfg.model.checkpoint_group_layers
    if value != "auto":
        return value, None
    return checkpoint_group_auto_choice(dims, run_shape_from_config(cfg, sizes, seq, grad_acc, dims=dims), host_limit_bytes)


def run_shape_from_config(cfg, sizes: dict[str, int], seq: int, grad_acc: int, dims: ModelDims | None = None) -> RunShape:  # noqa: ANN001
    """The :class:`RunShape` of a validated :class:`~automodel.config.schema.RecipeConfig`.

    ``sizes``: the resolved parallel sizes (``parallel_sizes``); ``seq``: the padded row length.
    ``fsdp.param_dtype=auto`` is planned as bfloat16 (CUDA), like the rest of the dry run.
    ``loss.chunk_tokens: auto`` is resolved by :func:`loss_auto_choice` on ``dims`` (the plain loss when
    ``dims`` is not given: the run and the dry run resolve it into the config first).
    """
    from automodel.config.cp_auto import packed_rows

    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}
    compute = "bfloat16" if cfg.fsdp.param_dtype == "auto" else cfg.fsdp.param_dtype
    shape = RunShape(
        local_batch=cfg.step_scheduler.local_batch_size,
        seq=seq,
        cp=sizes["cp"],
        tp=sizes["tp"],
        dp_shard=sizes["dp_shard"],
        cp_method=cfg.distributed.cp_method,
        attn=cfg.model.attn_implementation or "sdpa",
        activation_checkpointing=cfg.model.activation_checkpointing,
        chunk_tokens=None if cfg.loss.chunk_tokens == "auto" else cfg.loss.chunk_tokens,
        master_bytes=nbytes[cfg.model.dtype],
        compute_bytes=nbytes[compute] if cfg.fsdp.enabled else nbytes[cfg.model.dtype],
        reduce_bytes=nbytes[cfg.fsdp.reduce_dtype],
        grad_acc=grad_acc,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        loss_parallel=cfg.distributed.enable_loss_parallel,
        sequence_parallel=cfg.distributed.sequence_parallel,
        fsdp_enabled=cfg.fsdp.enabled,
        tiled_mlp=cfg.model.tiled_mlp,
        tiled_layer=cfg.model.tiled_layer,
        activation_offload=cfg.model.activation_offload,
        checkpoint_group=cfg.model.checkpoint_group_layers if cfg.model.checkpoint_group_layers != "auto" else 1,
        offload=cfg.fsdp.offload,
        cp_options=_cp_options(cfg),
        head_chunks=_head_chunks(cfg),
        packed=packed_rows(cfg),
        cudnn_packed_blocks=cfg.model.cudnn_packed_blocks,
    )
    kernel, rule = planned_kernel(cfg.model.attention_backend, cfg.recipe.gpu_type, shape, dims)
    shape = dataclasses.replace(shape, attention_kernel=kernel, attention_kernel_rule=rule)
    if cfg.loss.chunk_tokens == "auto" and dims is not None:
        shape = dataclasses.replace(shape, chunk_tokens=loss_auto_choice(dims, shape)[0])
    return shape


def planned_kernel(backend: str, gpu_type: str | None, r: RunShape, dims: ModelDims | None = None) -> tuple[str, str]:
    """``(kernel, why)``: the attention kernel the plan counts for ``model.attention_backend=backend`` on
    ``gpu_type`` (``None``: an H100-class GPU, compute capability 9.0, as the dry run plans bf16 for CUDA).

    A pinned kernel is what runs; ``auto`` follows
    :func:`automodel.distributed.cp.attention_kernels.auto_kernel` with the GPU's compute capability
    (:data:`automodel.config.gpu_specs.GPU_SPECS`), the installed CUDA torch's cuDNN (on a CPU-only torch the
    reference wheel's, :data:`~automodel.distributed.cp.block_backend.REFERENCE_CUDNN_VERSION`: 9.19, so cuDNN on
    H100 / H200 / B200, its K/V and dK/dV grouped) and the path the run's attention takes (``r.kernel_path``).
    """
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.distributed.cp import AUTO
    from automodel.distributed.cp.attention_kernels import AUTO_BACKEND, KERNEL_OF_BACKEND, auto_kernel

    if backend != AUTO_BACKEND:
        return KERNEL_OF_BACKEND[backend], f"pinned by model.attention_backend={backend}"
    spec = GPU_SPECS.get((gpu_type or "h100").lower())
    capability = spec.capability if spec is not None else (9, 0)
    import torch

    from automodel.distributed.cp.block_backend import REFERENCE_CUDNN_VERSION

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None  # a CUDA build's
    assumed = ""
    if cudnn is None:  # a CPU-only torch: the reference CUDA wheel's cuDNN
        cudnn = REFERENCE_CUDNN_VERSION
        assumed = "; a CPU-only torch here: the reference cuDNN 9.19 (torch 2.11's CUDA wheel) assumed"
    path = "sdpa" if r.cp == 1 or r.cp_method == AUTO else r.kernel_path
    head_dim = dims.head_dim if dims is not None and dims.head_dim else 128
    kernel, why = auto_kernel(path, capability, cudnn, half=r.compute_bytes == 2, head_dim=head_dim)
    where = f"{gpu_type}" if spec is not None and gpu_type else "an H100-class GPU (recipe.gpu_type not set)"
    return kernel, f"auto on {where}: {why}{assumed}"


def _head_chunks(cfg) -> int:  # noqa: ANN001
    """``distributed.ulysses_head_chunks`` for the plan: the integer, 1 for a method that takes none; at cp_size 1
    ``model.attention_head_chunks`` (``auto`` not resolved yet: 1; :func:`resolve_head_chunks` and
    :func:`resolve_attention_head_chunks` resolve them)."""
    from automodel.distributed.cp import AUTO, get_cp_method

    chunks, d = cfg.distributed.ulysses_head_chunks, cfg.distributed
    if d.cp_size <= 1:
        own = cfg.model.attention_head_chunks
        return own if isinstance(own, int) and own > 1 else 1
    if not isinstance(chunks, int) or chunks <= 1 or d.cp_size <= 1 or d.cp_method == AUTO:
        return 1
    return chunks if get_cp_method(d.cp_method).head_chunk_ranks(d.cp_size) else 1


def _cp_options(cfg) -> tuple[tuple[str, Any], ...]:  # noqa: ANN001
    """The configured CP method's bound options (usp: ``ulysses_size``), as :attr:`RunShape.cp_options`."""
    from automodel.distributed.cp import AUTO, get_cp_method

    if cfg.distributed.cp_method == AUTO:  # not resolved yet: the method's options are not known
        return ()
    return tuple(get_cp_method(cfg.distributed.cp_method).configured(cfg).options().items())
