"""Experiment trackers: TensorBoard event files and Weights & Biases, fed the metrics.jsonl records.

Both are optional (pyproject extras ``tensorboard`` and ``wandb``) and imported only when the config
turns them on; the config check (:mod:`automodel.config.logging_rules`) already refused a missing
package, and the import here repeats that message if the package vanished since. Rank 0 only.

- ``logging.tensorboard: true``: ``torch.utils.tensorboard.SummaryWriter`` writing to
  ``<run dir>/tensorboard``; scalars ``train/<key>`` per optimizer step and ``val/loss``.
- ``logging.wandb: {project, mode, name, entity}``: ``wandb.init(dir=<run dir>, config=<the effective
  config>)``; the same keys per step. ``mode: offline`` writes ``<run dir>/wandb/offline-run-*``
  (``wandb sync`` uploads it later); nothing touches the network.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from automodel.config.logging_rules import missing_tracker_package
from automodel.config.schema import LoggingSection
from automodel.errors import UserInputError

__all__ = ["TRAIN_SCALARS", "Trackers"]

logger = logging.getLogger(__name__)

# the numeric keys of a train record that go to the trackers (as train/<key>)
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "peak_mem_gib")


def _require(key: str) -> None:
    problem = missing_tracker_package(key)
    if problem:
        raise UserInputError(problem)


class Trackers:
    """The trackers a run's ``logging`` section asks for (none: every call is a no-op).

    Args:
        section: ``cfg.logging``.
        run_dir: the run directory (event files and wandb files go under it).
        run_name: the default wandb run name (``recipe.name``).
        config: the effective config (a plain mapping), recorded by wandb.
        enabled: False on every rank but 0.
    """

    def __init__(
        self, section: LoggingSection, run_dir: Path, run_name: str, config: dict[str, Any], enabled: bool
    ) -> None:
        self.tb: Any = None
        self.wandb_run: Any = None
        if not enabled:
            return
        if section.tensorboard:
            _require("logging.tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            logger.info("TensorBoard event files in %s", run_dir / "tensorboard")
        if section.wandb is not None:
            _require("logging.wandb")
            os.environ.setdefault("WANDB_SILENT", "true")  # its banners would interleave with the step lines
            import wandb

            w = section.wandb
            self.wandb_run = wandb.init(
                project=w.project,
                entity=w.entity,
                name=w.name or run_name,
                mode=w.mode,
                dir=str(run_dir),
                config=config,
            )
            logger.info("Weights & Biases run %s (%s) in %s", self.wandb_run.id, w.mode, run_dir / "wandb")

    def log(self, record: dict[str, Any]) -> None:
        """Send one metrics record (``type`` train or val) at its ``step``."""
        step = int(record["step"])
        if record.get("type") == "val":
            scalars = {"val/loss": float(record["val_loss"])}
        else:
            scalars = {f"train/{k}": float(record[k]) for k in TRAIN_SCALARS if k in record}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
