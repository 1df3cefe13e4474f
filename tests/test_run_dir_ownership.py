"""A run directory belongs to one run (issue 27 item 2): the refusal, what counts as another run's work,
and what a resume does to the metrics and to checkpoints of later steps. Unit level, no launch; the
user's case through the recipe is in tests/test_run_outputs.py (runs E and G)."""

from __future__ import annotations

import json

import pytest

from automodel.config.schema import CheckpointSection
from automodel.errors import UserInputError
from automodel.training.checkpoint import latest_checkpoint
from automodel.training.metrics import SUPERSEDED_METRICS, read_metrics, supersede_metrics
from automodel.training.run_dir import (
    check_run_dir_is_ours,
    other_run_outputs,
    supersede_later_checkpoints,
)


def _ckpt(root, step):
    (root / f"step_{step}").mkdir(parents=True)
    (root / f"step_{step}" / "meta.json").write_text(json.dumps({"step": step}))


def _finished_run(run):
    run.mkdir()
    (run / "config.yaml").write_text("a: 1\n")
    (run / "metrics.jsonl").write_text(json.dumps({"type": "train", "step": 1, "loss": 2.0}) + "\n")
    (run / "hf_model").mkdir()
    (run / "summary.json").write_text("{}")
    _ckpt(run / "checkpoints", 150)
    _ckpt(run / "checkpoints", 200)


def test_a_fresh_or_setup_only_directory_is_free(tmp_path):
    assert other_run_outputs(tmp_path / "missing", tmp_path / "missing" / "checkpoints") == []
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "config.yaml").write_text("a: 1\n")  # a run that stopped in its setup: no work to lose
    (run / "metrics.jsonl").write_text("")  # opened, no step written
    assert other_run_outputs(run, run / "checkpoints") == []
    check_run_dir_is_ours(run, CheckpointSection())


def test_another_runs_outputs_are_refused_naming_them_and_the_fixes(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    assert other_run_outputs(run, run / "checkpoints") == [
        "config.yaml", "metrics.jsonl", "summary.json", "hf_model/", "checkpoints step_150, step_200"
    ]  # fmt: skip
    with pytest.raises(UserInputError) as e:
        check_run_dir_is_ours(run, CheckpointSection())
    msg = str(e.value)
    assert f"the run directory {run} holds another run's outputs (config.yaml; metrics.jsonl;" in msg
    assert "checkpoints step_150, step_200)" in msg and "checkpoint.resume=false" in msg
    for fix in ("set recipe.output_dir to a new directory", "checkpoint.resume=auto", "checkpoint.resume_from="):
        assert fix in msg


def test_resuming_the_directory_is_allowed_starting_over_it_is_not(tmp_path):
    run = tmp_path / "run"
    _finished_run(run)
    check_run_dir_is_ours(run, CheckpointSection(resume="auto"))
    check_run_dir_is_ours(run, CheckpointSection(resume=True))
    check_run_dir_is_ours(run, CheckpointSection(resume_from=str(run / "checkpoints" / "step_150")))
    other = tmp_path / "other" / "checkpoints" / "step_5"
    with pytest.raises(UserInputError, match="is not one of its checkpoints"):
        check_run_dir_is_ours(run, CheckpointSection(resume_from=str(other)))
    for p in (run / "checkpoints").iterdir():  # resume=auto with nothing to continue starts a run of its own
        (p / "meta.json").unlink()
    with pytest.raises(UserInputError, match="finds no complete checkpoint"):
        check_run_dir_is_ours(run, CheckpointSection(resume="auto"))


def test_stale_checkpoints_in_an_explicit_checkpoint_dir_are_refused(tmp_path):
    shared = tmp_path / "ckpts"
    _ckpt(shared, 20)
    with pytest.raises(UserInputError, match=rf"checkpoints step_20 in checkpoint.dir={shared}"):
        check_run_dir_is_ours(tmp_path / "new_run", CheckpointSection(dir=str(shared)))


def test_a_resume_moves_later_checkpoints_aside(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _ckpt(root, step)
    moved = supersede_later_checkpoints(root, 2)
    assert sorted(p.name.split("-")[0] for p in moved) == ["step_4", "step_6"]
    assert all(p.parent == root / "superseded" and (p / "meta.json").is_file() for p in moved)
    assert latest_checkpoint(root).name == "step_2"  # resume=auto never takes the abandoned ones
    assert supersede_later_checkpoints(root, 2) == []


def test_a_resume_continues_the_metrics_without_repeats(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"type": "train", "step": s, "loss": float(s)} for s in (1, 2, 3, 4)] + [{"type": "val", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "train", "st')  # cut by a crash
    assert supersede_metrics(path, 2) == 4
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    superseded = (tmp_path / SUPERSEDED_METRICS).read_text().splitlines()
    assert [json.loads(x)["step"] for x in superseded[:3]] == [3, 4, 4] and superseded[3].endswith('"st')
    assert supersede_metrics(path, 2) == 0 and supersede_metrics(tmp_path / "none.jsonl", 0) == 0
