"""Ranks agree on a user error before exiting: rank 0 prints it once, whichever rank found it.

One 2-rank gloo group (tests/workers/user_errors_worker.py) runs
:func:`automodel.training.user_errors.run_guarded` through four scenarios: a user error in setup
on rank 1 only, one in training on both ranks, a clean run, and one in training on rank 1 only
while rank 0 trains on (the agreement times out and rank 1 reports it itself).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks():
    return run_distributed("tests.workers.user_errors_worker:scenarios", world_size=2, timeout=300)


def test_setup_error_on_one_rank_is_printed_by_rank_0(ranks):
    r0, r1 = ranks[0]["setup_one_rank"], ranks[1]["setup_one_rank"]
    assert r0["stderr"] == "error: data path '/node1/train.jsonl' does not exist; set data.dataset.path\n"
    assert r1["stderr"] == ""
    assert r0["exit_code"] == r1["exit_code"] == 2


def test_training_error_on_every_rank_is_printed_once(ranks):
    r0, r1 = ranks[0]["train_all_ranks"], ranks[1]["train_all_ranks"]
    assert r0["stderr"] == "error: /data/train.jsonl:7 is not valid JSON; fix line 7\n"
    assert r1["stderr"] == ""
    assert r0["exit_code"] == r1["exit_code"] == 2


def test_clean_run_prints_nothing(ranks):
    assert [r["ok"] for r in ranks] == [{"stderr": "", "exit_code": 0, "seconds": r["ok"]["seconds"]} for r in ranks]


def test_training_error_on_one_rank_alone_is_reported_by_that_rank(ranks):
    r0, r1 = ranks[0]["train_one_rank"], ranks[1]["train_one_rank"]
    assert r0["stderr"] == "" and r0["exit_code"] == 0  # rank 0 never saw it (torchrun would stop it)
    assert r1["stderr"] == "error: [rank 1] /node1/shard.jsonl:3 is not valid JSON; fix line 3\n"
    assert r1["exit_code"] == 2
    assert r1["seconds"] < 6.0  # it did not wait for rank 0: the agreement timed out after 2 s
