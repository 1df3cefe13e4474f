"""Is a checkpoint from this model? A model signature written at save and compared at load.

A checkpoint directory holds ``model_signature.json``: the model's config class and every
parameter's name and global shape (FSDP2 / DTensor parameters report their unsharded shape, so the
signature does not depend on the parallel layout). Resuming a run whose model differs (another
``hidden_size``, another number of layers, another architecture) then fails before any state is
read, with a :class:`automodel.errors.UserInputError` that names the first differences, instead of
a shape error deep inside ``torch.distributed.checkpoint`` on every rank.

Checkpoints written before this file existed have no signature; they load as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from automodel.errors import UserInputError

__all__ = [
    "SIGNATURE_FILE",
    "model_signature",
    "write_model_signature",
    "signature_differences",
    "check_model_signature",
]

SIGNATURE_FILE = "model_signature.json"
# Wrappers that insert a path component without changing the parameter (torch.compile, checkpoint_wrapper).
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_MAX_LISTED = 5


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def model_signature(model: torch.nn.Module) -> dict[str, Any]:
    """``{"config_class": str | None, "params": {name: [global shape]}}`` of ``model``.

    ``config_class`` is the class name of ``model.config`` (transformers models), else None.
    Shapes are the full (unsharded) ones for FSDP2 / DTensor parameters. Reads metadata only.
    """
    config = getattr(model, "config", None)
    return {
        "config_class": type(config).__name__ if config is not None else None,
        "params": {_clean(n): list(p.shape) for n, p in model.named_parameters()},
    }


def write_model_signature(checkpoint_dir: str | Path, model: torch.nn.Module) -> Path:
    """Write ``model``'s signature to ``<checkpoint_dir>/model_signature.json``; return the path.

    Call on one rank (it writes one small file); ``checkpoint_dir`` must exist.
    """
    path = Path(checkpoint_dir) / SIGNATURE_FILE
    path.write_text(json.dumps(model_signature(model), indent=1))
    return path


def signature_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two signatures, in words (empty: compatible)."""
    problems: list[str] = []
    if saved.get("config_class") and current.get("config_class") and saved["config_class"] != current["config_class"]:
        problems.append(f"model config class {saved['config_class']} in the checkpoint, {current['config_class']} now")
    old, new = saved.get("params", {}), current.get("params", {})
    shapes = [f"{n}: {old[n]} in the checkpoint, {new[n]} now" for n in new if n in old and old[n] != new[n]]
    missing = [n for n in new if n not in old]
    extra = [n for n in old if n not in new]

    def listed(what: str, items: list[str]) -> None:
        if items:
            more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
            problems.append(f"{what}: " + "; ".join(items[:_MAX_LISTED]) + more)

    listed("parameter shapes differ", shapes)
    listed("parameters missing from the checkpoint", missing)
    listed("parameters in the checkpoint that the model lacks", extra)
    return problems


def check_model_signature(checkpoint_dir: str | Path, model: torch.nn.Module) -> None:
    """Raise :class:`UserInputError` if the checkpoint at ``checkpoint_dir`` was written by another model.

    Does nothing for a checkpoint without ``model_signature.json`` (written before signatures existed).
    Every rank may call it (it only reads one file); no collective.
    """
    path = Path(checkpoint_dir) / SIGNATURE_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserInputError(
            f"{path} cannot be read ({e}); the checkpoint {checkpoint_dir} is damaged: resume from another "
            f"checkpoint (checkpoint.resume_from=<step_N directory>) or start fresh (checkpoint.resume=false)"
        ) from e
    problems = signature_differences(saved, model_signature(model))
    if problems:
        raise UserInputError(
            f"checkpoint {checkpoint_dir} was written by a different model than this run builds: "
            + " | ".join(problems)
            + ". Resume with the model config of the run that wrote it (its config.yaml is in the run "
            "directory), or start fresh: checkpoint.resume=false, or another recipe.output_dir / checkpoint.dir"
        )
