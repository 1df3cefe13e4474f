"""``automodel.distributed.tensor_parallel``: the plan, and parity of a TP model with one process.

One 2-rank gloo group (tests/workers/tp_worker.py) runs every case in fp64 and fp32: Llama with
gathered logits, with loss parallel, with loss + sequence parallel; Qwen2 (q/k/v biases); Qwen3 with
tied embeddings (per-head ``q_norm``/``k_norm``, the replicated-with-gradient-all-reduce style)
with loss parallel and with sequence parallel; Mistral with loss + sequence parallel; Llama with a tiled MLP
(``model.tiled_mlp``, tiles of 7 tokens) with loss parallel, with and without sequence parallel. Loss and
every parameter gradient are compared with the unsharded model on the same batch (with -100 labels).

Measured on CPU: fp64 agrees to ~1e-15 relative (loss and gradients), fp32 to ~1e-7 (loss) and
~1e-6 (gradients); the bounds are 1e-12 (fp64) and the parity contract's 1e-5 / 1e-4 (fp32).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from tests.workers.tp_worker import CASES, VOCAB

pytestmark = pytest.mark.dist

BOUNDS = {"float64": (1e-12, 1e-12), "float32": (1e-5, 1e-4)}  # (loss rel, gradient rel)


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.tp_worker:parity", world_size=2, timeout=300)[0]


@pytest.mark.parametrize("dtype", sorted(BOUNDS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_and_gradients_match_one_process(results, name, dtype):
    r = results[(name, dtype)]
    loss_bound, grad_bound = BOUNDS[dtype]
    assert abs(r["loss"] - r["ref_loss"]) <= loss_bound * abs(r["ref_loss"])
    assert r["grad_rel"] <= grad_bound
    assert r["params"]  # same parameter names as the stock model (checkpoints and export see HF keys)


@pytest.mark.parametrize("name", sorted(CASES))
def test_head_output_is_vocabulary_sharded_only_under_loss_parallel(results, name):
    loss_parallel = CASES[name][2]
    r = results[(name, "float32")]
    assert r["head_local"] == (2, 32, VOCAB // 2 if loss_parallel else VOCAB)


def test_placements_follow_the_plan(results):
    p = results[("qwen3_tied_lp", "float32")]["placements"]
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert p[f"model.layers.0.self_attn.{proj}.weight"] == "S(0)"
    for proj in ("gate_proj", "up_proj"):
        assert p[f"model.layers.1.mlp.{proj}.weight"] == "S(0)"
    assert p["model.layers.0.self_attn.o_proj.weight"] == "S(1)"
    assert p["model.layers.0.mlp.down_proj.weight"] == "S(1)"
    assert p["model.embed_tokens.weight"] == "S(0)"  # the vocabulary, shared with the tied head
    assert p["model.layers.0.self_attn.q_norm.weight"] == "R"
    assert p["model.layers.0.input_layernorm.weight"] == "plain"  # no sequence parallel: replicated compute
    assert results[("qwen3_tied_lp", "float32")]["tied"]
    sp = results[("qwen3_tied_sp", "float32")]["placements"]
    assert sp["model.layers.0.input_layernorm.weight"] == "R"  # SequenceParallel norms
    assert sp["model.norm.weight"] == "R"
    assert results[("qwen2_bias_lp", "float32")]["placements"]["model.layers.0.self_attn.q_proj.bias"] == "S(0)"
