"""Which run a resume continues, and what it may change: the config identity and the LR schedule.

**Config identity.** A run directory records ``run_identity.json``: the keys that make a run *that*
run (model, data, tokenizer, seed, global batch, optimizer but its lr, clipping, loss-free keys
aside, peft, the recipe name) and their hash. Left out: what may change on a resume without changing
the run (the parallel layout, local batch size, logging, export, checkpoint keys, activation
checkpointing, compile, the tiled MLP) and the schedule keys, which are checked on their own (below).

``checkpoint.resume=true|auto`` without a run directory (``recipe.output_dir``) or a checkpoint
(``checkpoint.resume_from`` / ``checkpoint.dir``) continues the newest run under
``<output_root>/<name>/`` that has a complete checkpoint **and the same config hash**; every other
run found is named with the reason it was passed over (the keys that differ). A run directory given
explicitly is resumed as given (with a note when its identity differs).

**Schedule.** Each checkpoint records the schedule it was written with (``step_scheduler.max_steps``,
``optimizer.lr``, the ``lr_scheduler`` node). A resume with another schedule is refused with the keys,
the values and the lr the next step would jump to, unless ``checkpoint.allow_schedule_change=true``:
then the new schedule is applied from the resumed step on (the new base lr included) and logged.

**Which checkpoint.** :func:`select_resume_checkpoint` verifies checkpoints against their manifests
(:mod:`automodel.training.checkpoint_manifest`) before any rank reads them: ``resume=true|auto``
takes the newest good one, skipping a damaged one with one warning naming it and the damaged file;
an explicit ``resume_from`` of a damaged checkpoint is a :class:`~automodel.errors.UserInputError`
naming the file and the newest good checkpoint beside it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from automodel.errors import UserInputError
from automodel.training.checkpoint import list_checkpoints
from automodel.training.checkpoint_manifest import MANIFEST_FILE, gather_group, verify_checkpoint

__all__ = [
    "IDENTITY_FILE",
    "run_identity",
    "identity_hash",
    "identity_diff",
    "write_run_identity",
    "read_run_identity",
    "schedule_of",
    "schedule_diff",
    "check_schedule_change",
    "apply_schedule",
    "check_resume_schedule",
    "select_resume_checkpoint",
]

logger = logging.getLogger(__name__)

IDENTITY_FILE = "run_identity.json"

# model keys that change how, not what, is trained
_MODEL_NOT_IDENTITY = (
    "activation_checkpointing", "activation_offload", "compile", "compile_backend", "attn_implementation", "tiled_mlp",
    "tiled_layer", "attention_head_chunks", "checkpoint_group_layers",
)


def run_identity(effective: dict[str, Any]) -> dict[str, Any]:
    """The identity-defining part of an effective config (see the module docstring): a plain mapping."""
    e = copy.deepcopy(effective)
    optimizer = {k: v for k, v in (e.get("optimizer") or {}).items() if k != "lr"}
    model = {k: v for k, v in (e.get("model") or {}).items() if k not in _MODEL_NOT_IDENTITY}
    data = {k: v for k, v in (e.get("data") or {}).items() if k != "pad_to_multiple_of"}  # follows cp/tp
    return {
        "recipe": {"name": e["recipe"]["name"], "seed": e["recipe"]["seed"]},
        "model": model,
        "data": data,
        "global_batch_size": e["step_scheduler"]["global_batch_size"],
        "optimizer": optimizer,
        "clip_grad": e.get("clip_grad"),
        "peft": e.get("peft"),
    }


def identity_hash(identity: dict[str, Any]) -> str:
    """A short stable hash of an identity mapping (16 hex digits)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def identity_diff(a: dict[str, Any], b: dict[str, Any], limit: int = 4) -> str:
    """The keys whose values differ between two identities, in words (``data.seq_len: 128 -> 256``)."""
    fa, fb = _flatten(a), _flatten(b)
    keys = sorted(k for k in set(fa) | set(fb) if fa.get(k) != fb.get(k))
    shown = [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in keys[:limit]]
    return ", ".join(shown) + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")


def write_run_identity(run_dir: Path, identity: dict[str, Any]) -> None:
    """Write ``run_dir/run_identity.json`` (rank 0)."""
    payload = {"config_hash": identity_hash(identity), "identity": identity}
    (run_dir / IDENTITY_FILE).write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))


def read_run_identity(run_dir: Path) -> dict[str, Any] | None:
    """``{config_hash, identity}`` of a run directory, or None when it has none (or it is unreadable)."""
    try:
        return json.loads((run_dir / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None


# ------------------------------------------------------------------ schedule


def schedule_of(effective: dict[str, Any]) -> dict[str, Any]:
    """``{max_steps, lr, lr_scheduler}`` of an effective config (what a checkpoint records)."""
    return {
        "max_steps": effective["step_scheduler"]["max_steps"],
        "lr": (effective.get("optimizer") or {}).get("lr"),
        "lr_scheduler": copy.deepcopy(effective.get("lr_scheduler")),
    }


_SCHEDULE_KEYS = {"max_steps": "step_scheduler.max_steps", "lr": "optimizer.lr", "lr_scheduler": "lr_scheduler"}


def schedule_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``["step_scheduler.max_steps: 40 -> 60", ...]`` for every schedule key that changed."""
    out = []
    for key, name in _SCHEDULE_KEYS.items():
        if key == "lr_scheduler":
            fa, fb = _flatten(saved.get(key) or {}, name), _flatten(current.get(key) or {}, name)
            out += [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
        elif saved.get(key) != current.get(key):
            out.append(f"{name}: {saved.get(key)!r} -> {current.get(key)!r}")
    return out


def check_schedule_change(
    path: Path,
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    allow: bool,
    step: int,
    lr_jump: tuple[float, float] | None = None,
) -> list[str]:
    """Refuse (or, with ``allow``, return) the schedule changes between a checkpoint and this run.

    Args:
        path: the checkpoint (for the message).
        saved: the schedule in its ``meta.json`` (None: a checkpoint that recorded none: not checked).
        current: this run's :func:`schedule_of`.
        allow: ``checkpoint.allow_schedule_change``.
        step: the checkpoint's step (the next step is ``step + 1``).
        lr_jump: ``(lr the old schedule gives step + 1, lr the new one gives it)`` when known.

    Returns:
        the changes in words (empty: none).

    Raises:
        UserInputError: there are changes and ``allow`` is false.
    """
    if saved is None:
        return []
    changes = schedule_diff(saved, current)
    if changes and not allow:
        jump = ""
        if lr_jump is not None:
            jump = f"; step {step + 1} would train at lr {lr_jump[1]:.4g} where the checkpointed run continues at {lr_jump[0]:.4g}"
        raise UserInputError(
            f"checkpoint {path} (step {step}) was written with another LR schedule: {'; '.join(changes)}{jump}. "
            "Resume with the checkpoint's values, or set checkpoint.allow_schedule_change=true to continue "
            "with the new schedule from this step on"
        )
    return changes


def apply_schedule(optimizer: torch.optim.Optimizer, scheduler: Any, lr: float | None) -> None:
    """After loading a checkpoint: make ``scheduler`` (a ``LambdaLR`` built for this run) follow this
    run's base lr ``lr`` from its restored step on. Mutates the optimizer's param groups and the scheduler
    (``load_state_dict`` restored the checkpoint's base lrs; the lambdas are this run's)."""
    if lr is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [float(lr)] * len(optimizer.param_groups)
        for group in optimizer.param_groups:
            group["initial_lr"] = float(lr)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is None:
        return
    step = scheduler.last_epoch
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def check_resume_schedule(path: Path, effective: dict[str, Any], scheduler: Any, allow: bool) -> list[str]:
    """:func:`check_schedule_change` for checkpoint ``path`` against this run (``effective`` config and its
    freshly built ``scheduler``), with the lr jump of the next step in the refusal. Read-only."""
    from automodel.training.checkpoint import read_meta

    meta = read_meta(path)
    saved, current = meta.get("schedule"), schedule_of(effective)
    if saved is None or not schedule_diff(saved, current):
        return []
    step, jump = int(meta["step"]), None
    lambdas = getattr(scheduler, "lr_lambdas", None)
    try:
        old = torch.load(Path(path) / "rank_0.pt", weights_only=False)["scheduler"]["_last_lr"][0]
        if lambdas and current["lr"] is not None:
            jump = (float(old), float(current["lr"]) * lambdas[0](step))
    except (OSError, KeyError, IndexError, TypeError):
        jump = None
    return check_schedule_change(Path(path), saved, current, allow, step, jump)


# ------------------------------------------------------------------ which checkpoint


def _is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _unverified_warning(path: Path) -> None:
    if _is_rank0():
        logger.warning(
            "checkpoint %s has no %s (written before checkpoints recorded their files): it cannot be "
            "verified, resuming from it as is",
            path,
            MANIFEST_FILE,
        )


def _rank0_view(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` on every rank (what it sees of the file system decides, so that every rank
    runs the same collectives even if a shared file system shows ranks different things). Collective."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return value


def _candidates(root: Path, group: Any) -> list[Path]:
    """The complete checkpoints under ``root``, newest first, as rank 0 sees them. Collective."""
    return [Path(p) for p in _rank0_view([str(p) for _, p in reversed(list_checkpoints(root))], group)]


def _newest_good(root: Path, exclude: Path | None, group: Any) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under ``root`` (not ``exclude``) that verifies, and the damaged ones
    passed over (in words). Collective."""
    passed = []
    for path in _candidates(root, group):
        if exclude is not None and path.resolve() == exclude.resolve():
            continue
        _, damage = verify_checkpoint(path, group)
        if damage is None:
            return path, passed
        passed.append(f"{path.name}: {damage.describe()}")
    return None, passed


def select_resume_checkpoint(
    root: str | Path, resume_from: str | Path | None, group: Any = None
) -> Path | None:
    """The checkpoint a run resumes, verified (see the module docstring); None: no checkpoint at all.

    Args:
        root: the run's checkpoint directory (``checkpoint.resume=true|auto``).
        resume_from: ``checkpoint.resume_from`` (wins over ``root``), or None.
        group: the process group of the verdicts' gather (a gloo group under NCCL; None: default).

    Collective: every rank calls it with the same arguments; every rank gets the same answer or the
    same error. Logs (rank 0) one warning per damaged checkpoint skipped, and one for a checkpoint
    that cannot be verified.

    Raises:
        UserInputError: ``resume_from`` is damaged (the message names the file and the newest good
            checkpoint beside it), or every checkpoint under ``root`` is damaged.
    """
    group = gather_group() if group is None else group
    if resume_from is not None:
        path = Path(resume_from)
        if not _rank0_view((path / "meta.json").exists() or (path / MANIFEST_FILE).exists(), group):
            return path  # not a checkpoint at all (or an interrupted save): read_meta says so in one line
        has_manifest, damage = verify_checkpoint(path, group)
        if damage is None:
            if not has_manifest:
                _unverified_warning(path)
            return path
        good, _ = _newest_good(path.parent, path, group)
        advice = (
            f"the newest good checkpoint is {good}: resume with checkpoint.resume_from={good} (or "
            f"checkpoint.resume=auto, which skips damaged checkpoints)"
            if good is not None
            else f"no good checkpoint is left in {path.parent}: start fresh with checkpoint.resume=false"
        )
        raise UserInputError(f"checkpoint {path} is damaged: {damage.describe()}; {advice}")
    root = Path(root)
    passed = []
    for path in _candidates(root, group):
        has_manifest, damage = verify_checkpoint(path, group)
        if damage is None:
            if not has_manifest:
                _unverified_warning(path)
            return path
        passed.append(f"{path.name}: {damage.describe()}")
        if _is_rank0():
            logger.warning(
                "checkpoint %s is damaged (%s): skipped; trying the next older checkpoint",
                path,
                damage.describe(),
            )
    if passed:
        raise UserInputError(
            f"every checkpoint under {root} is damaged ({'; '.join(passed)}); nothing to resume: start fresh "
            f"with checkpoint.resume=false (in another recipe.output_dir to keep these files)"
        )
    return None
