"""configs/vlm_cp.yaml end to end: the per-step losses at cp=2 (ring and Ulysses) equal cp=1, and the
HF export of the trained VLM loads with ``from_pretrained``.

Two launches (module-scoped): a 2-rank gloo group (ring cp=2 with export, Ulysses cp=2) and a 1-rank
group (the cp=1 reference, then the export loaded with ``AutoModelForImageTextToText.from_pretrained``).
Each run: the tiny Qwen2-VL of the config, generated image-text data of several image sizes, fp32,
4 optimizer steps of 2 micro-batches, validation after steps 2 and 4.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("vlm_recipe")
    pair = run_distributed("tests.workers.vlm_recipe_worker:pair", world_size=2, timeout=600, out=str(out))
    (single,) = run_distributed(
        "tests.workers.vlm_recipe_worker:single", world_size=1, timeout=400, out=str(out),
        export=pair[0]["ring"]["export"],
    )
    return {**pair[0], **single}


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


def test_reference_trains(runs):
    losses = runs["ref"]["losses"]
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    assert sorted(runs["ref"]["val_losses"]) == [2, 4]


@pytest.mark.parametrize("name", ["ring", "ulysses"])
def test_cp2_losses_equal_cp1(runs, name):
    run, ref = runs[name], runs["ref"]
    assert _max_rel(run["losses"], ref["losses"]) <= LOSS_RTOL
    assert _max_rel(run["val_losses"], ref["val_losses"]) <= LOSS_RTOL
    assert _max_rel(run["grad_norms"], ref["grad_norms"]) <= 1e-4
    assert max((run["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"]) <= WEIGHT_ATOL


def test_only_the_text_model_runs_ulysses(runs):
    assert runs["ulysses"]["attn"] == "ulysses" and runs["ulysses"]["vision_attn"] == "sdpa"
    assert runs["ring"]["attn"] == "sdpa"


def test_export_loads_with_from_pretrained(runs):
    assert runs["loaded_class"] == "Qwen2VLForConditionalGeneration"
    assert "config.json" in runs["export_files"] and "model.safetensors" in runs["export_files"]
    assert runs["processor"]["image_processor_type"].startswith("Qwen2VLImageProcessor")  # the dataset's, saved
    assert (runs["processor"]["patch_size"], runs["processor"]["merge_size"]) == (4, 2)
    trained, loaded = runs["ring"]["state"], runs["loaded_state"]
    assert sorted(trained) == sorted(loaded)
    assert max((trained[k] - loaded[k]).abs().max().item() for k in trained) == 0.0
