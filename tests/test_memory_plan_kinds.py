"""The memory planner's layer-kind terms (automodel.training.layer_kind_memory): attention masks counted where the
method's path builds them, ALiBi's score blocks on the halo kernel, a gathered-state kernel's tensors (DSA), and the
tiled MLP's weight-gradient copies; each against a hand-computed size for a known shape, present for a family that
has the tensor and absent for one that does not. Measured against the recipe by scripts/bench_plan_cases.py.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.distributed.cp.layers.gathered_state import GatheredState
from automodel.training.memory_plan import RunShape, model_dims, plan_memory
from tests.family_matrix import WINDOW, family_by_name, family_or_skip

SEQ = 4096  # global row
N = SEQ // 2  # local tokens at cp 2
BLOCK = 256  # the halo kernel's and the DSA kernel's query block


def _dims(name: str, **overrides):
    fam = family_by_name(name)
    config = fam.build_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"):
        return model_dims(AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation()))


def _plan(d, **kw):
    return plan_memory(d, RunShape(local_batch=1, seq=SEQ, **kw))


def test_sliding_window_mask_counted_where_its_path_builds_it():
    gemma = _dims("gemma3_text")
    assert gemma.attention_kinds and any(limit == WINDOW for limit, _ in gemma.attention_kinds)
    # ring: transformers' [1, 1, n, n] bool sliding mask from the rank's tokens, and the halo plan's block masks
    ring = _plan(gemma, cp=2).terms["attention masks"].bytes
    assert ring == N * N + N * (BLOCK + WINDOW)
    # no CP: the whole row's mask; Ulysses: the global mask its inner sdpa kernel gets (no halo kernel)
    assert _plan(gemma).terms["attention masks"].bytes == SEQ * SEQ
    assert _plan(gemma, cp=2, cp_method="ulysses").terms["attention masks"].bytes == SEQ * SEQ
    # thd_docs registers no mask implementation: only the halo kernel's block masks
    assert _plan(gemma, cp=2, cp_method="thd_docs").terms["attention masks"].bytes == N * (BLOCK + WINDOW)
    # the mask lives from the forward to the end of the backward: in every phase but the optimizer's
    plan = _plan(gemma, cp=2)
    assert all(plan.phases[p]["attention masks"] == ring for p in ("forward", "loss", "backward"))
    assert "attention masks" not in plan.phases["optimizer"]
    # a full-attention family under sdpa: SDPA's is_causal, no mask built on any path
    llama = _dims("llama")
    assert llama.attention_kinds == ((0, llama.layers),) and llama.forced_mask_heads == 0
    for kw in ({}, {"cp": 2}, {"cp": 2, "cp_method": "ulysses"}, {"cp": 2, "cp_method": "thd"}):
        assert _plan(llama, **kw).terms["attention masks"].bytes == 0, kw


def test_eager_masks_are_in_the_compute_dtype_per_kind():
    gemma = _dims("gemma3_text")
    kinds = len(gemma.attention_kinds)
    eager = plan_memory(gemma, RunShape(local_batch=1, seq=SEQ, cp=2, attn="eager")).terms["attention masks"].bytes
    assert kinds == 2 and eager == kinds * N * N * 4 + N * (BLOCK + WINDOW)
    flex = plan_memory(gemma, RunShape(local_batch=1, seq=SEQ, cp=2, attn="flex_attention"))
    assert flex.terms["attention masks"].bytes == N * (BLOCK + WINDOW)  # a BlockMask, not a dense mask


def test_falcon_alibi_folds_its_bias_into_a_mask_per_head():
    from tests.family_matrix import assert_falcon_refused, falcon_refused

    falcon = _dims("falcon@flagship")
    heads = falcon.heads
    if falcon_refused():  # transformers < 5.25: its own attention, which every CP method refuses: no ALiBi kernel
        assert falcon.forced_mask_heads == heads and falcon.alibi_layers == 0
        assert_falcon_refused("ring", {"alibi": True, "multi_query": False})  # the flagship row
    else:
        assert falcon.forced_mask_heads == heads and falcon.alibi_layers == falcon.layers
        masks = _plan(falcon, cp=2).terms["attention masks"].bytes
        # [1, heads, n, n] fp32 (where + masked_fill with the bias) and the ALiBi halo's block masks (the full prefix)
        assert masks == heads * N * N * 4 + N * (SEQ + BLOCK) / 2
    # Falcon-7B's RoPE: no ALiBi, but FalconModel builds its mask whatever the kernel (allow_is_causal_skip=False,
    # transformers 5.17 and 5.25): one boolean [1, 1, n, n] from the rank's tokens under ring (was planned as none)
    rope_falcon = _dims("falcon")
    assert rope_falcon.forced_mask_heads == 1 and rope_falcon.alibi_layers == 0
    assert _plan(rope_falcon, cp=2).terms["attention masks"].bytes == N * N


def test_alibi_score_blocks_on_the_halo_kernel_replace_the_eager_s2_term():
    bloom = _dims("bloom")
    assert bloom.alibi_layers == bloom.layers > 0
    h, d = bloom.heads, bloom.head_dim
    shape = RunShape(local_batch=1, seq=SEQ, cp=2, attn="eager")
    plan = plan_memory(bloom, shape)
    # three [1, H, block, S] fp32 score blocks, the block's K and V at the query heads, the rank's K/V with the halo,
    # and the exchanged rows (K, V and the per-head bias), fp32
    expected = 3 * h * BLOCK * SEQ * 4 + SEQ * (2 * h * d + 4 * h * d + h) * 4
    assert plan.terms["attention workspace"].bytes == expected
    assert plan.by_moment["forward"]["attention"]["attention workspace"] == expected
    # the halo kernel saves no [heads, S_q, S_k] probabilities: no S^2 activation term; nor does ring's path of an
    # eager Llama (torch's ring), whose own eager function runs under Ulysses (the inner kernel) and without CP
    llama = plan_memory(_dims("llama"), shape)
    assert "S^2" not in plan.terms["activations"].note and "S^2" not in llama.terms["activations"].note
    for kw in ({"cp_method": "ulysses"}, {"cp": 1}):
        assert "S^2" in plan_memory(_dims("llama"), dataclasses.replace(shape, **kw)).terms["activations"].note, kw
    assert llama.terms["attention workspace"].bytes != expected  # ring's own workspace, no ALiBi blocks
    # Ulysses hands SDPA the bias as a float [1, H / cp, S, S] mask, which SDPA saves per layer
    uly = plan_memory(bloom, dataclasses.replace(shape, cp_method="ulysses"))
    assert "S^2" in uly.terms["activations"].note
    # the ALiBi layers keep BLOOM's eager attention under every method: its [1, 1, n, n] fp32 mask from the rank's
    # tokens, not Ulysses' global one (thd registers no mask implementation, but BLOOM keeps its own)
    for method in ("ulysses", "thd"):
        masks = plan_memory(bloom, dataclasses.replace(shape, cp_method=method)).terms["attention masks"].bytes
        halo = 0 if method == "ulysses" else N * (SEQ + BLOCK) / 2
        assert masks == N * N * 4 + halo, method
    assert uly.terms["attention workspace"].bytes != expected


def test_dsa_declares_its_gathered_state_and_the_planner_counts_it():
    dsa = _dims("deepseek_v32")
    fam = family_by_name("deepseek_v32").build_config()
    (count, state), = dsa.gathered
    assert count == fam.num_hidden_layers
    rope, nope, v, heads = fam.qk_rope_head_dim, fam.qk_nope_head_dim, fam.v_head_dim, fam.num_attention_heads
    assert state == GatheredState(width=fam.kv_lora_rank + rope + fam.index_head_dim,
                                  expanded=heads * (nope + v + nope + rope), expanded_grad=heads * (nope + rope + v),
                                  heads=heads, block=BLOCK, mask_planes=3, index_slots=fam.index_topk)  # fmt: skip
    assert dsa.forced_mask_heads == 1  # allow_is_causal_skip=False: the [B, 1, n, n] mask on ring's path
    plan = _plan(dsa, cp=2)
    k = min(fam.index_topk, SEQ)
    fwd = SEQ * (state.width + state.expanded) * 4 + 2 * heads * BLOCK * SEQ * 4 + BLOCK * SEQ + 3 * N * SEQ + 2 * N * k * 8
    bwd = (SEQ * (state.width + state.expanded + state.expanded_grad) * 4 + 3 * heads * BLOCK * SEQ * 4 + BLOCK * SEQ
           + N * SEQ)  # fmt: skip
    assert plan.by_moment["forward"]["attention"]["attention workspace"] == fwd
    assert plan.by_moment["backward"]["attention"]["attention workspace"] == bwd
    assert plan.terms["attention masks"].bytes == N * N
    assert _plan(dsa).terms["attention workspace"].bytes == 0  # no CP: the model's own code, no gather
    assert _dims("llama").gathered == () and _dims("gemma3_text").gathered == ()


def test_doge_dynamic_mask_is_planned_per_kv_head_over_the_gathered_row():
    """Doge's kernel (dynamic_mask.py) builds a [B, Hkv, n, T] mask in the compute dtype, which the model repeats to the
    query heads and the blocks keep to the backward (A and dt_proj learn through it), O(S^2 / cp) per layer, with its
    gradient in the backward: the plan counts them, not only the gathered K and V."""
    doge = _dims("doge")
    fam = family_by_name("doge").build_config()
    (count, state), = doge.gathered
    kv, heads, dim = fam.num_key_value_heads, fam.num_attention_heads, fam.hidden_size // fam.num_attention_heads
    assert count == fam.num_hidden_layers
    assert state == GatheredState(width=2 * kv * dim, expanded=2 * heads * dim, expanded_grad=2 * heads * dim,
                                  heads=heads, block=BLOCK, mask_planes=1, bias_planes=kv, bias_heads=heads)  # fmt: skip
    plan = _plan(doge, cp=2)
    fwd = plan.by_moment["forward"]["attention"]["attention workspace"]
    bwd = plan.by_moment["backward"]["attention"]["attention workspace"]
    # the repeated mask and the top-k twin; in the backward the repeated mask and its gradient
    assert fwd >= (heads * 4 + kv) * N * SEQ and bwd >= 2 * heads * N * SEQ * 4


@pytest.mark.parametrize("name", ["deepseek_v4", "qwen4_exp_text", "kolibri1_1"])
def test_every_gathered_state_kernel_declares_what_it_gathers(name):
    """DeepSeek-V4, QSA and Kolibri-1.1 gather per-token state as DSA does: each declares it (its profile's widths),
    so the plan is not DSA's formula applied to another kernel."""
    from tests.family_matrix import skip_if_absent

    skip_if_absent(name if name != "qwen4_exp_text" else "qwen4_exp_text@qsa")  # 5.17's QSA: refused, no kernel
    fam = family_by_name(name)
    d = _dims(name)
    assert d.gathered, name
    for _, state in d.gathered:
        assert state.width > 0 and state.heads == fam.build_config().num_attention_heads, (name, state)
        assert state.bias_planes == 0
    assert _plan(d, cp=2).by_moment["forward"]["attention"]["attention workspace"] > 0


def test_tiled_mlp_backward_counts_the_tile_gradients_beside_their_running_sum():
    llama = _dims("llama", intermediate_size=256)
    base = RunShape(local_batch=1, seq=8192, activation_checkpointing=True, chunk_tokens=256)
    tiled = dataclasses.replace(base, tiled_mlp=1024)
    acts = plan_memory(llama, tiled).by_moment["recompute"]["MLP"]["activations"]
    untiled_mlp_free = plan_memory(llama, base).by_moment["recompute"]["attention"]["activations"]
    h, i = llama.hidden, llama.intermediate
    # the recomputed layer at its attention (the input norm's tensors; the post-attention norm's two and the residual
    # are freed by then: 3 [N, h] more at the MLP), plus one tile's 6 [T, I] and the tile's three weight gradients
    # (their running sum is the layer's gradient, which the gradients term counts whole at fsdp 1); the attention's
    # moment holds besides the output projection's input gradient and SDPA's dq, dk, dv (2 q + 2 kv, cp 1)
    q, kv = llama.heads * llama.head_dim, llama.kv_heads * llama.head_dim
    # (with the tiled MLP the layer's norms run in tiles too: the post-attention norm keeps its input and its output,
    # 2 [N, h], not 3 with its normalized copy)
    assert acts - untiled_mlp_free == (6 * 1024 * i + 3 * h * i + 2 * 8192 * h - 8192 * (2 * q + 2 * kv)) * 4
    # in bf16 the running sum over the tiles is fp32 (automodel.models.tile_backward): 2 bytes more per weight
    # (one tile of the whole row: its gradient is the sum, no fp32 copy)
    half, one_tile = (dataclasses.replace(tiled, compute_bytes=2, master_bytes=2, tiled_mlp=t) for t in (1024, 8192))
    acts, whole = (plan_memory(llama, x).by_moment["recompute"]["MLP"]["activations"] for x in (half, one_tile))
    assert acts - whole == 6 * (1024 - 8192) * i * 2 + 3 * h * i * 2
    # at fsdp 2 the gradients term counts the layer's shard; the running sum is whole until the reduce-scatter
    for shard in (2, 4):
        sharded = dataclasses.replace(tiled, dp_shard=shard)
        acts = plan_memory(llama, sharded).by_moment["recompute"]["MLP"]["activations"]
        free = plan_memory(llama, dataclasses.replace(base, dp_shard=shard)).by_moment["recompute"]["attention"]
        grads = 8192 * (2 * q + 2 * kv)  # the attention's moment: its output's gradient, dq, dk, dv
        assert acts - free["activations"] == (6 * 1024 * i + 3 * h * i + 3 * h * i * (1 - 1 / shard) + 2 * 8192 * h
                                              - grads) * 4  # fmt: skip


def test_tiled_mlp_does_not_keep_its_input_alive_under_checkpointing():
    """The tiled call's runner (kept by the autograd node until the layer's backward) must not hold the MLP's
    input: under activation checkpointing only what save_for_backward saves is dropped and recomputed."""
    from torch.utils.checkpoint import checkpoint

    from automodel.models.tiled_mlp import apply_tiled_mlp

    fam = family_by_name("llama")
    model = AutoModelForCausalLM.from_config(fam.build_config())
    assert apply_tiled_mlp(model, 8) >= 1
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 64, model.config.hidden_size, requires_grad=True)
    refs = []

    def layer(t: torch.Tensor) -> torch.Tensor:
        inner = t * 2.0  # the MLP's input, made inside the checkpointed function
        refs.append(weakref.ref(inner))
        return mlp(inner)

    out = checkpoint(layer, x, use_reentrant=False)
    gc.collect()
    assert refs[0]() is None, "the tiled MLP keeps its input alive beside the checkpoint"
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", ["llama", "gemma3_text", "bloom", "deepseek_v32"])
def test_optimizer_phase_holds_no_masks_or_workspace(name):
    plan = _plan(_dims(name), cp=2)
    assert set(plan.phases["optimizer"]) == {"gradients", "communication buffers", "optimizer temporaries"}


def test_plain_mlps_are_planned_by_their_structure_and_measured_activation():
    """A plain MLP (``fc2(act(fc1))``: GPT-NeoX, GPT-2, Falcon) was planned as a gated one (``4 I`` saved per token):
    over by 2 I with a one-kernel GELU, under by 1 I with GPT-2's tanh formula (5 ``[N, I]`` tensors saved), and
    GPT-2's and Falcon's width (``n_inner``, ``ffn_hidden_size``) was the config's ``4 h``
    (``scripts/bench_memory.py --structures only``)."""
    llama = _dims("llama")
    assert llama.mlp_gated and llama.mlp_moments == (4.0, 3.0, 6.0)
    neox = _dims("gpt_neox")
    assert not neox.mlp_gated and neox.mlp_moments == (2.0, 2.0, 3.1)  # fc1's output and its GELU
    gpt2 = _dims("gpt2", n_inner=96)
    assert not gpt2.mlp_gated and gpt2.intermediate == 96 and gpt2.mlp_moments[0] == 5.0
    falcon = _dims("falcon", ffn_hidden_size=80)
    assert not falcon.mlp_gated and falcon.intermediate == 80
    # the step estimate's GEMMs: a plain MLP has two matrices (fc1, fc2), a gated one three
    from automodel.training.step_estimate import _layer_gemms

    assert len(_layer_gemms(neox, 8, 1)) == 6 and len(_layer_gemms(llama, 8, 1)) == 7
    for d, saved in ((neox, 2.0), (gpt2, 5.0)):
        plain, gated = _plan(d), _plan(dataclasses.replace(d, mlp_gated=True))
        per_layer = SEQ * d.intermediate * 4  # one [N, I] fp32 tensor
        assert gated.phases["loss"]["activations"] - plain.phases["loss"]["activations"] == d.layers * (4 - saved) * per_layer


def test_cp1_sdpa_saves_kv_repeated_above_head_size_256_and_q_is_heads_times_head_dim():
    """Without CP, transformers' sdpa repeats K/V to the query heads above head size 256 (``use_gqa_in_sdpa``): SDPA
    saves them (``2 q`` per token and layer in place of the KV heads' ``2 kv``: repeat_kv and RoPE keep no input). And
    q and the attention output are ``heads x head_dim`` wide, not the hidden size (4 heads of 320 on 128: planned
    -54%, then +11% with both K/V counted and a transposed copy that Llama's token-major output never makes, now +1%
    and +2%: ``scripts/bench_memory.py --structures only``)."""
    base = _dims("llama")
    d = dataclasses.replace(base, heads=4, kv_heads=2, head_dim=320)
    q, kv = 4 * 320, 2 * 320

    def saved(dims, attn):
        return _plan(dims, attn=attn).phases["loss"]["activations"]

    # flash takes grouped K/V whatever the head size; sdpa repeats them above 256 and at 256 does not
    assert saved(d, "sdpa") - saved(d, "flash_attention_2") == d.layers * SEQ * (2 * q - 2 * kv) * 4
    d256 = dataclasses.replace(d, head_dim=256)
    assert saved(d256, "sdpa") == saved(d256, "flash_attention_2")
    # head groups at cp 1 recompute each group's attention: nothing repeated is saved
    assert _plan(d, attn="sdpa", head_chunks=2).phases["loss"]["activations"] < saved(d, "sdpa")
    # q-wide tensors: q after RoPE and the kernel's output (2 q: Llama's output is token-major, no copy), k and v
    # (2 kv), RoPE's cos and sin
    d160 = dataclasses.replace(d, head_dim=160)
    q160, kv160 = 4 * 160, 2 * 160
    per_layer = SEQ * (2 * (q - q160) + 2 * (kv - kv160)) * 4
    # a query made contiguous head-major (GPT-NeoX's partial RoPE) gives a head-major output: its copy is saved too
    copied = dataclasses.replace(d, attn_output_copy=True)
    assert saved(copied, "sdpa") - saved(d, "sdpa") == d.layers * SEQ * q * 4
    assert saved(d, "flash_attention_2") - saved(d160, "flash_attention_2") == d.layers * per_layer + SEQ * 2 * 160 * 4


def test_gpt_neo_per_layer_mask_buffers_are_persistent_state():
    """GPT-Neo's attention keeps a ``[1, 1, P, P]`` boolean buffer per layer (causal, or the local window cut out of it;
    ``P = max_position_embeddings``), on the device with the model and whole on every rank: 2 layers of 2048 are
    8 MiB; a long-context row needs ``P`` at least the row (its learned positions), so it grows as ``L S^2``."""
    d = _dims("gpt_neo", max_position_embeddings=2048)
    assert d.buffer_bytes == d.layers * 2048 * 2048
    plan = _plan(d, cp=2, dp_shard=2)
    assert {t.name: t.bytes for t in plan.persistent}["buffers"] == d.layers * 2048 * 2048  # not divided by fsdp
    assert "buffers" not in {t.name for t in _plan(_dims("llama")).persistent}


def test_cp1_sdpa_keeps_a_float_copy_of_a_boolean_mask_per_masked_layer():
    """SDPA converts a boolean mask to the compute dtype on every call and keeps the copy for its backward: per
    sliding layer (Gemma 3: 3 of 4 at window 256) and, for Falcon (its mask always built), every layer; planned
    -17% and -18% without it, +6% and +10% with (``scripts/bench_memory.py --structures only``)."""
    gemma = _dims("gemma3_text")
    masked = sum(n for limit, n in gemma.attention_kinds if 0 < limit < SEQ)
    assert 0 < masked < gemma.layers
    one = SEQ * SEQ * 4  # [1, 1, S, S] fp32

    def saved(dims, **kw):
        return _plan(dims, **kw).phases["loss"]["activations"]

    flash = saved(gemma, attn="flash_attention_2")  # no mask reaches the kernel
    # K/V repeated to the query heads in the masked layers, in place of the KV heads'
    repeated = masked * SEQ * 2 * (gemma.heads - gemma.kv_heads) * gemma.head_dim * 4
    repeated = repeated if gemma.kv_heads < gemma.heads else 0
    assert saved(gemma) - flash == pytest.approx(masked * one + repeated)
    from tests.family_matrix import falcon_refused

    if not falcon_refused():  # 5.25 on; before, Falcon's own attention code (not measured by the planner's rows)
        falcon = _dims("falcon")
        assert saved(falcon) - saved(falcon, attn="flash_attention_2") == falcon.layers * one
    # Ulysses hands its inner SDPA the whole row's boolean window mask: the same copy per windowed layer at [S, S]
    # (the gemma3_ulysses case of scripts/bench_plan_cases.py: -30% without it, +0.7% with it); ring: none
    ulysses = {"cp": 2, "cp_method": "ulysses"}
    assert saved(gemma, **ulysses) - saved(gemma, attn="flash_attention_2", **ulysses) == pytest.approx(masked * one)
    assert saved(gemma, cp=2) == saved(gemma, cp=2, attn="flash_attention_2")


def test_gpt_neo_masks_and_scores_as_its_own_code_builds_them():
    """GPT-Neo's layers compute their attention in their own code: at cp 1 the fp32 softmax per layer and one eager
    mask for both kinds (was: two masks and two score tensors in the compute dtype); under CP they hand q, k, v to the
    method, so no eager S^2 is saved (was planned: ring +256%, Ulysses +106%; now +11% and +5%,
    ``scripts/bench_plan_cases.py --cases gpt_neo_ring gpt_neo_ulysses``), the model still builds its mask from the
    rank's tokens and Ulysses its whole-row masks per kind for its inner kernel."""
    neo = _dims("gpt_neo")
    assert neo.single_mask and neo.own_code_layers == neo.layers and len(neo.attention_kinds) == 2
    assert _plan(neo, attn="eager").terms["attention masks"].bytes == SEQ * SEQ * 4
    assert _plan(neo, cp=2, attn="eager").terms["attention masks"].bytes == N * N * 4 + N * (BLOCK + WINDOW)
    ulysses = _plan(neo, cp=2, cp_method="ulysses", attn="eager").terms["attention masks"].bytes
    assert ulysses == N * N * 4 + 2 * SEQ * SEQ * 4

    def saved(**kw):
        return _plan(neo, **kw).phases["loss"]["activations"]

    scores = neo.layers * neo.heads * SEQ * SEQ
    assert saved(attn="eager") - saved(attn="flash_attention_2") == scores * 4  # fp32 softmax only
    half = {"compute_bytes": 2, "master_bytes": 2}
    assert saved(attn="eager", **half) - saved(attn="flash_attention_2", **half) == scores * 6  # and its bf16 cast
    assert saved(attn="eager", cp=2) == saved(attn="flash_attention_2", cp=2)


def test_eager_softcapping_keeps_its_tanh_output_per_layer():
    """Gemma 2's eager attention caps its scores with a tanh and keeps the tanh's output for its backward, beside the
    fp32 probabilities (and, in bf16, their cast): one more score per layer in the compute dtype than an uncapped
    eager layer (measured at cp 1: fp32 planned -21% without it), whether the plan reads it off the model's own eager
    function (:mod:`automodel.training.eager_memory`) or counts it (``ModelDims.attn_softcapping``)."""
    gemma2, uncapped = _dims("gemma2"), _dims("gemma2", attn_logit_softcapping=None)
    assert gemma2.attn_softcapping and not uncapped.attn_softcapping and not _dims("llama").attn_softcapping
    assert gemma2.eager_scores is not None and uncapped.eager_scores is not None

    def saved(d, **kw):
        return _plan(d, attn="eager", **kw).phases["loss"]["activations"]

    scores = gemma2.layers * gemma2.heads * SEQ * SEQ
    half = {"compute_bytes": 2, "master_bytes": 2}
    for measured in (True, False):
        capped, plain = (d if measured else dataclasses.replace(d, eager_scores=None) for d in (gemma2, uncapped))
        assert saved(capped) - saved(plain) == scores * 4, measured
        assert saved(capped, **half) - saved(plain, **half) == scores * 2, measured


def test_a_sliding_mask_built_for_no_layer_is_counted():
    """Qwen2-MoE with ``use_sliding_window=False`` still builds its sliding mask in every forward (window 0, used by no
    layer): a ``[1, 1, S, S]`` boolean under sdpa, planned 49% under at cp 1 with the tiled MLP without it. No layer
    is given it: no SDPA float copy, no halo block masks under ring. Decoders that guard the sliding mask
    (``has_sliding_layers``) or build it lazily (Dots1's ``lambda:``) declare no such kind."""
    d = _dims("qwen2_moe")
    assert d.attention_kinds == ((0, d.layers), (1, 0))
    assert _plan(d).terms["attention masks"].bytes == SEQ * SEQ
    plain = dataclasses.replace(d, attention_kinds=((0, d.layers),))
    assert _plan(plain).terms["attention masks"].bytes == 0
    assert _plan(d, attn="eager").terms["attention masks"].bytes == _plan(plain, attn="eager").terms[
        "attention masks"].bytes + SEQ * SEQ * 4  # eager: one more mask in the compute dtype
    # the mask is built and kept, never handed to a layer: the activations are the same
    assert _plan(d).phases["backward"]["activations"] == _plan(plain).phases["backward"][
        "activations"]
    # ring: the rank's [n, n] boolean, no halo block masks for a kind no layer has
    assert _plan(d, cp=2).terms["attention masks"].bytes == N * N
    for name in ("llama", "dots1", "mistral", "deepseek_v4"):
        assert all(count for _, count in _dims(name).attention_kinds), name


def test_dsa_index_mask_is_in_flight_at_each_layers_attention_without_cp():
    """Without CP, DeepSeek sparse attention's own code (HY-V4, DeepSeek-V3.2) folds the indexer's top-k into the
    mask per layer: a ``[B, 1, S, S]`` boolean index mask and the combined mask (fp32 under eager, boolean under sdpa)
    at the layer's attention (HY-V4 planned -11% at 2048 tokens without them, -3% with). DeepSeek-V4's layers fold
    nothing (their compressed entries are counted apart); under CP the method's kernel selects the keys."""
    from tests.family_matrix import skip_if_absent

    for name in ("hy_v4", "deepseek_v32", "deepseek_v4"):
        skip_if_absent(name)
    hy, v32 = _dims("hy_v4"), _dims("deepseek_v32")
    assert hy.index_mask_layers == hy.layers and v32.index_mask_layers == v32.layers
    assert _dims("deepseek_v4").index_mask_layers == 0 and _dims("llama").index_mask_layers == 0
    for d in (hy, v32):
        plain = dataclasses.replace(d, index_mask_layers=0)
        for attn, per_score in (("eager", 1 + 4), ("sdpa", 1 + 1)):
            kw = {"attn": attn, "activation_checkpointing": True}
            for moment in ("forward", "recompute"):  # the layer's attention, in the forward and in the backward
                gap = (_plan(d, **kw).by_moment[moment]["attention"]["activations"]
                       - _plan(plain, **kw).by_moment[moment]["attention"]["activations"])  # fmt: skip
                assert gap == SEQ * SEQ * per_score, (attn, moment, gap)
        assert _plan(d, cp=2).phases["backward"]["activations"] == _plan(
            plain, cp=2).phases["backward"]["activations"]


def test_bloom_keeps_the_previous_layers_probabilities_beside_the_next_attention():
    """BLOOM's layer loop holds each block's outputs, its attention probabilities among them, until the next block
    returns: with checkpointing (nothing else keeps them) one more ``[heads, S, S]`` in the compute dtype at a layer's
    attention in the forward (a snapshot at 2048 tokens holds four; planned -22% at cp 1 with three, now +0.1%);
    without checkpointing the backward keeps them anyway, and under CP the method computes the attention."""
    bloom = _dims("bloom")
    assert bloom.keeps_returned_probs and not _dims("mpt").keeps_returned_probs
    plain = dataclasses.replace(bloom, keeps_returned_probs=False)
    for c in (4, 2):
        kw = {"attn": "eager", "activation_checkpointing": True, "compute_bytes": c, "master_bytes": c}

        def fwd(d, kw=kw, **more):
            return _plan(d, **{**kw, **more}).by_moment["forward"]["attention"]["activations"]

        assert fwd(bloom) - fwd(plain) == bloom.heads * SEQ * SEQ * c
        assert fwd(bloom, cp=2) == fwd(plain, cp=2)
    assert _plan(bloom, attn="eager").phases["backward"] == _plan(plain, attn="eager").phases["backward"]


def test_gemma3n_checkpointing_keeps_altups_stacked_layer_inputs():
    """Gemma 3n's AltUp hands each decoder layer its ``altup_num_inputs`` predictions stacked (``[K, B, S, h]``):
    checkpointing keeps K ``[N, h]`` per layer and activation offload moves them (with checkpointing at cp 1 planned
    -25%, now -20%: the rest is its layer's own tensors, docs/benchmarks.md)."""
    g = _dims("gemma3n_text")
    k = g.layer_input_copies
    assert k == family_by_name("gemma3n_text").build_config().altup_num_inputs > 1 and _dims("llama").layer_input_copies == 1
    one = dataclasses.replace(g, layer_input_copies=1)
    kw = {"activation_checkpointing": True}
    loss = _plan(g, **kw).phases["loss"]["activations"] - _plan(one, **kw).phases["loss"]["activations"]
    assert loss == g.layers * SEQ * g.hidden * 4 * (k - 1)  # every layer input kept, fp32
    host = _plan(g, activation_offload=True, **kw).host_bytes
    assert host == _plan(one, activation_offload=True, **kw).host_bytes * k


def test_deepseek_v4_eager_scores_cover_its_compressed_entries():
    """DeepSeek-V4's compressed layers append one KV entry per ``compress_rate`` tokens to the window's keys and
    extend the mask to them: at cp 1 its eager scores are ``[heads, S, S (1 + 1 / rate)]`` (the CSA layers' 4: 1.25)
    and the extended mask is in flight at the layer's attention (planned -28% at 2048 tokens without them, -7% with)."""
    from tests.family_matrix import skip_if_absent

    skip_if_absent("deepseek_v4")
    d, llama = _dims("deepseek_v4"), _dims("llama")
    assert d.compressed_keys == 0.25 and llama.compressed_keys == 0.0
    flat = dataclasses.replace(d, compressed_keys=0.0)
    kept, backward = d.eager_scores[0].saved, d.eager_scores[0].backward
    scores = d.heads * SEQ * SEQ * 0.25  # the compressed entries' scores, per layer

    def act(dims, phase, **kw):
        return _plan(dims, attn="eager", **kw).phases[phase]["activations"]

    assert act(d, "loss") - act(flat, "loss") == d.layers * scores * kept
    mask = SEQ * SEQ * 1.25 * 4  # the extended fp32 mask, in flight at the recomputed layer's attention
    assert act(d, "recompute", activation_checkpointing=True) - act(flat, "recompute", activation_checkpointing=True) \
        == scores * backward + mask
    # under CP the method's kernel runs the compressed attention: the extent is the method's
    assert act(d, "loss", cp=2) == act(flat, "loss", cp=2)
    # its sinks (and q_a_norm and kv_norm) are pinned to fp32: a bf16 model's scores turn fp32 where they meet the
    # sinks, and the fp32 probabilities are kept beside their bf16 cast, 6 bytes a score (planned -50% at cp 1 with
    # the plain bf16 figures, -9% with the fp32 ones, +8% now): the probe keeps a pinned tensor in fp32, read off the
    # dtypes of the meta model built in the run's dtype, and the plan takes the larger of the fp32 and bf16 figures
    config = family_by_name("deepseek_v4").build_config()
    with torch.device("meta"):
        half = model_dims(AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.bfloat16))
        llama = model_dims(AutoModelForCausalLM.from_config(family_by_name("llama").build_config(),
                                                            attn_implementation="eager", dtype=torch.bfloat16))
    assert half.eager_scores[0] == d.eager_scores[0] and half.eager_scores[1].saved == 6.0
    assert all(getattr(half.eager_scores[1], k) >= getattr(half.eager_scores[0], k)
               for k in ("saved", "forward", "backward"))  # fmt: skip
    # built in fp32 nothing stands apart as pinned: the sinks follow the probe's dtype, bf16 probabilities alone (the
    # planner builds its meta model in the run's dtype)
    assert d.eager_scores[1].saved == 2.0
    assert llama.eager_scores[1] != llama.eager_scores[0]


@pytest.mark.parametrize("name", ["qwen3", "hunyuan_v1_dense", "persimmon", "lfm2"])
def test_per_head_qk_norms_are_found_by_each_familys_names(name):
    """q/k norms under other names than q_norm / k_norm (HunYuan's query_layernorm, Persimmon's and LFM2's
    q_layernorm) save their input and output per head like Qwen3's: planned without them, HunYuan-Dense's step peak
    was 15-23% under the measured one at cp 1 (``scripts/bench_plan_families.py``), now within -2% / +6%."""
    d = _dims(name)
    assert d.qk_norm
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    with_qk = _plan(d).phases["loss"]["activations"]
    without = _plan(dataclasses.replace(d, qk_norm=False)).phases["loss"]["activations"]
    assert with_qk - without == d.layers * SEQ * 2 * (q + kv) * 4


def test_the_widest_attention_head_is_planned_except_under_mla():
    """Gemma 4's full-attention layers have heads of ``global_head_dim`` (512) beside the sliding layers' ``head_dim``
    (16 in the tiny config): planned at 16, its cp 1 peak with checkpointing was 82% under the measured one. MLA keeps
    the config's head size, which the CP methods' rows are measured with."""
    gemma4 = _dims("gemma4_text")
    assert {(s.qk_head_dim, s.v_head_dim) for s in gemma4_profile_layers()} == {(16, 16), (512, 512)}
    assert gemma4.head_dim == 512
    assert _dims("deepseek_v3").head_dim == family_by_name("deepseek_v3").build_config().v_head_dim
    assert _dims("llama").head_dim == 16


def gemma4_profile_layers():
    from automodel.distributed.cp.guard import cached_profile

    fam = family_by_name("gemma4_text")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
    return [layer for layer in cached_profile(model).layers if layer.is_attention]


def test_mlp_activation_probe_runs_anywhere_and_leaves_the_random_stream_alone():
    """The planner's activation probe (``mlp_memory.plain_mlp_moments``) runs while a model is built on the meta device
    or under no_grad, and draws nothing from torch's generator (a dry run before training must not shift the seed's
    stream)."""
    from transformers.activations import ACT2FN

    from automodel.training.mlp_memory import _CACHE, plain_mlp_moments

    _CACHE.clear()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with torch.device("meta"), torch.no_grad():
        assert plain_mlp_moments(ACT2FN["gelu"]) == (2.0, 2.0, 3.1)
        assert plain_mlp_moments(ACT2FN["relu"])[0] == 1.0  # its output is what it saves
    assert torch.equal(torch.rand(3), expected)


def test_norms_that_compute_in_fp32_save_their_input_copy_in_bf16():
    """transformers' RMSNorm upcasts its input: in bf16 it saves the fp32 copy (2 units of [N, h] bf16) and the
    normalized bf16 tensor, 3 units where fp32 saves 2 (its input and the normalized); Gemma's saves 4; nn.LayerNorm
    saves its input in either dtype. The planner adds the difference per norm in bf16 / fp16 and nothing in fp32
    (scripts/bench_memory.py --structures only --structures-dtype bfloat16: the Gemma-3-like rows planned -19% / -16%
    below the measured peaks without it, -5% / -5% with it)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from automodel.training.norm_memory import half_precision_extra, saved_units

    assert saved_units(LlamaRMSNorm(64), torch.float32, 64) == pytest.approx(2, abs=0.05)
    assert saved_units(LlamaRMSNorm(64), torch.bfloat16, 64) == pytest.approx(3, abs=0.05)
    assert half_precision_extra([LlamaRMSNorm(64), torch.nn.LayerNorm(64)], 64) == pytest.approx(1, abs=0.05)
    assert half_precision_extra([Gemma3RMSNorm(64)], 64) == pytest.approx(2, abs=0.05)
    with torch.device("meta"):
        meta = LlamaRMSNorm(96)
    assert half_precision_extra([meta], 96) == pytest.approx(1, abs=0.05)

    class Broken(torch.nn.Module):  # a norm the CPU probe cannot run counts nothing
        def forward(self, x):
            raise RuntimeError("needs CUDA")

    assert half_precision_extra([Broken()], 64) == 0.0

    llama, neox = _dims("llama"), _dims("gpt_neox")
    assert (llama.norm_half_extra, llama.final_norm_half_extra) == pytest.approx((2, 1), abs=0.1)
    assert (neox.norm_half_extra, neox.final_norm_half_extra) == (0.0, 0.0)
    for c, extra in ((4, 0), (2, 1)):
        r = RunShape(local_batch=1, seq=1024, chunk_tokens=256, compute_bytes=c, master_bytes=c)
        without = dataclasses.replace(llama, norm_half_extra=0.0, final_norm_half_extra=0.0)
        got = plan_memory(llama, r).phases["loss"]["activations"] - plan_memory(without, r).phases["loss"]["activations"]
        want = extra * 1024 * (llama.layers * llama.norm_half_extra + llama.final_norm_half_extra) * llama.hidden * c
        assert got == pytest.approx(want), (c, got, want)


def test_the_final_norm_is_a_moment_of_its_own():
    """The final norm runs after every layer has saved its tensors, and without checkpointing its backward comes
    before any layer's has freed them: its forward holds its input, its copies and its output; its backward the
    incoming gradient and the reduction's gradient temporaries (transformers' RMSNorm: five fp32 [N, h], which do not
    halve in bf16). Without this moment the bf16 hidden-512 Llama row of scripts/bench_memory.py --structures only
    --structures-dtype bfloat16 was planned 9% below its measured peak (now -2%: that moment is the step's peak)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from automodel.training.norm_memory import RMS_NORM_PEAKS, NormPeaks, norm_peaks, peak_units

    assert peak_units(LlamaRMSNorm(64), torch.float32, 64) == pytest.approx((3, 6), abs=0.1)
    assert peak_units(LlamaRMSNorm(64), torch.bfloat16, 64) == pytest.approx((7, 12), abs=0.1)
    assert peak_units(torch.nn.LayerNorm(64), torch.bfloat16, 64) == pytest.approx((2, 3), abs=0.1)
    with torch.device("meta"):
        meta = LlamaRMSNorm(96)
    fp32, bf16 = norm_peaks([meta, torch.nn.LayerNorm(96)], 96)  # each figure the larger of the two norms'
    assert (fp32.forward, fp32.backward, bf16.forward, bf16.backward) == pytest.approx((3, 6, 7, 12), abs=0.1)
    # in token tiles (automodel.models.tiled_mlp.tile_final_norms): the input, the output or the gradients, plus a tile's share
    assert bf16.tiled_backward == pytest.approx((3.5, 13), abs=0.1) and bf16.tiled_forward[0] == pytest.approx(3.4, abs=0.1)
    assert bf16.at(1 / 64) == pytest.approx((3.4 + 7 / 64, 3.5 + 13 / 64), abs=0.1)

    class Broken(torch.nn.Module):  # a norm the CPU probe cannot run: transformers' RMSNorm's figures
        def forward(self, x):
            raise RuntimeError("needs CUDA")

    assert norm_peaks([Broken()], 64) == RMS_NORM_PEAKS
    assert norm_peaks([], 64) == RMS_NORM_PEAKS
    ln = _dims("gpt2").final_norm_peaks[1]  # nn.LayerNorm: its input and output, its gradients
    assert (ln.forward, ln.backward) == pytest.approx((2, 3), abs=0.1)

    # a Llama whose MLP is narrow next to its hidden size (the bench's hidden-512 row's proportions), bf16, no
    # checkpointing: the final norm's backward is the step's peak, and its moment is what every layer saved (the loss
    # phase's activations less the final norm's own tensors, the LM head's input among them) plus 12 units
    llama = _dims("llama", hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=128)  # fmt: skip
    n, h, c = 2048, 512, 2
    r = RunShape(local_batch=1, seq=n, chunk_tokens=256, compute_bytes=c, master_bytes=c, reduce_bytes=c)
    plan = plan_memory(llama, r)
    assert plan.peak_phase == "backward" and plan.moments["backward"] == "final norm"
    from automodel.training.memory_plan import memory_plan_lines

    assert any("<- step peak (at the final norm)" in line for line in memory_plan_lines(llama, r))  # the dry run says
    final_saved = n * h * c * (3 + llama.final_norm_half_extra)
    layers_saved = plan.phases["loss"]["activations"] - final_saved
    assert plan.by_moment["backward"]["final norm"]["activations"] == pytest.approx(layers_saved + 12.03 * n * h * c, rel=1e-3)
    assert plan.by_moment["forward"]["final norm"]["activations"] == pytest.approx(layers_saved + 7.03 * n * h * c, rel=1e-3)
    zero = NormPeaks(0, 0, (0, 0), (0, 0))
    without = plan_memory(dataclasses.replace(llama, final_norm_peaks=(zero, zero)), r)
    assert plan.step_peak_bytes - without.step_peak_bytes > 3 * n * h * c  # the moment decides the figure
    # with checkpointing only the layers' inputs are kept: the recomputed layer stays the peak
    ac = plan_memory(llama, dataclasses.replace(r, activation_checkpointing=True))
    assert ac.moments["recompute"] != "final norm"


def test_qk_norms_that_compute_in_fp32_save_their_copies_in_bf16():
    """Per-head q/k norms (Qwen3, Gemma 3, OLMo 2) upcast like the hidden-size ones: in bf16 they save the fp32 copy
    of q and k besides (Qwen3's RMSNorm 1 unit of [N, q + kv], Gemma 3's 2). OLMo 2's q norm spans the whole q (a
    [hidden] weight) and is counted as a q/k norm, not as a hidden-size norm of the layer."""
    qwen, gemma, olmo = _dims("qwen3"), _dims("gemma3_text"), _dims("olmo2")
    assert qwen.qk_norm and qwen.qk_norm_half_extra == pytest.approx(1, abs=0.1)
    assert gemma.qk_norm_half_extra == pytest.approx(2, abs=0.1)
    assert olmo.qk_norm and olmo.layer_norms == 2 and olmo.qk_norm_half_extra == pytest.approx(2, abs=0.1)
    assert _dims("llama").qk_norm_half_extra == 0.0
    q, kv = qwen.heads * qwen.head_dim, qwen.kv_heads * qwen.head_dim
    for c, extra in ((4, 0), (2, 1)):
        r = RunShape(local_batch=1, seq=1024, chunk_tokens=256, compute_bytes=c, master_bytes=c)
        without = dataclasses.replace(qwen, qk_norm_half_extra=0.0)
        got = plan_memory(qwen, r).phases["loss"]["activations"] - plan_memory(without, r).phases["loss"]["activations"]
        want = extra * 1024 * qwen.layers * qwen.qk_norm_half_extra * (q + kv) * c
        assert got == pytest.approx(want), (c, got, want)


@pytest.mark.parametrize("tiling", ["tiled_mlp", "tiled_layer"])
def test_bf16_norm_backwards_planned_as_measured_under_tiling(tiling):
    """Checkpointing in bf16 with the MLP tiled: whole, the recomputed layer's peak was its post-attention norm's
    backward (transformers' RMSNorm: five fp32 [N, h] temporaries beside its input's fp32 copy; planned 34% low
    without that moment); the tiled MLP now runs the layers' norms in tiles too, and that moment falls below the
    others. With the tiled layer the norms run per tile, and the final norm, tiled with it, no longer peaks: each plan
    within 10% of the tracked step (forward, loss and backward; the plan's optimizer phase is below them).
    Measured 2026-12-06 (measured / planned MiB): tiled MLP 22.9 / 23.1 with the norms whole, 12.1 / 13.2 with
    them in tiles; tiled layer 11.1 / 11.8."""
    from transformers import LlamaConfig

    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.tiled_layer import apply_tiled_layer
    from automodel.models.tiled_mlp import apply_tiled_mlp, tile_counts
    from automodel.training.step import forward_loss_sum
    from scripts.live_tensors import AllocationTracker

    seq, chunk = 4096, 512
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=seq, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).train()
    tile = 256  # tokens per tile (fewer tiles than true's 128: the same moments, half the Python calls)
    apply_tiled_mlp(model, tile)
    if tiling == "tiled_layer":
        apply_tiled_layer(model, tile)
    apply_activation_checkpointing(model)
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        (forward_loss_sum(model, {"input_ids": ids}, labels, chunk) / seq).backward()

    step()  # the first-call probes
    tracker = AllocationTracker()
    with tracker:
        step()
    assert [c.tiled_calls for c in tile_counts(model, "final_norm")] == [2]
    shape = RunShape(local_batch=1, seq=seq, chunk_tokens=chunk, activation_checkpointing=True, compute_bytes=2,
                     master_bytes=2, reduce_bytes=2, tiled_mlp=tile, tiled_layer=tile if tiling == "tiled_layer" else False)  # fmt: skip
    plan = plan_memory(model_dims(model), shape)
    planned = max(sum(plan.phases[p].values()) for p in ("forward", "loss", "recompute"))
    assert abs(planned - tracker.peak) <= 0.1 * tracker.peak, (planned / 2**20, tracker.peak / 2**20, plan.moments)
    # the decoder layers' norms ran in tiles (with the tiled layer: inside its tiles), so their backward is no longer
    # the recomputed layer's peak (it was with the norms whole: 12 [N, h] bf16 units)
    norms = tile_counts(model, "layer_norm")
    assert len(norms) == 4 and all(c.calls == c.tiled_calls + c.in_layer_tiles for c in norms), norms
    assert plan.moments["recompute"] != "norm" and plan.by_moment["recompute"]["norm"]["activations"] < 0.95 * planned


def test_parameter_free_layer_norms_are_found_tiled_and_counted():
    """NanoChat's RMSNorms and OLMo's LayerNorm have no weight: the decoder layers' own ones are norms over the hidden
    size all the same (``tiled_mlp.is_hidden_norm``, one rule for the tiled MLP and the plan), so the tiled MLP runs
    them in tiles and the plan counts what they save (bf16: their input's fp32 copy). Before, neither found them, and
    the plan took them as tiled while they ran whole: NanoChat bf16 with checkpointing and the tiled MLP was planned
    28% under its measured peak at hidden 256. A parameter-free norm inside the attention (Gemma 3n's value norm) names
    no width and is not one; a layer whose norms are none of these (Qwen4-Exp's hyper-connection norms, over 4 h) is
    not planned as tiled."""
    from automodel.models.tiled_mlp import find_layer_norms, is_hidden_norm

    fam = family_by_name("nanochat")
    model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation="sdpa")
    layer, hidden = model.model.layers[0], model.config.hidden_size
    assert [n for n, _ in find_layer_norms(model)][:2] == ["model.layers.0.input_layernorm",
                                                           "model.layers.0.post_attention_layernorm"]  # fmt: skip
    assert not is_hidden_norm(layer.input_layernorm, hidden)  # held by the layer is what says its width
    assert not is_hidden_norm(layer.self_attn.q_norm, hidden, held_by_layer=False)
    d = model_dims(model)
    assert d.layer_norm_tiles and d.layer_norms == 2
    # bf16: each saves its input's fp32 copy (2 bf16 units beyond fp32's), the q/k norms likewise per head
    assert d.norm_half_extra == pytest.approx(2.0, abs=0.1) and d.qk_norm_half_extra == pytest.approx(1.0, abs=0.1)
    assert d.final_norm_half_extra == pytest.approx(1.0, abs=0.1)
    olmo = AutoModelForCausalLM.from_config(family_by_name("olmo").build_config(), attn_implementation="sdpa")
    assert is_hidden_norm(olmo.model.layers[0].input_layernorm, hidden)  # normalized_shape says (hidden,)
    assert not is_hidden_norm(olmo.model.layers[0].input_layernorm, hidden + 1, held_by_layer=True)
    assert model_dims(olmo).norm_half_extra > 1.5
    for name, where in (("gemma3n_text", "self_attn.v_norm"), ("qwen4_exp_text", "attn_hyper_connection.hc_norm")):
        fam = family_by_name(name)
        with torch.device("meta"):
            other = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
        assert not any(n.endswith(where) for n, _ in find_layer_norms(other)), name
    assert not _dims("qwen4_exp_text").layer_norm_tiles


def _tracked_step_peak(model, vocab: int, seq: int, chunk: int | None) -> int:  # noqa: ANN001
    """The tracked allocations' peak (bytes) of one training step (forward, loss, backward) of ``model`` on one row of
    ``seq`` random token ids, after a first step (the first-call probes)."""
    from automodel.training.step import forward_loss_sum
    from scripts.live_tensors import AllocationTracker

    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        (forward_loss_sum(model, {"input_ids": ids}, labels, chunk) / seq).backward()

    step()
    gc.collect()
    tracker = AllocationTracker()
    with tracker:
        step()
    return tracker.peak


@pytest.mark.parametrize(
    ("name", "dtype", "chunk", "tiled", "ac", "vocab", "peak"),
    [("llama", torch.bfloat16, 256, False, True, 16384, "loss"), ("llama", torch.float32, 256, False, True, 16384, "loss"),
     ("nanochat", torch.bfloat16, None, False, True, 16384, "loss"),
     ("nanochat", torch.bfloat16, None, True, True, 128, "recompute"),
     ("mixtral", torch.bfloat16, 256, True, True, 128, "recompute"), ("phi3", torch.bfloat16, 256, False, False, 128, "backward"),
     ("glm4", torch.bfloat16, 256, False, True, 128, "recompute"),
     ("minimax_m3_vl_text", torch.bfloat16, 256, False, False, 128, "backward"),
     ("bitnet", torch.bfloat16, 256, False, True, 128, "recompute"),
     ("diffllama", torch.bfloat16, 256, False, False, 128, "backward"),
     ("gemma3n_text", torch.bfloat16, None, False, True, 128, "recompute")],
    ids=["chunked-bf16", "chunked-fp32", "softcap-bf16", "norms-tiled-bf16", "moe-tiled-bf16", "fused-qkv-bf16",
         "post-mlp-norm-bf16", "experts-gate-bf16", "mlp-norm-backward-bf16", "two-kernel-calls-bf16",
         "altup-correct-bf16"],
)  # fmt: skip
def test_cp1_terms_planned_as_measured_at_hidden_256(name, dtype, chunk, tiled, ac, vocab, peak):
    """A training step (forward, loss, backward; with checkpointing but Phi-3's) against the plan, hidden 256:
    - the chunked loss's backward (vocabulary 16384, where the loss is the step's peak): in bf16 each chunk's
      weight-gradient product is added into the fp32 sum without an fp32 copy of it (it was: 67.6 MiB measured,
      planned 59.7), fp32 adds it in place; now 51.6 / 51.7 in bf16;
    - NanoChat's soft-capped logits (the plain loss: ``chunk_tokens: auto`` keeps it): its ``tanh`` output, kept for
      the backward beside the loss's fp32 tensors (planned 14% low without it);
    - NanoChat with the tiled MLP (vocabulary 128: the recomputed layer peaks): its parameter-free norms in tiles
      (at 2048 tokens, scripts/bench_plan_families.py: measured 26.4 MiB whole, planned 19.1; now 19.3 measured,
      20.6 planned);
    - Mixtral with the tiled MLP: the tiled backward's weight gradients are the whole MoE block's, every expert's
      (``ModelDims.mlp_weights``), a tile's and their fp32 running sum (planned as one expert's, at 2048 tokens:
      31.5 MiB measured, 24.8 planned; now 34.2; here at 1024 tokens 28.2 measured, 20.5 planned before);
    - Phi-3 without checkpointing (vocabulary 128): v, a view of its fused qkv_proj output, keeps all of it alive in
      every layer (``ModelDims.fused_qkv``; at 2048 tokens 63.5 MiB measured, 59.5 planned before, 62.5 now);
    - GLM-4 with checkpointing (vocabulary 128): its post_mlp_layernorm's backward comes while the MLP's saved
      tensors are alive (``_layer_norm_moment``; 2048 tokens: 42.9 MiB measured, 39.4 planned before, 46.5 now; at
      1024 tokens the old plan's MLP moment was within 5%, so this row runs 2048);
    - MiniMax-M3 without checkpointing (vocabulary 128): its experts' clamped, sigmoid-gated activation keeps 7
      ``[k N, I_e]`` per routed copy where SiLU's keeps 4 (``ModelDims.experts_gate_extra``; at 2048 tokens, hidden
      256: -24.5% before, -0.5% now);
    - BitNet with checkpointing (vocabulary 128): its MLP's norm over ``I`` (``ffn_sub_norm``) runs its backward in
      fp32, 6 ``[N, I]`` (bf16 units) above what it saves more at the recomputed MLP's backward
      (``ModelDims.mlp_peak_extra``; at 2048 tokens -27.8% before, +0.2% now);
    - DiffLlama without checkpointing (vocabulary 128): two kernel calls per layer on the halves of V, their outputs'
      concatenation, difference and group norm (``ModelDims.attention_saved_extra``; at 2048 tokens -19.7% before,
      -4.1% now);
    - Gemma 3n with checkpointing (vocabulary 128): its layer's backward begins with its AltUp correction's, which
      holds ``[K, N, h]`` gradients of its product, innovation and predictions and its norms' fp32 temporaries while
      every tensor the recomputed layer saved is alive (``ModelDims.residual_backward_extra``, the moment
      ``residual streams``; scripts/bench_plan_families.py at 2048 tokens, the optimizer's states alive: -9.4%
      before, +2.2% now; here, the step alone: -1.7% before, +3.8% now, the row checks that moment).
    Each within -5% / +10% of the tracked peak."""
    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.tiled_mlp import apply_tiled_mlp

    seq, fam = 2048 if name in ("glm4", "gemma3n_text") else 1024, family_by_name(name)
    config = fam.build_config()
    sizes = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                 vocab_size=vocab, max_position_embeddings=seq, use_cache=False)  # fmt: skip
    for key, value in sizes.items():
        default = getattr(config, key, None)
        setattr(config, key, [value] * len(default) if isinstance(default, list) else value)  # Gemma 3n's per layer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).train()
    if tiled:
        apply_tiled_mlp(model, True)
    if ac:
        apply_activation_checkpointing(model)
    measured = _tracked_step_peak(model, config.vocab_size, seq, chunk)
    size = torch.finfo(dtype).bits // 8
    shape = RunShape(local_batch=1, seq=seq, chunk_tokens=chunk, activation_checkpointing=ac, compute_bytes=size,
                     master_bytes=size, reduce_bytes=size, tiled_mlp=tiled)  # fmt: skip
    d = model_dims(model)
    plan = plan_memory(d, shape)
    backward = "recompute" if ac else "backward"
    phases = {p: sum(plan.phases[p].values()) for p in ("forward", "loss", backward)}
    planned = max(phases.values())
    assert -0.05 <= (planned - measured) / measured <= 0.10, (planned / 2**20, measured / 2**20)
    assert max(phases, key=phases.get) == peak, phases  # the moment whose term the row checks
    assert d.fused_qkv == (name == "phi3")
    assert (plan.moments[backward] == "residual streams") == (name == "gemma3n_text"), plan.moments


def test_a_fused_qkv_projection_with_rope_keeps_its_output_per_layer():
    """One projection for q, k and v (Phi-3's qkv_proj, GPT-NeoX's query_key_value) and RoPE, which replaces q and k:
    v, a view of the projection's output, keeps all of it alive, ``q + kv`` more per token and layer than the v the
    plan counts; without RoPE (GPT-2's c_attn, BLOOM) q, k and v are all views, already counted; separate
    projections (Llama) keep nothing more. Where K/V are repeated to the query heads the view is freed."""
    fused = {name: _dims(name).fused_qkv for name in ("phi3", "gpt_neox", "gpt2", "bloom", "llama")}
    assert fused == {"phi3": True, "gpt_neox": True, "gpt2": False, "bloom": False, "llama": False}
    d = _dims("phi3")
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    on, off = (_plan(dataclasses.replace(d, fused_qkv=f)) for f in (True, False))
    extra = on.phases["backward"]["activations"] - off.phases["backward"]["activations"]
    assert extra == pytest.approx(d.layers * SEQ * (q + kv) * 4)


def _looped_step_peaks(name: str, ac: bool, **overrides) -> tuple[float, float, Any]:
    """``(measured, planned, dims)``: the tracked step peak of one 1024-token row of the family's tiny config with
    ``overrides`` (fp32, the chunked loss), and the plan's peak over the forward, the loss and the backward."""
    from automodel.models.block_call import apply_activation_checkpointing
    from tests.family_matrix import cycled

    seq, config = 1024, family_or_skip(name).build_config()
    for key, value in dict(max_position_embeddings=seq, use_cache=False, **overrides).items():
        setattr(config, key, value)
    if len(getattr(config, "layer_types", None) or ()) not in (0, config.num_hidden_layers):
        config.layer_types = cycled(config.layer_types, config.num_hidden_layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if ac:
        apply_activation_checkpointing(model)
    measured = _tracked_step_peak(model, config.vocab_size, seq, 256)
    d = model_dims(model)
    plan = plan_memory(d, RunShape(local_batch=1, seq=seq, chunk_tokens=256, activation_checkpointing=ac))
    phases = ("forward", "loss", "recompute" if ac else "backward")
    return measured, max(sum(plan.phases[p].values()) for p in phases), d


@pytest.mark.parametrize(
    ("name", "fewer", "more"),
    [("dory", dict(n_recurrent_loops=1), dict(n_recurrent_loops=3)),
     ("hrm_text", dict(L_bp_cycles=[1]), dict(L_bp_cycles=[3]))],
    ids=["dory", "hrm"],
)  # fmt: skip
def test_a_looped_model_is_planned_per_layer_call(name, fewer, more):
    """A looped model's layers run more than once a forward (``ModelDims.layer_calls``): Dory's recurrent slice
    ``n_recurrent_loops`` times, HRM's L stack once per cycle with autograd (``L_bp_cycles``). Each call saves its
    layer's activations again, or, checkpointed, its input, and each pass keeps one more hidden state between the
    passes (``loop_restarts``). Two more passes (4 more layer calls) must grow the plan as they grow the measured
    peak: with checkpointing within 5% (the kept inputs), without it within 15% (Dory's nGPT layer is not the plan's
    per-layer shape: its L2 norms and interpolations; +12% measured since its MLP's norm over ``I`` and its output
    gate are counted, -13% before). The plan counted every layer once: it grew by nothing, and Dory's row read
    -54%."""
    base = dict(num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2) if name == "dory" else {}
    for ac, bound in ((True, 0.05), (False, 0.15)):
        m1, p1, d1 = _looped_step_peaks(name, ac, **base, **fewer)
        m3, p3, d3 = _looped_step_peaks(name, ac, **base, **more)
        assert d3.calls - d1.calls == 4 and d3.loop_restarts - d1.loop_restarts == 2, (d1, d3)
        grown, planned = m3 - m1, p3 - p1
        assert abs(planned - grown) <= bound * grown, (ac, grown / 2**20, planned / 2**20)
        if name == "hrm_text" and ac:  # its layer's own terms are planned: the whole row too
            assert -0.05 <= (p3 - m3) / m3 <= 0.10, (m3 / 2**20, p3 / 2**20)


@pytest.mark.parametrize("name", ["llama", "bitnet", "dory", "gemma3n_text"])
def test_a_gated_mlp_block_is_planned_at_what_it_saves(name):
    """A gated dense MLP block saves ``4 I`` per token (gate, up, ``act(gate)``, the product), or more: BitNet's and
    Dory's norm over ``I`` (with its fp32 copy in bf16), BitNet's SwiGLU in fp32. The meta-device probe
    (``mlp_memory.dense_mlp_saved``) counts exactly what a real CPU forward of the block saves for its backward (its
    input and weights left out), in fp32 and bf16, tiled or not, and the plan's MLP term is that count
    (``ModelDims.mlp_saved_extra``; it was ``4 I`` for every gated block: BitNet bf16 without checkpointing -35% at
    hidden 256, now -17%, the rest its norm's backward temporaries; Dory -29% -> -8%)."""
    from automodel.models.parallelize import decoder_layers
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.memory_plan import _mlp_moments
    from automodel.training.mlp_memory import _SAVED_CACHE, dense_mlp_of, dense_mlp_saved

    for dtype, c, which in ((torch.float32, 4, 0), (torch.bfloat16, 2, 1)):
        model = family_or_skip(name).build_model(0).to(dtype)
        mlp, hidden = dense_mlp_of(decoder_layers(model)[0]), model.config.hidden_size
        x = torch.randn(1, 64, hidden, dtype=dtype, requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in (x, *mlp.parameters())}
        saved = {}

        def pack(t, skip=skip, saved=saved):  # noqa: ANN001, ANN202
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            mlp(x)
        measured = sum(saved.values()) / 64 / c  # elements per token
        _SAVED_CACHE.clear()
        probed = dense_mlp_saved(mlp, hidden)[which]
        apply_tiled_mlp(model, 16)  # tiled: the probe measures the block whole all the same
        _SAVED_CACHE.clear()
        assert dense_mlp_saved(mlp, hidden)[which] == probed
        assert probed == pytest.approx(measured, rel=1e-3), (dtype, probed, measured)
        d = model_dims(model)
        assert _mlp_moments(d, c).saved == pytest.approx(max(measured, 4 * d.intermediate), rel=2e-3), dtype
    assert (d.mlp_saved_extra == (0.0, 0.0)) == (name == "llama"), d.mlp_saved_extra


def test_an_attention_output_gate_is_found_and_counted_per_layer_call():
    """``out * sigmoid(gate_proj(x))`` in the attention (AFMoE, Beam, HRM, Dory, HY-V4; a gate per head: Laguna's
    ``g_proj``, dots3's) keeps the sigmoid's output and the gated product, which the output projection saves in place
    of the kernel's output: ``2 q`` per token and layer call (a gate per head: ``q + heads``). Llama has none; an MLP's
    ``gate_proj`` is not one. Measured (``scripts/bench_plan_families.py``, bf16, hidden 256, 2048 tokens, the four
    technique rows): HRM -5% / -3% / -9% / -20% -> +3% / +1% / -3% / -3%, Beam -17% / -12% -> -13% / -9%, Dory
    -8% / -19% / -12% / -15% -> -4% / -17% / -8% / -7%, AFMoE +2% .. +6% -> +5% .. +13%."""
    from automodel.training.memory_plan import _attn_output_gate

    assert _dims("hrm_text").attn_output_gate == 2.0 and _dims("afmoe").attn_output_gate == 2.0
    assert _dims("llama").attn_output_gate == 0.0 and _dims("qwen3").attn_output_gate == 0.0
    d = _dims("laguna")
    assert d.attn_output_gate == pytest.approx(1 + d.heads / (d.heads * d.head_dim))
    n, seq = 1, 2048
    hrm = _dims("hrm_text")
    plain = dataclasses.replace(hrm, attn_output_gate=0.0)
    for ac in (False, True):
        grown = plan_memory(hrm, RunShape(local_batch=n, seq=seq, activation_checkpointing=ac))
        base = plan_memory(plain, RunShape(local_batch=n, seq=seq, activation_checkpointing=ac))
        q = hrm.heads * hrm.head_dim
        saved = grown.terms["activations"].bytes - base.terms["activations"].bytes
        # every layer call's gate tensors without checkpointing (10 calls); one layer's, recomputed, with it
        assert saved == pytest.approx((1 if ac else hrm.calls) * seq * 2 * q * 4), (ac, saved)
    assert _attn_output_gate(None, 64, 64, 4) == {"attn_output_gate": 0.0}


def test_an_output_gate_in_the_query_projection_or_past_the_first_layer_is_found():
    """Qwen3-Next, Qwen3.5 and Qwen4-Exp split each head's ``q_proj`` output into its query and an output gate
    (``query_gate``); Qwen3-Next's, LFM3's and Bailing-hybrid's first layers are linear attention or convolutions, so
    the gate is read off the first layer the profile marks as attention (LFM3's and Bailing-hybrid's ``g_proj``: one
    value per head). MLA's wider query head is not a gate, and a gate made by ``q_proj`` in fp32 keeps the whole
    projection where the q norm saves its input view: ``q`` more per token and layer, not in bf16."""
    for name in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen4_exp_text"):
        family_or_skip(name)
        d = _dims(name)
        assert (d.attn_output_gate, d.query_gate, d.qk_norm) == (2.0, True, True), name
    for name in ("lfm3", "bailing_hybrid"):
        family_or_skip(name)
        d = _dims(name)
        assert d.attn_output_gate == pytest.approx(1 + d.heads / (d.heads * d.head_dim)) and not d.query_gate, name
    for name in ("deepseek_v2", "sarvam_mla", "kimi_linear", "qwen3", "llama", "axk2"):
        d = _dims(name)
        assert (d.attn_output_gate, d.query_gate) == (0.0, False), name
    # MiniCPM5-MoE names its query and gate projection q_gate_proj (no q/k norm): planned without it, its tiled-MLP
    # row read -9.4% (bf16, hidden 256, 2048 tokens), +4.6% with it
    family_or_skip("minicpm5_moe")
    assert (lambda d: (d.attn_output_gate, d.query_gate, d.qk_norm))(_dims("minicpm5_moe")) == (2.0, True, False)
    d = _dims("qwen3_5_text")
    q = d.heads * d.head_dim
    for size, extra in ((4, 3), (2, 2)):  # fp32: the sigmoid's output, the product and q_proj's other half
        shape = dict(activation_checkpointing=False, compute_bytes=size, master_bytes=size, reduce_bytes=size)
        gated, plain = (_plan(x, **shape) for x in (d, dataclasses.replace(d, attn_output_gate=0.0, query_gate=False)))
        saved = gated.terms["activations"].bytes - plain.terms["activations"].bytes
        assert saved == pytest.approx(d.calls * SEQ * extra * q * size), size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_query_projection_gate_is_planned_as_measured(dtype):
    """Qwen3.5 with every layer full attention (its linear-attention layers' CPU reference kernel holds chunk tensors
    the CUDA kernel does not make), hidden 256, 1024 tokens, without checkpointing, where every layer's gate tensors
    are alive at the backward's start: the step's tracked peak against the plan, within -5% / +10%. Planned without the
    gate, fp32 read -7% and bf16 -6% at 2048 tokens (scripts/bench_plan_families.py's shapes)."""
    config = family_or_skip("qwen3_5_text").build_config()
    seq = 1024
    sizes = dict(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                 max_position_embeddings=seq, use_cache=False)  # fmt: skip
    for key, value in sizes.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).train()
    measured = _tracked_step_peak(model, config.vocab_size, seq, 256)
    size = torch.finfo(dtype).bits // 8
    shape = RunShape(local_batch=1, seq=seq, chunk_tokens=256, compute_bytes=size, master_bytes=size, reduce_bytes=size)
    d = model_dims(model)
    assert d.query_gate
    planned = max(sum(plan_memory(d, shape).phases[p].values()) for p in ("forward", "loss", "backward"))
    assert -0.05 <= (planned - measured) / measured <= 0.10, (planned / 2**20, measured / 2**20)


def test_hyper_connected_layers_keep_their_streams_and_mixing():
    """DeepSeek-V4 (``hc_mult``), HY-V4 and Qwen4-Exp (``hc_count``) pass ``K`` residual streams from layer to layer
    and mix them around the attention and the MLP: checkpointing keeps ``K [N, h]`` per layer
    (``layer_input_copies``), and each layer's residual structure saves what the meta-device probe counts
    (``residual_memory.residual_saved``, its attention and MLP stubbed out, less a plain pre-norm layer of its norms:
    the stream term's part). The probe equals what a real CPU forward without hooks keeps alive (every tensor it made,
    with its output alive, less the output, the parameters and the input), is the same on every call (a stubbed
    block's freed parameters are not taken for the layer's), and is 0 for a model of one stream. Measured
    (scripts/bench_plan_families.py's rows, fp32, hidden 64, 2048 tokens, no checkpointing / checkpointing / both
    with the tiled MLP / the tiled MLP alone): DeepSeek-V4 -8% / -7% / -7% / -7% -> +3% / -5% / -5% / +5%; Qwen4-Exp
    -39% / -37% / -46% / -43% -> -5% / -0% / -8% / -5%."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from automodel.models.parallelize import decoder_layers
    from automodel.models.tiled_mlp import is_hidden_norm
    from automodel.training import residual_memory
    from automodel.training.residual_memory import _BLOCK_NAMES, _TUPLE_NAMES, _model_class, _Stub

    class Made(TorchDispatchMode):  # every tensor an op makes, weakly
        def __init__(self) -> None:
            super().__init__()
            self.made: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            self.made += [weakref.ref(t) for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    for name, streams in (("deepseek_v4", 4), ("hy_v4", 4), ("qwen4_exp_text", 4)):
        fam = family_or_skip(name)
        d = _dims(name)
        assert d.layer_input_copies == streams and min(d.residual_saved_extra) > streams, (name, d.residual_saved_extra)
        config = fam.build_config().get_text_config()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
        cls = _model_class(decoder_layers(model)[0])
        probed = residual_memory._saved_on_meta(cls, config, streams, torch.float32)
        assert residual_memory._saved_on_meta(cls, config, streams, torch.float32) == probed
        assert d.residual_saved_extra[0] == pytest.approx(probed + streams - 1)
        # the same layer on the CPU, its attention and MLP stubbed as the probe's, run without hooks
        torch.manual_seed(0)
        layer = cls(config, 0)
        norms = [m for _, m in layer.named_children() if is_hidden_norm(m, config.hidden_size, held_by_layer=True)]
        with torch.device("meta"):
            plain = residual_memory._plain_saved_on_meta([type(n)(config.hidden_size) for n in norms], 64,
                                                         config.hidden_size, torch.float32)  # fmt: skip
        for block in _BLOCK_NAMES:
            if isinstance(getattr(layer, block, None), torch.nn.Module):
                setattr(layer, block, _Stub(3 if name == "hy_v4" and block in _TUPLE_NAMES else
                                            2 if block in _TUPLE_NAMES else 0))  # fmt: skip
        if getattr(layer, "ple", None) is not None:
            layer.ple = None
        shape = (1, 64, streams * config.hidden_size) if name == "qwen4_exp_text" else (1, 64, streams, config.hidden_size)
        x = torch.randn(shape, requires_grad=True)
        made = Made()
        with made:
            out = layer(x, position_embeddings=None, attention_mask=None)
        kept = {t.untyped_storage()._cdata for t in (*layer.parameters(), x, *torch.utils._pytree.tree_leaves(out))
                if isinstance(t, torch.Tensor)}  # fmt: skip
        alive = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in (r() for r in made.made)
                 if t is not None and t.untyped_storage()._cdata not in kept}  # fmt: skip
        assert probed == pytest.approx((sum(alive.values()) - plain) / 64 / config.hidden_size / 4), name
        del out
    for name in ("llama", "qwen3_next"):  # one stream (Gemma 3n's stacked predictions: the next test)
        assert _dims(name).residual_saved_extra == (0.0, 0.0), name
    assert _dims("gemma3n_text").layer_input_copies == family_by_name("gemma3n_text").build_config().altup_num_inputs
    assert _dims("llama").layer_input_copies == 1
    d = _dims("deepseek_v4")
    plain = dataclasses.replace(d, residual_saved_extra=(0.0, 0.0))
    for ac in (False, True):
        grown, base = (_plan(x, activation_checkpointing=ac).terms["activations"].bytes for x in (d, plain))
        # every layer's residual tensors without checkpointing; the recomputed layer's with it
        assert grown - base == pytest.approx((1 if ac else d.calls) * SEQ * d.residual_saved_extra[0] * d.hidden * 4)
    # checkpointing keeps each layer's K streams: (K - 1) [N, h] more per layer than one stream
    one = dataclasses.replace(d, layer_input_copies=1)
    kept = [_plan(x, activation_checkpointing=True).terms["activations"].bytes for x in (d, one)]
    assert kept[0] - kept[1] >= (d.layers - 1) * 3 * SEQ * d.hidden * 4


def test_a_hyper_connected_model_is_planned_as_measured():
    """DeepSeek-V4's tiny config (4 streams, fp32, 1024 tokens, the chunked loss, no checkpointing: every layer's
    streams and mixing alive at the backward's start): the tracked step peak against the plan, within -5% / +10%
    (planned without them: -8% at 2048 tokens). With checkpointing the figures are in docs/benchmarks.md (-7% -> -5%
    at 2048 tokens: the kept streams weigh little at hidden 64)."""
    config = family_or_skip("deepseek_v4").build_config()
    seq = 1024
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=family_by_name("deepseek_v4").attn_implementation())
    measured = _tracked_step_peak(model.train(), config.vocab_size, seq, 256)
    shape = RunShape(local_batch=1, seq=seq, chunk_tokens=256, attn=model.config._attn_implementation)
    plan = plan_memory(model_dims(model), shape)
    planned = max(sum(plan.phases[p].values()) for p in ("forward", "loss", "backward"))
    assert -0.05 <= (planned - measured) / measured <= 0.10, (planned / 2**20, measured / 2**20)



def test_saved_storage_counts_what_the_graph_keeps():
    """``saved_storage.saved_storage_bytes``: the distinct storages a forward's graph keeps, less the excluded ones.
    A branch the output does not need is freed as in a real step, also where it saves its output (the hook keeps a
    detached alias: the tensor itself would make the output and its node a cycle nothing frees); two saved views of
    one storage are one storage."""
    from automodel.training.saved_storage import saved_storage_bytes

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16, requires_grad=True)

    def forward():
        y = x @ w  # saves x and w: excluded
        z = y.sigmoid()  # saves its output: [8, 16] fp32
        (y * 2).exp()  # saves its output, dropped at once: a branch the returned tensor does not need
        return (z * z[:, :8].repeat(1, 2)).sum()  # saves z (one storage) and the repeated copy: [8, 16] fp32

    assert saved_storage_bytes(forward, (x, w)) == 2 * 8 * 16 * 4
    assert saved_storage_bytes(forward) == 2 * 8 * 16 * 4 + (8 * 16 + 16 * 16) * 4  # x and w counted
    with torch.device("meta"):  # the planner's probes run on the meta device
        xm, wm = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    x, w = xm, wm
    assert saved_storage_bytes(forward, (x, w)) == 2 * 8 * 16 * 4


def test_a_learned_relative_position_bias_is_planned_per_layer():
    """Inkling 1, 2 and 2-loop build a learned relative-position bias ``[B, heads, S, S]`` in every layer
    (``ModelDims.position_bias_heads``; Inkling 2 its int64 ``[S, S]`` distance tables once per forward, one per
    attention kind: ``position_bias_tables``), refused by every CP method. Without CP each layer keeps the bias's
    gather index and mask (9 bytes per ``S^2``), under ``sdpa`` the folded ``[B, heads, S, S]`` mask too; the plan
    counted none of it (fp32, 1024 tokens: Inkling eager -28% / -19% (checkpointing), Inkling 2 -43% / -48%, Inkling's
    sdpa on the CPU -84% / -87%). Measured here: Inkling under eager, fp32, 512 tokens, no checkpointing, against
    the tracked step peak."""
    from automodel.training.layer_kind_memory import position_bias_bytes

    for name in ("inkling_text", "inkling2_text", "inkling2_loop_text"):
        family_or_skip(name)  # (not in every supported transformers)
    ink, ink2, llama = _dims("inkling_text"), _dims("inkling2_text"), _dims("llama")
    assert ink.position_bias_heads == (4,) * ink.layers and ink.position_bias_tables == 0
    assert ink2.position_bias_heads == (4,) * ink2.layers and ink2.position_bias_tables == 2
    assert _dims("inkling2_loop_text").position_bias_tables == 2 and llama.position_bias_heads == ()
    s, c = 1024, 4
    for attn, kept, flight in (("sdpa", 4 * s * s * c + 9 * s * s, 2 * 4 * s * s * c), ("eager", 9 * s * s, 4 * s * s * c)):
        shape = RunShape(local_batch=1, seq=s, attn=attn)
        assert position_bias_bytes(ink, shape) == (kept, kept, flight, flight, 0.0)
        assert position_bias_bytes(ink2, shape)[4] == 2 * 8 * s * s
        assert position_bias_bytes(ink, dataclasses.replace(shape, cp=2)) == (0.0,) * 5  # refused under CP
        # every layer keeps its part without checkpointing; the tables are held to the backward with it
        plain = dataclasses.replace(ink2, position_bias_heads=(), position_bias_tables=0)
        for ac in (False, True):
            grown, base = (plan_memory(x, dataclasses.replace(shape, activation_checkpointing=ac))
                           for x in (ink2, plain))  # fmt: skip
            added = grown.terms["activations"].bytes - base.terms["activations"].bytes
            assert added >= (2 * 8 * s * s if ac else ink2.calls * kept), (attn, ac, added)
    config = family_or_skip("inkling_text").build_config()
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    seq = 512
    measured = _tracked_step_peak(model.train(), config.vocab_size, seq, None)
    plan = plan_memory(model_dims(model), RunShape(local_batch=1, seq=seq, chunk_tokens=None, attn="eager"))
    planned = max(sum(plan.phases[p].values()) for p in ("forward", "loss", "backward"))
    assert -0.05 <= (planned - measured) / measured <= 0.10, (planned / 2**20, measured / 2**20)


def test_the_experts_gate_is_measured_against_silus():
    """The experts' gate between their gate/up and down projections (transformers' ``_apply_gate``, which its
    ``grouped_mm`` and eager expert loops call) is measured on the meta device: SiLU's default keeps 4 ``[k N, I_e]``
    per routed copy (the gate/up output, ``act(gate)``, the product), the plan's count; MiniMax-M3's clamps and
    sigmoid keep 7, GPT-OSS's 7, Beam's fp32 SwiGLU 7 in bf16 (read off its first MoE block); ungated experts (Nemotron-H's ``act(up)``) are not probed. The excess is in every MoE
    moment: saved, forward and backward."""
    from automodel.training.memory_plan import _mlp_moments
    from automodel.training.mlp_memory import DEFAULT_EXPERTS_GATE_SAVED, experts_gate_saved

    def experts(name: str):
        fam = family_or_skip(name)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
        return next(m for m in model.modules() if callable(getattr(type(m), "_apply_gate", None)))

    assert experts_gate_saved(experts("mixtral"), 32) == (DEFAULT_EXPERTS_GATE_SAVED,) * 2 == (4.0, 4.0)
    assert experts_gate_saved(experts("minimax_m3_vl_text"), 32) == (7.0, 7.0)
    assert experts_gate_saved(experts("nemotron_h"), 32) is None
    assert _dims("mixtral").experts_gate_extra == (0.0, 0.0) and _dims("nemotron_h").experts_gate_extra == (0.0, 0.0)
    d = _dims("minimax_m3_vl_text")
    assert d.experts_gate_extra == (3.0, 3.0) and _dims("gpt_oss").experts_gate_extra == (3.0, 3.0)
    # Beam's first layer is dense (its experts come later); its gate computes in fp32: 3 more in bf16 only
    assert family_or_skip("beam") and _dims("beam").experts_gate_extra == (0.0, 3.0)
    plain = dataclasses.replace(d, experts_gate_extra=(0.0, 0.0))
    grown, base = _mlp_moments(d, 2), _mlp_moments(plain, 2)
    extra = d.top_k * d.expert_intermediate * 3
    moved = (grown.saved - base.saved, grown.forward - base.forward, grown.backward - base.backward)
    assert moved == pytest.approx((extra,) * 3)


def test_a_gated_mlps_peaks_are_measured_against_swiglus():
    """``mlp_memory.dense_mlp_peaks``: a gated block's forward and backward peaks against Llama's SwiGLU of the same
    widths, beyond what it saves more, measured on the meta device at two lengths (the weights' gradients cancel):
    0 for Llama's own MLP, BitNet's fp32 norm over ``I`` 6 ``[N, I]`` at its backward in bf16 (1 in fp32), and the
    plan's MLP forward and backward moments grow by them."""
    from automodel.models.parallelize import decoder_layers
    from automodel.training.memory_plan import _mlp_moments
    from automodel.training.mlp_memory import dense_mlp_of, dense_mlp_peaks

    def mlp(name: str):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(family_by_name(name).build_config())
        return dense_mlp_of(decoder_layers(model)[0]), model.config.hidden_size, model.config.intermediate_size

    assert dense_mlp_peaks(*mlp("llama")) == ((0.0, 0.0), (0.0, 0.0))
    (f32_fwd, f32_bwd), (bf16_fwd, bf16_bwd) = dense_mlp_peaks(*mlp("bitnet"))
    assert f32_fwd == 0.0 and f32_bwd == pytest.approx(1.0, abs=0.05)
    assert bf16_bwd == pytest.approx(6.0, abs=0.05) and bf16_fwd == pytest.approx(2.5, abs=0.05)
    d = _dims("bitnet")
    assert d.mlp_peak_extra == dense_mlp_peaks(*mlp("bitnet")) and _dims("llama").mlp_peak_extra == ((0.0, 0.0),) * 2
    plain = dataclasses.replace(d, mlp_peak_extra=((0.0, 0.0), (0.0, 0.0)))
    grown, base = _mlp_moments(d, 2), _mlp_moments(plain, 2)
    assert grown.saved == base.saved
    assert (grown.forward - base.forward, grown.backward - base.backward) == pytest.approx(
        (bf16_fwd * d.intermediate, bf16_bwd * d.intermediate))


def test_an_attention_that_calls_its_kernel_twice_is_measured_against_llamas():
    """``attention_memory.attention_saved_extra``: an attention module whose forward calls its attention function more
    than once (DiffLlama's differential attention: two calls on the halves of V) is run on the meta device with a
    kernel that keeps what a fused kernel keeps, beside ``LlamaAttention`` of its widths; the difference in ``q``
    units goes into every layer's attention term. One call (Llama, Qwen3: their q/k norms are the plan's own terms)
    is not probed."""
    from automodel.models.parallelize import decoder_layers
    from automodel.training.attention_memory import attention_calls

    def attention(name: str):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(family_by_name(name).build_config())
        return decoder_layers(model)[0].self_attn

    assert [attention_calls(attention(n)) for n in ("diffllama", "llama", "qwen3")] == [2, 1, 1]
    d = _dims("diffllama")
    assert d.attention_saved_extra == (4.59, 5.69)  # fp32, bf16 (its group norm keeps an fp32 copy in bf16)
    assert _dims("llama").attention_saved_extra == _dims("qwen3").attention_saved_extra == (0.0, 0.0)
    plain = dataclasses.replace(d, attention_saved_extra=(0.0, 0.0))
    grown, base = (_plan(x).terms["activations"].bytes for x in (d, plain))
    assert grown - base == pytest.approx(d.calls * SEQ * 4.59 * d.heads * d.head_dim * 4)


def test_jetmoe_mixture_of_attention_heads_is_measured_on_the_cpu(monkeypatch):
    """JetMoE's attention (a decoder layer's ``self_attention``) routes each token's queries through ``k`` of its
    experts (mixture of attention heads: parameters that stack matrices, ``attention_memory.routes_heads``), keeping a
    gathered copy of its input per expert, the experts' outputs before their gates, and K and V repeated to the ``k``
    groups of heads. Its router reads values (``expert_size.tolist()``), so the probe that fails on the meta device runs
    on the CPU with zero weights; a module too large for that keeps the plan's own count. Measured
    (``scripts/bench_plan_families.py``, bf16, hidden 256, 2048 tokens; no techniques / the tiled MLP alone; it refuses
    checkpointing): -14.3% / -36.8% before, +0.1% / -8.0% with the term."""
    from automodel.models.parallelize import decoder_layers
    from automodel.training import attention_memory

    with torch.device("meta"):
        models = {n: AutoModelForCausalLM.from_config(family_by_name(n).build_config())
                  for n in ("jetmoe", "llama", "kimi_linear", "zaya")}  # fmt: skip
    found = {n: attention_memory.attention_module(decoder_layers(m)[0]) for n, m in models.items()}
    assert type(found["jetmoe"]).__name__ == "JetMoeAttention"
    # kimi_linear's first layer is linear attention, its A_log of shape (1, 1, heads, 1); ZAYA's Conv1d weights: not
    # routed experts
    assert [attention_memory.routes_heads(a) for a in found.values()] == [True, False, False, False]
    d = _dims("jetmoe")
    assert d.attention_saved_extra == (8.25, 8.47)
    plain = dataclasses.replace(d, attention_saved_extra=(0.0, 0.0))
    grown, base = (_plan(x).terms["activations"].bytes for x in (d, plain))
    assert grown - base == pytest.approx(d.calls * SEQ * 8.25 * d.heads * d.head_dim * 4)
    # no CPU copy of a module over the bound: the plan's own count stays
    monkeypatch.setattr(attention_memory, "_CPU_PROBE_BYTES", 0)
    attention_memory._CACHE.clear()
    try:
        assert _dims("jetmoe").attention_saved_extra == (0.0, 0.0)
    finally:
        attention_memory._CACHE.clear()


def test_kolibri_chunked_indexer_selection_and_pools_are_planned():
    """Kolibri-1.1's indexed layers select their keys with a weightless reference indexer (no gradient): per call the
    pool of candidate keys and the selection (``[B, q, k]`` booleans), while it finds each query's first and last
    visible keys a flipped copy of the mask and its int32 copy (7 bytes per element), then fp32 score chunks of at
    most ``max_scores`` scores with a dozen temporaries (18 bytes per score); under checkpointing every pool a later
    layer is handed stays with that layer's checkpoint to the end of the backward. Unplanned, its steps read -7% /
    -33% / -55% / -27% (bf16, hidden 256, 2048 tokens; no techniques / checkpointing / both with the tiled MLP / the
    tiled MLP alone); planned, +6.1% / +2.5% / +4.5% / +3.1%; six indexed layers of four pools (two handed on) at
    4096 tokens with chunks of 2^20 scores, -3.7% / -6.3% (no techniques / checkpointing: the recomputed layer's
    fresh pool beside the two kept, all three in a live-tensor snapshot; the rest the sliding mask this all-indexed
    config builds for no layer). Under ring CP (``scripts/bench_plan_cases.py
    --cases kolibri_ring``: five indexed layers, the rank's queries against the gathered keys) +5.1%. Under CP its
    layers call the blocked QSA kernel (their ``_ConfigView``'s attention function) under every attention
    implementation: its ``[B, H, 256, T]`` fp32 score blocks, three at the recomputed layer's backward (planned as the
    class's own SDPA call, without them, the tiny config read -18% / -16% / -18% at cp 4 under ring / Ulysses / usp,
    ``scripts/bench_plan_families_cp.py --cp 4``; +3% / +4% / +4% with them)."""
    from automodel.training.layer_kind_memory import INDEXER_CHUNK_BYTES, INDEXER_SPAN_BYTES, indexer_bytes

    d = _dims("kolibri1_1")
    config = family_by_name("kolibri1_1").build_config()
    indexed = config.layer_types.count("indexed_attention")
    # the tiny config's one indexed layer is its last: the pool it builds is handed to no later layer
    assert (d.indexer_layers, d.indexer_chunk, d.indexer_pools) == (indexed, 2**26, 0) == (1, 2**26, 0)
    six = _dims("kolibri1_1", num_hidden_layers=6, layer_types=["indexed_attention"] * 6, index_layers=[0, 2, 3, 5],
                kv_source_layers=list(range(6)))  # fmt: skip
    # sources 0, 2, 3 and 5: layer 1 is handed 0's pool, layer 4 3's; 2's goes to source 3, which starts from none,
    # and 5 is the last layer
    assert (six.indexer_layers, six.indexer_pools) == (6, 2)
    assert _dims("llama").indexer_layers == _dims("deepseek_v32").indexer_layers == 0  # DSA's indexer has weights
    span = SEQ * SEQ
    short = RunShape(local_batch=1, seq=SEQ)
    # a row of 4096 keys: chunks of 2^26 // 4096 = 16384 queries, the whole row; the chunk's 18 bytes dominate
    assert indexer_bytes(six, short) == (2 * span + INDEXER_CHUNK_BYTES * span, 0.0)
    # checkpointing keeps the two handed-on pools; eager also keeps the visible keys of its float mask
    assert indexer_bytes(six, dataclasses.replace(short, activation_checkpointing=True))[1] == 2 * span
    assert indexer_bytes(six, dataclasses.replace(short, attn="eager"))[0] == (3 + INDEXER_CHUNK_BYTES) * span
    # 128K keys: chunks of 512 queries; the first / last visible key search over the whole [S, S] is the peak
    long = RunShape(local_batch=1, seq=131072)
    assert indexer_bytes(six, long)[0] == INDEXER_SPAN_BYTES * 131072**2 > 2 * 131072**2 + 18 * 512 * 131072
    # under CP the rank's queries against the whole row's keys (the K/V gather)
    cp = indexer_bytes(six, RunShape(local_batch=1, seq=SEQ, cp=2))[0]
    assert cp == 2 * N * SEQ + INDEXER_CHUNK_BYTES * N * SEQ
    # the plan's step: the selection is a moment of its own (before the kernel), in the forward and, under
    # checkpointing, in the recomputation; the other moments hold the kept pools only
    ((_, state),) = d.gathered
    assert state.own_kernel and state.block == BLOCK and state.mask_planes == 1  # the layout's: the indexer's own apart
    ring = _plan(d, cp=2, activation_checkpointing=True).by_moment["recompute"]["attention"]["attention workspace"]
    assert ring >= 3 * config.num_attention_heads * BLOCK * SEQ * 4
    plain = dataclasses.replace(six, indexer_layers=0, indexer_chunk=0, indexer_pools=0)
    for ac in (False, True):
        grown, base = (_plan(x, activation_checkpointing=ac) for x in (six, plain))
        assert grown.step_peak_bytes - base.step_peak_bytes >= 0.5 * indexer_bytes(six, short)[0], ac
        phase = "recompute" if ac else "backward"
        assert grown.moments["forward"] == "indexer" and "indexer" not in base.by_moment["forward"]
        assert ("indexer" in grown.by_moment[phase]) == ac
        kept = 2 * span if ac else 0.0
        assert grown.by_moment[phase]["attention"]["activations"] == base.by_moment[phase]["attention"]["activations"] + kept


def test_minimax_lightning_attention_layers_are_measured():
    """MiniMax's linear-attention layers hold ``MiniMaxLightningAttention`` where a layer holds its attention: it calls
    no attention function and has no kernel package to run in place of its torch code (transformers' block loop runs
    on every device), so it is measured on the meta device against ``LlamaAttention`` of its widths: per block its
    ``[heads, b, b]`` scores, decayed q and k, and the ``[heads, d, d]`` state before and after the block, ~11 ``q``
    per token. The plan adds it to each such layer (the layers' average in what they keep, one layer in flight).
    Kimi Linear's delta rule (fla's kernels where installed) is not read. Measured (``scripts/bench_plan_families.py``,
    bf16, hidden 256, 2048 tokens; no techniques / checkpointing / both with the tiled MLP / the tiled MLP alone):
    MiniMax -10.5% / -7.4% / -13.7% / -23.0% -> +6.6% / +10.5% / +16.8% / +16.7%, its flagship pattern (7 linear
    layers of 8) -17.6% / -5.8% / -0.0% / -40.2% -> +2.9% / +6.1% / -0.0% / +15.1%."""
    from automodel.models.parallelize import decoder_layers
    from automodel.training.attention_memory import attention_module, calls_attention_function, torch_only

    flagship = _dims("minimax@flagship")
    config = family_by_name("minimax@flagship").build_config()
    assert flagship.mixer_layers == config.layer_types.count("linear_attention") == 7
    fp32, bf16 = flagship.mixer_saved_extra
    assert 9 < fp32 < 13 and 9 < bf16 < 14, flagship.mixer_saved_extra
    assert _dims("minimax").mixer_layers == 1
    for name in ("llama", "kimi_linear", "qwen3_next", "jamba"):
        assert _dims(name).mixer_layers == 0, name
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_by_name("kimi_linear").build_config())
    mixers = [m for m in (attention_module(layer) for layer in decoder_layers(model)) if m is not None]
    kimi = next(m for m in mixers if not calls_attention_function(m))
    assert not torch_only(kimi)  # its modeling file names fla's kernels
    n, q = SEQ, flagship.heads * flagship.head_dim
    plain = dataclasses.replace(flagship, mixer_layers=0, mixer_saved_extra=(0.0, 0.0))
    for ac in (False, True):
        grown, base = (_plan(x, activation_checkpointing=ac) for x in (flagship, plain))
        delta = grown.terms["activations"].bytes - base.terms["activations"].bytes
        kept = n * fp32 * q * 4  # one layer's, fp32
        # without checkpointing every linear layer keeps it (the layers' average, 7 of 8, for the seven layers before
        # the one in flight, counted whole); with it the one recomputed layer
        assert delta == pytest.approx(kept * (1 if ac else 7 * 7 / 8 + 1)), (ac, delta / kept)


def test_the_plan_names_linear_mixers_it_does_not_measure():
    """Linear-mixer layers the planner does not measure are named in the activations' note, so that a plan is not
    read as covering them: on a GPU where their kernel package is installed (fla, causal-conv1d, mamba-ssm), those
    whose modeling file names it, planned with attention terms while those kernels run them. Where transformers' torch
    code runs them (on the CPU, where the package is missing, and for the torch-only RG-LRU, xLSTM and RWKV on every
    device) their cores are measured. MiniMax's lightning layers are measured (the test above) and Llama has none."""
    shape = RunShape(local_batch=1, seq=1024, activation_checkpointing=True)
    # ZAYA's linear-mixer layers are its compressed convolutional attention, inside the attention the attention probe
    # measures; Kimi Linear's delta rule sits where its layers hold attention, beside its measured MLA layers
    for name, packaged, torch_code in (("qwen3_next", 3, 0), ("mamba", 2, 0), ("recurrent_gemma", 0, 2),
                                       ("minimax@flagship", 0, 0), ("llama", 0, 0), ("zaya", 0, 0),
                                       ("kimi_linear", 4, 0)):  # fmt: skip
        family_or_skip(name)
        d = _dims(name)
        assert (d.kernel_mixer_layers, d.torch_mixer_layers) == (packaged, torch_code), name
        # where their torch code runs (the CPU, every device for the torch-only ones) they are measured
        # (test_linear_mixer_cores_outside_the_chain_are_counted_where_their_torch_code_runs) and said so
        note = plan_memory(d, shape).terms["activations"].note
        assert "not measured" not in note and ("transformers' torch code" in note) == bool(packaged or torch_code), note
        # on a GPU where their kernel package is installed (fla, mamba-ssm) they are not: the note names them
        gpu = dataclasses.replace(shape, attention_kernel="flash")
        note = plan_memory(dataclasses.replace(d, gpu_torch_core_layers=torch_code), gpu).terms["activations"].note
        assert ("torch fallback" in note) == bool(packaged) and ("not measured" in note) == bool(packaged), note


def test_an_expert_loop_over_stacked_weights_holds_three_gradient_copies():
    """An expert loop that indexes its stacked weights per expert (``experts_implementation="eager"``; JetMoE's
    ``self.weight[i]``, DBRX's ``w1.view(...)[expert_idx]``) makes each expert's gradient full-size and the autograd
    engine sums them out of place: three copies of the weight's gradient at once (the probe below), two beyond the
    one the plan counts, at the MLP's backward (and per tile). grouped_mm and Llama 4's bmm compute the gradient at
    once. Measured (``scripts/bench_plan_families.py`` / a live-tensor snapshot, bf16, hidden 256, 2048 tokens):
    JetMoE +0.1% / -8.0% -> +5.4% / +2.7% (no techniques / the tiled MLP alone), Mixtral with eager experts
    +1.9% / -10.3% / -12.3% / +22.3% -> +8.2% / +5.5% / +3.3% / +33.9% (no techniques / both / the tiled MLP alone /
    checkpointing alone)."""
    from scripts.live_tensors import AllocationTracker

    weight = torch.nn.Parameter(torch.randn(8, 64, 32))
    x = torch.randn(8 * 16, 32)

    def loop() -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x[e * 16:(e + 1) * 16], weight[e]) for e in range(8)]).sum()

    tracker = AllocationTracker()
    with tracker:
        loop().backward()
    assert tracker.peak >= 3 * weight.numel() * 4
    assert _dims("jetmoe").expert_loop_param == 4 * 2 * 64 * 64  # input_linear [E, 2 I, h] of the tiny config
    assert _dims("dbrx").expert_loop_param > 0
    assert _dims("mixtral").expert_loop_param == 0 == _dims("llama4_text").expert_loop_param  # grouped_mm; bmm
    config = family_by_name("mixtral").build_config()
    with torch.device("meta"):
        eager = model_dims(AutoModelForCausalLM.from_config(config, experts_implementation="eager"))
    assert eager.expert_loop_param == config.num_local_experts * 2 * config.intermediate_size * config.hidden_size
    plain = dataclasses.replace(eager, expert_loop_param=0)
    for tiled in (False, 512):
        grown, base = (_plan(x, tiled_mlp=tiled, activation_checkpointing=True) for x in (eager, plain))
        assert grown.by_moment["recompute"]["MLP"]["activations"] - base.by_moment["recompute"]["MLP"]["activations"] \
            == 2 * eager.expert_loop_param * 4, tiled


def test_zaya_fp32_residual_stream_and_convolutional_attention_are_measured():
    """ZAYA keeps its residual stream in fp32 whatever the model's dtype (``residual_fp32``: read off the dtype of
    the first layer's input in a meta-device run of a fresh bf16 copy of its text model), scales the residual and the
    blocks' outputs in fp32 around each block (``residual_saved_extra``, the layer probe given an fp32 input), and
    mixes q and k with a convolution over the tokens before its kernel (``attention_saved_extra``: the attention probe
    runs a module holding a ``Conv1d``, as Inkling's short convolutions of k and v, less the q/k norms the plan counts
    itself). In bf16 checkpointing keeps its layer inputs in fp32: twice the bytes of a compute-dtype input; in fp32
    nothing changes. Measured (``scripts/bench_plan_families.py``, bf16, hidden 256, 2048 tokens; no checkpointing /
    checkpointing / both with the tiled MLP / the tiled MLP alone): -34.6% / -33.6% / -47.5% / -52.8% before, -3.8% /
    -2.2% / +6.6% / +3.2% with these terms and the tiled MLP's own width (the next test)."""
    d, llama = _dims("zaya"), _dims("llama")
    assert d.residual_fp32 and not llama.residual_fp32 and not _dims("qwen3").residual_fp32
    # the two residual scalings keep (hidden + bias) and (residual + bias): 4 [N, h] in fp32; in bf16 the scaled
    # hidden states in bf16 and the fp32 residual's (2 units each) beside the fp32 copies its casts make
    assert d.residual_saved_extra == (4.0, 6.0) and llama.residual_saved_extra == (0.0, 0.0)
    # q and k (q + kv channels) padded, convolved twice and added to their residual paths, its own q/k norm: ~5.4 q
    assert d.attention_saved_extra[0] == d.attention_saved_extra[1] and 5.0 < d.attention_saved_extra[0] < 6.0
    inkling = _dims("inkling_text")  # its k and v short convolutions' outputs, kv = q / 2 each: ~1 q beyond its norms
    assert inkling.qk_norm and 0.9 < inkling.attention_saved_extra[0] < 1.2, inkling.attention_saved_extra
    plain = dataclasses.replace(d, residual_fp32=False)
    for size in (2, 4):
        kw = dict(activation_checkpointing=True, compute_bytes=size, master_bytes=size, reduce_bytes=size)
        grown, base = (_plan(x, **kw).by_moment["recompute"]["attention"]["activations"] for x in (d, plain))
        # every layer input kept in fp32: (4 - c) bytes more per element in bf16 (the final norm's input too)
        assert grown - base == (d.calls * SEQ * d.hidden * (4 - size) if size < 4 else 0), (size, grown - base)


def test_the_plan_tiles_the_mlp_as_the_model_does():
    """The tiled MLP cuts its tiles by the model's MLP width (``tiled_mlp.mlp_intermediate_width``: a mixture's
    ``top_k`` routed and shared experts, ``4 h`` where the config names none) and runs an MLP no wider than ``h`` as
    one tile; the plan tiles by the same width (``ModelDims.tile_width``). Before, the plan used the dense
    ``intermediate_size`` (``4 h`` where absent): ZAYA's top-1 experts, no wider than ``h``, ran the whole row as one
    tile while the plan counted tiles of ``h`` tokens (its tiled rows -10% / -12% under after the fp32-residual fix),
    and a model whose routed width exceeds ``h`` while its dense width does not (DeepSeek-V4, JetMoE) was planned
    untiled."""
    from automodel.models.tiled_mlp import apply_tiled_mlp, tile_counts
    from automodel.training.memory_plan import _mlp_tile

    seq = 256
    for name in ("zaya", "deepseek_v4", "jetmoe", "llama"):
        fam = family_or_skip(name)
        config = fam.build_config()
        config.use_cache = False
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation()).train()
        apply_tiled_mlp(model, True)
        ids = torch.randint(0, min(config.vocab_size, 100), (1, seq), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(input_ids=ids)
        ran = max(c.max_tile_tokens for c in tile_counts(model))
        planned = _mlp_tile(model_dims(model), RunShape(local_batch=1, seq=seq, tiled_mlp=True))
        assert planned == ran, (name, planned, ran)
    assert _mlp_tile(_dims("zaya"), RunShape(local_batch=1, seq=seq, tiled_mlp=True)) == seq  # one tile


def test_gemma3n_altup_layer_probed_with_its_predictions_stacked_first():
    """Gemma 3n hands each layer its AltUp predictions stacked first (``[K, B, S, h]``) and gates a per-layer input
    into them: the layer probe tries that layout and passes the per-layer input (``[B, S, hidden_size_per_layer_input]``)
    where the layer's forward takes one. Before, every layout failed on the meta device and the layer's AltUp, Laurel
    and gate tensors went uncounted (bf16 at hidden 256: -21.5% / -15.9% / -18.3% / -15.0%; now +7.1% / -9.4% / +9.1% /
    +35.3%, the tiled MLP alone over)."""
    from automodel.models.parallelize import decoder_layers
    from automodel.training import residual_memory

    fam = family_or_skip("gemma3n_text")
    config = fam.build_config().get_text_config()
    d = _dims("gemma3n_text")
    streams = config.altup_num_inputs
    assert d.layer_input_copies == streams and streams > 1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
    cls = residual_memory._model_class(decoder_layers(model)[0])
    probed = [residual_memory._saved_on_meta(cls, config, streams, dtype) for dtype in (torch.float32, torch.bfloat16)]
    assert d.residual_saved_extra == pytest.approx(tuple(p + streams - 1 for p in probed))
    # its predictions, corrections, Laurel block and per-layer gate: more than ten [N, h] beyond a plain layer's norms
    assert min(probed) > 10, probed


def test_gemma3n_residual_backward_probed_on_meta_as_on_the_cpu():
    """``ModelDims.residual_backward_extra`` for Gemma 3n (fp32): the meta-device probe's two figures equal the same
    stubbed layer run on the CPU with real tensors (what its backward holds beyond what it saved, less the two
    gradients every layer counts; and its peak above the plain layer's, beyond what it saves more); more than
    the ``K - 1`` further gradients of its streams alone, and none for a plain layer."""
    from automodel.models.parallelize import decoder_layers
    from automodel.models.tiled_mlp import is_hidden_norm
    from automodel.training import residual_memory
    from automodel.training.mlp_memory import live_moments

    fam = family_or_skip("gemma3n_text")
    config = fam.build_config().get_text_config()
    d, streams, h = _dims("gemma3n_text"), config.altup_num_inputs, config.hidden_size
    assert _dims("llama").residual_backward_extra == ((0.0, 0.0), (0.0, 0.0))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
    cls = residual_memory._model_class(decoder_layers(model)[0])
    torch.manual_seed(0)
    layer = cls(config, 0)
    for block in residual_memory._BLOCK_NAMES:
        if isinstance(getattr(layer, block, None), torch.nn.Module):
            layer.set_submodule(block, residual_memory._Stub(2 if block in residual_memory._TUPLE_NAMES else 0))
    norms = [m for _, m in layer.named_children() if is_hidden_norm(m, h, held_by_layer=True)]
    held, higher = [], []
    for tokens in residual_memory._PEAK_TOKENS:
        x = torch.randn(streams, 1, tokens, h, requires_grad=True)
        per_layer = torch.randn(1, tokens, config.hidden_size_per_layer_input)
        saved, _, backward = live_moments(
            lambda x=x, p=per_layer: layer(x, position_embeddings=None, attention_mask=None, per_layer_input=p),
            output_grad=True)  # fmt: skip
        plain = torch.randn(1, tokens, h, requires_grad=True)
        p_saved, _, p_backward = live_moments(lambda p=plain: residual_memory._plain_forward(norms, p), output_grad=True)
        held.append(backward - saved)
        higher.append((backward - p_backward) - (saved - p_saved))
    unit = h * 4 * (residual_memory._PEAK_TOKENS[1] - residual_memory._PEAK_TOKENS[0])
    cpu = (round((held[1] - held[0]) / unit - 2, 2), round((higher[1] - higher[0]) / unit, 2))
    assert d.residual_backward_extra[0] == pytest.approx(cpu, abs=0.02), (d.residual_backward_extra, cpu)
    assert min(cpu) > streams - 1, cpu


def test_doge_dynamic_mask_is_planned_per_layer():
    """Doge's attention builds a dynamic mask from its value states per layer (``prepare_dynamic_mask``: a float
    ``[B, kv, S, S]`` from the broadcast ``dt`` states, the attention mask filled in, the keys outside each query's
    top ``keep_window_size`` masked, repeated to the query heads) and hands it to the kernel with its gradient. The
    plan counted none of it (hidden 256, bf16: -85% to -92% once the MLP was planned dense; before, 64 routed copies
    of the MLP had hidden it). Now: the booleans its ``masked_fill`` calls keep per layer, the build in the forward,
    under ``sdpa`` the repeated mask the kernel keeps and its gradient with two reductions in the backward (what the
    memory-efficient kernel does on a GPU: not measured here, CPU's math kernel keeps more); under ``eager`` the mask
    is built before the scores and its gradient is theirs. Eager, measured on the CPU (bf16 / fp32, hidden 256, 2048
    tokens, with and without checkpointing): within +0.3% to +2.1%; below, the tracked step within 5%."""
    from automodel.training.layer_kind_memory import dynamic_mask_bytes

    fam = family_by_name("doge")
    config = fam.build_config()
    d = _dims("doge")
    assert (d.dynamic_mask_layers, d.dynamic_mask_window) == (d.layers, config.keep_window_size)
    assert _dims("llama").dynamic_mask_layers == 0
    seq, b, c = 64, 1, 2
    r = RunShape(local_batch=b, seq=seq, compute_bytes=c, attn="sdpa")
    sq, kv, h = seq * seq, d.kv_heads, d.heads
    assert seq > d.dynamic_mask_window  # the window's boolean mask too
    kept = sq * (1 + kv) + sq * h * c
    assert dynamic_mask_bytes(d, r) == (kept, kept, 3 * sq * kv * c + kv * seq * d.dynamic_mask_window * (8 + c),
                                        sq * h * c + 2 * sq * kv * c)  # fmt: skip
    assert dynamic_mask_bytes(d, dataclasses.replace(r, cp=2)) == (0.0, 0.0, 0.0, 0.0)
    eager = dynamic_mask_bytes(d, dataclasses.replace(r, attn="eager"))
    assert eager[1] == sq * (1 + kv) and eager[3] == 0.0
    seq = 1024
    config.max_position_embeddings = seq
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.bfloat16).train()
    measured = _tracked_step_peak(model, config.vocab_size, seq, 256)
    shape = RunShape(local_batch=1, seq=seq, chunk_tokens=256, attn="eager", compute_bytes=2, master_bytes=2,
                     reduce_bytes=2)  # fmt: skip
    plan = plan_memory(model_dims(model), shape)
    planned = max(sum(plan.phases[p].values()) for p in ("forward", "loss", "backward"))
    assert -0.05 <= (planned - measured) / measured <= 0.05, (planned / 2**20, measured / 2**20)


def test_doge_dense_mlp_is_planned_dense():
    """Doge's config names its retrieval experts (``num_experts`` 16384, ``num_experts_per_tok`` 64) whether or not it
    builds them: with ``is_moe=False`` (its default, and the only form CP runs) every layer's MLP is a dense gated
    MLP of ``intermediate_size``. The plan counted 64 routed copies of it per token (+313% without checkpointing at
    hidden 256, bf16) and the tiled MLP cut its tiles by ``64 I``; both now read the MLP the model builds."""
    from transformers import DogeConfig

    from automodel.models.tiled_mlp import mlp_intermediate_width

    d = _dims("doge")
    config = family_by_name("doge").build_config()
    assert config.is_moe is False and config.num_experts_per_tok > 1
    assert (d.experts, d.top_k, d.tile_width) == (0, 0, config.intermediate_size) and d.mlp_matrices == 3
    moe = DogeConfig(is_moe=True, hidden_size=64, intermediate_size=128)
    assert mlp_intermediate_width(moe) == moe.num_experts_per_tok * 128
    assert mlp_intermediate_width(DogeConfig(is_moe=False, hidden_size=64, intermediate_size=128)) == 128


def test_a_router_scoring_in_fp32_keeps_its_input_in_fp32():
    """DeepSeek-style routers (DeepSeek-V3, GLM-4-MoE, Solar Open, ...) score in fp32:
    ``F.linear(x.float(), w.float())`` keeps an fp32 copy of the ``[N, h]`` input for the weight's gradient, ``4 h``
    bytes per token and MoE layer in a bf16 run (none in fp32, where the cast is the input itself). The router probe
    (``mlp_memory.router_saved``, the block's ``gate`` on the meta device at two lengths) measures what a router keeps
    beyond the router term's ``4 E + 16 k``: ``ModelDims.router_saved_extra``. A router of the compute dtype (Mixtral's
    linear gate, Qwen3-MoE's) adds nothing. Under the tiled MLP the router runs inside the tiles' Function: it is
    counted per tile, no longer per layer as well. Solar Open bf16 at hidden 256 without techniques: -7.3% -> -1.7%."""
    d = _dims("solar_open")
    assert d.router_saved_extra[0] == 0.0 and d.router_saved_extra[1] == pytest.approx(4 * d.hidden, rel=0.02)
    assert _dims("deepseek_v3").router_saved_extra == d.router_saved_extra
    assert _dims("mixtral").router_saved_extra == _dims("qwen3_moe").router_saved_extra == (0.0, 0.0)
    plain = dataclasses.replace(d, router_saved_extra=(0.0, 0.0))
    kw = dict(compute_bytes=2, master_bytes=2, reduce_bytes=2)
    grown, base = (_plan(x, **kw).by_moment["backward"]["MLP"]["activations"] for x in (d, plain))
    assert grown - base == pytest.approx(d.calls * SEQ * d.router_saved_extra[1])  # every layer keeps it
    grown, base = (_plan(x, tiled_mlp=True, **kw).by_moment["backward"]["MLP"]["activations"] for x in (d, plain))
    assert 0 < grown - base <= SEQ * d.router_saved_extra[1] / 2  # one tile's


def test_eager_scores_are_planned_only_where_the_models_eager_function_runs():
    """An eager model's own attention function keeps its ``[heads, S_q, S_k]`` scores without CP and under Ulysses
    (its inner kernel, over the whole row for ``H / cp`` heads). Ring routes an eager model's layers to torch's ring
    or the halo kernel, and thd, thd_docs and usp (and Ulysses on packed rows) run their block kernels: no eager
    scores. The plan counted the rank's ``[heads, n, S]`` scores under every method; Gemma 2 under ring read +146%
    (``scripts/bench_plan_families_cp.py``, hidden 256, 2048 tokens, cp 2)."""
    d = _dims("gemma2")
    n_scores = d.heads * N * SEQ

    def activations(attn: str, **kw) -> float:
        return _plan(d, attn=attn, cp=2, **kw).terms["activations"].bytes

    for method in ("ring", "thd", "thd_docs"):
        assert activations("eager", cp_method=method) == activations("sdpa", cp_method=method), method
    assert activations("eager", cp_method="ulysses", packed=True) == activations("sdpa", cp_method="ulysses", packed=True)
    # Ulysses' inner kernel is the model's eager function: its scores over the whole row for H / cp heads, per layer
    ulysses = activations("eager", cp_method="ulysses") - activations("sdpa", cp_method="ulysses")
    assert ulysses >= (d.heads // 2) * SEQ * SEQ * 4 >= n_scores
    assert _plan(d, attn="eager").terms["activations"].bytes > _plan(d, attn="sdpa").terms["activations"].bytes


def test_softcapped_and_sink_layers_on_the_halo_kernel_are_planned():
    """Ring (and thd, thd_docs, usp) runs soft-capped and sink layers on the halo kernel, full-prefix layers too, whose
    blocks a CPU runs in exact math: a block of 256 queries against every key it may see, in fp32, three (Gemma 2's
    soft-cap) or four (gpt-oss' sinks) score blocks at the forward's peak and six or five at the backward's, beside
    the keys and values with the halo. Unplanned (once the eager scores ring never keeps were not counted), Gemma 2
    under ring read -55%; planned, +10.7%; gpt-oss +15.9% (``scripts/bench_plan_families_cp.py``, hidden 256, 2048
    tokens, cp 2, with the live tensors of a snapshot)."""
    from automodel.training.layer_kind_memory import halo_math_workspace

    gemma2, gpt_oss = _dims("gemma2"), _dims("gpt_oss")
    full = sum(1 for t in family_by_name("gemma2").build_config().layer_types if t == "full_attention")
    assert {(limit, fwd, bwd) for limit, _, fwd, bwd in gemma2.halo_math} == {(0, 3, 6), (WINDOW, 3, 6)}
    assert dict((limit, count) for limit, count, _, _ in gemma2.halo_math)[0] == full
    assert {(fwd, bwd) for _, _, fwd, bwd in gpt_oss.halo_math} == {(4, 5)}
    assert _dims("llama").halo_math == _dims("gemma3_text").halo_math == ()
    ring = RunShape(local_batch=1, seq=SEQ, cp=2)
    d = gemma2
    buffers = 6 * SEQ * d.kv_heads * d.head_dim * 4  # the full prefix: every key of the row
    scores = d.heads * BLOCK * SEQ * 4
    assert halo_math_workspace(d, ring) == (buffers + 3 * scores, buffers + 6 * scores)
    # a CUDA device runs the blocks in FlexAttention: the buffers only; Ulysses runs no halo kernel
    assert halo_math_workspace(d, dataclasses.replace(ring, attention_kernel="flash")) == (buffers, buffers)
    assert halo_math_workspace(d, dataclasses.replace(ring, cp_method="ulysses")) == (0.0, 0.0)
    assert halo_math_workspace(d, RunShape(local_batch=1, seq=SEQ)) == (0.0, 0.0)
    # usp (2 x ring 2) runs the halo kernel over its ring sub-group for H / 2 heads and its Ulysses sub-group's
    # queries (planned at all heads, Gemma 2 and gpt-oss read +60% to +82% at cp 4): ring's blocks at cp 2, half the
    # heads, the KV heads split as usp's all-to-all splits them; halo block masks for its sub-group's queries
    from automodel.training.layer_kind_memory import mask_bytes

    usp = RunShape(local_batch=1, seq=SEQ, cp=4, cp_method="usp", cp_options=(("ulysses_size", 2),))
    heads, kv_heads, queries = usp.method.halo_extent(d, usp)
    assert (heads, kv_heads, queries) == (d.heads // 2, max(1, d.kv_heads // 2), SEQ // 2)
    usp_buffers = 6 * SEQ * kv_heads * d.head_dim * 4
    assert halo_math_workspace(d, usp) == (usp_buffers + 3 * scores / 2, usp_buffers + 6 * scores / 2)
    assert mask_bytes(d, usp)[0] == SEQ // 2 * min(SEQ, min(BLOCK, SEQ // 2) + WINDOW)  # one window kind
    plan = _plan(d, cp=2, attn="eager")
    assert plan.terms["attention workspace"].bytes >= buffers + 6 * scores
    assert "halo kernel" in plan.terms["attention workspace"].note


def test_doge_under_cp_keeps_its_repeated_mask_and_makes_its_gradient_once():
    """Doge under CP hands its blocked attention the dynamic mask repeated to the query heads (the model's
    ``repeat_kv``: ``[B, Hq, n, T]`` in the compute dtype), which the blocks keep for the backward, where its gradient
    is made too. Each block's slice of the mask once made a whole ``[B, Hq, n, T]`` of zeros around its block's
    gradient, and their sum two more: four mask-sized tensors at the backward's peak (ring cp 2, hidden 256, 8 / 4
    heads, 2048 tokens: 300 MiB measured against 120 planned, -60%). The kernel splits the mask into its blocks now,
    and the gradient is made once from theirs (187 MiB); the plan counts the copy and its gradient (+11%). The
    kernel's output and gradients are the plain softmax's (fp64)."""
    from automodel.distributed.cp.layers.dynamic_mask import QUERY_BLOCK, dynamic_mask_attention
    from scripts.live_tensors import AllocationTracker

    config = family_by_name("doge").build_config()
    ((_, state),) = _dims("doge").gathered
    assert (state.bias_planes, state.bias_heads) == (config.num_key_value_heads, config.num_attention_heads)
    n, total, c = 1024, 2048, 4
    with_grad = state.backward_bytes(1, n, total, c) - dataclasses.replace(state, bias_heads=0).backward_bytes(1, n, total, c)
    assert with_grad == (2 * state.bias_heads * c + state.bias_planes - state.bias_planes * c) * n * total - (
        state.heads * min(state.block, n) * total * 4)  # fmt: skip
    # the kernel: four query heads over two KV heads, four blocks of queries
    hq, hkv, dim, t = 4, 2, 8, 4 * QUERY_BLOCK
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, hq, t, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, hkv, t, dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = torch.randn(1, hq, t, t, generator=g, dtype=torch.float64).tril().requires_grad_()
    out, _ = dynamic_mask_attention(torch.nn.Module(), q, k, v, mask, scaling=0.3)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ref = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3 + mask, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, (q, k, v, mask), grad_out)
    want = torch.autograd.grad(ref.transpose(1, 2), (q, k, v, mask), grad_out)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # the backward's peak beyond what exists: the mask's gradient and one block's scores, not a mask per block
    out, _ = dynamic_mask_attention(torch.nn.Module(), q, k, v, mask, scaling=0.3)
    tracker = AllocationTracker()
    with tracker:
        torch.autograd.grad(out, (q, k, v, mask), grad_out)
    mask_bytes = mask.numel() * 8
    assert tracker.peak < 2.5 * mask_bytes, tracker.peak / mask_bytes


_CORE_FIELDS = ("chain_kept_per_token", "chain_kept_per_row", "core_saved_per_token", "core_forward_per_token",
                "core_backward_per_token")


def _unmeasured(d):
    """``d`` as if its linear-mixer cores could not be measured (the plan's terms without them)."""
    return dataclasses.replace(d, **{name: (0.0, 0.0) for name in _CORE_FIELDS})


def _activations_added(d, phase: str, **kw) -> dict[str, float]:
    """Per moment of ``phase``, the activation bytes the plan adds for ``d``'s measured linear-mixer cores."""
    got, without = (_plan(x, **kw).by_moment[phase] for x in (d, _unmeasured(d)))
    return {m: got[m]["activations"] - without[m]["activations"] for m in got}


def test_the_plan_counts_what_the_chain_keeps_under_checkpointing():
    """Ring, thd, thd_docs and usp run a linear mixer's core in the state chain, which keeps each layer's saved
    tensors, inputs, outputs and states through the step outside activation checkpointing, a recomputed layer's
    chain once more in its backward, and a little more in flight at its mixer; the plan counts them from the
    meta-device measurement (``ModelDims.chain_*``) and says so. Uncounted, OLMo-Hybrid under ring cp 2 with
    checkpointing read -38% (hidden 256, 2048 tokens) and -84% at its tiny size; counted, +9% at its tiny size
    (scripts/bench_plan_families_cp.py). Ulysses recomputes its head-sharded cores: no chain there."""
    d = _dims("olmo_hybrid")
    layers = d.chained_mixer_layers
    assert layers == d.kernel_mixer_layers > 0
    assert d.chain_kept_per_token[0] > d.chain_kept_per_token[1] > 0
    # ZAYA's convolutional attention is chained too (its projection's conv state), though its attention probe measures it
    assert _dims("zaya").chained_mixer_layers == _dims("zaya").layers and _dims("zaya").kernel_mixer_layers == 0
    n = SEQ // 2
    saved, fwd, bwd = (n * x[0] for x in (d.core_saved_per_token, d.core_forward_per_token, d.core_backward_per_token))
    for method in ("ring", "thd", "thd_docs"):
        kw = dict(cp=2, cp_method=method, activation_checkpointing=True)
        kept = n * d.chain_kept_per_token[0] + d.chain_kept_per_row[0]
        # every chain from the last chained layer's forward on, what a core holds beyond what it saves at a layer's
        # mixer (the whole row's: the chain's pieces are shorter); the recomputed layer's chain once more
        again = kept / layers
        assert _activations_added(d, "forward", **kw) == pytest.approx(
            {"MLP": kept, "attention": kept + fwd - saved, "final norm": kept})
        assert _activations_added(d, "recompute", **kw) == pytest.approx(
            {"MLP": kept + again, "norm": kept + again, "attention": kept + again + max(fwd, bwd) - saved,
             "final norm": kept})
        note = _plan(d, **kw).terms["activations"].note
        assert f"under {method} the {layers} linear-mixer layers' cores run in the state chain, which keeps " in note
        assert "checkpointing does not recompute them" in note and "not counted" not in note
        # what is counted is transformers' torch code, not the CUDA kernels: said once, in place of the kernel note
        assert "measured with transformers' torch code" in note and "torch fallback" not in note
        assert "not counted" in _plan(_unmeasured(d), **kw).terms["activations"].note
    # bf16: the bf16 figures
    kw = dict(cp=2, cp_method="ring", activation_checkpointing=True, compute_bytes=2)
    assert _activations_added(d, "forward", **kw)["MLP"] == pytest.approx(
        n * d.chain_kept_per_token[1] + d.chain_kept_per_row[1])
    # without checkpointing the chain keeps the same (as autograd would), with no recomputation
    kept = n * d.chain_kept_per_token[0] + d.chain_kept_per_row[0]
    assert _activations_added(d, "backward", cp=2, cp_method="ring")["MLP"] == pytest.approx(kept)
    # Ulysses and one process: no chain (their cores as autograd saves them: the next test)
    for kw in (dict(cp=2, cp_method="ulysses", activation_checkpointing=True), {}):
        assert "state chain" not in _plan(d, **kw).terms["activations"].note
    assert "state chain" not in _plan(_dims("llama"), cp=2, activation_checkpointing=True).terms["activations"].note


def test_linear_mixer_cores_outside_the_chain_are_counted_where_their_torch_code_runs(monkeypatch):
    """Outside the chain (one process, Ulysses) a linear-mixer layer's core keeps what autograd saves and holds more at
    its peaks: with checkpointing the layer in flight (its forward at its mixer; in its recomputed backward what it
    saved, and at its mixer its backward's peak), without every such layer keeps what it saved. Where transformers'
    torch code runs them (on the CPU; on a GPU where their kernel package is not installed here, or none exists), the
    plan counts them from the meta-device measurement (``ModelDims.core_*``); planned as attention layers of the
    model's heads, Kimi Linear and Bailing-hybrid read -93% to -98% under Ulysses at cp 2 and Jamba -37%."""
    import importlib.util

    from automodel.training.chain_memory import torch_code_on_gpu

    d = _dims("kimi_linear")
    assert d.core_layers == d.gpu_torch_core_layers == d.chained_mixer_layers == d.kernel_mixer_layers > 0

    def per(tokens: int) -> tuple[float, float, float]:
        return tuple(tokens * x[0] for x in (d.core_saved_per_token, d.core_forward_per_token, d.core_backward_per_token))

    saved, fwd, bwd = per(SEQ)
    assert bwd > saved > 0 and fwd > 0
    ckpt = dict(activation_checkpointing=True)
    # the layer in flight's core: its forward at its mixer; in its recomputed backward what it saved, at its mixer
    # the larger of its recomputed forward's peak and its backward's
    assert _activations_added(d, "forward", **ckpt) == pytest.approx({"MLP": 0.0, "attention": fwd, "final norm": 0.0})
    assert _activations_added(d, "recompute", **ckpt) == pytest.approx(
        {"MLP": saved, "attention": max(fwd, bwd), "norm": saved, "final norm": 0.0})
    # Ulysses: the head shard's cores on the whole row hold the rank's share (half the row's at cp 2)
    assert _activations_added(d, "recompute", cp=2, cp_method="ulysses", **ckpt)["attention"] == pytest.approx(
        max(per(N)[1:]))
    # without checkpointing every such layer keeps what it saved, the last one more in flight at its mixer
    every = saved * d.core_layers
    assert _activations_added(d, "backward") == pytest.approx(
        {"MLP": every, "attention": every + bwd - saved, "norm": every, "final norm": every})
    note = _plan(d, **ckpt).terms["activations"].note
    assert "the recomputed linear-mixer layer's core, transformers' torch code on the CPU" in note
    assert "torch fallback" not in note  # said by the kernel note only where not counted
    # a GPU run counts them only where their kernel package is missing here: with fla installed, fla's kernels run
    # them, which the plan does not measure (the kernel note says so)
    mixer = next(m for m in AutoModelForCausalLM.from_config(family_by_name("kimi_linear").build_config()).modules()
                 if type(m).__name__ == "KimiLinearDeltaAttention")  # fmt: skip
    assert torch_code_on_gpu(mixer)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "fla" else real(name, *a))
    assert not torch_code_on_gpu(mixer)
    gpu = dict(activation_checkpointing=True, attention_kernel="flash")
    with_fla = dataclasses.replace(d, gpu_torch_core_layers=0)
    assert not any(_activations_added(with_fla, "recompute", **gpu).values())
    assert "torch fallback" in _plan(with_fla, **gpu).terms["activations"].note
    assert _activations_added(d, "recompute", **gpu)["attention"] == pytest.approx(max(fwd, bwd))
    # MiniMax's lightning layers are measured by their own probe (ModelDims.mixer_saved_extra), ZAYA's CCA by its
    # attention's: not counted twice
    assert _dims("minimax").core_layers == 0 and _dims("zaya").core_layers == 0


def test_ring_rotates_kv_at_the_query_heads_where_transformers_repeated_them():
    """Above head size 256 transformers' ``sdpa`` function repeats K/V to the query heads before the kernel (it cannot
    pass ``enable_gqa``), so torch's ring rotates, accumulates and sends them at the query heads: Gemma 4's 512-wide
    full-attention layers under ring cp 2 read -27% with the KV heads' blocks, -1.3% now
    (``scripts/bench_plan_families_cp.py``)."""
    d = _dims("llama")
    wide = dataclasses.replace(d, head_dim=320)
    ring = RunShape(local_batch=1, seq=SEQ, cp=2)
    assert d.kv_heads < d.heads

    def workspace(dims) -> float:
        return ring.method.attention_workspace(dims, ring)[0]

    # the same layer with K/V at the query heads is the grouped one's workspace with kv = q
    assert workspace(wide) == workspace(dataclasses.replace(wide, kv_heads=wide.heads))
    assert workspace(d) < workspace(dataclasses.replace(d, kv_heads=d.heads))
