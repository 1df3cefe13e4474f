"""What a run leaves for its user: step lines, tracker files, samples, and which run a resume continues
(see tests/test_run_outputs.py). One world-1 group, seven short runs of ``configs/cp.yaml`` with the
tiny overrides of ``recipe_worker``, all under one ``recipe.output_root`` (no ``recipe.output_dir``, so
``checkpoint.resume=auto`` has to search)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from automodel.config import load_config
from automodel.errors import UserInputError
from automodel.training.metrics import read_metrics
from automodel.training.trainer import FinetuneTrainer
from automodel.training.user_errors import RunAborted
from tests.workers.recipe_worker import CP, TINY


def _run(out: Path, overrides: list[str]) -> tuple[FinetuneTrainer, object, str]:
    argv = ["--config", CP, *TINY, f"recipe.output_root={out}", "recipe.name=outputs",
            "distributed.cp_size=1", *overrides]  # fmt: skip
    stdout, sys.stdout = sys.stdout, io.StringIO()  # setup_logging binds the console handler to this
    try:
        trainer = FinetuneTrainer(load_config(argv, world_size=1))
        result = trainer.run()
        return trainer, result, sys.stdout.getvalue()
    finally:
        sys.stdout = stdout


def main(rank: int, world_size: int, out: str, prompt: str) -> dict:
    out_dir, res = Path(out), {}
    # A: 4 steps, step lines every 2 steps, both trackers, a checkpoint at 2 and 4, export + samples
    a = [
        "step_scheduler.max_steps=4", "step_scheduler.val_every_steps=2", "step_scheduler.ckpt_every_steps=2",
        "logging.log_every_steps=2", "logging.tensorboard=true", "+logging.wandb.project=automodel-test",
        "logging.progress_bar=true",  # no terminal here: no bar
        "export.enabled=true", f"recipe.sample_prompts=[{prompt}]", "recipe.sample_max_new_tokens=5",
    ]  # fmt: skip
    trainer, result, stdout = _run(out_dir, a)
    res["a"] = {
        "run_dir": str(result.run_dir),
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "stdout": stdout,
        "rank0_log": (result.run_dir / "logs" / "rank_0.log").read_text(),
        "samples_path": str(result.samples_path) if result.samples_path else None,
        "metrics": read_metrics(result.run_dir / "metrics.jsonl"),  # as A left it (G rewrites the file later)
    }
    # B: another config (data.seq_len): resume=auto must not continue A
    _, result_b, stdout_b = _run(out_dir, ["data.seq_len=64", "step_scheduler.max_steps=2",
                                           "step_scheduler.val_every_steps=null", "checkpoint.resume=auto"])  # fmt: skip
    res["b"] = {"run_dir": str(result_b.run_dir), "start_step": result_b.start_step, "stdout": stdout_b}
    # C: A's config with max_steps 6 and resume=auto: finds A (same config hash), refuses the new schedule
    c = ["step_scheduler.max_steps=6", "step_scheduler.val_every_steps=null", "checkpoint.resume=auto"]
    try:
        _run(out_dir, c)
        res["c_error"] = None
    except UserInputError as e:
        res["c_error"] = str(e)
    # D: the same with the change made explicit: continues A at step 5 on the new schedule
    trainer_d, result_d, stdout_d = _run(out_dir, [*c, "checkpoint.allow_schedule_change=true"])
    res["d"] = {
        "run_dir": str(result_d.run_dir),
        "start_step": result_d.start_step,
        "losses": dict(result_d.losses),
        "lr_last": trainer_d.optimizer.param_groups[0]["lr"],
        "stdout": stdout_d,
    }
    run_a = Path(res["a"]["run_dir"])
    res["d"]["metrics_steps"] = [r["step"] for r in read_metrics(run_a / "metrics.jsonl") if r["type"] == "train"]
    # E: the user's case: a shorter run into the directory of a finished one, not resuming it -> refused
    before = {p.name: p.stat().st_mtime_ns for p in run_a.iterdir()}
    try:
        _run(out_dir, [f"recipe.output_dir={run_a}", "step_scheduler.max_steps=2"])
        res["e_error"] = None
    except UserInputError as e:
        res["e_error"] = str(e)
    res["e_untouched"] = before == {p.name: p.stat().st_mtime_ns for p in run_a.iterdir()}
    # G: A's run resumed from its earlier step_2 (explicit resume_from, A's schedule): steps 3, 4 again, each
    # step once in the metrics (A's 3, 4 and D's 5, 6 moved aside); A's step_4 moved aside, never taken for G's
    g = [*a[:3], f"recipe.output_dir={run_a}", f"checkpoint.resume_from={run_a / 'checkpoints' / 'step_2'}"]
    _, result_g, stdout_g = _run(out_dir, g)
    res["g"] = {
        "start_step": result_g.start_step,
        "losses": dict(result_g.losses),
        "stdout": stdout_g,
        "metrics_steps": [r["step"] for r in read_metrics(run_a / "metrics.jsonl") if r["type"] == "train"],
        "superseded_metrics": read_metrics(run_a / "metrics.superseded.jsonl"),
        "checkpoints": sorted(p.name for p in (run_a / "checkpoints").iterdir()),
        "superseded_checkpoints": sorted(p.name for p in (run_a / "checkpoints" / "superseded").iterdir()),
    }
    # H: optimizer.lr=1e6 with recipe.on_nonfinite=skip, 2 in a row allowed: the first non-finite step is
    # skipped and counted, the run goes on, the second in a row stops it (exit 3), nothing non-finite saved
    h_dir, err = out_dir / "nonfinite_skip", io.StringIO()
    h = [f"recipe.output_dir={h_dir}", "optimizer.lr=1e6", "recipe.on_nonfinite=skip", "recipe.max_nonfinite_in_row=2",
         "step_scheduler.max_steps=8", "step_scheduler.val_every_steps=null", "step_scheduler.ckpt_every_steps=1",
         "checkpoint.keep_last=null"]  # fmt: skip
    with contextlib.redirect_stderr(err):
        try:
            _run(out_dir, h)
            res["h_exit"] = 0
        except RunAborted as e:
            res["h_exit"] = e.exit_code
    res["h"] = {
        "stderr": err.getvalue(),
        "metrics": read_metrics(h_dir / "metrics.jsonl"),
        "summary": json.loads((h_dir / "summary.json").read_text()),
        "checkpoints": sorted(int(p.name.split("_")[1]) for p in (h_dir / "checkpoints").glob("step_*")),
    }
    return res
