"""Headwise Ulysses (``distributed.ulysses_head_chunks``) in one process: the rule, the config checks, the exact
chunked computation at cp=1, and the planner's terms. The multi-process parity runs in existing launches:
tests/test_ulysses.py (cp=2) and tests/test_usp.py (cp=4: Ulysses and usp 2 x 2), tests/workers/headwise_worker.py.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from automodel.config import ConfigError, load_config
from automodel.distributed.cp.head_chunks import (
    ALL_TO_ALL_LATENCY_S,
    head_chunk_choices,
    head_chunks_problem,
    kv_heads_per_rank,
)
from automodel.training.memory_plan import (
    ModelDims,
    RunShape,
    head_chunk_options,
    head_chunks_auto_choice,
    plan_memory,
)

ULYSSES = "configs/cp_ulysses.yaml"


def _problems(*overrides: str, world: int = 2, config: str = ULYSSES) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["--config", config, *overrides], world_size=world)
    return str(info.value)


def test_the_rule_keeps_kv_groups_whole():
    assert kv_heads_per_rank(8, 8) == 1 and kv_heads_per_rank(8, 2) == 4 and kv_heads_per_rank(2, 4) == 1
    assert kv_heads_per_rank(6, 4) == 3  # 6 KV heads replicated to lcm(6, 4) = 12 over 4 ranks
    assert head_chunk_choices(8, 2) == [1, 2, 4] and head_chunk_choices(8, 8) == [1]
    assert head_chunks_problem(2, 32, 8, 2) is None and head_chunks_problem("auto", 32, 8, 8) is None
    msg = head_chunks_problem(2, 32, 8, 8, "cp_size=8")
    assert "distributed.ulysses_head_chunks=2 does not divide the 1 KV head(s) each rank holds" in msg
    assert "(8 KV heads over 8 ranks, cp_size=8)" in msg and "one of [1] (or auto)" in msg
    assert "must be 'auto' or a positive integer" in head_chunks_problem(0, 32, 8, 2)
    assert "must be 'auto' or a positive integer" in head_chunks_problem(True, 32, 8, 2)


def test_config_rules_refuse_before_the_model_loads():
    msg = _problems("distributed.cp_size=2", "distributed.ulysses_head_chunks=4")  # 2 KV heads over 2 ranks: 1 each
    assert "distributed.ulysses_head_chunks=4 does not divide the 1 KV head(s) each rank holds" in msg
    assert "KV heads of model.config over 2 ranks" in msg and "one of [1]" in msg
    msg = _problems("distributed.cp_method=ring", "distributed.ulysses_head_chunks=2")
    assert "distributed.cp_method=ring with cp_size=2 splits no heads by all-to-all" in msg
    assert "set distributed.ulysses_head_chunks=1" in msg
    assert "must be 'auto' or a positive integer" in _problems("distributed.ulysses_head_chunks=0")
    cfg = load_config(["--config", ULYSSES, "++model.config.num_key_value_heads=4",
                       "distributed.ulysses_head_chunks=2"], world_size=2).cfg  # fmt: skip
    from automodel.distributed.cp import get_cp_method

    assert get_cp_method("ulysses").recipe_batch_options(cfg) == {"head_chunks": 2}
    assert load_config(["--config", ULYSSES, "distributed.ulysses_head_chunks=auto"], world_size=2).cfg


def _tiny(kv: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=kv, head_dim=8, vocab_size=50, attn_implementation="sdpa")  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)


@pytest.mark.parametrize("packed", [False, True])
def test_head_groups_compute_the_same_bits_at_cp1(packed):
    """cp=1 (no all-to-all): 2 and 4 head groups give the unchunked loss and gradients bit for bit, with
    checkpointing too, and every group ran (2 layers x G in the forward, as many recomputed in the backward)."""
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention

    base = _tiny(4)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    if packed:
        batch["seq_lens_padded"] = torch.tensor([[10, 14], [24, -1000]])
        batch["position_ids"] = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24).clone()
        batch["position_ids"][1] = torch.arange(24)
    results = {}
    for chunks in (1, 2, 4):
        model = copy.deepcopy(base).train()
        set_ulysses_attention(model)
        ctx, local = make_ulysses_batch_and_ctx(None, batch, inner_attn="sdpa", head_chunks=chunks)
        with ctx() as active:
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), local["labels"].flatten())
            loss.backward()
        results[chunks] = (loss.detach(), [p.grad for p in model.parameters()], active.head_group_runs)
    for chunks in (2, 4):
        loss, grads, runs = results[chunks]
        assert torch.equal(loss, results[1][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[1][1], strict=True))
        assert runs == 2 * chunks * 2
    assert results[1][2] == 2  # unchunked: one call per layer, nothing recomputed


def test_a_count_that_splits_a_kv_group_is_refused_at_the_call():
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention

    model = _tiny(2)
    set_ulysses_attention(model)
    ids = torch.zeros(1, 8, dtype=torch.long)
    ctx, local = make_ulysses_batch_and_ctx(None, {"input_ids": ids}, head_chunks=4)
    with pytest.raises(ValueError, match="ulysses_head_chunks=4 does not divide the 2 KV head"), ctx():
        model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    with pytest.raises(ValueError, match="resolved by the recipe"):
        make_ulysses_batch_and_ctx(None, {"input_ids": ids}, head_chunks="auto")


# ------------------------------------------------------------------ the planner's terms

def _llama_8b() -> ModelDims:
    """Llama-3.1-8B's sizes (meta device, no weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.training.memory_plan import model_dims

    with torch.device("meta"):
        return model_dims(AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256)))  # fmt: skip


LLAMA_8B = _llama_8b()


def _shape(chunks: int, method: str = "ulysses", cp: int = 2, **kw) -> RunShape:
    return RunShape(local_batch=1, seq=1 << 20, cp=cp, cp_method=method, activation_checkpointing=True, tiled_mlp=True,
                    chunk_tokens=1024, compute_bytes=2, head_chunks=chunks, attention_kernel="flash", **kw)  # fmt: skip


def test_the_plan_counts_one_head_group_of_buffers():
    d = LLAMA_8B
    whole, half = plan_memory(d, _shape(1)), plan_memory(d, _shape(4))
    n, c = (1 << 20) // 2, 2
    h, kv = d.hidden, d.kv_heads * d.head_dim
    grads = (2 * h + 2 * kv) * c * n  # the backward's full-row dO, dQ, dK, dV of the rank's heads
    assert whole.terms["attention workspace"].bytes == grads
    assert half.terms["attention workspace"].bytes == grads / 4 + 3 / 4 * (h + 2 * kv) * c * n  # + the groups done
    assert half.terms["attention kernel"].bytes == pytest.approx(whole.terms["attention kernel"].bytes / 4)
    # the recomputed layer's backward is the peak, at its MLP's backward (the MLP and the norms tiled: a tiled norm's
    # temporaries no longer outweigh a tile; the attention's moment holds the input norm's output, not the
    # post-attention norm's tensors and the residual: scripts/bench_memory.py --headwise only, --tiled-layer only);
    # in head groups fewer buffers at the attention's moment, and no kernel output nor LSE saved at any: a lower total
    assert half.peak_phase == whole.peak_phase == "recompute"
    assert half.moments["recompute"] == whole.moments["recompute"] == "MLP"
    at_whole, at_half = (sum(p.by_moment["recompute"]["attention"].values()) for p in (whole, half))
    assert at_half < at_whole
    assert half.total_bytes < whole.total_bytes
    assert head_chunk_options(d, _shape(1)) == [1, 2, 4] and head_chunk_options(d, _shape(1, cp=8)) == [1]
    assert head_chunk_options(d, _shape(1, method="ring")) == [1]
    usp = _shape(2, method="usp", cp=8, cp_options=(("ulysses_size", 2),))
    assert head_chunk_options(d, usp) == [1, 2, 4]
    assert plan_memory(d, usp).terms["attention workspace"].bytes < plan_memory(
        d, dataclasses.replace(usp, head_chunks=1)).terms["attention workspace"].bytes  # fmt: skip
    pick, why = head_chunks_auto_choice(d, _shape(1))
    assert pick in (2, 4) and "distributed.ulysses_head_chunks=auto" in why
    # without the tiled MLP the MLP's backward is the peak too; head groups still lower it by the recomputed layer's
    # kernel output and LSE they do not save, so auto takes the fewest groups that reach the lowest total
    untiled = dataclasses.replace(_shape(1), tiled_mlp=False)
    assert plan_memory(d, untiled).peak_phase == "recompute" and plan_memory(d, untiled).moments["recompute"] == "MLP"
    pick = head_chunks_auto_choice(d, untiled)[0]
    totals = {g: plan_memory(d, dataclasses.replace(untiled, head_chunks=g)).total_bytes for g in (1, 2, 4)}
    assert pick == 2 and totals[2] < totals[1] and totals[4] == totals[2]


def test_the_estimate_charges_the_recomputed_forward_and_each_groups_all_to_all():
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.distributed.cp import get_cp_method
    from automodel.distributed.cp.cost import exchange_cost
    from automodel.training.step_estimate import estimate_step

    d, spec = LLAMA_8B, GPU_SPECS["h100"]
    sizes = {"dp_replicate": 1, "dp_shard": 1, "dp": 1, "cp": 2, "tp": 1}
    one, four = (estimate_step(d, _shape(g), sizes, 2, 1, spec, 8) for g in (1, 4))
    assert four.attention_flops == pytest.approx(one.attention_flops * 5 / 4)  # fwd, recomputed fwd, bwd (2) + 1
    assert four.step_s > one.step_s
    kw = dict(seq_len=1 << 20, cp_size=2, compute_bytes=2)
    (t1,), (t4,) = (exchange_cost(get_cp_method("ulysses"), d, head_chunks=g, **kw).terms for g in (1, 4))
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    assert t4.forward_bytes == t1.forward_bytes
    assert t4.backward_bytes == pytest.approx(t1.backward_bytes + t1.forward_bytes * (q + 2 * kv) / (2 * q + 2 * kv))
    assert t4.forward_latency_s == pytest.approx(4 * 3 * ALL_TO_ALL_LATENCY_S)
    assert t4.backward_latency_s == pytest.approx((4 * 3 + 3 * 4) * ALL_TO_ALL_LATENCY_S)


def test_plan_search_offers_head_groups_and_their_keys():
    from automodel.training.plan_search import Layout

    layout = Layout(1, 2, 1, "ulysses", False, (), 4)
    assert layout.text == "cp 2 ulysses h/4"
    assert "distributed.ulysses_head_chunks=4" in layout.overrides()
    assert "distributed.ulysses_head_chunks" not in " ".join(Layout(1, 2, 1, "ulysses").overrides())


# ------------------------------------------------------------------ without CP: model.attention_head_chunks


def _gqa(kind: str, dtype: torch.dtype, attn: str = "sdpa", **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=4, head_dim=8, vocab_size=50, max_position_embeddings=64, **kw)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).train()


def _grouped_batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (2, 27), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # documents by position_ids restarts: transformers' packed mask, built for the inner implementation
        batch["position_ids"] = torch.cat([torch.arange(11), torch.arange(16)]).expand(2, -1).clone()
    return batch


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, bound: float) -> None:  # noqa: ANN001
    assert abs(float(got[0] - want[0])) <= bound * abs(float(want[0]))
    assert got[1].keys() == want[1].keys() and len(want[1]) > 0
    for n, g in want[1].items():
        assert float((got[1][n] - g).abs().max()) <= bound * float(g.abs().max().clamp_min(1e-30)), n


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_attention_head_groups_without_cp_give_the_same_loss_and_gradients(kind, dtype, packed):
    """cp=1: 2 and 4 groups of whole KV heads (8 heads / 4 KV heads) give the ungrouped loss and every gradient
    (fp32 rel <= 1e-6, fp64 <= 1e-15), packed rows included; every call ran its groups, each recomputed once."""
    from automodel.models.attention_head_chunks import (
        ATTENTION_HEAD_GROUP_COUNTS,
        apply_attention_head_chunks,
        remove_attention_head_chunks,
    )

    base = _gqa(kind, dtype)
    batch = _grouped_batch(packed)
    want = _loss_and_grads(base, batch)
    bound = 1e-15 if dtype == torch.float64 else 1e-6
    for chunks in (2, 4):
        model = copy.deepcopy(base)
        assert apply_attention_head_chunks(model, chunks) == 2
        assert model.config._attn_implementation == "automodel_head_groups_sdpa"
        ATTENTION_HEAD_GROUP_COUNTS.reset()
        _assert_same(_loss_and_grads(model, batch), want, bound)
        c = ATTENTION_HEAD_GROUP_COUNTS
        assert (c.calls, c.groups, c.recomputed, c.max_groups) == (2, 2 * chunks, 2 * chunks, chunks)
        assert remove_attention_head_chunks(model) == 2 and model.config._attn_implementation == "sdpa"


def test_attention_head_groups_compose_with_the_tiled_layer_checkpointing_offload_and_compile():
    """cp=1, packed rows, fp32: head groups inside the tiled layer's core with the tiled MLP, activation checkpointing
    and offload, then under torch.compile of the blocks (aot_eager): the plain run's loss and gradients."""
    from automodel.models.attention_head_chunks import (
        ATTENTION_HEAD_GROUP_COUNTS,
        apply_attention_head_chunks,
    )
    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.compile import compile_decoder_blocks
    from automodel.models.tiled_layer import apply_tiled_layer, layer_tile_counts
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.activation_offload import apply_activation_offload

    base = _gqa("qwen3", torch.float32)
    batch = _grouped_batch(True)
    want = _loss_and_grads(base, batch)
    model = copy.deepcopy(base)
    apply_tiled_mlp(model, 6)
    apply_tiled_layer(model, 5)
    apply_attention_head_chunks(model, 4)
    apply_activation_checkpointing(model)
    store = apply_activation_offload(model)
    ATTENTION_HEAD_GROUP_COUNTS.reset()
    _assert_same(_loss_and_grads(model, batch), want, 1e-6)
    c = ATTENTION_HEAD_GROUP_COUNTS  # forward + checkpoint's recomputation, each 2 layers x 4 groups; backward 8
    assert (c.calls, c.groups, c.recomputed) == (4, 16, 8)
    assert sum(t.calls for t in layer_tile_counts(model)) == 4 and store.stats().peak_host_bytes > 0
    compiled = copy.deepcopy(base)
    apply_attention_head_chunks(compiled, 2)
    apply_activation_checkpointing(compiled)
    compile_decoder_blocks(compiled, backend="aot_eager")
    ATTENTION_HEAD_GROUP_COUNTS.reset()
    _assert_same(_loss_and_grads(compiled, batch), want, 1e-6)
    assert ATTENTION_HEAD_GROUP_COUNTS.groups == 8


def test_attention_head_groups_refuse_what_they_cannot_group():
    from automodel.errors import UserInputError
    from automodel.models.attention_head_chunks import apply_attention_head_chunks

    with pytest.raises(UserInputError, match=r"model.attention_head_chunks=3 does not divide the model's 4 KV head"):
        apply_attention_head_chunks(_gqa("llama", torch.float32), 3)
    dropout = _gqa("llama", torch.float32, attention_dropout=0.1)
    apply_attention_head_chunks(dropout, 2)
    with pytest.raises(ValueError, match="runs attention dropout 0.1 in training"):
        dropout(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=False)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        sinks = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=50, num_local_experts=2, num_experts_per_tok=1))  # fmt: skip
    with pytest.raises(UserInputError, match="per-head sink logits; set model.attention_head_chunks=null"):
        apply_attention_head_chunks(sinks, 2)


def test_attention_head_chunks_config_rules():
    cp1 = ("distributed.cp_size=1", "++model.config.num_key_value_heads=2")
    msg = _problems(*cp1, "++model.attention_head_chunks=4", world=1)
    assert "model.attention_head_chunks=4 does not divide model.config's 2 KV head(s)" in msg and "[1, 2]" in msg
    msg = _problems("++model.attention_head_chunks=2")  # cp_size=2 (Ulysses)
    assert "distributed.cp_size=2 runs distributed.cp_method=ulysses" in msg
    assert "set model.attention_head_chunks=null" in msg and "distributed.ulysses_head_chunks=2" in msg
    assert "must be null, 'auto' or a positive integer" in _problems(*cp1, "++model.attention_head_chunks=0", world=1)
    msg = _problems(*cp1, "distributed.tp_size=2", "++model.attention_head_chunks=2", world=2)
    assert "model.attention_head_chunks=2 with distributed.tp_size=2" in msg
    for value in ("2", "auto", "null"):
        assert load_config(["--config", ULYSSES, *cp1, f"++model.attention_head_chunks={value}"], world_size=1).cfg


def test_the_plan_counts_one_head_group_at_cp1_and_the_search_offers_it():
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.training.plan_search import Layout
    from automodel.training.step_estimate import estimate_step

    d = LLAMA_8B
    one = dict(cp=1, method="ring", tiled_layer=True, activation_offload=True, offload="all")
    whole, grouped = plan_memory(d, _shape(1, **one)), plan_memory(d, _shape(8, **one))
    # cuDNN's / flash's buffers of one call: one group's heads
    assert grouped.terms["attention kernel"].bytes == pytest.approx(whole.terms["attention kernel"].bytes / 8, rel=1e-3)
    assert "[1, 4 heads (1 KV)" in grouped.terms["attention kernel"].note
    n, c, q, kv = 1 << 20, 2, d.heads * d.head_dim, d.kv_heads * d.head_dim
    # the kernel's output and LSE are not kept (each group recomputes them); one group's tensors in the backward
    saved = whole.by_moment["recompute"]["attention"]["activations"] - grouped.by_moment["recompute"]["attention"]["activations"]
    assert saved == pytest.approx(n * (q * c + d.heads * 4) - n * ((3 * q + 2 * kv) * c + d.heads * 4) / 8)
    assert grouped.total_bytes < whole.total_bytes
    assert head_chunk_options(d, _shape(1, **one)) == [1, 2, 4, 8]
    pick, why = head_chunks_auto_choice(d, _shape(1, **one))
    assert pick > 1 and why.startswith("model.attention_head_chunks=auto")
    sizes = {"dp_replicate": 1, "dp_shard": 1, "dp": 1, "cp": 1, "tp": 1}
    e1, e8 = (estimate_step(d, _shape(g, **one), sizes, 1, 1, GPU_SPECS["h100"], 8) for g in (1, 8))
    assert e8.attention_flops == pytest.approx(e1.attention_flops * 5 / 4)  # the groups' forward once more
    layout = Layout(1, 1, 1, None, False, (), 8)
    assert layout.text == "h/8" and "model.attention_head_chunks=8" in layout.overrides()


def test_the_run_log_says_how_many_head_groups_ran():
    from automodel.models.attention_head_chunks import apply_attention_head_chunks
    from automodel.training.technique_report import (
        collect_technique_report,
        reset_technique_counts,
        technique_lines,
        technique_problems,
    )

    model = _gqa("llama", torch.float32)
    apply_attention_head_chunks(model, 2)
    reset_technique_counts(model, None)
    _loss_and_grads(model, _grouped_batch(False))
    report = collect_technique_report(model, None, 1, attention_head_chunks=2)
    assert report["attention_head_groups"] == {"head_chunks": 2, "calls": 2, "groups": 4, "recomputed": 4,
                                               "max_groups": 2}  # fmt: skip
    assert ("attention head groups (model.attention_head_chunks=2, no CP): 2 attention call(s) in 2 head groups each, "
            "4 group(s) run one at a time in the forward and 4 recomputed group by group in the backward "
            "(1 micro-batch(es))") in technique_lines(report)  # fmt: skip
    assert technique_problems(report) == []
    reset_technique_counts(model, None)
    problems = technique_problems(collect_technique_report(model, None, 1, attention_head_chunks=2))
    assert "model.attention_head_chunks=2 but 0 attention call(s) ran 0 head group(s)" in problems[0]


@pytest.mark.parametrize("method", ["ulysses", "thd_docs"])
def test_attention_head_groups_wrap_the_document_attention_a_method_runs_at_cp1(method):
    """Packed rows at cp_size=1 where the reference is a method's document-aware attention on the one rank: grouped
    around it (the inner implementation), the same loss and gradients (fp64, bit for bit on CPU)."""
    from automodel.distributed.cp.bind import bind_cp_method
    from automodel.models.attention_head_chunks import (
        ATTENTION_HEAD_GROUP_COUNTS,
        apply_attention_head_chunks,
    )

    base = _gqa("llama", torch.float64)
    ids = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(5))
    lens = torch.tensor([[10, 14], [24, -1000]])
    pos = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(24)])
    results = []
    for chunks in (None, 2):
        model = copy.deepcopy(base)
        fn, _ = bind_cp_method(method, model, None, 1, packed=True, trust_own_forward=False)
        apply_attention_head_chunks(model, chunks)
        ATTENTION_HEAD_GROUP_COUNTS.reset()
        ctx, local = fn(None, {"input_ids": ids, "labels": ids.clone(), "seq_lens": lens, "seq_lens_padded": lens,
                               "position_ids": pos})  # fmt: skip
        with ctx():
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
            loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()], model.config._attn_implementation))
    assert results[1][2] == f"automodel_head_groups_{method}" and ATTENTION_HEAD_GROUP_COUNTS.groups == 4
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
