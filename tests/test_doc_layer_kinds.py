"""thd_docs computes every attention layer kind thd computes, packed and unpacked (issue 28, item 1).

Tiny transformers families built from config through ``set_doc_attention`` + ``make_doc_batch_and_ctx``
(the model's cost model), loss and every parameter gradient against each document run alone in one
process, fp32 and fp64: Mistral (sliding windows), Gemma 2 (softcapping and windows, eager), gpt-oss
(sinks on windowed and full layers, eager), DeepSeek-V3 (MLA value heads), Llama 4 (attention chunks and
the NoPE query temperature, switched on and varying within a few tokens). cp=2: one packed row of three
documents, the longest split over both ranks (its windows / chunks cross the rank boundary), the other
two whole on one rank each and longer than the window; an unpacked row split over both ranks; two
documents whole on their ranks (nothing exchanged). cp=4: two packed rows, a document over every rank
(a window reaching past a whole predecessor chunk), one over a subset, four whole. DeepSeek sparse attention
(DeepSeek-V3.2, GLM-5; fp64 with every MLP dense) the same way. Also: the halo each rank
receives is exactly the window (or partial chunk) before its chunks, and the cost model counts windowed
and chunked layers as linear.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed
from tests.family_matrix import launched_cases, left_out
from tests.workers.layer_kinds_worker import KOLIBRI_CONFIG, QSA_CONFIG, V4_CONFIG, V4_RANDOM

WINDOW = 16  # tests/family_matrix.py: the families' windows and attention chunks
FAMILIES = ("mistral", "gemma2", "gpt_oss", "deepseek_v3", "llama4_text")
# a part in fp32 even for fp64 models (gemma2's eager softmax, the MoE routers): tests/test_layer_kinds.py
FP32_INSIDE = ("gemma2", "deepseek_v3", "llama4_text", "bloom", "mpt", "gpt_neo")  # BLOOM, MPT, GPT-Neo: their softmax
TOLERANCES = {"fp64": (1e-12, 1e-10), "fp64_fp32_inside": (1e-9, 1e-6), "fp32": (1e-5, 1e-4)}

CP2 = {
    **{
        f"{fam}/packed/{dtype}": dict(family=fam, dtype=dtype, rows=[[70, 24, 22]], packed=True)
        for fam in FAMILIES
        for dtype in ("float32", "float64")
    },
    **{f"{fam}/unpacked/float64": dict(family=fam, dtype="float64", rows=[[48]], packed=False) for fam in FAMILIES},
    "gpt_oss/whole/float64": dict(family="gpt_oss", dtype="float64", rows=[[32, 32]], packed=True),
    # ALiBi in BLOOM's and MPT's own attention code, handed to thd_docs (cp/layers/alibi.py; issue 43)
    **{f"{fam}/packed/{dtype}": dict(family=fam, dtype=dtype, rows=[[70, 24, 22]], packed=True)
       for fam in ("bloom", "mpt") for dtype in ("float32", "float64")},
    # Falcon with alibi=True: its bf16 ALiBi, computed by the kernel for each key's in-document position (issue 43)
    **{f"falcon@alibi/packed/{dtype}": dict(family="falcon", dtype=dtype, rows=[[70, 24, 22]], packed=True,
                                            config={"alibi": True})
       for dtype in ("float32", "float64")},
    # GPT-Neo's global and local-window masks in its own code, handed to thd_docs with its window (issue 43)
    **{f"gpt_neo/packed/{dtype}": dict(family="gpt_neo", dtype=dtype, rows=[[70, 24, 22]], packed=True)
       for dtype in ("float32", "float64")},
    # GPT-NeoX-Japanese, OpenAI GPT, XGLM: causal attention in their own code, handed to thd_docs (issue 43); XGLM in
    # fp64 with torch's default dtype fp64 (transformers' XGLM clamps its scores with a tensor of the default dtype)
    **{f"{fam}/packed/{dtype}": dict(family=fam, dtype=dtype, rows=[[70, 24, 22]], packed=True,
                                     **({"default_dtype": dtype} if fam == "xglm" else {}))
       for fam in ("gpt_neox_japanese", "openai-gpt", "xglm") for dtype in ("float32", "float64")},
    # Gemma 4 in fp64 with its RMSNorms in fp64 (tests/workers/exact_norms.py; issue 43)
    "gemma4_text/packed/float64": dict(family="gemma4_text", dtype="float64", rows=[[70, 24, 22]], packed=True,
                                       exact_norms=True),
}
# DeepSeek sparse attention (top-k 16 per document), fp64 with every MLP dense (no fp32 MoE router)
DSA = {
    f"{fam}/packed/{dtype}": dict(family=fam, dtype=dtype, rows=[[70, 24, 22]], packed=True, dense_mlp=dtype == "float64",
                                  exact_norms=fam == "hy_v4")  # HY-V4's hyper-connections in fp64 (exact_norms.py)
    for fam in ("deepseek_v32", "glm_moe_dsa", "dots3_note_text", "hy_v4", "axk2")
    for dtype in ("float32", "float64")
}
# Doge's dynamic mask attention (keep_window_size 8: every document's queries take a top-k), A ~ N(0, 1) and A = 0
# (every bias 1: all ties, resolved as in the document alone), fp64 with its RMSNorms in fp64
DOGE = {
    f"doge/packed/{dtype}" + ("" if random_a else "/A0"): dict(family="doge", dtype=dtype, rows=[[70, 24, 22]],
                                                                packed=True, random_A=random_a, exact_norms=True)
    for dtype in ("float32", "float64")
    for random_a in (True, False)
    if random_a or dtype == "float64"
}
DSA.update(DOGE)
CP2.update(DSA)
# DeepSeek-V4: window + sinks, HCA and CSA layers (tests/workers/layer_kinds_worker.py's V4_CONFIG), sinks, pooling biases and
# hash routing drawn afresh, fp64 with its fp32 casts in fp64; the split document's blocks straddle the ranks
V4 = {
    f"deepseek_v4/packed/{dtype}": dict(family="deepseek_v4", dtype=dtype, rows=[[70, 24, 22]], packed=True,
                                        config=V4_CONFIG, randomize=V4_RANDOM, exact_norms=True)
    for dtype in ("float32", "float64")
}
CP2.update(V4)
# Qwen4-Exp's QSA layers and Kolibri-1.1's indexed layers (K and V gathered, the class's own selection;
# tests/workers/layer_kinds_worker.py: QSA_CONFIG, KOLIBRI_CONFIG)
KV_GATHER = {"qwen4_exp_text@qsa": ("qwen4_exp_text", QSA_CONFIG), "kolibri1_1@shared": ("kolibri1_1", KOLIBRI_CONFIG)}
CP2.update({f"{name}/packed/{dtype}": dict(family=family, dtype=dtype, rows=[[70, 24, 22]], packed=True, config=config,
                                           exact_norms=True)
            for name, (family, config) in KV_GATHER.items() for dtype in ("float32", "float64")})
# ZAYA's compressed convolutional attention (cp/layers/cca.py; tests/test_layer_kinds.py: ZAYA_CONFIG)
ZAYA = {"zaya@bias": ("zaya", {"attention_bias": True, "cca_time0": 3, "cca_time1": 2})}
CP2.update({f"zaya@bias/packed/{dtype}": dict(family="zaya", dtype=dtype, rows=[[70, 24, 22]], packed=True,
                                              config=ZAYA["zaya@bias"][1], exact_norms=True)
            for dtype in ("float32", "float64")})
CP4_ROWS = [[96, 48, 24], [48, 48, 24]]
CP4 = {
    "gpt_oss/packed/float32": dict(family="gpt_oss", dtype="float32", rows=CP4_ROWS, packed=True),
    "gpt_oss/packed/float64": dict(family="gpt_oss", dtype="float64", rows=CP4_ROWS, packed=True),
    "llama4_text/packed/float64": dict(family="llama4_text", dtype="float64", rows=CP4_ROWS, packed=True),
    "mistral/unpacked/float32": dict(family="mistral", dtype="float32", rows=[[48]], packed=False),
    "deepseek_v32/packed/float64": dict(family="deepseek_v32", dtype="float64", rows=CP4_ROWS, packed=True, dense_mlp=True),
    "glm_moe_dsa/packed/float64": dict(family="glm_moe_dsa", dtype="float64", rows=CP4_ROWS, packed=True, dense_mlp=True),
    "hy_v4/packed/float64": dict(family="hy_v4", dtype="float64", rows=CP4_ROWS, packed=True, dense_mlp=True,
                                 exact_norms=True),
    "doge/packed/float64": dict(family="doge", dtype="float64", rows=CP4_ROWS, packed=True, random_A=True,
                                exact_norms=True),
    "deepseek_v4/packed/float64": {**V4["deepseek_v4/packed/float64"], "rows": CP4_ROWS},
    "axk2/packed/float64": dict(family="axk2", dtype="float64", rows=CP4_ROWS, packed=True, dense_mlp=True),
    **{f"{name}/packed/float64": dict(family=family, dtype="float64", rows=CP4_ROWS, packed=True, config=config,
                                      exact_norms=True) for name, (family, config) in {**KV_GATHER, **ZAYA}.items()},
}




@pytest.fixture(scope="module")
def cp2():
    return run_distributed("tests.workers.doc_layer_kinds_worker:main", world_size=2, timeout=600,
                           model_cases=launched_cases(CP2))


@pytest.fixture(scope="module")
def cp4():
    return run_distributed("tests.workers.doc_layer_kinds_worker:main", world_size=4, timeout=600,
                           model_cases=launched_cases(CP4))


def _check(ranks: list[dict], name: str) -> None:
    kind = "fp32" if name.endswith("float32") else "fp64_fp32_inside" if name.split("/")[0] in FP32_INSIDE else "fp64"
    loss_tol, grad_tol = TOLERANCES[kind]
    if kind == "fp64" and (name in DSA or name in V4):  # every MLP dense: fp64's own round-off (measured 2e-16 and 1e-15)
        loss_tol, grad_tol = 1e-14, 1e-13
    if kind == "fp64" and name.startswith("doge/"):  # its RMSNorms in fp64 (exact_norms.py)
        loss_tol, grad_tol = 1e-14, 1e-12
    # DeepSeek-V4: gradients relative to their largest entry floored at 1e-3 of the model's (the table's measure; its
    # final hyper-connection scale's gradient nearly cancels over the tokens: tests/test_layer_kinds.py)
    grad = "grad_rel_floored" if name in V4 else "grad_rel"
    for rank in ranks:
        r = rank[name]
        assert r["loss_rel"] <= loss_tol, (name, r)
        assert r[grad] <= grad_tol and not r["missing"], (name, r)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CP2))
def test_layer_kinds_match_one_process_cp2(request, name):
    if not left_out(name, CP2[name], "thd_docs"):
        _check(request.getfixturevalue("cp2"), name)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CP4))
def test_layer_kinds_match_one_process_cp4(request, name):
    if not left_out(name, CP4[name], "thd_docs"):
        _check(request.getfixturevalue("cp4"), name)


@pytest.mark.dist
def test_whole_documents_run_locally_and_split_ones_exchange_only_the_window(cp2, cp4):
    windowed = f"({WINDOW}, None)"
    for fam in FAMILIES:
        r0, r1 = (rank[f"{fam}/packed/float64"] for rank in cp2)
        # the longest document over both ranks, the two others whole, longer than the window
        assert r0["spans"] == {0: [0, 1]} and min(r0["lengths"][1:]) > WINDOW and r0["lengths"][0] > 4 * WINDOW
        if fam in ("mistral", "gemma2", "gpt_oss"):  # head-tail chunks of 17-18 tokens: W-1 keys cross each boundary
            assert r0["halos"][windowed] == r1["halos"][windowed] == WINDOW - 1, fam
    llama = [rank["llama4_text/packed/float64"]["halos"] for rank in cp2]
    # chunks of 16 from the document's start: rank 0's chunk [53,70) needs [48,53), rank 1's [18,36) needs [16,18)
    assert [h[f"(None, {WINDOW})"] for h in llama] == [5, 2]
    assert all(rank["deepseek_v3/packed/float64"]["halos"] == {} for rank in cp2)  # full layers: no halo kernel
    for rank in cp2:  # two documents whole on their ranks: no K/V and no halo moves at all
        whole = rank["gpt_oss/whole/float64"]
        assert whole["spans"] == {} and whole["lent"] == 0 and set(whole["halos"].values()) == {0}
    world = len(cp4)
    spans = cp4[0]["gpt_oss/packed/float64"]["spans"]
    assert [0, 1, 2, 3] in spans.values() and len(spans) < len(cp4[0]["gpt_oss/packed/float64"]["lengths"])
    for rank in cp4:  # chunks of 12 under a window of 16: halos reach past a whole predecessor chunk
        assert rank["gpt_oss/packed/float64"]["halos"][windowed] >= WINDOW - 1
    assert world == 4


def test_cost_model_counts_windows_and_chunks_as_linear():
    from automodel.distributed.cp.profile import LayerSpec, ModelProfile
    from automodel.distributed.cp.thd_docs.placement import CostModel

    layers = (
        LayerSpec(0, "sliding_window", window=WINDOW),
        LayerSpec(1, "chunked_attention", chunk=WINDOW),
        LayerSpec(2, "full_attention", sinks=True),
        LayerSpec(3, "linear_mixer", mixer="GatedDeltaNet"),
    )
    profile = ModelProfile("x", "X", layers, 4, 2, 16, False, "sdpa", True)
    cost = CostModel.from_profile(profile)
    assert (cost.full_layers, cost.windows, cost.chunks) == (1, (WINDOW,), (WINDOW,))
    local = CostModel(token=0.0, pair=1.0, full_layers=0, windows=cost.windows, chunks=cost.chunks)
    steps = [local.prefix(n + 64) - local.prefix(n) for n in (64, 128, 256, 1024)]
    assert steps[0] == steps[1] == steps[2] == steps[3] > 0  # linear in the document's length
    full = CostModel(token=0.0, pair=1.0, full_layers=1)
    assert full.prefix(2048) - full.prefix(1024) > 3 * (full.prefix(1024) - full.prefix(512))  # quadratic
