"""One output directory per run, shared by all ranks.

Rank 0 chooses it and broadcasts it (ranks start in different seconds, so a per-rank timestamp
would split a run over several directories):

- ``recipe.output_dir`` if set, as given;
- else, when resuming without ``checkpoint.resume_from``/``checkpoint.dir``, the newest run under
  ``<recipe.output_root>/<recipe.name>/`` that holds a complete checkpoint (the run continues there);
- else a new ``<recipe.output_root>/<recipe.name>/<YYYYmmdd-HHMMSS>`` (``-1``, ``-2``... if taken).

Relative paths are relative to the working directory of the launch.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from automodel.config.schema import CheckpointSection, RecipeSection
from automodel.training.checkpoint import latest_checkpoint

__all__ = ["choose_run_dir", "shared_run_dir", "CHECKPOINT_SUBDIR"]

CHECKPOINT_SUBDIR = "checkpoints"


def choose_run_dir(recipe: RecipeSection, checkpoint: CheckpointSection) -> Path:
    """The run directory (absolute), decided on one process. Does not create it."""
    if recipe.output_dir:
        return Path(recipe.output_dir).expanduser().resolve()
    base = Path(recipe.output_root).expanduser().resolve() / recipe.name
    if checkpoint.resume and not checkpoint.resume_from and not checkpoint.dir and base.is_dir():
        runs = sorted((p for p in base.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True)
        for run in runs:
            if latest_checkpoint(run / CHECKPOINT_SUBDIR) is not None:
                return run
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, i = base / stamp, 0
    while path.exists():
        i += 1
        path = base / f"{stamp}-{i}"
    return path


def shared_run_dir(recipe: RecipeSection, checkpoint: CheckpointSection) -> Path:
    """:func:`choose_run_dir` on rank 0, broadcast to every rank, created. Collective."""
    chosen = (
        [str(choose_run_dir(recipe, checkpoint))]
        if not dist.is_initialized() or dist.get_rank() == 0
        else [None]
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    path = Path(chosen[0])
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return path
