"""Rules of the ``logging`` section: step-line frequency and the optional trackers' packages.

The trackers (TensorBoard, Weights & Biases) are pyproject extras, imported only when a run uses
them; a missing package is reported here, before any process group or model exists, with the extra
to install.
"""

from __future__ import annotations

import importlib.util

from automodel.config.schema import RecipeConfig

__all__ = ["TRACKER_PACKAGES", "logging_problems", "missing_tracker_package"]

# config key -> (module imported, pyproject extra)
TRACKER_PACKAGES = {"logging.tensorboard": ("tensorboard", "tensorboard"), "logging.wandb": ("wandb", "wandb")}
_OFF = {"logging.tensorboard": "logging.tensorboard=false", "logging.wandb": "logging.wandb=null"}


def missing_tracker_package(key: str) -> str | None:
    """The problem line when the package behind tracker ``key`` is not importable, else None."""
    module, extra = TRACKER_PACKAGES[key]
    if importlib.util.find_spec(module) is not None:
        return None
    return (
        f"{key} needs the {module!r} package, which is not installed; install the extra with "
        f"pip install 'automodel[{extra}]' (or pip install {module}), or set {_OFF[key]}"
    )


def logging_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.logging`` (empty: fine)."""
    lg, problems = cfg.logging, []
    if lg.log_every_steps is not None and lg.log_every_steps < 1:
        problems.append(
            f"logging.log_every_steps={lg.log_every_steps} must be >= 1 (a step line every N optimizer steps), "
            "or null for no step lines"
        )
    if lg.wandb is not None and not lg.wandb.project:
        problems.append("logging.wandb.project is empty; set logging.wandb.project=<name>")
    for key, on in (("logging.tensorboard", lg.tensorboard), ("logging.wandb", lg.wandb is not None)):
        problem = missing_tracker_package(key) if on and not cfg.recipe.dry_run else None
        if problem:
            problems.append(problem)
    return problems
