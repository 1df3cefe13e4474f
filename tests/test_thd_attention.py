"""THD attention for HF models: library parity at cp=2 (one gloo launch) plus in-process unit checks.

Parity: packed rows of 4 documents (lengths 1, 22, 13, 7: a one-token document, one longer than
S/cp, lengths not multiples of 2*cp) vs every document run alone in one process; tiny Llama with GQA
(4 query / 2 KV heads) and with KV heads < cp (1 KV head), fp64 and fp32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from automodel.distributed.cp import blocks
from automodel.distributed.cp.gathered_attention import THDPlan, check_thd_kernel, thd_attention
from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention
from tests.dist_harness import run_distributed
from tests.workers.thd_attention_worker import pack, tiny_llama

CASES = [("float64", 2), ("float64", 1), ("float32", 2), ("float32", 1)]
BARS = {"float64": (1e-10, 1e-8), "float32": (1e-5, 1e-4)}  # (loss, every gradient)


def _sdpa_per_document(q, k, v, cu):
    g = q.shape[1] // k.shape[1]
    return torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, a:b],
                k[:, :, a:b].repeat_interleave(g, 1),
                v[:, :, a:b].repeat_interleave(g, 1),
                is_causal=True,
            )
            for a, b in zip(cu[:-1], cu[1:])
        ],
        2,
    )


@pytest.mark.parametrize("math_blocks", [False, True])
def test_one_rank_equals_sdpa_per_document(math_blocks):
    torch.manual_seed(0)
    cu = [0, 4, 6, 16]
    plan = THDPlan(None, 1, 0, cu, cu, 10)
    q = torch.randn(1, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    with blocks.force_backend("math") if math_blocks else contextlib.nullcontext():
        out = thd_attention(q, k, v, plan)
        ref = _sdpa_per_document(q, k, v, cu)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_batch_without_cp_is_the_flat_thd_batch():
    batch = pack([[{"input_ids": torch.arange(3), "labels": torch.arange(3)}]] * 2, 4)
    _, local = make_thd_batch_and_ctx(None, batch)
    assert local["input_ids"].shape == (1, 8) and local["position_ids"].tolist() == [[0, 1, 2, 3] * 2]
    assert local["cu_seqlens"].tolist() == [0, 3, 6] and local["cu_seqlens_padded"].tolist() == [0, 4, 8]
    # unpacked rows: each row is one document
    _, plain = make_thd_batch_and_ctx(
        None, {"input_ids": torch.ones(2, 6, dtype=torch.long), "labels": torch.ones(2, 6, dtype=torch.long)}
    )
    assert plain["cu_seqlens_padded"].tolist() == [0, 6, 12] and plain["position_ids"].tolist() == [
        list(range(6)) * 2
    ]


def test_bad_input_errors():
    class FakeMesh:
        pass

    model = tiny_llama(2, torch.float32)
    set_thd_attention(model)
    assert model.config._attn_implementation == "thd"
    with pytest.raises(ValueError, match=r"Linear is not a transformers PreTrainedModel.*cannot be swapped"):
        set_thd_attention(torch.nn.Linear(2, 2))
    with pytest.raises(
        ValueError, match=r"distributed.thd_kernel=flash_attn needs CUDA tensors, but the run is on cpu"
    ):
        check_thd_kernel("flash_attn", "cpu")
    with pytest.raises(ValueError, match=r"THD kernel 'bogus' is not one of"):
        check_thd_kernel("bogus", "cpu")
    with pytest.raises(ValueError, match=r"document 1 has padded length 6, not a multiple of 2\*cp_size=4"):
        THDPlan(None, 2, 0, [0, 4, 10, 12], [0, 3, 9, 12], 6)
    # an attention call outside any THD context
    with pytest.raises(RuntimeError, match="outside a THD context"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    # a model that never calls THD attention inside the context
    plain = tiny_llama(2, torch.float32)
    ctx, local = make_thd_batch_and_ctx(
        None, {"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.ones(1, 4, dtype=torch.long)}
    )
    with pytest.raises(RuntimeError, match="no THD attention ran inside the THD context"):
        with ctx():
            plain(input_ids=local["input_ids"], position_ids=local["position_ids"])


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.thd_attention_worker:main", world_size=2, timeout=600, cases=CASES)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_library_parity_cp2(results, case):
    for r in results:
        res = r[case]
        loss_bar, grad_bar = BARS[case[0]]
        assert res["loss_rel"] <= loss_bar, res
        worst = max(res["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= grad_bar, worst
        assert len(res["grad_rel"]) > 10  # every parameter compared
        assert res["saved_global_sized"] == [], "a global-sized tensor was kept for the backward"
        assert res["local_tokens"] == (1, r["seq_len"])  # 2 rows x S / cp=2 = S tokens per rank


@pytest.mark.dist
def test_isolation_math_blocks_and_negative_control(results):
    for r in results:
        assert r["n_docs"] >= 3
        assert r["isolation"]["n_others"] > 0
        assert r["isolation"]["others_max_diff"] == 0.0  # no other document's output moved
        assert r["isolation"]["changed_max_diff"] > 1e-3 or r["isolation"]["n_others"] == r["seq_len"]
        assert r["math_blocks"]["loss_rel"] <= 1e-10 and r["math_blocks"]["grad_rel"] <= 1e-8
        assert r["negative_control_loss_rel"] > 1e-3  # attending locally is measurably wrong
