"""The memory planner (automodel.training.memory_plan): its terms, its suggestions, the dry-run report,
and its step-peak prediction against the measured step peak of a tiny Llama on CPU (issue 14, item 3).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from automodel.distributed.cp import get_cp_method
from automodel.training.cpu_memory import MMAP_ENV
from automodel.training.memory_plan import (
    RunShape,
    _changes,
    _fmt,
    memory_plan_lines,
    model_dims,
    plan_memory,
    suggest_changes,
)
from tests.dist_harness import run_distributed

# the measured model: small hidden size, 2 layers, fp32 (attention dominates the time, so keep h small)
TINY = dict(
    hidden_size=32,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=2048,
)
CASES = [
    {"seq": 4096, "chunk": None},
    {"seq": 4096, "chunk": 256},
    {"seq": 16384, "chunk": None},
    {"seq": 16384, "chunk": 256},
]
MIB = 2**20


def _dims(**kw):
    with torch.device("meta"):
        return model_dims(AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **(TINY | kw))))


LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)


def test_model_dims_counts_parameters_once():
    d = _dims(tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **(TINY | {"tie_word_embeddings": True})))
    assert d.params == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert d.root_params == 2048 * 32 + 32  # tied embedding/LM head + final norm
    assert d.layer_params == (d.params - d.root_params) // 2
    assert (d.head_dim, d.kv_heads) == (16, 1)


def test_cp_divides_activations_and_logits_but_not_the_chunked_loss():
    # Llama's q is a transposed view of its projection: at cp 1 torch's SDPA returns the output token-major and no
    # transposed copy is saved; the CP methods' outputs are counted with theirs (memory_plan._output_copies)
    assert not _dims().attn_output_copy
    d = dataclasses.replace(_dims(), attn_output_copy=True)
    one = plan_memory(d, RunShape(local_batch=1, seq=16384))
    two = plan_memory(d, RunShape(local_batch=1, seq=16384, cp=2, cp_method="ulysses"))  # SDPA's GQA, as at cp 1
    for term in ("activations", "logits and loss"):
        assert two.terms[term].bytes == pytest.approx(one.terms[term].bytes / 2, rel=1e-3)
    no_copy = plan_memory(_dims(), RunShape(local_batch=1, seq=16384))
    q = d.heads * d.head_dim
    assert one.phases["loss"]["activations"] - no_copy.phases["loss"]["activations"] == d.layers * 16384 * q * 4
    # ring runs torch's ring ops through transformers' sdpa, which passes enable_gqa (K/V saved at the KV heads) up to
    # head size 256 and repeats K/V to the query heads above it: 2 q per token and layer more
    ring = plan_memory(d, RunShape(local_batch=1, seq=16384, cp=2))
    assert ring.terms["activations"].bytes == two.terms["activations"].bytes
    wide = _dims(head_dim=512)  # 2 heads of 512, 1 KV head
    extra = [plan_memory(wide, RunShape(local_batch=1, seq=16384, cp=2, cp_method=m)).terms["activations"].bytes
             for m in ("ring", "ulysses")]  # fmt: skip
    # K/V repeated to the 2 query heads in place of the 1 KV head's (never both: repeat_kv and RoPE keep no input)
    assert extra[0] - extra[1] == pytest.approx((2 * 2 * 512 - 2 * 512) * 4 * 8192 * 2, rel=1e-9)
    assert one.terms["logits and loss"].bytes == pytest.approx(3 * 16384 * 2048 * 4 + 16384 * 32 * 4)
    chunked = [plan_memory(d, RunShape(local_batch=1, seq=s, chunk_tokens=256)) for s in (4096, 65536)]
    loss = [p.terms["logits and loss"].bytes for p in chunked]
    grad_h = [s * 32 * 4 for s in (4096, 65536)]  # only the hidden-state gradient grows with the tokens
    assert loss[1] - grad_h[1] == pytest.approx(loss[0] - grad_h[0])
    assert two.persistent_bytes == pytest.approx(one.persistent_bytes / 2)  # FSDP over dp_shard * cp


def test_activation_checkpointing_keeps_layer_inputs_and_recomputes_one_layer():
    d = _dims()
    off = plan_memory(d, RunShape(local_batch=1, seq=4096, chunk_tokens=256))
    on = plan_memory(d, RunShape(local_batch=1, seq=4096, chunk_tokens=256, activation_checkpointing=True))
    assert off.peak_phase == "loss" and on.peak_phase == "recompute"
    # the 2 layer inputs (the first is the embedding output), the final norm (3 h), ids/labels/positions and
    # RoPE's cos and sin ([N, head_dim] each)
    assert on.phases["loss"]["activations"] == 4096 * (2 * 32 * 4 + 3 * 32 * 4 + 24 + 2 * 16 * 4)
    assert on.step_peak_bytes < off.step_peak_bytes


def test_dominant_term_and_cheapest_change_for_a_long_llama():
    d = _dims(**LLAMA_1B)
    shape = RunShape(local_batch=1, seq=32768, cp=4, compute_bytes=2, activation_checkpointing=True)
    plan = plan_memory(d, shape)
    assert plan.dominant == "logits and loss"
    budget = plan.total_bytes * 0.6
    lines = suggest_changes(d, shape, budget, world=4)
    assert "does NOT fit" in lines[0]
    assert lines[1].startswith("cheapest change that fits: loss.chunk_tokens=1024")
    assert len(lines) == 2 and not any("tp_size" in line for line in lines)  # a fix cheaper than TP exists
    fixed = plan_memory(d, dataclasses.replace(shape, chunk_tokens=1024))
    assert fixed.total_bytes <= budget
    # no AC, no chunked loss, a budget only cp can meet: the suggestion raises cp_size
    big = RunShape(local_batch=1, seq=131072, cp=1, compute_bytes=2)
    tiny_budget = plan_memory(d, dataclasses.replace(big, cp=8, chunk_tokens=1024, activation_checkpointing=True))
    lines = suggest_changes(d, big, tiny_budget.total_bytes * 1.01, world=1)
    assert "distributed.cp_size=" in lines[1] and "ranks instead of 1" in lines[1], lines
    assert suggest_changes(d, big, 1e15, world=1)[0].endswith("-> fits")
    text = "\n".join(memory_plan_lines(d, big, budget_gib=1.0, world=1))
    assert "no change tried fits" in text and "dominant term: activations" in text


def test_dry_run_prints_the_plan_and_the_budget_is_validated(capsys):
    from recipes.finetune import main

    # configs/cp.yaml (4 layers, 512 local tokens): activations dominate, so checkpointing is the fix
    assert main(["--config", "configs/cp.yaml", "recipe.dry_run=true", "recipe.memory_budget_gib=0.02"]) == 0
    out = capsys.readouterr().out
    assert "predicted memory per rank" in out and "<- step peak" in out and "dominant term: activations" in out
    assert "does NOT fit" in out and "cheapest change that fits: model.activation_checkpointing=true" in out
    code = main(["--config", "configs/cp.yaml", "recipe.dry_run=true", "recipe.memory_budget_gib=-1"])
    err = capsys.readouterr()
    assert code != 0 and "recipe.memory_budget_gib=-1.0 must be > 0" in err.out + err.err


def _measure(world: int) -> list[dict]:
    saved = {k: os.environ.get(k) for k in MMAP_ENV}
    os.environ.update(MMAP_ENV)  # read by the spawned interpreters' glibc at start-up
    try:
        ranks = run_distributed("scripts.bench_memory:measure_worker", world, 900, cases=CASES, model_kw=TINY)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return [max(r[i]["peak_mib"] for r in ranks) for i in range(len(CASES))]


@pytest.fixture(scope="module")
def measured() -> dict[int, list[float]]:
    out = {world: _measure(world) for world in (1, 2)}
    print(f"measured step peaks MiB per cp, cases {CASES}: {out}")  # shown with pytest -s
    return out


@pytest.mark.dist
@pytest.mark.parametrize("cp", [1, 2])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_predicted_step_peak_within_20_percent_of_measured(measured, cp, case):
    c = CASES[case]
    meas = measured[cp][case]
    pred = plan_memory(_dims(), RunShape(local_batch=1, seq=c["seq"], cp=cp, chunk_tokens=c["chunk"]))
    # the measured ranks hold a replicated model (gradients all-reduced, no FSDP2): no gathered parameters
    planned = (pred.step_peak_bytes - pred.phases[pred.peak_phase]["communication buffers"]) / MIB
    assert abs(planned - meas) / meas <= 0.2, f"cp {cp} {c}: predicted {planned:.1f} MiB, measured {meas:.1f} MiB"


# ------------------------------------------------------------------ tensor parallelism (issue 8)


def test_tp_sharded_parameters_are_the_projections_embedding_and_head():
    for tied in (False, True):
        d = _dims(tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **(TINY | {"tie_word_embeddings": tied})))
        unique = {id(p): p for p in model.parameters()}
        linear = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
        norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
        assert d.tp_params == sum(unique[i].numel() for i in linear) == d.params - norms
        assert d.tp_layer_params == d.layer_params - 2 * 32  # two RMSNorm weights per layer stay whole
        assert d.tp_root_params == d.root_params - 32  # the final norm stays whole
        assert d.tp_capable


def test_tp_divides_sharded_parameters_but_not_norms():
    d = _dims()
    one = plan_memory(d, RunShape(local_batch=1, seq=4096))
    two = plan_memory(d, RunShape(local_batch=1, seq=4096, tp=2, loss_parallel=True))
    norms = d.params - d.tp_params
    assert two.persistent[0].bytes == (d.tp_params / 2 + norms) * 4
    assert one.persistent[0].bytes / 2 < two.persistent[0].bytes < one.persistent[0].bytes
    assert two.terms["gradients"].bytes == two.persistent[0].bytes  # everything trainable
    assert two.persistent[1].bytes == 2 * two.persistent[0].bytes
    # FSDP2 over dp_shard * cp divides the TP-local parameters (norms included) once more
    fsdp = plan_memory(d, RunShape(local_batch=1, seq=4096, tp=2, cp=2, loss_parallel=True))
    assert fsdp.persistent_bytes == pytest.approx(two.persistent_bytes / 2)


def test_loss_parallel_holds_the_logits_on_the_vocabulary_shard():
    d = _dims()
    n = 1 * 16384 // 2  # local tokens at cp 2: the same on both TP ranks
    grad_h = n * 32 * 4
    one = plan_memory(d, RunShape(local_batch=1, seq=16384, cp=2)).terms["logits and loss"].bytes
    for tp in (2, 4):
        lp = plan_memory(d, RunShape(local_batch=1, seq=16384, cp=2, tp=tp, loss_parallel=True))
        gathered = plan_memory(d, RunShape(local_batch=1, seq=16384, cp=2, tp=tp))
        # [N, V / tp] per rank; torch's vocabulary-parallel backward holds 4 of them (3 without TP)
        assert lp.terms["logits and loss"].bytes - grad_h == 4 * n * (2048 // tp) * 4
        assert (one - grad_h) / (lp.terms["logits and loss"].bytes - grad_h) == 3 * tp / 4
        assert gathered.terms["logits and loss"].bytes == one  # without loss parallel: [N, V] on every rank


def test_tp_activations_split_heads_and_mlp_but_not_the_residual_stream_unless_sequence_parallel():
    d = _dims(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    n, h, i, c = 4096, 64, 256, 4
    kv = 2 * 16
    shape = RunShape(local_batch=1, seq=n)
    one, two, sp = (  # what the forward saves (the loss phase)
        plan_memory(d, dataclasses.replace(shape, **kw)).phases["loss"]["activations"]
        for kw in ({}, {"tp": 2, "loss_parallel": True}, {"tp": 2, "loss_parallel": True, "sequence_parallel": True})
    )
    # q, k/v (SDPA's own GQA), the attention output (token-major at cp 1: no transposed copy), MLP; LSE
    split_per_layer = (h + 2 * kv + h + 4 * i) * c + 4 * 4
    assert one - two == pytest.approx(n * 2 * split_per_layer / 2)  # only the split half is gone
    stream = 2 * 5 * h * c + 4 * h * c  # two layers' norms + residual, embedding output + final norm
    gathered = 2 * 2 * h * c + h * c  # the attention and the MLP block gather their input once; the LM head too
    assert sp - two == pytest.approx(n * (gathered - stream / 2))
    assert sp < two  # sequence parallel saves memory: the stream is split, and gathered only twice per layer


def test_tp_suggestions_turn_on_loss_parallel_and_never_the_chunked_loss():
    d = _dims(**LLAMA_1B)
    shape = RunShape(local_batch=1, seq=32768, cp=2, tp=2, compute_bytes=2, activation_checkpointing=True)
    plan = plan_memory(d, shape)
    assert plan.dominant == "logits and loss"
    fixed = plan_memory(d, dataclasses.replace(shape, loss_parallel=True))
    lines = suggest_changes(d, shape, (plan.total_bytes + fixed.total_bytes) / 2, world=4)
    assert lines[1].startswith("cheapest change that fits: distributed.enable_loss_parallel=true"), lines
    for fraction in (0.9, 0.6, 0.3, 0.1):  # tighter budgets: never the chunked loss (it does not compose with TP)
        lines = suggest_changes(d, shape, fixed.total_bytes * fraction, world=4)
        assert "does NOT fit" in lines[0] and "chunk_tokens=1024" not in "\n".join(lines), lines
    # cp at its cap (64): only tp_size can split further, on more ranks, and it turns off the chunked loss
    base = RunShape(local_batch=1, seq=65536, cp=64, compute_bytes=2, activation_checkpointing=True, chunk_tokens=1024)
    tp2 = dataclasses.replace(base, tp=2, chunk_tokens=None, loss_parallel=True)
    assert plan_memory(d, tp2).persistent_bytes < plan_memory(d, base).persistent_bytes
    lines = suggest_changes(d, base, plan_memory(d, tp2).total_bytes * 1.001, world=64)
    assert lines[1].startswith(
        "cheapest change that fits: distributed.tp_size=2 distributed.enable_loss_parallel=true loss.chunk_tokens=null"
    ), lines
    assert "128 ranks instead of 64" in lines[1]
    odd = _dims(**(LLAMA_1B | {"num_key_value_heads": 1}))  # 1 KV head: tp cannot split it
    assert "tp_size" not in "\n".join(suggest_changes(odd, base, 1.0, world=64))


def test_suggested_tp_and_cp_sizes_keep_ulysses_head_split_valid():
    d = _dims(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8)
    shape = RunShape(local_batch=1, seq=4096, cp=2, cp_method="ulysses")
    sizes = {(s.cp, s.tp) for _, s, _ in _changes(d, shape, world=2)}
    # ulysses splits each TP rank's 8 / tp heads over cp again: (cp, tp) with (8 / tp) % cp == 0 only
    assert {(2, 1), (2, 2), (2, 4), (4, 1), (8, 1)} <= sizes
    assert all((8 // tp) % cp == 0 for cp, tp in sizes) and (2, 8) not in sizes and (16, 1) not in sizes


def test_tp_lines_show_the_logits_with_and_without_loss_parallel():
    d = _dims(**LLAMA_1B)
    shape = RunShape(local_batch=1, seq=32768, cp=4, tp=2, compute_bytes=2, loss_parallel=True)
    text = "\n".join(memory_plan_lines(d, shape))
    n = 32768 // 4
    with_lp = 4 * n * (128256 // 2) * 4 + n * 2048 * 2
    without = 3 * n * 128256 * 4 + n * 2048 * 2
    assert f"with loss parallel ([{n}, 64128] per rank)" in text and f"without ([{n}, 128256] gathered)" in text
    assert f"{_fmt(with_lp)} with loss parallel" in text and f"{_fmt(without)} without" in text
    one = plan_memory(d, dataclasses.replace(shape, tp=1, loss_parallel=False)).persistent[0].bytes
    two = plan_memory(d, shape).persistent[0].bytes
    assert two < one and f"parameters {_fmt(two)} per rank instead of {_fmt(one)} at tp 1" in text


TP_TINY = TINY | {"num_attention_heads": 4, "num_key_value_heads": 2}  # heads and KV heads split over tp 2


@pytest.mark.dist
def test_tp2_parameters_exact_and_step_peak_within_20_percent_of_measured():
    """tp=2 on two gloo ranks (scripts/bench_tp.py's worker: the recipe's TP plan and loss, AdamW, no
    FSDP2), logits gathered and loss parallel: the local parameter bytes equal the plan's, the
    measured step peak is within 20% of the plan's, and loss parallel measurably lowers it."""
    from scripts.bench_tp import planned

    settings = [{"lp": False, "sp": False}, {"lp": True, "sp": False}]
    saved = {k: os.environ.get(k) for k in MMAP_ENV}
    os.environ.update(MMAP_ENV)
    try:
        ranks = run_distributed(
            "scripts.bench_tp:measure_worker", 2, 600, settings=settings, seq=4096, steps=1, model_kw=TP_TINY
        )
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    peaks = []
    for i, s in enumerate(settings):
        plan = planned(TP_TINY, 4096, 2, s["lp"], s["sp"])
        assert all(r[i]["param_mib"] * MIB == pytest.approx(plan.persistent[0].bytes, rel=1e-9) for r in ranks)
        meas, pred = max(r[i]["peak_mib"] for r in ranks), plan.step_peak_bytes / MIB
        assert abs(pred - meas) / meas <= 0.2, f"{s}: predicted {pred:.1f} MiB, measured {meas:.1f} MiB"
        peaks.append(meas)
    assert peaks[1] < 0.85 * peaks[0], peaks  # plan: loss parallel holds 4 x [N, V/2] instead of 3 x [N, V]


def test_dry_run_reports_tp_parameters_logits_and_sequence_parallel_shapes():
    from automodel.config import load_config
    from automodel.training.dry_run import dry_run_report

    tp = ["distributed.cp_size=1", "distributed.tp_size=2", "recipe.dry_run_world_size=2", "recipe.dry_run=true"]
    report = dry_run_report(
        load_config(["--config", "configs/cp.yaml", *tp, "distributed.enable_loss_parallel=true",
                     "distributed.sequence_parallel=true"])  # fmt: skip
    )
    # configs/cp.yaml: 4 layers, hidden 128, 4 heads (2 KV), vocab 1024, batch 4 x 256 tokens
    assert "per rank (TP over 2: 0.9M sharded, norms whole; then FSDP over 1): 0.5M parameters" in report
    assert "hidden states            [4, 128, 128] bfloat16 between blocks (sequence parallel" in report
    assert "attention q / k,v        [4, 2, 256, 32] / [4, 1, 256, 32] (tp 2" in report
    assert "logits                   [4, 256, 512] bfloat16" in report
    lp = 4 * 1024 * 512 * 4 + 1024 * 128 * 2
    assert f"{_fmt(lp)} with loss parallel ([1024, 512] per rank)" in report
    gathered = dry_run_report(load_config(["--config", "configs/cp.yaml", *tp]))
    plain = 3 * 1024 * 1024 * 4 + 1024 * 128 * 2  # [1024, 1024] gathered on each TP rank
    assert "distributed.enable_loss_parallel is off" in gathered
    assert f"{'logits and loss':<24}{_fmt(plain):>12}  plain: [1024, 1024]" in gathered


def test_thd_workspace_is_the_whole_rows_kv_gathered_per_layer():
    """thd all-gathers the K/V of the whole row in every layer (and again, with dK/dV, in the backward):
    its workspace does not shrink with cp, where ring's K/V blocks do (issue 18, item 8)."""
    d = _dims(**LLAMA_1B)

    def workspace(method: str, cp: int) -> float:
        shape = RunShape(local_batch=1, seq=32768, cp=cp, cp_method=method, compute_bytes=2)
        return plan_memory(d, shape).terms["attention workspace"]

    thd4, thd8, ring4, ring8 = workspace("thd", 4), workspace("thd", 8), workspace("ring", 4), workspace("ring", 8)
    kv_row = 2 * d.kv_heads * d.head_dim * 32768 * 2  # K and V of the whole row, bf16
    assert thd4.bytes >= 4 * kv_row and thd8.bytes >= 4 * kv_row  # K/V + dK/dV and their reorder copies
    assert thd8.bytes > 0.85 * thd4.bytes  # the gathered row does not shrink with cp (only the fp32 partials do)
    assert ring8.bytes == pytest.approx(ring4.bytes / 2)  # ring holds S/cp-token blocks
    assert thd4.bytes > ring4.bytes and "all-gathered per layer" in thd4.note


def test_workspaces_count_the_query_heads_width_not_the_hidden_size():
    """The all-to-all gradients (Ulysses, usp) and the fp32 output partials (thd, thd_docs, usp) are ``[N, heads x
    head_dim]``: the hidden size only where ``head_dim = hidden / heads``. Qwen3-30B-A3B's 32 heads of 128 on a hidden
    size of 2048, Gemma 4's 512-wide heads: counted at the hidden size, Gemma 4's tiny config read 12% under its
    measured peak under Ulysses at cp 2 (scripts/bench_plan_families_cp.py)."""
    c, n, seq = 2, 2048, 4096
    wide, narrow = _dims(head_dim=64), _dims(head_dim=16)  # 2 heads (1 KV head) on a hidden size of 32
    assert (wide.heads * wide.head_dim, narrow.heads * narrow.head_dim, wide.hidden) == (128, 32, 32)

    def workspace(d, method: str, **kw) -> float:
        shape = RunShape(local_batch=1, seq=seq, cp=2, cp_method=method, compute_bytes=c, **kw)
        return shape.method.attention_workspace(d, shape)[0]

    for d in (wide, narrow):
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        # the full-row gradients of the output and q, and of k and v (1 KV head replicated to cp 2: 2 kv)
        assert workspace(d, "ulysses") == (2 * q + 2 * 2 * kv) * c * n
        # two head groups: one group's gradients, and the local q, k, v gradients of the group done
        assert workspace(d, "ulysses", head_chunks=2) == (2 * q + 4 * kv) * c * n / 2 + (q + 4 * kv) * c * n / 2
        # thd: the whole row's K/V and dK/dV (8 kv per row token), and the fp32 output and LSE of the rank's queries
        partials = n * (q + d.heads) * 4
        assert workspace(d, "thd") == 8 * kv * c * seq + partials
        # thd_docs: the rank's K/V and the borrowed chunks (at most the rest of the row), doubled in the backward
        assert workspace(d, "thd_docs") == 2 * 2 * kv * c * (n + 2 * (seq - n)) + partials
        # usp, 2 x ring 2: K/V of the row for the rank's Ulysses share of the KV heads (1 KV head replicated to 2, so
        # one), gathered and its gradient; the all-to-alls of the output, q, k and v (kv' = 2 kv), forward and backward
        usp = RunShape(local_batch=1, seq=seq, cp=4, cp_method="usp", cp_options=(("ulysses_size", 2),),
                       compute_bytes=c)  # fmt: skip
        n4 = seq // 4
        assert usp.method.attention_workspace(d, usp)[0] == (
            8 * kv * c * seq + n4 * (q + d.heads) * 4 + 2 * (2 * q + 2 * 2 * kv) * c * n4)


def test_dry_run_describes_the_thd_exchange_and_the_layer_kinds(capsys):
    from recipes.finetune import main

    assert main(["--config", "configs/cp_packed.yaml", "recipe.dry_run=true", "distributed.cp_method=thd"]) == 0
    out = capsys.readouterr().out
    assert "cp_method thd (packed documents" in out
    assert "all-gather (thd)" in out and "thd: K/V of the whole row" in out
    assert "model profile: LlamaForCausalLM (llama), 4 layers: full attention x4; 4 heads, 2 kv heads of" in out
    assert "exact under cp_method thd" in out


# --- issue 41: the attention kernel's backward buffers, MoE layers, what each phase holds -------------------


def test_the_planned_kernels_backward_buffers_join_one_layers_backward():
    from automodel.distributed.cp import attention_kernels as ak
    from automodel.distributed.cp.block_backend import CUDNN, FLASH

    d = _dims()  # 2 heads, 1 KV head of 16
    n = 4096
    for ac, phase in ((False, "backward"), (True, "recompute")):
        base = RunShape(local_batch=1, seq=n, activation_checkpointing=ac, compute_bytes=2)
        cpu, flash = plan_memory(d, base), plan_memory(d, dataclasses.replace(base, attention_kernel=FLASH))
        expected = 128 * (n // 128) * 2 * 32 * 4 + 2 * n * 4 + 2 * n * 2 * 16 * 2  # dq_accum, softmax_d, dK/dV x H
        assert flash.terms["attention kernel"].bytes == expected and cpu.terms["attention kernel"].bytes == 0
        # the kernel's buffers join the attention's backward moment, not the MLP's (backward reaches it later)
        attn_flash, attn_cpu = flash.by_moment[phase]["attention"], cpu.by_moment[phase]["attention"]
        assert attn_flash["attention kernel"] == expected
        assert sum(attn_flash.values()) - sum(attn_cpu.values()) == expected
        assert "attention kernel" not in flash.by_moment[phase]["MLP"]
        assert sum(flash.phases[phase].values()) == max(sum(m.values()) for m in flash.by_moment[phase].values())
        assert "attention kernel" not in flash.phases["loss"] and "attention workspace" not in flash.phases["loss"]
    # Llama-3.1-8B under Ulysses over 8 GPUs at 3.94M tokens: 4 query heads, 1 KV head per GPU; flash ~15 GiB
    big = dataclasses.replace(_dims(), heads=32, kv_heads=8, head_dim=128, hidden=4096)
    r = RunShape(local_batch=1, seq=3_939_600, cp=8, cp_method="ulysses", activation_checkpointing=True,
                 compute_bytes=2, attention_kernel=FLASH)  # fmt: skip
    call = plan_memory(big, r).terms["attention kernel"]
    s128 = -(-3_939_600 // 128) * 128
    assert call.bytes == s128 * 4 * 128 * 4 + 4 * s128 * 4 + 2 * 3_939_600 * 4 * 128 * 2
    assert 14.5 < call.bytes / 2**30 < 15.5 and "4 heads (1 KV)" in call.note
    cudnn = plan_memory(big, dataclasses.replace(r, attention_kernel=CUDNN)).terms["attention kernel"].bytes
    assert cudnn == 3_939_600 * 4 * 128 * 4 + 3_939_600 * 4 * 4  # dK/dV at the KV heads: no expansion
    assert ak.kernel_label(FLASH) in "\n".join(memory_plan_lines(big, r))
    # auto: the kernel select_kernel picks with the installed CUDA torch's cuDNN, on a CPU-only torch the reference
    # wheel's (9.19): cuDNN on H100 / H200 (its K/V grouped, counted above), flash on A100
    from automodel.training.memory_plan import planned_kernel

    if not torch.backends.cudnn.is_available():  # a CPU-only torch
        for gpu, kernel in (("h100", CUDNN), ("h200", CUDNN), ("a100", FLASH)):
            got, why = planned_kernel("auto", gpu, r, big)
            assert got == kernel and "reference cuDNN 9.19" in why, (gpu, why)
    assert planned_kernel("flash", "h100", r, big)[0] == FLASH


def test_moe_layers_plan_their_routed_and_shared_experts():
    """Per token and MoE layer: k routed copies each save their input, gate/up, silu(gate), the product and
    the weighted output (k (2 h + 4 I_e)), shared experts a dense MLP (4 I_s), the router fp32 probabilities over
    E experts plus top-k weights and indices (4 E + 16 k bytes)."""
    dense = _dims()
    n, h, c = 4096, 32, 4
    moe = dataclasses.replace(dense, experts=8, top_k=2, expert_intermediate=48, shared_intermediate=64)
    r = RunShape(local_batch=1, seq=n)
    got = plan_memory(moe, r).phases["loss"]["activations"] - plan_memory(dense, r).phases["loss"]["activations"]
    per_layer = (2 * (2 * h + 4 * 48) + 4 * 64 - 4 * 128) * c + 4 * 8 + 16 * 2
    assert got == n * 2 * per_layer
    # checkpointed, the recomputed layer's MLP backward: the expert loop (transformers' eager experts) at its bound,
    # everything saved plus 2 (k I_e + I_s) gradients, against the dense MLP's 6 I (the product freed, 3 gradients)
    ra = dataclasses.replace(r, activation_checkpointing=True)

    def mlp_moment(dims):  # noqa: ANN001, ANN202
        return plan_memory(dims, ra).by_moment["recompute"]["MLP"]["activations"]

    loop = (2 * (2 * h + 4 * 48) + 4 * 64 + 2 * (2 * 48 + 64)) * c + 4 * 8 + 16 * 2
    assert mlp_moment(moe) - mlp_moment(dense) == n * (loop - 6 * 128 * c)
    # torch._grouped_mm (transformers' grouped_mm experts): its backward's peak holds k (4.6 h + 5 I_e) per token
    # (the [k N, h] gather, scatter and gradient buffers beside the [k N, I_e] ones: MOE_GROUPED_BACKWARD, measured by
    # scripts/bench_plan_families.py --moe-block), the shared experts' 4 I_s
    grouped = dataclasses.replace(moe, experts_impl="grouped_mm")
    moment = max(2 * (4.6 * h + 5 * 48) + 4 * 64, 2 * (2 * h + 4 * 48) + 6 * 64) * c + 4 * 8 + 16 * 2
    assert mlp_moment(grouped) - mlp_moment(dense) == pytest.approx(n * (moment - 6 * 128 * c))
    with torch.device("meta"):
        from transformers import MixtralConfig

        mixtral = model_dims(AutoModelForCausalLM.from_config(MixtralConfig(
            hidden_size=32, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=256)))  # fmt: skip
    assert (mixtral.experts, mixtral.top_k, mixtral.expert_intermediate, mixtral.shared_intermediate) == (4, 2, 96, 0)
    assert mixtral.experts_impl == "grouped_mm"  # the default of transformers 5.17 to 5.25
    # DBRX keeps its experts' sizes in ffn_config and runs them in its own loop (planned as a dense MLP of 4 h
    # before: +18% / +29% over at cp 1, now -5% / +2%: scripts/bench_plan_families.py)
    from tests.family_matrix import family_by_name

    config = family_by_name("dbrx").build_config()
    with torch.device("meta"):
        dbrx = model_dims(AutoModelForCausalLM.from_config(config))
    ffn = config.ffn_config
    assert (dbrx.experts, dbrx.top_k, dbrx.expert_intermediate) == (ffn.moe_num_experts, ffn.moe_top_k,
                                                                    ffn.ffn_hidden_size)  # fmt: skip
    assert dbrx.experts > 1 and dbrx.experts_impl == "eager"
    # Aria names them moe_num_experts / moe_topk and fuses moe_num_shared_experts into one MLP; ERNIE 4.5's shared
    # experts are moe_num_shared_experts of the routed width (Aria planned -59% as dense, ERNIE -10% without them)
    for name, shared in (("aria_text", "moe_num_shared_experts"), ("ernie4_5_moe", "moe_num_shared_experts")):
        config = family_by_name(name).build_config()
        with torch.device("meta"):
            d = model_dims(AutoModelForCausalLM.from_config(config))
        width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        assert (d.experts, d.top_k, d.expert_intermediate) == (4, 2, width), name
        assert d.shared_intermediate == getattr(config, shared) * width > 0, name
    # shared experts named num_shared_experts (AFMoE, EXAONE-MoE, HY-V3) or shared_intermediate_size (Granite-MoE-Shared,
    # Ergo); their first layers are dense in the tiny configs
    for name, width in (("afmoe", lambda c: c.num_shared_experts * c.moe_intermediate_size),
                        ("granitemoeshared", lambda c: c.shared_intermediate_size)):
        config = family_by_name(name).build_config()
        with torch.device("meta"):
            assert model_dims(AutoModelForCausalLM.from_config(config)).shared_intermediate == width(config) > 0, name
    # HunYuan-MoE's block always holds a shared MLP of the dense width that no config key names: read off the block's
    # ``shared_mlp`` (at hidden 256 in bf16, -19% / -11% without and with checkpointing before, -1% / +4% now);
    # Qwen2-MoE's one-output shared_expert_gate is not an expert (its width comes from its config)
    config = family_by_name("hunyuan_v1_moe").build_config()
    with torch.device("meta"):
        hunyuan = AutoModelForCausalLM.from_config(config)
    assert model_dims(hunyuan).shared_intermediate == config.intermediate_size > 0
    assert not any(k in config.to_dict() for k in ("shared_expert_intermediate_size", "n_shared_experts"))
    with torch.device("meta"):
        qwen2_moe = AutoModelForCausalLM.from_config(family_by_name("qwen2_moe").build_config())
    assert model_dims(qwen2_moe).shared_intermediate == qwen2_moe.config.shared_expert_intermediate_size
    # the tiled MLP's backward holds the gradient of the whole block, every expert's: its trainable parameters
    block, d = qwen2_moe.model.layers[0].mlp, model_dims(qwen2_moe)
    assert d.mlp_weights == sum(p.numel() for p in block.parameters()) > d.experts * 3 * d.hidden * d.expert_intermediate
    # transformers' Llama 4 runs every expert on every token (its router's scores scale E copies of the input) beside
    # a shared expert: E routed copies in its own bmm (planned with k: -27% / -22% at cp 1, now +3% / +7%)
    config = family_by_name("llama4_text").build_config()
    with torch.device("meta"):
        d = model_dims(AutoModelForCausalLM.from_config(config))
    assert (d.experts, d.top_k, d.shared_intermediate, d.experts_impl) == (
        config.num_local_experts, config.num_local_experts, config.intermediate_size, "eager")
    assert config.num_experts_per_tok < config.num_local_experts


def test_each_phase_counts_only_what_is_live():
    """The loss phase: the root stays gathered, the layers are resharded, no attention buffers; backward through
    the last layer: the LM head's gradient and that layer's, not every gradient (the embedding's comes last)."""
    d = _dims()  # untied: embedding 2048 x 32 looked up, LM head 2048 x 32
    r = RunShape(local_batch=1, seq=4096, cp=2, dp_shard=1, cp_method="ulysses", compute_bytes=2)
    plan = plan_memory(d, r)
    assert plan.phases["loss"]["communication buffers"] == d.root_params * 2
    assert plan.phases["backward"]["communication buffers"] == plan.terms["communication buffers"].bytes
    head = d.root_params - d.lookup_params  # LM head + final norm
    assert plan.by_moment["backward"]["MLP"]["gradients"] == (head + d.layer_params) * 4 / 2
    assert plan.by_moment["backward"]["final norm"]["gradients"] == head * 4 / 2  # before any layer's backward
    assert plan.terms["gradients"].bytes == d.params * 4 / 2  # the optimizer phase holds them all
    # checkpointed: while layer l (from the last) recomputes, l + 1 layers' gradients exist and l inputs are freed
    ra = dataclasses.replace(r, activation_checkpointing=True)
    inp = 2048 * 32 * 2  # one kept [N, h] input in bf16
    layer = d.layer_params * 4 / 2
    expected = head * 4 / 2 + layer + max(0.0, (d.layers - 1) * (layer - inp))
    assert plan_memory(d, ra).phases["recompute"]["gradients"] == expected
    keep = plan_memory(d, dataclasses.replace(r, reshard_after_forward=False))
    assert keep.phases["loss"]["communication buffers"] == (d.root_params + d.layers * d.layer_params) * 2


def test_attention_moments_ring_workspace_and_head_groups_as_measured():
    """What live-tensor snapshots of scripts/bench_memory.py --tiled-layer only showed (hidden 256, 16 / 8 heads)."""
    d = _dims(hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=8)
    h, q, kv, c = 256, 256, 128, 4
    base = dict(local_batch=1, seq=8192, cp=2, chunk_tokens=256, activation_checkpointing=True)
    n = 4096
    uly = plan_memory(d, RunShape(cp_method="ulysses", **base)).by_moment["recompute"]
    # at the attention's backward the post-attention norm (2 h) and the residual (h) are freed: the stream is the
    # input norm's 2 h; the MLP's backward holds the whole stream (5 h) and its 6 [N, I]
    assert uly["MLP"]["activations"] - uly["attention"]["activations"] == n * (3 * h + 6 * 512) * c
    # head groups: each group is checkpointed, so the kernel's output (q) and its fp32 LSE are not saved
    grouped = plan_memory(d, RunShape(cp_method="ulysses", head_chunks=2, **base)).by_moment["recompute"]["MLP"]
    assert uly["MLP"]["activations"] - grouped["activations"] == n * (q * c + 16 * 4)
    # ring: K/V saved at the KV heads (as Ulysses'); its workspace is torch's ring loop: K/V blocks (2 at cp 2 on
    # CPU), the fp32 dq accumulator, dK/dV in fp32 three times, two ring steps' dq, dk, dv
    ring = plan_memory(d, RunShape(**base)).by_moment["recompute"]
    assert ring["MLP"]["activations"] == uly["MLP"]["activations"]
    assert ring["attention"]["attention workspace"] == n * (2 * 2 * kv * c + q * 4 + 6 * kv * 4 + 2 * (q + 2 * kv) * c)
    # under CUDA's all-gather rotation every rank's K/V at once plus the block being sent (cp + 1)
    cuda = plan_memory(d, RunShape(attention_kernel="flash", **(base | {"cp": 8})))
    n8 = 1024
    assert cuda.terms["attention workspace"].bytes == n8 * (9 * 2 * kv * c + q * 4 + 6 * kv * 4 + 2 * (q + 2 * kv) * c)
    # above head size 256 transformers' sdpa repeats K/V to the query heads: ring saves them (2 q per token and layer)
    assert get_cp_method("ring").saves_repeated_kv(False, 512) and not get_cp_method("ring").saves_repeated_kv(False, 128)
