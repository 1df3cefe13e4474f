"""The memory planner's terms of layer kinds beyond a Llama-style layer: masks, ALiBi's score blocks, gathered state.

:mod:`automodel.training.memory_plan` counts a decoder layer as a Llama-style block. Three kinds of tensors come
on top where the model's layers or the CP method's path build them; each function here returns bytes per rank
for a ``ModelDims`` ``d`` and a ``RunShape`` ``r`` (typed ``Any``: this module sits below the planner, which
imports it), counted where the tensor is really built, measured by ``scripts/bench_plan_cases.py``:

* :func:`mask_bytes`: the attention masks a step keeps from its forward to the end of its backward (the
  decoder layers are handed them; activation checkpointing keeps them for the recomputation):

  - transformers' own ``[B, 1, q, k]`` mask (``masking_utils``), where the method's path lets the model build one
    (:meth:`~automodel.distributed.cp.CPMethod.mask_scope`: no CP, or ring, from the rank's ``q = k = n`` tokens;
    Ulysses: its global ``[B, 1, S, S]`` mask per layer kind for the inner kernel; the methods whose attention
    function is not a mask implementation, thd, thd_docs and usp, none; a model of ALiBi layers keeps its own
    attention implementation under every method, so its mask is built from the rank's tokens everywhere). Under ``sdpa`` one boolean mask per
    sliding-window or chunked kind whose window is shorter than the keys (``_ignore_causal_mask_sdpa`` never skips
    those), none for full causal layers (SDPA's ``is_causal``); under ``eager`` one mask per kind in the compute
    dtype (``eager_mask``; GPT-Neo one for both of its kinds, and under Ulysses the method's whole-row mask per kind
    besides, cached for the step); none under flash attention, and FlexAttention's block mask is not counted (``(S/128)^2``). A model that always builds its mask (``ModelDims.forced_mask_heads``: DeepSeek
    sparse attention's ``allow_is_causal_skip=False``; Falcon with ALiBi, whose bias is folded into a
    ``[B, heads, q, k]`` mask in the compute dtype) builds it on those paths whatever the kernel.
  - the halo kernel's per-block key masks (``TokenLayout.halo_plan``, cached for the step, one plan per window):
    each block of 256 queries against the keys it may see, ``n (block + W)`` bytes for a window ``W``; a full
    prefix (ALiBi) ``n (S + block) / 2`` (the blocks' last queries sit on average half-way along the row).
* :func:`sdpa_mask_copy`: without CP, the float copy of a boolean mask SDPA makes per call and keeps per layer.
* :func:`position_bias_bytes`: without CP, a learned relative-position bias ``[B, heads, S, S]`` per layer (Inkling).
* :func:`dynamic_mask_bytes`: without CP, a dynamic mask ``[B, heads, S, S]`` per layer that needs its gradient (Doge).
* :func:`indexer_bytes`: a chunked indexer's selection of keys (Kolibri-1.1): ``[B, q, k]`` booleans and int32
  copies, fp32 score chunks.
* :func:`alibi_workspace`: one ALiBi layer on the halo kernel (:mod:`~automodel.distributed.cp.layers.alibi`, ring,
  thd, thd_docs, usp): its last query block scores every key of the row in exact math, ``[B, Hq, block, S]`` fp32
  three times (scores plus bias, the masked copy, the softmax), the block's K and V repeated to the query heads
  (``2 B Hq S D``), the rank's keys and values with the halo (``2 B Hkv S D``) and the rows exchanged
  (``B S (2 Hkv D + Hq)``), compute dtype; a transient at the layer's attention, forward and recomputation alike.
  Under Ulysses an ALiBi layer hands SDPA its bias as a float ``[B, Hl, S, S]`` mask, which SDPA saves:
  :func:`alibi_saved_per_layer`.
* :func:`gathered_workspace`: a gathered-state kernel's layer (DeepSeek sparse attention), from its
  :class:`~automodel.distributed.cp.layers.gathered_state.GatheredState` declaration: the gathered row and what the
  layer expands from it, the query blocks' scores against the whole row, the ``[B, n, T]`` masks and the top-k
  index slots, at the forward's and the backward's attention moments.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HALO_BLOCK", "alibi_saved_per_layer", "alibi_workspace", "dynamic_mask_bytes", "gathered_state_bytes",
           "gathered_workspace", "halo_math_scores", "halo_math_workspace", "indexer_bytes", "mask_bytes", "position_bias_bytes", "runs_halo_alibi", "sdpa_mask_copy"]  # fmt: skip

#: queries per block of the halo kernel (``masked_attention.DEFAULT_BLOCK``)
HALO_BLOCK = 256


def _row(r: Any) -> int:
    """Local tokens of one row on this rank."""
    return max(1, r.local_tokens // max(1, r.local_batch))


def runs_halo_alibi(d: Any, r: Any) -> bool:
    """Whether the run's ALiBi layers go through the halo kernel (a CP method whose layers run it)."""
    return bool(d.alibi_layers) and r.cp > 1 and r.method.runs_halo_kernel()


def mask_bytes(d: Any, r: Any) -> tuple[float, str]:
    """The attention masks a step holds from its forward to the end of its backward, bytes per rank, and a note."""
    b, c, s, n = r.local_batch, r.compute_bytes, r.seq, _row(r)
    eager = r.attn == "eager"
    parts: list[str] = []
    total = 0.0
    # ALiBi's own-code layers keep the model's attention implementation under every method (cp/layers/alibi.py
    # dispatches them; the methods leave the config as it is), so the model builds its mask from the rank's tokens
    # GPT-Neo's and the other own-code layers likewise (ModelDims.own_code_layers); Ulysses builds its global masks per
    # kind for its inner kernel besides (below)
    own = bool(getattr(d, "own_code_layers", 0)) and not d.alibi_layers
    method_scope = r.method.mask_scope(r.packed) if r.cp > 1 else None
    scope = "local" if r.cp == 1 or d.alibi_layers or own else method_scope
    if scope is not None:
        q = k = n if scope == "local" else s
        if scope == "local" and d.forced_mask_heads:
            size = c if eager or d.forced_mask_heads > 1 else 1
            total += b * d.forced_mask_heads * q * k * size
            parts.append(f"the model's own [{b}, {d.forced_mask_heads}, {q}, {k}] mask (always built)")
        else:
            # GPT-Neo builds one mask for both of its kinds (its layers cut the window out of their own buffer)
            kinds = ((0, d.layers),) if getattr(d, "single_mask", False) else d.attention_kinds
            for limit, _ in kinds:
                if eager:
                    total += b * q * k * c
                    parts.append(f"[{b}, 1, {q}, {k}] eager mask" + (f" (window {limit})" if limit else ""))
                elif r.attn == "sdpa" and 0 < limit < k:  # flash: no mask; flex: a BlockMask, O((S / 128)^2)
                    total += b * q * k
                    parts.append(f"[{b}, 1, {q}, {k}] bool mask (window {limit})")
    if own and method_scope == "global":  # the method's whole-row masks per kind, cached for the step (GPT-Neo, Ulysses)
        for limit, _ in d.attention_kinds:
            if eager or (r.attn == "sdpa" and 0 < limit < s):
                total += b * s * s * (c if eager else 1)
                parts.append(f"the method's [{b}, 1, {s}, {s}] mask" + (f" (window {limit})" if limit else ""))
    if r.cp > 1 and r.method.runs_halo_kernel():
        q = r.method.halo_extent(d, r)[2]  # the queries it sees (usp: its Ulysses sub-group's)
        block = min(HALO_BLOCK, q)
        for limit, count in d.attention_kinds:
            if 0 < limit < s and count:  # a mask kind no layer has (ModelDims.attention_kinds) runs no halo kernel
                total += q * min(s, block + limit)
                parts.append(f"halo block masks (window {limit})")
        if d.alibi_layers:
            total += q * (s + block) / 2
            parts.append("halo block masks (ALiBi, the full prefix)")
    return total, "; ".join(parts) if parts else "none built on this path"


def sdpa_mask_copy(d: Any, r: Any) -> tuple[float, float]:
    """``(per layer on average, the largest layer's)``: the float copy of a boolean mask that SDPA makes for each call
    (``convert_boolean_attn_mask``, ``[B, 1, q, k]`` in the compute dtype) and keeps for its backward, bytes; 0 where no
    boolean mask reaches SDPA. Without CP under ``sdpa``: the layers of a sliding-window or chunked kind shorter than
    the row, or every layer of a model that always builds a boolean mask (``forced_mask_heads == 1``: Falcon without
    ALiBi, DeepSeek sparse attention). Live-tensor snapshots of ``scripts/bench_memory.py --structures only``: a Gemma-3
    -like model of 3 sliding layers of 4 holds three ``[1, 1, 2048, 2048]`` fp32 copies, Falcon one per layer.
    Under CP where the method hands its inner SDPA the whole row's boolean mask per kind (Ulysses: ``mask_scope``
    ``"global"``), the same per windowed layer at ``[B, 1, S, S]`` (``scripts/bench_plan_cases.py --cases
    gemma3_ulysses``: planned -30% without it); ring drops the plain causal mask and runs windows on the halo kernel,
    ALiBi and own-code layers are counted apart."""
    if r.attn != "sdpa" or not d.heads:
        return 0.0, 0.0
    if r.cp > 1:
        own = getattr(d, "own_code_layers", 0)
        if d.alibi_layers or own or d.forced_mask_heads or r.method.mask_scope(r.packed) != "global":
            return 0.0, 0.0
        n = r.seq
    else:
        n = _row(r)
    one = r.local_batch * n * n * r.compute_bytes
    total = sum(count for _, count in d.attention_kinds)
    if not total:
        return 0.0, 0.0
    if d.forced_mask_heads == 1:
        return one, one
    masked = sum(count for limit, count in d.attention_kinds if 0 < limit < n)
    return one * masked / d.layers, one if masked else 0.0


def position_bias_bytes(d: Any, r: Any) -> tuple[float, float, float, float, float]:
    """A learned relative-position bias built per layer call (Inkling 1, 2 and 2-loop: each query's states over the
    key distances, gathered into ``[B, heads, S, S]`` in the compute dtype; :attr:`ModelDims.position_bias_heads`),
    bytes per rank: ``(kept per layer call on average, kept by the largest layer, in flight at a layer's attention in
    the forward, in its backward, the model's distance tables)``; zeros without such layers and under CP (every method
    refuses them).

    Each layer keeps its bias's int64 ``[1, 1, S, S]`` gather index and the boolean mask of the distances outside the
    extent (``masked_fill``'s): 9 bytes per ``S^2``. Under ``sdpa`` transformers folds the bias and the attention mask
    into one float ``[B, heads, S, S]`` mask (``create_position_bias_mask``), which the kernel keeps for its backward
    and whose gradient it returns (the memory-efficient and cuDNN kernels on a GPU; CPU's SDPA runs a bias that
    needs a gradient on its math kernel, which also keeps the ``[B, heads, S, S]`` probabilities: measured one such
    more per layer than planned); the forward holds the bias beside the folded mask, the backward the mask's
    gradient beside the bias's. Under ``eager`` the bias is added to the scores and freed with the layer's forward:
    one ``[B, heads, S, S]`` beside the eager scores at the layer's attention, forward and backward. A model that
    builds its query-key distances once per forward (Inkling 2: an int64 ``[S, S]`` per attention kind,
    :attr:`ModelDims.position_bias_tables`) holds them through its forward, and under checkpointing to the end of the
    backward (each layer's recomputation is handed them)."""
    heads = getattr(d, "position_bias_heads", ())
    if not heads or r.cp > 1:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    b, c, n = r.local_batch, r.compute_bytes, _row(r)
    squares = n * n
    index = 9 * squares
    largest = max(heads)
    tables = 8 * squares * getattr(d, "position_bias_tables", 0)
    if r.attn == "eager":
        return index * len(heads) / d.layers, index, b * largest * squares * c, b * largest * squares * c, tables
    kept = [b * h * squares * c + index for h in heads]
    return sum(kept) / d.layers, max(kept), 2 * b * largest * squares * c, 2 * b * largest * squares * c, tables


def dynamic_mask_bytes(d: Any, r: Any) -> tuple[float, float, float, float]:
    """Doge's dynamic mask attention (``prepare_dynamic_mask``: :attr:`ModelDims.dynamic_mask_layers`), bytes per
    rank without CP: ``(kept per layer call on average, kept by one such layer, in flight at its attention in the
    forward, in its backward)``; zeros without such layers and under CP (whose methods run the mask in their own
    kernel, ``cp/layers/dynamic_mask.py``).

    Each such layer builds a float ``[B, kv, S, S]`` mask in the compute dtype from its value states (broadcast over
    the queries, the attention mask filled in: ``masked_fill`` keeps the boolean ``[B, 1, S, S]`` it filled by; a row
    longer than ``keep_window_size`` also keeps the boolean ``[B, kv, S, S]`` of the keys outside each query's top
    ``keep_window_size``, whose ``topk`` indices ``[B, kv, S, W]`` int64, zeros and scatter come and go), repeats it to
    the query heads (``[B, H, S, S]``) and hands it to the kernel, which needs its gradient: under ``sdpa`` the kernel
    keeps it for its backward (the memory-efficient kernel on a GPU; CPU's SDPA runs a mask that needs a gradient on
    its math kernel, which keeps the probabilities too: not planned), under ``eager`` it is added to the scores and
    freed. Under ``sdpa`` the backward holds the repeated mask's gradient and its two ``[B, kv, S, S]`` reductions;
    under ``eager`` that gradient is the scores' own, within the eager moments, and the forward's building of the
    mask comes before the scores' (the planner takes the larger of the two moments)."""
    layers = getattr(d, "dynamic_mask_layers", 0)
    if not layers or r.cp > 1:
        return 0.0, 0.0, 0.0, 0.0
    b, c, n = r.local_batch, r.compute_bytes, _row(r)
    squares = b * n * n
    heads, kv = d.heads, d.kv_heads or d.heads
    window = getattr(d, "dynamic_mask_window", 0)
    windowed = bool(window) and n > window
    bools = squares * (1 + (kv if windowed else 0))
    # while the mask is built: the filled float mask beside the attention mask's float copy it is filled from; with
    # the window the filled mask, the zeros and the scatter of the kept keys, and topk's values and int64 indices;
    # then the repeated copy beside the filled mask
    topk = b * kv * n * window * (8 + c) if windowed else 0.0
    build = max(squares * (kv + 1) * c, (3 * squares * kv * c + topk) if windowed else 0.0)
    repeated = squares * heads * c
    if r.attn == "eager":
        # built and freed before the scores' moments (the add frees the repeated copy); the mask's gradient is the
        # scores' own and its reductions come after the scores' backward has freed them (measured, bf16 and fp32,
        # hidden 256, 2048 tokens: the plan within 2% with the kept booleans alone in the backward)
        return bools * layers / d.layers, bools, max(build, squares * (kv + heads) * c), 0.0
    kept = bools + repeated
    return kept * layers / d.layers, kept, max(build, squares * kv * c), repeated + 2 * squares * kv * c


#: bytes per ``[B, q, k]`` element while a chunked indexer finds each query's first and last visible keys (its pool
#: and the selection it fills, booleans; the flipped mask and its int32 copy): 7; and beside the pool and the selection,
#: per score of a chunk: the fp32 scores, their masked copy, the int32 ranks of the ties and six boolean masks: 18
INDEXER_SPAN_BYTES, INDEXER_CHUNK_BYTES = 7, 18


def indexer_bytes(d: Any, r: Any) -> tuple[float, float]:
    """``(at an indexed layer's attention, kept under checkpointing)``, bytes per rank, for a model whose indexed
    layers select their keys with a chunked reference indexer (:attr:`ModelDims.indexer_layers`: Kolibri-1.1's
    ``Kolibri1_1Indexer``, no gradient); zeros elsewhere.

    Per indexed layer and call (forward, and the recomputation under checkpointing) it holds, over the rank's ``q``
    queries and the row's ``k`` keys (under CP its keys are all-gathered: ``k`` the whole row): the pool of
    candidate keys and the selection it fills (``[B, q, k]`` booleans each), while it finds each query's first and
    last visible keys a flipped copy of the mask and its int32 copy (:data:`INDEXER_SPAN_BYTES`: 7 bytes per
    element), then per chunk of at most ``max_scores`` scores (whole queries) the fp32 scores, their masked copy,
    the int32 ranks of ties and six boolean masks (:data:`INDEXER_CHUNK_BYTES`: 18 bytes per score); under
    ``eager`` the mask's visible keys besides. Measured with ``scripts/bench_plan_families.py`` and a live-tensor
    snapshot (bf16, 2048 tokens: 79 MiB at the selection's peak, 2 + 18 bytes per element). Without checkpointing
    the pool lives through the forward only (counted in the layer's call); under checkpointing each layer's
    recomputation is handed the pool it ran with, so every pool the model built (:attr:`ModelDims.indexer_pools`)
    is kept to the end of the backward. At 128K tokens without CP one ``[S, S]`` boolean is 16 GiB: the plan says so
    rather than the model running out."""
    if not getattr(d, "indexer_layers", 0):
        return 0.0, 0.0
    b, q = r.local_batch, _row(r)
    k = r.seq if r.cp > 1 else q
    span = b * q * k
    rows = min(q, max(1, d.indexer_chunk // k)) if d.indexer_chunk else q
    call = max(INDEXER_SPAN_BYTES * span, 2 * span + INDEXER_CHUNK_BYTES * rows * k)
    call += span if r.attn == "eager" else 0.0  # the float mask's visible keys, a boolean copy
    return call, (d.indexer_pools * span if r.activation_checkpointing else 0.0)


def alibi_workspace(d: Any, r: Any) -> float:
    """One ALiBi layer's transient on the halo kernel (the module docstring), bytes per rank; 0 elsewhere."""
    if not runs_halo_alibi(d, r):
        return 0.0
    b, c, s = r.local_batch, r.compute_bytes, r.seq
    hq, hkv, q = r.method.halo_extent(d, r)
    block, dim = min(HALO_BLOCK, q), d.head_dim
    acc = 8 if c == 8 else 4
    scores = 3 * b * hq * block * s * acc
    return scores + b * s * (2 * hq * dim + 2 * hkv * dim + 2 * hkv * dim + hq) * c


def halo_math_workspace(d: Any, r: Any) -> tuple[float, float]:
    """``(forward, backward)``: one soft-capped or sink layer on the halo kernel (``ModelDims.halo_math``: a CP
    method that runs it, ring, thd, thd_docs, usp), bytes per rank; ``(0, 0)`` elsewhere. The kernel gathers the
    rank's keys and values with the halo (the rows exchanged, the halo received, the two buffers and a query block's
    selected copies: ``6 B Hkv D c`` per key row, the whole row for a full prefix, else the rank's tokens and the
    window); it runs each block of :data:`HALO_BLOCK` queries against the keys it may see (the row's for a full
    prefix, the block and the window else). A CPU runs such blocks in exact math (``blocks.resolve_backend``: its
    flash kernel takes neither soft-capping nor sinks), ``[B, Hq, block, m]`` fp32 scores (fp64 in fp64), as many at
    once as :func:`halo_math_scores` counts. A CUDA device runs them in FlexAttention, whose blocks are not counted. A
    transient at the layer's attention, forward and recomputation alike. Measured
    (``scripts/bench_plan_families_cp.py``, hidden 256, 2048 tokens, ring cp 2): Gemma 2's six
    ``[1, 4, 2, 256, 2048]`` fp32 at the backward's peak, 96 of the step's 121 MiB; gpt-oss's five."""
    if not d.halo_math or r.cp <= 1 or not r.method.runs_halo_kernel():
        return 0.0, 0.0
    from automodel.distributed.cp.attention_kernels import CPU_KERNEL

    b, c, s = r.local_batch, r.compute_bytes, r.seq
    hq, hkv, n = r.method.halo_extent(d, r)
    block, dim = min(HALO_BLOCK, n), d.head_dim
    acc = 8 if c == 8 else 4
    cpu = getattr(r, "attention_kernel", CPU_KERNEL) == CPU_KERNEL
    fwd = bwd = 0.0
    for limit, count, fwd_scores, bwd_scores in d.halo_math:
        if not count:
            continue
        keys = s if not limit else min(s, block + limit)
        rows = s if not limit else min(s, n + limit)
        buffers = 6 * b * rows * hkv * dim * c
        scores = b * hq * block * keys * acc if cpu else 0.0
        fwd, bwd = max(fwd, buffers + fwd_scores * scores), max(bwd, buffers + bwd_scores * scores)
    return fwd, bwd


def halo_math_scores(softcap: bool, sinks: bool) -> tuple[int, int]:
    """``(forward, backward)``: the score blocks an exact-math halo block (``blocks._math_forward`` /
    ``_math_backward``) holds at once at its forward's and its backward's peak. Soft-capping: the scores, their tanh
    and the capped copy (3); in the backward the recomputed scores, tanh, capped and masked copies, ``s - lse`` and
    its exp (6). Sinks: the masked scores, their copy with the sink column, ``s - lse`` and its exp (4); in the
    backward five (live-tensor snapshots, ``scripts/bench_plan_families_cp.py --snapshots``: Gemma 2, gpt-oss)."""
    return (4 if sinks else 3), (6 if softcap else 5)


def alibi_saved_per_layer(d: Any, r: Any) -> float:
    """Under Ulysses: the float ``[B, H / cp, S, S]`` bias mask each ALiBi layer hands SDPA, which SDPA saves for its
    backward, bytes per layer; 0 elsewhere."""
    if not d.alibi_layers or r.cp <= 1 or r.method.runs_halo_kernel():
        return 0.0
    heads, _, _ = r.method.attention_extent(d, r)
    return r.local_batch * heads * r.seq * r.seq * r.compute_bytes


def alibi_mask_build(d: Any, r: Any) -> float:
    """Under Ulysses, while an ALiBi layer's forward builds its bias mask (``ulysses/attention.py``,
    ``_alibi_attention``): the boolean ``[B, S, S]`` causal mask and its negation beside the bias mask being filled,
    bytes (a live-tensor snapshot of ``scripts/bench_plan_cases.py``'s BLOOM-like Ulysses case: 8 MiB at 2048 tokens);
    0 elsewhere. The forward's attention moment."""
    if not alibi_saved_per_layer(d, r):
        return 0.0
    return 2 * r.local_batch * r.seq * r.seq


def gathered_state_bytes(d: Any, r: Any) -> float:
    """Under CP, the largest gathered-state layer's gathered row (``width`` per token, the whole row) and its mask
    planes, bytes per rank: what an indexed layer's key selection reads before its kernel runs; 0 without CP."""
    if r.cp <= 1:
        return 0.0
    n = _row(r)
    return max((state.row_bytes(r.local_batch, n, r.seq, r.compute_bytes) for _, state in d.gathered), default=0.0)


def gathered_workspace(d: Any, r: Any) -> tuple[float, float]:
    """``(forward, backward)``: the largest gathered-state layer's bytes at its attention moment, per rank."""
    fwd = bwd = 0.0
    if r.cp <= 1:
        return fwd, bwd
    n = _row(r)
    for _, state in d.gathered:
        eager = r.attn == "eager"
        fwd = max(fwd, state.forward_bytes(r.local_batch, n, r.seq, r.compute_bytes, r.tp, eager))
        bwd = max(bwd, state.backward_bytes(r.local_batch, n, r.seq, r.compute_bytes, r.tp, eager))
    return fwd, bwd
