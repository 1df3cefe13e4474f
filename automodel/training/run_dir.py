"""One output directory per run, shared by all ranks.

Rank 0 chooses it and broadcasts it (ranks start in different seconds, so a per-rank timestamp
would split a run over several directories):

- ``recipe.output_dir`` if set, as given;
- else, when resuming without ``checkpoint.resume_from``/``checkpoint.dir``, the newest run under
  ``<recipe.output_root>/<recipe.name>/`` that holds a complete checkpoint and was written with the same
  config (hash, :mod:`automodel.training.resume_policy`): the run continues there;
- else a new ``<recipe.output_root>/<recipe.name>/<YYYYmmdd-HHMMSS>`` (``-1``, ``-2``... if taken).

Relative paths are relative to the working directory of the launch.

**A run directory belongs to one run.** :func:`other_run_outputs` lists what of an earlier run's work a
directory holds (``metrics.jsonl``, ``summary.json``, ``loss.png``, ``samples.jsonl``, ``hf_model/``,
``step_<N>`` checkpoints); a run that does not resume that directory refuses to start there
(:func:`check_run_dir_is_ours`, a :class:`~automodel.errors.UserInputError` before any work). A
directory holding only ``config.yaml``/``logs/`` (a run that stopped before its first step) is free.
A run that resumes it continues that run: :func:`supersede_later_checkpoints` moves checkpoints of
later steps than the one resumed into ``checkpoints/superseded/`` (they belong to the trajectory the
resume abandoned) and :func:`automodel.training.metrics.supersede_metrics` does the same for the
metrics, so ``metrics.jsonl`` and the plot hold one run's steps, each once.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from automodel.config.schema import CheckpointSection, RecipeSection
from automodel.errors import UserInputError
from automodel.training.checkpoint import latest_checkpoint, list_checkpoints
from automodel.training.resume_policy import IDENTITY_FILE, identity_diff, identity_hash, read_run_identity

__all__ = [
    "CHECKPOINT_SUBDIR",
    "RUN_OUTPUTS",
    "SUPERSEDED_SUBDIR",
    "check_run_dir_is_ours",
    "checkpoint_root",
    "choose_run_dir",
    "other_run_outputs",
    "shared_run_dir",
    "supersede_later_checkpoints",
]

CHECKPOINT_SUBDIR = "checkpoints"
SUPERSEDED_SUBDIR = "superseded"  # under the checkpoint root: checkpoints a resume from an earlier step abandoned
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "samples.jsonl", "hf_model")  # work of a run that trained


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


def checkpoint_root(run_dir: Path, checkpoint: CheckpointSection) -> Path:
    """Where this run's ``step_<N>`` checkpoints go: ``checkpoint.dir`` if set, else ``<run dir>/checkpoints``."""
    return Path(checkpoint.dir).expanduser().resolve() if checkpoint.dir else run_dir / CHECKPOINT_SUBDIR


def other_run_outputs(run_dir: Path, ckpt_root: Path) -> list[str]:
    """What of a run's work ``run_dir`` (and the checkpoint root ``ckpt_root``) holds, as short names.

    ``metrics.jsonl`` (non-empty), ``summary.json``, ``loss.png``, ``samples.jsonl``, ``hf_model/`` and every
    ``step_<N>`` directory of the checkpoint root (complete or not); ``config.yaml`` is named as well when
    any of these is there. Empty when none is (a missing directory, or only ``config.yaml``/``logs/``).
    """
    found = []
    for name in RUN_OUTPUTS:
        path = run_dir / name
        if path.is_dir() or (path.is_file() and path.stat().st_size > 0):
            found.append(name + ("/" if path.is_dir() else ""))
    if ckpt_root.is_dir():
        steps = sorted(
            (p.name for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("step_")),
            key=lambda n: (len(n), n),
        )
        if steps:
            where = "" if ckpt_root == run_dir / CHECKPOINT_SUBDIR else f" in checkpoint.dir={ckpt_root}"
            found.append(f"checkpoints {', '.join(steps)}{where}")
    if found and (run_dir / "config.yaml").is_file():
        found.insert(0, "config.yaml")
    return found


def check_run_dir_is_ours(run_dir: Path, checkpoint: CheckpointSection) -> None:
    """``UserInputError`` unless this run may write into ``run_dir``: it holds no other run's outputs
    (:func:`other_run_outputs`), or this run resumes it.

    Resuming means ``checkpoint.resume=true|auto`` finding a checkpoint in this run's checkpoint root,
    or ``checkpoint.resume_from`` naming one there. A ``resume_from`` of another directory, or
    ``resume=auto`` with no checkpoint to continue, starts a run of its own: the directory must be free.
    """
    root = checkpoint_root(run_dir, checkpoint)
    found = other_run_outputs(run_dir, root)
    if not found:
        return
    if checkpoint.resume_from:
        if Path(checkpoint.resume_from).expanduser().resolve().parent == root:
            return
        how = f"checkpoint.resume_from={checkpoint.resume_from} is not one of its checkpoints"
    elif checkpoint.resume:
        if latest_checkpoint(root) is not None:
            return
        how = f"checkpoint.resume={checkpoint.resume} finds no complete checkpoint in {root} to continue"
    else:
        how = "this run does not resume it (checkpoint.resume=false)"
    raise UserInputError(
        f"the run directory {run_dir} holds another run's outputs ({'; '.join(found)}) and {how}; a run never "
        f"overwrites or mixes with another: set recipe.output_dir to a new directory, continue that run with "
        f"checkpoint.resume=auto (or checkpoint.resume_from=<one of its step_N>), or delete the directory"
    )


def supersede_later_checkpoints(ckpt_root: Path, step: int) -> list[Path]:
    """Move the complete checkpoints of steps after ``step`` into ``<ckpt_root>/superseded/`` (rank 0).

    Called once a run resumed ``step_<step>``: the later ones belong to the trajectory it abandoned and
    must never be taken for this run's own by a later ``resume=auto``. Returns their new paths.
    """
    moved = []
    for s, path in list_checkpoints(ckpt_root):
        if s > step:
            dest = ckpt_root / SUPERSEDED_SUBDIR / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            dest.parent.mkdir(exist_ok=True)
            shutil.move(str(path), str(dest))
            moved.append(dest)
    return moved


def shared_run_dir(
    recipe: RecipeSection,
    checkpoint: CheckpointSection,
    identity: dict[str, Any] | None = None,
    notes: list[tuple[int, str]] | None = None,
) -> Path:
    """:func:`choose_run_dir` on rank 0, broadcast to every rank, created. Collective (``notes``: rank 0).

    Raises ``UserInputError`` on every rank, before anything is written, when the directory holds another
    run's outputs and this run does not resume it (:func:`check_run_dir_is_ours`, decided on rank 0).
    """
    chosen: list[str | None] = [None, None]  # the directory, the refusal
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = choose_run_dir(recipe, checkpoint, identity, notes)
        try:
            check_run_dir_is_ours(path, checkpoint)
        except UserInputError as e:
            chosen[1] = str(e)
        chosen[0] = str(path)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    if chosen[1] is not None:
        raise UserInputError(chosen[1])
    path = Path(chosen[0])
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return path
