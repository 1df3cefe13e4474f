"""Units of what a run reports: the epoch plan, step lines, the terminal-only bar, tracker config checks,
the config identity of resume=auto and the schedule check of a resume."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from automodel.config.schema import CheckpointSection, RecipeSection
from automodel.data.epoch_plan import epoch_plan
from automodel.errors import UserInputError
from automodel.training import resume_policy as rp
from automodel.training.run_dir import choose_run_dir
from automodel.training.step_log import format_step_line, progress_bar, should_log_step

# ------------------------------------------------------------------ epoch plan


def test_epoch_line_and_the_warning_when_a_step_needs_more_rows_than_the_split():
    # the case: 9 rows, global batch 16 = local 4 x dp 1 x grad_acc 4
    plan = epoch_plan(9, global_batch_size=16, local_batch_size=4, dp_size=1, drop_last=True, seq_len=256)
    assert plan.line == (
        "data: 9 train rows; an optimizer step takes 16 rows (global batch = local 4 x dp 1 x grad_acc 4), "
        "seq_len 256; one epoch = 0.50 optimizer steps (1 rows left out each epoch: data.drop_last=true)"
    )
    assert "has 9 rows (8 per epoch)" in plan.warning and "about 2.0 times" in plan.warning
    assert "step_scheduler.global_batch_size=8 or lower" in plan.warning
    ok = epoch_plan(64, global_batch_size=16, local_batch_size=4, dp_size=2, drop_last=False, seq_len=8)
    assert ok.warning is None and "one epoch = 4 optimizer steps" in ok.line and "left out" not in ok.line
    assert "streaming" in epoch_plan(None, global_batch_size=8, local_batch_size=1, dp_size=1, drop_last=True,
                                     seq_len=8).line  # fmt: skip


# ------------------------------------------------------------------ step lines and the bar

RECORD = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
          "tokens_per_s_per_device": 500.0, "step_time_s": 0.25, "peak_mem_gib": 1.5, "mem_kind": "cpu_peak_rss"}  # fmt: skip


def test_step_line_and_when_it_is_written():
    assert format_step_line(RECORD, 10) == (
        "step 3/10 | loss 2.5000 | lr 1.000e-03 | grad norm 0.500 | 1000 tokens/s (500/device) | 0.25 s/step | "
        "peak mem 1.50 GiB (cpu_peak_rss)"
    )
    assert [s for s in range(1, 11) if should_log_step(s, 4, 0, 10)] == [1, 4, 8, 10]
    assert [s for s in range(6, 11) if should_log_step(s, 4, 5, 10)] == [6, 8, 10]  # resumed at 5
    assert not any(should_log_step(s, None, 0, 10) for s in range(1, 11))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_only_on_a_terminal_and_log_lines_never_inside_a_frame():
    with progress_bar(True, 5, 0, stream=io.StringIO()) as bar:
        assert bar is None  # a pipe or a file: no bar
    with progress_bar(False, 5, 0, stream=_Tty()) as bar:
        assert bar is None
    log, console = logging.getLogger("automodel"), _Tty()
    handler = logging.StreamHandler(console)
    log.addHandler(handler)
    old_level, log.level = log.level, logging.INFO
    try:
        with progress_bar(True, 5, 0, stream=console) as bar:
            bar.update(1)
            log.info("step 1/5 | loss 1.0")
            bar.update(1)
        text = console.getvalue()
        # the line is on a line of its own: whatever the bar drew before it ends with \r or \n
        (line,) = [seg for seg in text.replace("\r", "\n").split("\n") if "loss 1.0" in seg]
        assert line == "step 1/5 | loss 1.0"
    finally:
        log.removeHandler(handler)
        log.level = old_level


def test_missing_tracker_package_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    from automodel.config import ConfigError, load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_config(["--config", "configs/cp.yaml", "logging.tensorboard=true", "+logging.wandb.mode=offline",
                     "logging.log_every_steps=0"], world_size=2)  # fmt: skip
    text = str(e.value)
    assert "pip install 'automodel[tensorboard]'" in text and "set logging.tensorboard=false" in text
    assert "pip install 'automodel[wandb]'" in text and "set logging.wandb=null" in text
    assert "logging.log_every_steps=0 must be >= 1" in text


# ------------------------------------------------------------------ resume: identity and schedule


def _effective(**changes) -> dict:
    from automodel.config import load_config

    argv = ["--config", "configs/cp.yaml", *[f"{k}={v}" for k, v in changes.items()]]
    return load_config(argv, world_size=2).effective


def test_identity_ignores_layout_and_schedule_but_not_data():
    base = rp.run_identity(_effective())
    same = rp.run_identity(_effective(**{"distributed.cp_size": 1, "step_scheduler.local_batch_size": 2,
                                         "step_scheduler.max_steps": 17, "optimizer.lr": 0.1,
                                         "logging.log_every_steps": 3, "model.activation_checkpointing": True}))  # fmt: skip
    assert rp.identity_hash(same) == rp.identity_hash(base)
    other = rp.run_identity(_effective(**{"data.seq_len": 64, "recipe.seed": 5}))
    assert rp.identity_hash(other) != rp.identity_hash(base)
    assert rp.identity_diff(base, other) == "data.seq_len: 256 -> 64, recipe.seed: 1234 -> 5"


def _fake_run(root, name: str, identity: dict | None, step: int = 2):
    run = root / "exp" / name
    (run / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run / "checkpoints" / f"step_{step}" / "meta.json").write_text("{}")
    if identity is not None:
        rp.write_run_identity(run, identity)
    return run


def test_resume_auto_takes_only_the_newest_run_of_the_same_config(tmp_path):
    mine, theirs = {"data": {"seq_len": 8}}, {"data": {"seq_len": 16}}
    old_mine = _fake_run(tmp_path, "20250101-000000", mine)
    _fake_run(tmp_path, "20250102-000000", mine, step=4)
    newest_mine = tmp_path / "exp" / "20250102-000000"
    _fake_run(tmp_path, "20250103-000000", theirs)  # newer, another config
    _fake_run(tmp_path, "20250104-000000", None)  # newer, no identity file
    rec, notes = RecipeSection(name="exp", output_root=str(tmp_path)), []
    assert choose_run_dir(rec, CheckpointSection(resume="auto"), mine, notes) == newest_mine != old_mine
    assert notes == [(logging.INFO, f"checkpoint.resume=auto: continuing {newest_mine} (config hash "
                                    f"{rp.identity_hash(mine)})")]  # fmt: skip
    notes = []
    fresh = choose_run_dir(rec, CheckpointSection(resume=True), {"data": {"seq_len": 32}}, notes)
    assert fresh.parent == tmp_path / "exp" and not fresh.exists()
    ((level, text),) = notes
    assert level == logging.WARNING and "passed over 4 run(s)" in text
    assert "20250104-000000 (step_2: no run_identity.json" in text
    assert "20250103-000000 (step_2: another config: data.seq_len: 16 -> 32)" in text
    assert "set recipe.output_dir=<its directory>" in text
    # a run directory given explicitly is resumed as given, with a note when its config differs
    notes = []
    given = RecipeSection(output_dir=str(old_mine))
    assert choose_run_dir(given, CheckpointSection(resume=True), theirs, notes) == old_mine
    assert notes[0][0] == logging.WARNING and "data.seq_len: 8 -> 16" in notes[0][1]


def _sched(max_steps=4, lr=1e-3, warmup=2):
    return {"max_steps": max_steps, "lr": lr, "lr_scheduler": {"_target_": "x.warmup_cosine", "warmup_steps": warmup}}


def test_schedule_change_is_refused_with_the_keys_and_the_lr_jump_or_allowed():
    assert rp.check_schedule_change("ck", _sched(), _sched(), False, 4) == []
    assert rp.check_schedule_change("ck", None, _sched(max_steps=9), False, 4) == []  # an older checkpoint
    with pytest.raises(UserInputError) as e:
        rp.check_schedule_change("ck", _sched(), _sched(max_steps=6, warmup=1), False, 4, (3e-4, 3.5e-4))
    text = str(e.value)
    assert "step_scheduler.max_steps: 4 -> 6" in text and "lr_scheduler.warmup_steps: 2 -> 1" in text
    assert "step 5 would train at lr 0.00035 where the checkpointed run continues at 0.0003" in text
    assert "checkpoint.allow_schedule_change=true" in text
    allowed = rp.check_schedule_change("ck", _sched(), _sched(lr=2e-3), True, 4)
    assert allowed == ["optimizer.lr: 0.001 -> 0.002"]


def test_apply_schedule_sets_the_new_base_lr_at_the_restored_step():
    from automodel.training.lr_schedule import warmup_linear

    p = torch.nn.Parameter(torch.zeros(1))
    old_opt = torch.optim.SGD([p], lr=1.0)
    old = warmup_linear(old_opt, total_steps=4)
    for _ in range(2):
        old_opt.step()
        old.step()
    opt = torch.optim.SGD([p], lr=3.0)
    new = warmup_linear(opt, total_steps=8)  # a longer run with another lr, resumed at step 2
    opt.load_state_dict(old_opt.state_dict())
    new.load_state_dict(old.state_dict())
    assert new.base_lrs == [1.0]  # what load_state_dict restores: the old base lr
    rp.apply_schedule(opt, new, 3.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(3.0 * (1 - 2 / 7)) and new.get_last_lr() == [opt.param_groups[0]["lr"]]
    opt.step()
    new.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3.0 * (1 - 3 / 7))
    json.dumps(rp.schedule_of(_effective()))  # recorded in meta.json: plain JSON
