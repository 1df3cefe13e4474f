"""Elastic resume through the recipe (see tests/test_elastic_resume.py).

One 8-step run (``configs/cp.yaml``, ring CP, with the tiny fp32 overrides of ``recipe_worker``) is
cut into segments, each stopped by SIGTERM
(checkpoint + stop) and resumed at another layout from the previous segment's checkpoint:

    steps 1-2  world 2, cp=2          (launch "first", world 2)
    steps 3-4  world 1, cp=1          (launch "second", world 1)
    steps 5-6  world 2, dp=2          (launch "third", world 2)
    steps 7-8  world 4, dp=2 x cp=2   (launch "fourth", world 4: opt-in)

Each launch also runs the uninterrupted reference at its layout (the same 8-step config, stopped by
SIGTERM after the last step the test compares); the test compares the continued losses with it.
"""

from __future__ import annotations

from pathlib import Path

from automodel.errors import UserInputError
from tests.workers.recipe_worker import CP, TINY, _sigterm_at

LAYOUTS = {
    "cp2": ["distributed.cp_size=2"],
    "cp1": ["distributed.cp_size=1"],
    "dp2": ["distributed.cp_size=1"],
    "dp2cp2": ["distributed.cp_size=2"],
}


def _run(world: int, out: Path, name: str, overrides: list[str], stop_at: int | None = None):
    from automodel.config import load_config
    from automodel.training.trainer import FinetuneTrainer

    argv = ["--config", CP, *TINY, f"recipe.output_dir={out / name}", *overrides]
    trainer = FinetuneTrainer(load_config(argv, world_size=world), _sigterm_at(stop_at) if stop_at else None)
    result = trainer.run()
    return {
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "start_step": result.start_step,
        "final_step": result.final_step,
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "lr_last": trainer.optimizer.param_groups[0]["lr"],
        "layout": trainer.layout.describe(),
        "resumed_from": str(trainer.resumed_from) if trainer.resumed_from else None,
    }


def _segment(world: int, out: Path, layout: str, resume_from: str | None, stop_at: int | None) -> dict:
    overrides = list(LAYOUTS[layout])
    if resume_from:
        overrides.append(f"checkpoint.resume_from={resume_from}")
    name = f"{layout}_from_{Path(resume_from).name if resume_from else 'start'}"
    return _run(world, out, name, overrides, stop_at)


def _user_error(world: int, out: Path, name: str, overrides: list[str]) -> str | None:
    try:
        _run(world, out, name, overrides)
    except UserInputError as e:
        return str(e)
    return None


def first(rank: int, world_size: int, out: str) -> dict:
    """World 2: cp=2 steps 1-2 (checkpoint at 2), and the uninterrupted dp=2 reference."""
    o = Path(out)
    return {
        "cp2": _segment(world_size, o, "cp2", None, stop_at=2),
        "dp2_full": _segment(world_size, o, "dp2", None, stop_at=6),
    }


def second(rank: int, world_size: int, out: str, ckpt: str) -> dict:
    """World 1: cp=1 steps 3-4 from the cp=2 checkpoint (checkpoint at 4), and the uninterrupted cp=1 run."""
    o = Path(out)
    return {
        "cp1": _segment(world_size, o, "cp1", ckpt, stop_at=4),
        "cp1_full": _segment(world_size, o, "cp1", None, stop_at=4),
    }


def third(rank: int, world_size: int, out: str, ckpt: str) -> dict:
    """World 2: dp=2 steps 5-6 from the world-1 checkpoint (checkpoint at 6), and two refusals."""
    o = Path(out)
    res = {"dp2": _segment(world_size, o, "dp2", ckpt, stop_at=6)}
    resume = [*LAYOUTS["dp2"], f"checkpoint.resume_from={ckpt}"]
    res["gbs_error"] = _user_error(world_size, o, "gbs", [*resume, "step_scheduler.global_batch_size=16"])
    res["seed_error"] = _user_error(world_size, o, "seed", [*resume, "recipe.seed=99"])
    return res


def fourth(rank: int, world_size: int, out: str, ckpt: str) -> dict:
    """World 4: dp=2 x cp=2 steps 7-8 from the dp=2 checkpoint, and the uninterrupted dp=2 x cp=2 run."""
    o = Path(out)
    return {
        "dp2cp2": _segment(world_size, o, "dp2cp2", ckpt, stop_at=None),
        "dp2cp2_full": _segment(world_size, o, "dp2cp2", None, stop_at=None),
    }
