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
    # the attention's moment of the recomputed layer's backward is the peak once the tiled MLP shrinks the MLP's:
    # fewer buffers, a lower total
    assert half.peak_phase == whole.peak_phase == "recompute"
    assert half.moments["recompute"] == whole.moments["recompute"] == "attention"
    assert half.total_bytes < whole.total_bytes
    assert head_chunk_options(d, _shape(1)) == [1, 2, 4] and head_chunk_options(d, _shape(1, cp=8)) == [1]
    assert head_chunk_options(d, _shape(1, method="ring")) == [1]
    usp = _shape(2, method="usp", cp=8, cp_options=(("ulysses_size", 2),))
    assert head_chunk_options(d, usp) == [1, 2, 4]
    assert plan_memory(d, usp).terms["attention workspace"].bytes < plan_memory(
        d, dataclasses.replace(usp, head_chunks=1)).terms["attention workspace"].bytes  # fmt: skip
    pick, why = head_chunks_auto_choice(d, _shape(1))
    assert pick in (2, 4) and "distributed.ulysses_head_chunks=auto" in why
    # without the tiled MLP the MLP's backward is the peak: more head groups would not lower it, auto keeps 1
    untiled = dataclasses.replace(_shape(1), tiled_mlp=False)
    assert plan_memory(d, untiled).peak_phase == "recompute" and plan_memory(d, untiled).moments["recompute"] == "MLP"
    assert head_chunks_auto_choice(d, untiled)[0] == 1


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
