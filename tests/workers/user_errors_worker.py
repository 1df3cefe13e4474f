"""Agreement on user errors between gloo ranks (see tests/test_user_errors_agreement.py).

Every scenario runs :func:`automodel.training.user_errors.run_guarded` on both ranks with stderr
captured, and returns what each rank printed, the exit code it got and how long it took.
"""

from __future__ import annotations

import contextlib
import io
import signal
import time

import torch.distributed as dist

from automodel.errors import UserInputError
from automodel.training.user_errors import RunAborted, run_guarded


def _scenario(setup, train, train_timeout_s: float = 60.0) -> dict:
    err = io.StringIO()
    t0 = time.monotonic()
    code = 0
    with contextlib.redirect_stderr(err):
        try:
            run_guarded(setup, train, train_timeout_s=train_timeout_s)
        except RunAborted as e:
            code = e.exit_code
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # run_guarded ignores SIGTERM once an error is agreed
    return {"stderr": err.getvalue(), "exit_code": code, "seconds": time.monotonic() - t0}


def scenarios(rank: int, world_size: int) -> dict:
    assert dist.get_rank() == rank and world_size == 2

    def missing_on_rank_1():
        if rank == 1:
            raise UserInputError("data path '/node1/train.jsonl' does not exist; set data.dataset.path")
        time.sleep(1.0)  # rank 0 is still busy (e.g. loading the model) when rank 1 fails

    def bad_row_everywhere():
        raise UserInputError("/data/train.jsonl:7 is not valid JSON; fix line 7")

    def bad_row_on_rank_1_only():
        if rank == 1:
            raise UserInputError("/node1/shard.jsonl:3 is not valid JSON; fix line 3")
        time.sleep(6.0)  # rank 0 trains on and never joins the agreement

    out = {
        "setup_one_rank": _scenario(missing_on_rank_1, lambda: None),
        "train_all_ranks": _scenario(lambda: None, bad_row_everywhere),
        "ok": _scenario(lambda: None, lambda: None),
    }
    out["train_one_rank"] = _scenario(lambda: None, bad_row_on_rank_1_only, train_timeout_s=2.0)
    return out
