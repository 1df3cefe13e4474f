"""The CP self-check (``recipe.cp_self_check``): passes on every shipped config's CP method, aborts on a
broken normaliser, and leaves the run untouched.

One 2-rank gloo group runs every case (tests/workers/self_check_worker.py): configs/cp.yaml (ring),
configs/cp_ulysses.yaml on plain and on packed rows, each with the tiny fp32 overrides of the recipe
tests and a 60-token slice of 128/256-token rows; and configs/cp.yaml with the loss normaliser
monkeypatched to a per-rank mean (the classic CP scaling bug), and with a validation loss that
comes out ``cp_size`` times too large under CP.
"""

from __future__ import annotations

import pytest
import torch

from automodel.training.self_check import CPSelfCheckError, truncate_batch
from tests.dist_harness import run_distributed

SHIPPED = ("ring", "ulysses", "ulysses_packed")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("self_check")
    return run_distributed("tests.workers.self_check_worker:main", world_size=2, timeout=600, out=str(out))


@pytest.mark.dist
def test_self_check_passes_on_every_shipped_method(results):
    for rank, res in enumerate(results):
        for name in SHIPPED:
            r = res[name]
            assert r["passed"], f"rank {rank} {name}: {r}"
            assert r["cp_size"] == 2 and r["cp_method"] == name.split("_")[0]
            assert r["micro_batches"] == 2 and r["rows"] == 4  # grad accumulation is covered
            assert r["tokens"] == 60  # rows of 128 (packed: 256) tokens cut to the configured slice
            assert r["label_tokens_cp"] == r["label_tokens_ref"] > 0
            assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-4  # the parity bar, fp32
            assert r["val_loss_rel"] <= 1e-5
            assert r["val_loss_cp"] == pytest.approx(r["loss_cp"], rel=1e-5)  # same slice, same weights
            assert 5.0 < r["loss_cp"] < 8.0 and r["grad_norm_cp"] > 0.1  # a real loss of a fresh model


@pytest.mark.dist
@pytest.mark.parametrize("name", ["lora", "vlm_ring", "vlm_ulysses"])
def test_self_check_passes_on_the_other_shipped_configs(results, name):
    """configs/cp_lora.yaml and configs/vlm_cp.yaml (ring and Ulysses): a VLM's reference run still
    encodes its images (a reference without them differed by 5e-4 in the loss and 8% in the grad norm)."""
    for rank, res in enumerate(results):
        r = res[name]
        assert r["passed"], f"rank {rank} {name}: {r}"
        assert r["loss_rel"] <= 1e-5 and r["grad_norm_rel"] <= 1e-4 and r["val_loss_rel"] <= 1e-5
        assert r["label_tokens_cp"] == r["label_tokens_ref"] > 0


@pytest.mark.dist
def test_self_check_restores_ulysses_attention(results):
    assert results[0]["ulysses"]["attn_after"] == "ulysses"
    assert results[0]["ulysses_packed"]["attn_after"] == "ulysses"


@pytest.mark.dist
def test_self_check_leaves_the_run_untouched(results):
    ring = results[0]["ring"]
    assert ring["weights_untouched"] and ring["grads_none"] and ring["optimizer_state_empty"]
    assert ring["scheduler_epoch"] == 0
    assert ring["json"]  # <run dir>/cp_self_check.json
    # training after the check is bit-identical to training without it
    assert ring["losses"] == ring["losses_without_check"]
    assert sorted(ring["losses"]) == [1, 2]


@pytest.mark.dist
def test_broken_normaliser_aborts_with_the_figures(results):
    for res in results:
        broken = res["broken"]
        assert broken["raised"] == CPSelfCheckError.__name__ and broken["is_value_error"]
        msg = broken["message"]
        assert msg.startswith("recipe.cp_self_check: one step with distributed.cp_method=ring over cp_size=2")
        assert "loss " in msg and "grad norm " in msg and "rel 1 > 0.0001" in msg
        assert "recipe.cp_self_check=false" in msg
        assert "Try another distributed.cp_method (" in msg or "No other distributed.cp_method runs" in msg, msg
        assert "()" not in msg and "(none runs" not in msg, msg  # the fix reads as a sentence either way


@pytest.mark.dist
def test_recipe_reports_the_abort_as_one_error_line(results):
    rec = results[0]["recipe"]  # rank 0: recipes/finetune.py main() with the broken normaliser
    assert rec["exit_code"] == 2
    lines = [ln for ln in rec["printed"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: recipe.cp_self_check: one step with")
    assert "Traceback" not in rec["printed"]


@pytest.mark.dist
def test_eval_loss_bug_aborts(results):
    for res in results:
        bug = res["eval_bug"]
        assert bug["raised"] == CPSelfCheckError.__name__
        assert "validation loss " in bug["message"] and "rel 1 > 0.0001" in bug["message"]
        assert "grad norm" not in bug["message"]  # training itself is right: only the eval figure differs


def test_truncate_batch_plain_rows():
    batch = {
        "input_ids": torch.arange(16).reshape(2, 8),
        "labels": torch.arange(1, 17).reshape(2, 8),
        "position_ids": torch.arange(8).repeat(2, 1),
        "note": "kept",
    }
    out = truncate_batch(batch, 4)
    assert torch.equal(out["input_ids"], batch["input_ids"][:, :4])
    assert torch.equal(out["labels"], torch.tensor([[1, 2, 3, 4], [9, 10, 11, 12]]))
    assert out["note"] == "kept" and batch["input_ids"].shape == (2, 8)  # input not mutated
    assert truncate_batch(batch, 8)["input_ids"] is batch["input_ids"]


def test_truncate_batch_packed_rows_keeps_boundaries():
    pad = -1000
    # row 0: documents of 3 (padded 4), 2 (padded 2) and 1 (padded 2) tokens; row 1: one document of 8
    batch = {
        "input_ids": torch.zeros(2, 8, dtype=torch.long),
        "labels": torch.zeros(2, 8, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1], list(range(8))]),
        "seq_lens": torch.tensor([[3, 2, 1], [8, pad, pad]]),
        "seq_lens_padded": torch.tensor([[4, 2, 2], [8, pad, pad]]),
    }
    out = truncate_batch(batch, 5)
    assert out["seq_lens_padded"].tolist() == [[4, 1, pad], [5, pad, pad]]
    assert out["seq_lens"].tolist() == [[3, 1, pad], [5, pad, pad]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]
    assert (out["seq_lens_padded"].clamp(min=0).sum(1) == 5).all()
    out = truncate_batch(batch, 3)  # cut inside the first document's padding-free part
    assert out["seq_lens_padded"].tolist() == [[3, pad, pad], [3, pad, pad]]
    assert out["seq_lens"].tolist() == [[3, pad, pad], [3, pad, pad]]


def test_self_check_tokens_validated_before_anything_loads():
    from automodel.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"recipe.cp_self_check_tokens=0 must be >= 1"):
        load_config(["--config", "configs/cp.yaml", "recipe.cp_self_check_tokens=0"], world_size=2)
    cfg = load_config(["--config", "configs/cp.yaml"], world_size=2).cfg
    assert (cfg.recipe.cp_self_check, cfg.recipe.cp_self_check_tokens) == (True, 512)  # on by default
