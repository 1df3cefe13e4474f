"""Multi-module pipeline communicator on 4 gloo ranks: fan-in, fan-out, bridges, schedules, errors.

ONE launched group (tests/workers/multimodule_worker.py) runs every scenario; each rank compares
with the float64 single-process reference itself and returns the differences.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist
EXACT = 1e-12


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.multimodule_worker:main", world_size=4, timeout=420)


def test_fan_in_with_cp1_to_cp2_bridge_is_exact(results):
    r = [res["fan_in_cp"] for res in results]
    for llm in r[2:]:
        assert llm["keys"] == ["audio", "image"]
        assert llm["shapes"] == {"image": (2, 4, 4), "audio": (4, 4)}  # head-tail halves; audio stays 2-D
        assert llm["image_err"] < EXACT and llm["audio_err"] < EXACT
    wl = r[2]["wl_grad"] + r[3]["wl_grad"]
    assert float((wl - r[2]["wl_ref"]).abs().max()) < EXACT
    for enc in r[:2]:
        assert enc["out_grad_err"] < EXACT and enc["w_grad_err"] < EXACT
    assert [x["current_stage"] for x in r] == [0, 0, 1, 1] and r[0]["total_stages"] == 2  # 0-indexed


def test_fan_out_moves_rows_and_sums_gradients(results):
    r = [res["fan_out_dp"] for res in results]
    assert all(x["recv_err"] < EXACT for x in r[1:])
    assert r[0]["out_grad_err"] < EXACT and r[0]["w_grad_err"] < EXACT


def test_gpipe_through_intra_module_pipeline_matches_one_process(results):
    r = [res["chain_gpipe"] for res in results]
    assert all(x["w_grad_err"] < EXACT for x in r)
    assert r[3]["loss_err"] < EXACT
    assert [x["stage"] + 1 for x in r] == [x["stage_from_meshes"] for x in r] == [1, 2, 3, 4] and r[0]["total"] == 4
    assert [x["first"] for x in r] == [True, False, False, False]
    assert [x["last"] for x in r] == [False, False, False, True]


def test_combined_1f1b_calls(results):
    r = [res["one_f_one_b"] for res in results]
    assert r[0]["w_grad_err"] < EXACT
    assert all(x["recv_err"] < EXACT for x in r[1:])


def test_colocated_modules_in_one_exchange(results):
    r = [res["colocated"] for res in results]
    assert [x["modules"] for x in r] == [["image", "audio", "llm"]] * 2 + [["llm"]] * 2  # the map's order
    assert all(x["recv_err"] < EXACT for x in r)
    for w in ("wi", "wa"):
        total = r[0][f"{w}_grad"] + r[1][f"{w}_grad"]
        assert float((total - r[0][f"{w}_ref"]).abs().max()) < EXACT


def test_tensor_parallel_replicas_receive_and_tp_rank_0_sends(results):
    r = [res["tensor_parallel"] for res in results]
    assert r[0]["grad_err"] < EXACT  # tp rank 1's corrupted gradient never left it
    assert r[1]["recv_err"] < EXACT and r[2]["recv_err"] < EXACT
    assert r[1]["grad_err"] < EXACT and r[2]["grad_err"] < EXACT
    assert r[3]["recv_err"] < EXACT  # tp rank 1's corrupted activation never left it


def test_mismatches_fail_fast_on_both_sides(results):
    r = [res["errors"] for res in results]
    for llm in r[2:]:
        assert "the senders of the activation enc[pp 0] -> llm[pp 0] disagree on its global shape" in llm["disagree"]
        assert "rank 0: (2, 8, 2); rank 1: (2, 6, 2)" in llm["disagree"]
        assert "sequence length 6 is not divisible by 4 (head_tail layout, cp=2)" in llm["indivisible"]
        assert "has 2 dims, but module_output_ndim['enc'] is 3" in llm["ndim"]
        assert "the receiver rejected gradient llm[pp 0] -> enc[pp 0]" in llm["bad_grad"]
    for enc in r[:2]:
        for key in ("disagree", "indivisible", "ndim"):
            assert "the receiver rejected activation enc[pp 0] -> llm[pp 0] to rank 2" in enc[key], enc[key]
        assert "has global shape [2, 8, 3] torch.float32, but the activation sent had [2, 8, 2]" in enc["bad_grad"]
        assert enc["round_trip_err"] == 0.0  # the group is still in step after every rejection
        assert enc["steady_err"] == 0.0 and enc["longer_err"] == 0.0
        assert "has global shape [2, 16, 2] torch.float32, but the activation sent had [2, 8, 2]" in enc["stale_grad"]
    for llm in r[2:]:
        assert llm["longer_shape"] == (2, 8, 2)
        assert llm["stale_grad"] == "<no error>"  # an unchanged header is not acknowledged: only the receiver raises


def test_a_receive_without_a_sender_times_out(results):
    r = results[1]["timeout"]
    assert "rank 1: the pipeline header exchange with rank(s) [0] did not complete within 3s" in r["message"], r
    assert 2.5 < r["waited"] < 60


@pytest.mark.parametrize("dp", [2, 4])
def test_vision_encoder_2d_output_fans_out_to_llm_dp(results, dp):
    """[B*S, H] from a dp=1 encoder into an LLM at dp=2 (rank 3 idles) and dp=4: tokens split by rows."""
    r = [res["vision_2d_fan_out"][f"dp{dp}"] for res in results]
    llm = [x for x in r if "recv_err" in x]
    assert len(llm) == dp and all(x["recv_err"] < EXACT for x in llm)
    wl = sum(x["wl_grad"] for x in llm)  # parameter gradients SUM over the LLM's dp ranks
    assert float((wl - r[0]["wl_ref"]).abs().max()) < EXACT
    assert r[0]["out_grad_err"] < EXACT and r[0]["we_grad_err"] < EXACT
    if dp == 2:
        assert r[3]["modules"] == [] and r[3]["idle"] == ({}, {}) and r[3]["stage"] == 0
        assert [x["stage"] for x in r[:3]] == [0, 1, 1]
    else:
        assert r[0]["modules"] == ["vision", "llm"] and r[0]["stage"] == 0  # the map's first module


def test_vision_encoder_2d_output_fans_in_from_dp2(results):
    r = [res["vision_2d_fan_out"]["fan_in"] for res in results]
    assert r[2]["recv_err"] < EXACT and r[2]["wl_grad_err"] < EXACT
    assert r[0]["out_grad_err"] < EXACT and r[1]["out_grad_err"] < EXACT
    assert float((r[0]["we_grad"] + r[1]["we_grad"] - r[0]["we_ref"]).abs().max()) < EXACT  # SUM over dp


def test_megatron_call_forms(results):
    r = [res["megatron_call_forms"] for res in results]
    assert r[0]["early_grad_err"] < EXACT and r[0]["grad_err"] < EXACT  # a gradient before any activation
    assert r[1]["recv_err"] < EXACT and r[2]["recv_err"] < EXACT  # [S, B, H] split along b
    assert [x["stage"] for x in r] == [0, 1, 1, 0] and [x["in_enc_grid"] for x in r] == [True, False, False, False]


@pytest.mark.parametrize("kind", ["bshd", "packed"])
@pytest.mark.parametrize("scale", ["down", "up", None])
def test_hybrid_ring_x_ulysses_against_one_process(results, kind, scale):
    for rank, res in enumerate(results):
        h = res["hybrid_cp"]
        assert h["sizes"] == (2, 2) and h["ranks"] == (rank // 2, rank % 2)
        errs = h[f"{kind}/{scale}"]
        assert max(errs.values()) < EXACT, errs
    assert "sequence length 10 along dim 1 is not a multiple of 2 * ring_size = 4" in results[0]["hybrid_cp"]["error"]
