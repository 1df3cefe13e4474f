"""Sharded training checkpoints: model, optimizer, LR scheduler, data position, RNG.

Layout of one checkpoint ``<checkpoint dir>/step_<N>/``:

- ``.metadata`` + ``__*.distcp``: model and optimizer state, sharded by
  ``torch.distributed.checkpoint`` (each rank writes its FSDP shards; loads reshard).
- ``rank_<r>.pt``: the LR scheduler, step counter and dataloader position (identical on all
  ranks, kept with each for simplicity) and this rank's RNG states.
- ``meta.json``: step, the parallel layout, the global batch size and the LR schedule, written (and
  fsynced) after every rank has finished its files.
- ``manifest.json``: every other file's size and sha256, written last (atomically), the completion
  record: a resume verifies the checkpoint against it before any rank reads it, and skips or names a
  damaged one (:mod:`automodel.training.checkpoint_manifest`,
  :func:`automodel.training.resume_policy.select_resume_checkpoint`).

Crash safety: a checkpoint is written to ``step_<N>.tmp``; after every rank has finished, rank 0
writes ``meta.json`` into it, all ranks hash the files, rank 0 writes ``manifest.json`` and renames
the directory to ``step_<N>`` (an atomic rename on one file system),
then fsyncs the directory. A process killed at any point (SIGKILL mid-write included) leaves at most
a ``*.tmp`` directory, which :func:`list_checkpoints` ignores and the next successful save deletes;
``keep_last`` pruning runs only after the new checkpoint is complete, so the newest complete
checkpoint is never deleted before its successor exists.

Elastic resume: a checkpoint resumes at another layout (world size, dp, cp): the model and
optimizer are resharded by ``torch.distributed.checkpoint``, the scheduler and data position come
from rank 0's file (the data position mapped to the new batch split or refused), and the RNG is
reseeded per step by the trainer (see :mod:`automodel.training.elastic`). At the same layout each
rank also restores its own RNG states.

:class:`SigtermFlag` turns SIGTERM (sent by torchrun / SLURM on preemption) into a flag that the
loop checks after each step, on all ranks at once, to save a checkpoint and stop cleanly.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from automodel.errors import UserInputError
from automodel.training.checkpoint_compat import check_model_signature, write_model_signature
from automodel.training.checkpoint_manifest import MANIFEST_FILE, fsync_dir, gather_group, write_manifest
from automodel.training.elastic import check_resume_compatible, warn_if_dropout
from automodel.training.optimizer_offload import HostOffloadOptimizer

__all__ = [
    "CheckpointLayout",
    "Checkpointer",
    "list_checkpoints",
    "latest_checkpoint",
    "read_meta",
    "PAUSE_ENV",
    "get_rng_state",
    "set_rng_state",
    "SigtermFlag",
]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_SUFFIX = ".tmp"
# Test-only: "<step>:<rank>:<marker file>" makes that rank, while saving that step, write its pid to
# the marker file after its model/optimizer shards and before its rank file, then sleep (the crash
# test SIGKILLs it there).
PAUSE_ENV = "AUTOMODEL_TEST_PAUSE_IN_CHECKPOINT_SAVE"


@dataclass(frozen=True)
class CheckpointLayout:
    """The parallel layout a checkpoint was written with (another one may resume it: elastic)."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    def describe(self) -> str:
        return (
            f"world_size={self.world_size} (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, "
            f"cp={self.cp}, tp={self.tp})"
        )


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "meta.json").is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _maybe_pause_for_test(step: int, rank: int) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    at_step, at_rank, marker = spec.split(":", 2)
    if int(at_step) == step and int(at_rank) == rank:
        Path(marker).write_text(str(os.getpid()))
        logger.warning("%s: paused in the save of step %d (pid %d)", PAUSE_ENV, step, os.getpid())
        time.sleep(600)


def read_meta(path: str | Path) -> dict[str, Any]:
    """``meta.json`` of a complete checkpoint directory.

    Raises:
        UserInputError: ``path`` is missing or not a complete checkpoint (no ``meta.json``: an
            interrupted save, or not a checkpoint at all).
    """
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        found = latest_checkpoint(path.parent) if path.parent.is_dir() else None
        hint = f" (the newest complete one there is {found})" if found is not None else ""
        raise UserInputError(
            f"{path} is not a complete checkpoint (no meta.json: missing, or a save that was interrupted)"
            f"{hint}; point checkpoint.resume_from at a step_<N> directory written by this recipe, or use "
            f"checkpoint.resume=auto to pick the newest complete one"
        )
    try:
        meta = json.loads(meta_file.read_text())
        if not isinstance(meta, dict) or "step" not in meta:
            raise ValueError("not a mapping with a step")
    except (OSError, ValueError) as e:
        raise UserInputError(
            f"{meta_file} cannot be read ({type(e).__name__}: {e}): the checkpoint {path} is damaged; resume "
            f"from another one (checkpoint.resume_from=<step_N directory>, or checkpoint.resume=auto, which "
            f"skips damaged checkpoints)"
        ) from e
    return meta


def get_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU (and CUDA, if used) RNG states of this process."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Save / load sharded checkpoints under ``root`` (a directory shared by all ranks).

    All methods are collective: every rank calls them with its own objects. ``trainable_only``
    (PEFT adapters): model state holds only parameters with ``requires_grad``; the frozen ones are
    rebuilt from the model's source on resume.
    """

    def __init__(
        self,
        root: str | Path,
        layout: CheckpointLayout,
        keep_last: int | None = None,
        trainable_only: bool = False,
        global_batch_size: int | None = None,
        schedule: dict[str, Any] | None = None,
    ):
        self.schedule = schedule  # recorded in meta.json: a resume compares it (training.resume_policy)
        self.root = Path(root)
        self.layout = layout
        self.keep_last = keep_last
        self.trainable_only = trainable_only
        self.global_batch_size = global_batch_size  # recorded; a resume must keep it

    def _sd_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # not strict with adapters only: the frozen weights are absent from the state dict on purpose
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def _state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's state dicts, keyed by parameter name. An offloaded optimizer
        (``fsdp.offload=optimizer``) gives its host state through a view over the model's parameters: the same
        keys and shards as without offload (the tensors are its own, so a load fills them in place)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if isinstance(optimizer, HostOffloadOptimizer):
            optimizer = optimizer.model_view()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=self._sd_options())
        if self.trainable_only:  # ignore_frozen_params keeps the second name of a tied frozen weight
            frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
        return model_sd, optim_sd

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        dataloader: Any,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write checkpoint ``step_<step>`` crash-safely (see the module docstring); return its path.

        Collective. On success, stale ``*.tmp`` directories of interrupted saves are deleted and
        ``keep_last`` is applied."""
        import torch.distributed.checkpoint as dcp

        rank = dist.get_rank()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}{_TMP_SUFFIX}"
        t0 = time.perf_counter()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = self._state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        _maybe_pause_for_test(step, rank)
        rank_file = tmp / f"rank_{rank}.pt"
        torch.save(
            {
                "step": step,
                "scheduler": scheduler.state_dict(),
                "dataloader": dataloader.state_dict() if hasattr(dataloader, "state_dict") else None,
                "rng": get_rng_state(),
                "extra": extra or {},
            },
            rank_file,
        )
        with open(rank_file, "rb") as fh:
            os.fsync(fh.fileno())
        dist.barrier()
        if rank == 0:
            write_model_signature(tmp, model)  # checked at load (checkpoint_compat): same model?
            meta = {
                "step": step,
                "layout": self.layout.__dict__,
                "global_batch_size": self.global_batch_size,
                "trainable_only": self.trainable_only,
                "schedule": self.schedule,
                "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "manifest": MANIFEST_FILE,  # written last: a checkpoint without it is incomplete
            }
            _write_synced(tmp / "meta.json", json.dumps(meta, indent=2))
        dist.barrier()
        t_hash = time.perf_counter()
        write_manifest(tmp, gather_group())  # every file's size and sha256, hashed by all ranks; rank 0 writes it
        t_hash = time.perf_counter() - t_hash
        if rank == 0:
            fsync_dir(tmp)
            if final.exists():  # the same step saved again (resumed from an older one): swap, then delete
                aside = self.root / f"step_{step}.replaced{_TMP_SUFFIX}"
                if aside.exists():
                    shutil.rmtree(aside)
                final.rename(aside)
            tmp.rename(final)
            fsync_dir(self.root)
            self._clean_incomplete()
            self._prune(keep=final)
        dist.barrier()
        logger.info(
            "saved checkpoint %s in %.1fs (manifest %.1fs)", final, time.perf_counter() - t0, t_hash
        )
        return final

    def _clean_incomplete(self) -> None:
        """Delete ``*.tmp`` directories: saves interrupted by a crash (called after a complete save)."""
        for p in self.root.iterdir():
            if p.name.endswith(_TMP_SUFFIX) and p.name.startswith("step_") and p.is_dir():
                logger.info("deleting %s: an interrupted checkpoint save", p)
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        """Keep the ``keep_last`` highest-step complete checkpoints, and always ``keep`` (the one just
        written; called after it is complete)."""
        found = list_checkpoints(self.root)
        keep_step = int(_STEP_DIR.match(keep.name).group(1))
        later = [p.name for step, p in found if step > keep_step]
        if later:
            logger.warning(
                "%s holds checkpoints of later steps than %s (%s, from before this run resumed an older "
                "one); checkpoint.resume=true|auto picks the highest step: delete them to continue from "
                "this run",
                self.root,
                keep.name,
                ", ".join(later),
            )
        if self.keep_last is None:
            return
        for _, path in found[: -self.keep_last]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(
        self,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        dataloader: Any,
    ) -> dict[str, Any]:
        """Restore everything from checkpoint directory ``path``; return the payload it restored.

        The layout may differ from the one the checkpoint was written with (elastic resume, see
        the module docstring); the checks that can refuse run before the checkpoint's weights are
        read. Mutates ``model``, ``optimizer``, ``scheduler``, ``dataloader`` and, at the same
        layout, the RNGs.

        Raises:
            UserInputError: ``path`` is not a complete checkpoint, or it cannot continue the run
                exactly at this layout (another global batch size, seed or data; a data position
                that does not map to the new batch split). The message names both layouts.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        path = Path(path)
        meta = read_meta(path)
        check_model_signature(path, model)  # a checkpoint of another model: UserInputError, before any read
        saved = CheckpointLayout(**meta["layout"])
        same_layout = saved == self.layout
        check_resume_compatible(path, meta, saved.describe(), self.layout.describe(), self.global_batch_size)
        if bool(meta.get("trainable_only", False)) != self.trainable_only:
            what = {True: "adapters only (a peft run)", False: "the whole model"}
            raise UserInputError(
                f"checkpoint {path} holds {what[bool(meta.get('trainable_only', False))]} but this run saves "
                f"{what[self.trainable_only]}; resume with the peft section the checkpoint was written with"
            )
        rank = dist.get_rank()
        # per-rank RNG states only mean something at the same layout; the rest is the same on every rank
        payload = torch.load(path / f"rank_{rank if same_layout else 0}.pt", weights_only=False)
        if payload["dataloader"] is not None and hasattr(dataloader, "load_state_dict"):
            try:
                dataloader.load_state_dict(payload["dataloader"])
            except ValueError as e:
                raise UserInputError(
                    f"checkpoint {path} ({saved.describe()}) cannot be resumed exactly with "
                    f"{self.layout.describe()}: {e}"
                ) from e
        scheduler.load_state_dict(payload["scheduler"])
        model_sd, optim_sd = self._state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))  # reshards to this layout
        if isinstance(optimizer, HostOffloadOptimizer):  # its state tensors were loaded in place (host)
            set_model_state_dict(model, state["model"], options=self._sd_options())
            optimizer.load_param_groups(state["optim"]["param_groups"])
            optimizer.sync_from_model()  # the host copies of the parameters: the loaded weights
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=self._sd_options(),
            )
        if same_layout:
            set_rng_state(payload["rng"])
        dist.barrier()
        if same_layout:
            logger.info("resumed from %s (step %d)", path, payload["step"])
        else:
            logger.info(
                "resumed from %s (step %d) written with %s, now %s (elastic resume)",
                path,
                payload["step"],
                saved.describe(),
                self.layout.describe(),
            )
            warn_if_dropout(model, saved.describe(), self.layout.describe())
        return payload


class SigtermFlag:
    """Catch SIGTERM while active; :meth:`should_stop` agrees across ranks whether any got one.

    Use as a context manager around the training loop; the previous handler is restored on exit.
    A second SIGTERM while the flag is already set is passed to the previous handler (so an
    impatient second signal still terminates).
    """

    def __init__(self) -> None:
        self.received = False
        self._logged = False
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received and callable(self._previous):
            self._previous(signum, frame)
            return
        self.received = True  # logged where the ranks act on it (should_stop): a launcher stopping the
        # survivors of a lost rank sends SIGTERM too, and those never get to act on it

    def __enter__(self) -> SigtermFlag:
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        except ValueError:  # not the main thread: cannot install handlers
            logger.warning("not in the main thread: SIGTERM will not trigger a checkpoint")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def should_stop(self, device: torch.device) -> bool:
        """True on every rank if any rank received SIGTERM. Collective (one tiny all-reduce)."""
        flag = torch.tensor([1 if self.received else 0], device=device, dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
        if stop and not self._logged:
            self._logged = True
            logger.warning("SIGTERM received: checkpointing and stopping after this step")
        return stop
