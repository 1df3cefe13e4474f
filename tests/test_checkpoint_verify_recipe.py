"""A damaged checkpoint end to end (2 ranks through the ``automodel`` command, issue 27 item 3).

One run trains 6 steps of the tiny recipe with a checkpoint every 2 (``step_2``, ``step_4``,
``step_6``). Every file of ``step_6``, truncated, is found by the verification a resume runs (no launch). Then
a shard of ``step_6`` is truncated and the run resumed:

- ``checkpoint.resume=auto``: one warning names ``step_6`` and the damaged file, the run resumes from
  ``step_4``, and its steps 5 and 6 have exactly the losses of the uninterrupted run (it writes
  ``step_6`` again, intact, for the next case);
- ``checkpoint.resume_from=<step_6>``: one ``error:`` line naming the file and ``step_4``, exit 2, no
  traceback on the terminal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_harness import REPO_ROOT
from tests.workers.recipe_worker import TINY

pytestmark = pytest.mark.dist

ARGS = [
    *TINY,
    "distributed.cp_size=2",
    "step_scheduler.max_steps=6",
    "step_scheduler.val_every_steps=null",
    "step_scheduler.ckpt_every_steps=2",
    "checkpoint.keep_last=null",
]


def _cli(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "automodel.cli", "finetune", "--config", "configs/cp.yaml", "--nproc-per-node", "2",
           *ARGS, f"recipe.output_dir={run_dir}", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def _losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs its steps again)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("type") == "train":
            out[r["step"]] = r["loss"]
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("verify") / "run"
    first = _cli(run_dir)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4", "step_6"]
    return run_dir, _losses(run_dir)


def test_every_file_the_recipe_writes_is_verified(trained):
    """Each file of a real checkpoint (the model and optimizer shards, ``.metadata``, ``meta.json``, each rank's
    ``rank_<r>.pt``), truncated, is found and named by the verification a resume runs; every file is put back.
    (The kinds of damage on one file: tests/test_checkpoint_manifest.py.)"""
    from automodel.training.checkpoint_manifest import MANIFEST_FILE, verify_checkpoint

    step_6 = trained[0] / "checkpoints" / "step_6"
    files = sorted(p.name for p in step_6.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.json", "rank_0.pt", "rank_1.pt"} <= set(files), files
    assert verify_checkpoint(step_6) == (True, None)
    for name in files:
        data = (step_6 / name).read_bytes()
        _truncate(step_6 / name)
        try:
            has_manifest, found = verify_checkpoint(step_6)
        finally:
            (step_6 / name).write_bytes(data)
        assert has_manifest and found is not None and found.file == name and "bytes where" in found.reason, found
    assert verify_checkpoint(step_6) == (True, None)


def test_resume_auto_skips_a_damaged_checkpoint_and_continues_exactly(trained):
    run_dir, reference = trained
    step_6 = run_dir / "checkpoints" / "step_6"
    damaged = "__1_0.distcp"
    _truncate(step_6 / damaged)
    run = _cli(run_dir, "checkpoint.resume=auto")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    warnings = [line for line in out.splitlines() if "damaged" in line]
    assert len(warnings) == 1, out
    assert str(step_6) in warnings[0] and damaged in warnings[0], warnings
    assert "Traceback" not in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"].endswith("checkpoints/step_4"), summary
    losses = _losses(run_dir)
    assert [losses[s] for s in (5, 6)] == [reference[s] for s in (5, 6)], (losses, reference)


def test_explicit_damaged_checkpoint_is_one_error_line_exit_2(trained):
    run_dir, _ = trained
    step_6 = run_dir / "checkpoints" / "step_6"
    _truncate(step_6 / "__1_0.distcp")
    run = _cli(run_dir, f"checkpoint.resume_from={step_6}")
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-4000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out
    assert errors[0].startswith(f"error: checkpoint {step_6} is damaged: __1_0.distcp has "), errors
    good = run_dir / "checkpoints" / "step_4"
    assert f"the newest good checkpoint is {good}: resume with checkpoint.resume_from={good}" in errors[0]
    assert "Traceback" not in out and "gloo" not in out.lower(), out
