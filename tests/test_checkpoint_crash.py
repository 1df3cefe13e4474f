"""Crash-safe checkpoints: a rank SIGKILLed in the middle of a checkpoint write corrupts nothing.

Launched through ``torchrun`` as a user would (2 ranks, ``configs/cp.yaml`` with the tiny fp32
overrides of ``tests/workers/recipe_worker.py``, 6 steps, a checkpoint every 2, ``keep_last=1``):

1. the test-only hook ``AUTOMODEL_TEST_PAUSE_IN_CHECKPOINT_SAVE=4:1:<marker>`` makes rank 1 stop
   inside the save of step 4, after its model/optimizer shards and before its rank file; the test
   checks the half-written ``step_4.tmp`` and SIGKILLs rank 1; torchrun tears the job down;
2. ``step_2`` is still complete (``keep_last=1`` did not prune it for an incomplete successor) and
   ``checkpoint.resume=auto`` resumes from it, ignoring ``step_4.tmp``; steps 3 and 4 repeat the
   first launch's losses exactly (same layout, same state). It checkpoints every 3 steps, so its
   first save (step 3, another step) must delete the stale ``step_4.tmp``; pruning leaves only the
   newest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from automodel.training.checkpoint import PAUSE_ENV, latest_checkpoint, list_checkpoints
from tests.dist_harness import REPO_ROOT, free_port
from tests.workers.recipe_worker import TINY

pytestmark = pytest.mark.dist

ARGS = [
    *TINY,
    "distributed.cp_size=2",
    "step_scheduler.max_steps=6",
    "step_scheduler.val_every_steps=null",
    "step_scheduler.ckpt_every_steps=2",
    "checkpoint.keep_last=1",
    "checkpoint.save_final=true",
]


def _launch(run_dir: Path, extra: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", PAUSE_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", **env_extra)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO_ROOT / "recipes" / "finetune.py"), "--config", "configs/cp.yaml",
        *ARGS, f"recipe.output_dir={run_dir}", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _train_losses(run_dir: Path, name: str = "metrics.jsonl") -> list[tuple[int, float]]:
    lines = (run_dir / name).read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["type"] == "train"]


@pytest.fixture(scope="module")
def crash(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crash")
    run_dir, marker = tmp / "run", tmp / "paused_pid"
    ckpts = run_dir / "checkpoints"
    proc = _launch(run_dir, [], {PAUSE_ENV: f"4:1:{marker}"})
    try:
        deadline = time.monotonic() + 400
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marker.exists(), f"rank 1 never paused in the save:\n{proc.communicate(timeout=60)[0][-4000:]}"
        time.sleep(0.5)  # the marker is written before the sleep; let the write finish
        during = {
            "complete": [p.name for _, p in list_checkpoints(ckpts)],
            "tmp_files": sorted(p.name for p in (ckpts / "step_4.tmp").iterdir()),
        }
        os.kill(int(marker.read_text()), signal.SIGKILL)
        first_log = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    after_kill = {
        "returncode": proc.returncode,
        "complete": [p.name for _, p in list_checkpoints(ckpts)],
        "entries": sorted(p.name for p in ckpts.iterdir()),
        "losses": _train_losses(run_dir),
    }
    resumed = _launch(run_dir, ["checkpoint.resume=auto", "step_scheduler.ckpt_every_steps=3"], {})
    second_log = resumed.communicate(timeout=500)[0]
    return {
        "during": during,
        "after_kill": after_kill,
        "first_log": first_log,
        "second_rc": resumed.returncode,
        "second_log": second_log,
        "entries_end": sorted(p.name for p in ckpts.iterdir()),
        "losses": _train_losses(run_dir),
        "superseded": _train_losses(run_dir, "metrics.superseded.jsonl"),
        "summary": json.loads(summary.read_text()) if (summary := run_dir / "summary.json").exists() else {},
        "ckpts": ckpts,
        "rank0_log": (run_dir / "logs" / "rank_0.log").read_text(),
    }


def test_kill_happened_in_the_middle_of_the_write(crash):
    during = crash["during"]
    assert during["complete"] == ["step_2"]
    files = during["tmp_files"]
    assert any(f.endswith(".distcp") for f in files), files  # shards written ...
    assert "meta.json" not in files and "rank_1.pt" not in files, files  # ... but not finished
    after = crash["after_kill"]
    assert after["returncode"] != 0, crash["first_log"][-3000:]
    assert [s for s, _ in after["losses"]] == [1, 2, 3, 4]  # step 4 trained, its save was cut


def test_latest_complete_checkpoint_survives_the_kill(crash):
    after = crash["after_kill"]
    # keep_last=1 must not have pruned step_2 for a successor that never completed
    assert after["complete"] == ["step_2"]
    assert "step_4.tmp" in after["entries"] and "step_4" not in after["entries"]


def test_resume_auto_picks_the_complete_one_and_continues_exactly(crash):
    assert crash["second_rc"] == 0, crash["second_log"][-4000:]
    assert crash["summary"]["resumed_from"].endswith("checkpoints/step_2")
    losses = crash["losses"]
    assert [s for s, _ in losses] == [1, 2, 3, 4, 5, 6]  # metrics.jsonl continues the run, each step once
    assert [s for s, _ in crash["superseded"]] == [3, 4]  # the first pass's steps after step_2, kept aside
    first, second = dict(crash["superseded"]), dict(losses)
    for step in (3, 4):
        assert abs(second[step] - first[step]) <= 1e-6 * abs(first[step]), (step, first, second)


def test_next_save_cleans_the_temp_dir_and_prunes_after_completion(crash):
    log = crash["rank0_log"]
    deleted = log.index("step_4.tmp: an interrupted checkpoint save")
    assert deleted < log.index("checkpoints/step_3 in") < log.index("checkpoints/step_6 in")
    assert crash["entries_end"] == ["step_6"]  # step_4.tmp deleted, keep_last=1 kept the newest
    assert latest_checkpoint(crash["ckpts"]).name == "step_6"
    meta = json.loads((crash["ckpts"] / "step_6" / "meta.json").read_text())
    assert meta["step"] == 6 and meta["global_batch_size"] == 8 and meta["layout"]["world_size"] == 2
