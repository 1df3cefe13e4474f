"""THD attention library parity at cp=4 (one 4-rank gloo launch): GQA with 1 KV head < cp, fp64 and fp32.

Same documents as tests/test_thd_attention.py, padded to multiples of 2*cp=8 (lengths 1, 22, 13, 7:
the 22-token document is longer than S/cp = 32/4). Also ``model.tiled_mlp`` at cp=4 (fp64, tiles of 3 tokens).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

CASES = [("float64", 1), ("float32", 1)]
BARS = {"float64": (1e-10, 1e-8), "float32": (1e-5, 1e-4)}


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.thd_attention_worker:main", world_size=4, timeout=600, cases=CASES)


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_library_parity_cp4(results, case):
    assert len(results) == 4
    for r in results:
        res = r[case]
        loss_bar, grad_bar = BARS[case[0]]
        assert res["loss_rel"] <= loss_bar, res
        worst = max(res["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= grad_bar, worst
        assert res["saved_global_sized"] == []
        assert res["local_tokens"] == (1, 2 * r["seq_len"] // 4)
        assert 22 > r["seq_len"] // 4  # a document longer than S/cp


@pytest.mark.dist
def test_isolation_cp4(results):
    for r in results:
        assert r["isolation"]["others_max_diff"] == 0.0
        assert r["math_blocks"]["loss_rel"] <= 1e-10 and r["math_blocks"]["grad_rel"] <= 1e-8


@pytest.mark.dist
def test_tiled_mlp_cp4(results):
    for r in results:
        assert r["tiled_mlp"]["loss_rel"] <= 1e-10 and r["tiled_mlp"]["grad_rel"] <= 1e-8, r["tiled_mlp"]
