"""One output directory per run, shared by all ranks.

Rank 0 chooses it and broadcasts it (ranks start in different seconds, so a per-rank timestamp
would split a run over several directories):

- ``recipe.output_dir`` if set, as given;
- else, when resuming without ``checkpoint.resume_from``/``checkpoint.dir``, the newest run under
  ``<recipe.output_root>/<recipe.name>/`` that holds a complete checkpoint and was written with the same
  config (hash, :mod:`automodel.training.resume_policy`): the run continues there;
- else a new ``<recipe.output_root>/<recipe.name>/<YYYYmmdd-HHMMSS>`` (``-1``, ``-2``... if taken).

Relative paths are relative to the working directory of the launch.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel.config.schema import CheckpointSection, RecipeSection
from automodel.training.checkpoint import latest_checkpoint
from automodel.training.resume_policy import IDENTITY_FILE, identity_diff, identity_hash, read_run_identity

__all__ = ["choose_run_dir", "shared_run_dir", "CHECKPOINT_SUBDIR"]

CHECKPOINT_SUBDIR = "checkpoints"


def choose_run_dir(
    recipe: RecipeSection,
    checkpoint: CheckpointSection,
    identity: dict[str, Any] | None = None,
    notes: list[tuple[int, str]] | None = None,
) -> Path:
    """The run directory (absolute), decided on one process. Does not create it.

    ``identity`` (:func:`~automodel.training.resume_policy.run_identity`): a resume search takes only a
    run of the same config hash (None: any run). ``notes`` receives ``(logging level, message)``: what
    the search found and why it did not use it (logged by the caller once logging is set up).
    """
    notes = notes if notes is not None else []
    if recipe.output_dir:
        path = Path(recipe.output_dir).expanduser().resolve()
        if checkpoint.resume and identity is not None and (saved := read_run_identity(path)) is not None:
            if saved.get("config_hash") != identity_hash(identity):
                notes.append((logging.WARNING,
                    f"resuming {path} as recipe.output_dir names it, although it was written with another config "
                    f"({identity_diff(saved.get('identity', {}), identity)})"
                ))  # fmt: skip
        return path
    base = Path(recipe.output_root).expanduser().resolve() / recipe.name
    if checkpoint.resume and not checkpoint.resume_from and not checkpoint.dir and base.is_dir():
        runs = sorted((p for p in base.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True)
        want = identity_hash(identity) if identity is not None else None
        passed = []
        for run in runs:
            ckpt = latest_checkpoint(run / CHECKPOINT_SUBDIR)
            if ckpt is None:
                continue
            if want is None:
                return run
            saved = read_run_identity(run)
            if saved is not None and saved.get("config_hash") == want:
                notes.append(
                    (logging.INFO, f"checkpoint.resume={checkpoint.resume}: continuing {run} (config hash {want})")
                )
                return run
            why = (
                f"no {IDENTITY_FILE} (written by an older version)"
                if saved is None
                else f"another config: {identity_diff(saved.get('identity', {}), identity)}"
            )
            passed.append(f"{run.name} ({ckpt.name}: {why})")
        if passed:
            notes.append((logging.WARNING,
                f"checkpoint.resume={checkpoint.resume}: no run of this config (hash {want}) under {base}; passed "
                f"over {len(passed)} run(s) with checkpoints: {'; '.join(passed)}. Starting a new run; to continue "
                "one of them anyway, set recipe.output_dir=<its directory> or checkpoint.resume_from=<step_N>"
            ))  # fmt: skip
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, i = base / stamp, 0
    while path.exists():
        i += 1
        path = base / f"{stamp}-{i}"
    return path


def shared_run_dir(
    recipe: RecipeSection,
    checkpoint: CheckpointSection,
    identity: dict[str, Any] | None = None,
    notes: list[tuple[int, str]] | None = None,
) -> Path:
    """:func:`choose_run_dir` on rank 0, broadcast to every rank, created. Collective (``notes``: rank 0)."""
    chosen = (
        [str(choose_run_dir(recipe, checkpoint, identity, notes))]
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
