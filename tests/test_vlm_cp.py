"""VLM fine-tuning under CP: a tiny Qwen2-VL, ring and Ulysses, against one process on the whole batch.

Single-process: the CP input path without CP is the stock HF forward exactly, and bad inputs get clear
errors. Gloo groups (tests/workers/vlm_worker.py): at cp=2 (fp32 and fp64) and cp=4 (fp32) the loss and
the gradient of every parameter, vision tower included, equal the single-process run, with images of
mixed sizes plus a video over two rows, and with fewer images than ranks (a dummy image on the idle rank);
the second family, Qwen2.5-VL (window attention in the vision tower), at cp=2 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx
from automodel.models.vlm_cp import build_vlm_inputs, is_vlm, make_vlm_cp_batch_and_ctx, vlm_parts
from tests.dist_harness import run_distributed
from tests.workers.vlm_worker import IMAGE, make_batch, tiny_model


def test_without_cp_equals_the_stock_forward():
    model = tiny_model()
    batch = make_batch("mixed", 1)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    expected = model(**kwargs, use_cache=False).logits
    ctx, local = make_vlm_cp_batch_and_ctx(model, None, batch)
    assert sorted(local) == ["inputs_embeds", "labels", "position_ids"]
    assert local["position_ids"].shape == (3, *batch["input_ids"].shape)
    with ctx():
        got = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # mm_token_type_ids are derived from the placeholder ids when the batch lacks them
    derived = build_vlm_inputs(model, {k: v for k, v in batch.items() if k != "mm_token_type_ids"})
    assert torch.equal(derived["position_ids"], local["position_ids"])


def test_qwen2_5_vl_without_cp_equals_the_stock_forward():
    model = tiny_model(family="qwen2_5_vl")
    batch = make_batch("mixed", 1)
    expected = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    _, local = make_vlm_cp_batch_and_ctx(model, None, batch)
    got = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_vlm_detection_and_errors():
    model = tiny_model()
    assert is_vlm(model) and is_vlm(model.config) and vlm_parts(model).spatial_merge_size == 2
    with pytest.raises(TypeError, match="is not a supported VLM"):
        vlm_parts(torch.nn.Linear(2, 2))
    batch = make_batch("one_image", 1)
    bad = dict(batch, input_ids=batch["input_ids"].clone())
    bad["input_ids"][0, bad["input_ids"][0].tolist().index(IMAGE)] = 5  # one placeholder too few
    with pytest.raises(ValueError, match="has 5 image placeholder tokens .* produced 6 image embeddings"):
        build_vlm_inputs(model, bad)
    with pytest.raises(ValueError, match="'pixel_values' without 'image_grid_thw'"):
        build_vlm_inputs(model, {k: v for k, v in batch.items() if k != "image_grid_thw"})
    bad = dict(batch, pixel_values=batch["pixel_values"][:-1])
    with pytest.raises(ValueError, match="pixel_values has 23 patch rows but grid_thw describes 24 patches"):
        build_vlm_inputs(model, bad)


def test_ulysses_batch_inputs_embeds_and_mrope():
    embeds = torch.randn(2, 8, 4, requires_grad=True)
    mrope = torch.arange(8).expand(3, 2, 8)
    labels = torch.zeros(2, 8, dtype=torch.long)
    _, local = make_ulysses_batch_and_ctx(None, {"inputs_embeds": embeds, "position_ids": mrope, "labels": labels})
    assert local["position_ids"].shape == (3, 2, 8) and local["inputs_embeds"].requires_grad
    with pytest.raises(ValueError, match="has both of 'input_ids' and 'inputs_embeds'"):
        make_ulysses_batch_and_ctx(None, {"inputs_embeds": embeds, "input_ids": labels, "labels": labels})
    with pytest.raises(ValueError, match="has neither of 'input_ids' and 'inputs_embeds'"):
        make_ulysses_batch_and_ctx(None, {"labels": labels})
    with pytest.raises(ValueError, match=r"cp_method ulysses .* position_ids \[4, B, S\] .* thd \| thd_docs \| usp"):
        make_ulysses_batch_and_ctx(None, {"inputs_embeds": embeds, "position_ids": torch.zeros(4, 2, 8)})


CP2_CASES = [
    ("ring", "mixed", "float32"),
    ("ulysses", "mixed", "float32"),
    ("ring", "one_image", "float32"),
    ("ulysses", "one_image", "float32"),
    ("ring", "mixed", "float64"),
    ("ulysses", "mixed", "float64"),
    ("ring", "mixed", "float32", "qwen2_5_vl"),  # the second family: window attention in the vision tower
    ("ulysses", "mixed", "float32", "qwen2_5_vl"),
]
CP4_CASES = [("ring", "mixed", "float32"), ("ulysses", "mixed", "float32")]


@pytest.fixture(scope="module")
def cp2():
    return run_distributed("tests.workers.vlm_worker:run", world_size=2, timeout=600, cases=CP2_CASES)


@pytest.fixture(scope="module")
def cp4():
    return run_distributed("tests.workers.vlm_worker:run", world_size=4, timeout=600, cases=CP4_CASES)


def _check(result, dtype, world):
    assert result["missing"] == [] and result["n_vision"] > 0 and result["n_params"] >= 57, result
    loss_tol, grad_tol = (1e-5, 1e-4) if dtype == "float32" else (1e-12, 1e-10)
    assert result["loss_rel"] <= loss_tol, result
    assert result["grad_rel"] <= grad_tol and result["vision_grad_rel"] <= grad_tol, result
    assert result["local_seq"] * world == result["seq"], result


@pytest.mark.dist
@pytest.mark.parametrize("case", CP2_CASES, ids=["-".join(c) for c in CP2_CASES])
def test_vlm_parity_cp2(cp2, case):
    for rank in range(2):
        _check(cp2[rank][case], case[2], 2)


@pytest.mark.dist
@pytest.mark.parametrize("case", CP4_CASES, ids=["-".join(c) for c in CP4_CASES])
def test_vlm_parity_cp4(cp4, case):
    for rank in range(4):
        _check(cp4[rank][case], case[2], 4)
