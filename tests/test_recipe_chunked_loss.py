"""``loss.chunk_tokens`` through the recipe: the chunked linear cross-entropy gives the per-step losses
(and validation losses, grad norms) of the plain loss at cp=1, with ring and with Ulysses +
activation checkpointing at cp=2. One 2-rank launch for the module."""

from __future__ import annotations

import pytest

from automodel.config import ConfigError, load_config
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_loss_runs")
    return run_distributed("tests.workers.chunked_loss_worker:pair", world_size=2, timeout=900, out=str(out))[0]


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


@pytest.mark.parametrize("name", ["chunked_cp1", "chunked_ring_cp2", "chunked_ulysses_ac_cp2"])
def test_chunked_loss_matches_plain_loss_at_cp1(runs, name):
    ref, run = runs["plain_cp1"], runs[name]
    assert sorted(run["losses"]) == list(range(1, 9))
    assert _max_rel(run["losses"], ref["losses"]) <= LOSS_RTOL
    assert _max_rel(run["val_losses"], ref["val_losses"]) <= LOSS_RTOL  # validation uses the same loss
    assert _max_rel(run["grad_norms"], ref["grad_norms"]) <= 1e-4


def test_reference_learns(runs):
    losses = runs["plain_cp1"]["losses"]
    assert losses[8] < losses[1] - 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.chunk_tokens=0"], "loss.chunk_tokens=0 must be >= 1"),
        (
            ["loss.chunk_tokens=64", "distributed.cp_size=1", "distributed.tp_size=2"],
            "multiplies each chunk by the whole LM head",
        ),
    ],
)
def test_bad_chunk_settings_are_rejected_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "configs/cp.yaml", *overrides], world_size=2)


def test_model_without_a_linear_head_is_rejected():
    import torch

    from automodel.training.step import check_model_for_chunked_loss

    with pytest.raises(ValueError, match="loss.chunk_tokens needs a causal LM.*set loss.chunk_tokens=null"):
        check_model_for_chunked_loss(torch.nn.Linear(2, 2))
