"""Non-finite loss, gradients and weights (issue 27 item 4): named in one line, agreed by every rank,
a distinct exit code, never saved.

The user's case, ``optimizer.lr=1e6`` with the default ``recipe.on_nonfinite=stop``, runs under torchrun
on 2 ranks (one launch): one ``error:`` line from rank 0 naming the step and the loss, exit 3 on every
rank, no traceback; a second, shorter run into its directory is refused (one line, exit 2). ``on_nonfinite=skip`` (counted, continued, stopped after ``max_nonfinite_in_row`` in
a row) runs in the world-1 group of tests/test_run_outputs.py (run H).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from automodel.training.nonfinite import (
    EXIT_NONFINITE,
    NonFiniteStop,
    agree_nonfinite_step,
    first_nonfinite_weight,
    nonfinite_message,
    parameter_name,
)
from automodel.training.trainer import FinetuneTrainer
from automodel.training.user_errors import RunAborted, stop_run_agreed
from tests.dist_harness import free_port
from tests.workers.recipe_worker import TINY

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    return model


def test_a_finite_step_names_nothing():
    assert agree_nonfinite_step(1.5, 0.3, _model(), CPU) is None


def test_the_loss_is_named_first_then_the_first_parameter_with_a_bad_gradient():
    model = _model()
    model[1].weight.grad[0, 1] = float("inf")
    model[1].bias.grad[0] = float("nan")
    assert agree_nonfinite_step(float("nan"), float("nan"), model, CPU) == "the loss is nan"
    assert agree_nonfinite_step(2.0, float("inf"), model, CPU) == (
        "the gradient norm is inf (the first parameter with a non-finite gradient: 1.weight)"
    )


def test_weights_and_wrapper_names():
    model = _model()
    assert first_nonfinite_weight(model, CPU) is None
    with torch.no_grad():
        model[0].bias[2] = float("-inf")
    assert first_nonfinite_weight(model, CPU) == "0.bias"
    assert parameter_name("_orig_mod.layers.0._checkpoint_wrapped_module.mlp.w") == "layers.0.mlp.w"


def test_the_message_names_the_step_the_quantity_and_the_fixes():
    msg = nonfinite_message(7, "the loss is nan", lr=1e6, last_checkpoint="/r/checkpoints/step_6")
    assert msg.startswith("step 7: the loss is nan; recipe.on_nonfinite=stop ended the run without saving it")
    assert "/r/checkpoints/step_6" in msg and "optimizer.lr (1e+06 at this step)" in msg
    assert "recipe.on_nonfinite=skip" in msg and "clip_grad.max_norm" in msg and "\n" not in msg
    msg = nonfinite_message(9, "the loss is inf", lr=1e-3, last_checkpoint=None, in_row=3)
    assert "3 steps in a row" in msg and "recipe.max_nonfinite_in_row=3" in msg and "no checkpoint was saved" in msg


def test_a_checkpoint_with_non_finite_weights_is_never_written(tmp_path):
    class NoSave:
        root = tmp_path

        def save(self, *a, **k):
            raise AssertionError("saved a checkpoint with non-finite weights")

    trainer = FinetuneTrainer.__new__(FinetuneTrainer)
    trainer.model, trainer.device, trainer.step, trainer.checkpointer = _model(), CPU, 5, NoSave()
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    trainer.cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(enabled=True))
    with torch.no_grad():
        trainer.model[1].weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteStop) as e:  # train() turns it into RunAborted(EXIT_NONFINITE) on every rank
        trainer.save_checkpoint()
    assert e.value.message.startswith("step 5: parameter 1.weight holds non-finite weights; the checkpoint was not")


def test_an_agreed_stop_prints_one_line_and_carries_exit_3(capsys):
    aborted = stop_run_agreed("step 3: the loss is nan; ...", EXIT_NONFINITE)
    assert isinstance(aborted, RunAborted) and aborted.exit_code == 3
    assert capsys.readouterr().err == "error: step 3: the loss is nan; ...\n"


# ------------------------------------------------------------------ the user's case under torchrun


@pytest.fixture(scope="module")
def lr_1e6(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nonfinite")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--tee", "3",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--log-dir", str(tmp / "torchrun_logs"), str(REPO / "recipes" / "finetune.py"),
           "--config", str(REPO / "configs" / "cp.yaml"), *TINY, "model.config.num_hidden_layers=1",
           "step_scheduler.val_every_steps=null", "step_scheduler.ckpt_every_steps=1", "checkpoint.keep_last=null",
           "optimizer.lr=1e6", f"recipe.output_dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    # then a shorter run into the same directory, not resuming it (issue 27 item 2, as the recipe exits)
    again = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "finetune.py"), "--config", str(REPO / "configs" / "cp.yaml"),
         *TINY, "distributed.cp_size=1", "step_scheduler.max_steps=2", f"recipe.output_dir={run_dir}"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr, "run_dir": run_dir,
            "again_rc": again.returncode, "again_out": again.stdout + again.stderr}  # fmt: skip


@pytest.mark.dist
def test_lr_1e6_stops_with_one_line_and_exit_3_on_every_rank(lr_1e6):
    out = lr_1e6["out"]
    assert lr_1e6["rc"] != 0, out
    errors = [line for line in out.splitlines() if "error:" in line and "ChildFailedError" not in line]
    assert len(errors) == 1 and errors[0].startswith("[default0]:error: step "), out  # rank 0, once
    assert re.search(r"error: step (\d+): the (loss|gradient norm) is (nan|inf)", errors[0]), errors[0]
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    assert codes and set(codes) == {"3"}, out  # every rank exited 3 (torchrun's report lists them)
    rank_output = out[: out.find("Traceback (most recent call last):")] if "ChildFailedError" in out else out
    assert "Traceback" not in rank_output and "FloatingPointError" not in out, out  # only torchrun's own


@pytest.mark.dist
def test_lr_1e6_saved_nothing_of_the_bad_step(lr_1e6):
    run_dir = lr_1e6["run_dir"]
    step = int(re.search(r"error: step (\d+):", lr_1e6["out"]).group(1))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step and records[-1]["skipped"] and records[-1]["nonfinite"]
    assert all("nonfinite" not in r for r in records[:-1])
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == list(range(1, step))  # every step before, none of the bad one
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == step and summary["stopped_by_nonfinite"].startswith(f"step {step}: ")
    assert not (run_dir / "hf_model").exists()


@pytest.mark.dist
def test_a_second_run_into_the_directory_is_refused_with_exit_2(lr_1e6):
    out = lr_1e6["again_out"]
    assert lr_1e6["again_rc"] == 2, out
    (line,) = [x for x in out.splitlines() if "error:" in x]
    assert line.startswith(f"error: the run directory {lr_1e6['run_dir']} holds another run's outputs (")
    assert "metrics.jsonl" in line and "checkpoints step_1" in line and "Traceback" not in out
