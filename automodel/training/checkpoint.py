"""Sharded training checkpoints: model, optimizer, LR scheduler, data position, RNG.

Layout of one checkpoint ``<checkpoint dir>/step_<N>/``:

- ``.metadata`` + ``__*.distcp``: model and optimizer state, sharded by
  ``torch.distributed.checkpoint`` (each rank writes its FSDP shards; loads reshard).
- ``rank_<r>.pt``: what differs per rank: dataloader position, RNG states, and the LR scheduler
  and step counter (identical on all ranks, kept with each for simplicity).
- ``meta.json``: step and the parallel layout. Written last: a directory without it is incomplete.

A checkpoint is written to ``step_<N>.tmp`` and renamed by rank 0 after every rank has finished,
so a crash mid-save never leaves a directory that looks complete. The per-rank state requires
resuming with the same layout (world size, dp, cp); the error says so.

:class:`SigtermFlag` turns SIGTERM (sent by torchrun / SLURM on preemption) into a flag that the
loop checks after each step, on all ranks at once, to save a checkpoint and stop cleanly.
"""

from __future__ import annotations

import json
import logging
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

from automodel.training.checkpoint_compat import check_model_signature, write_model_signature

__all__ = [
    "CheckpointLayout",
    "Checkpointer",
    "list_checkpoints",
    "latest_checkpoint",
    "get_rng_state",
    "set_rng_state",
    "SigtermFlag",
]

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointLayout:
    """The parallel layout a checkpoint was written with (resume needs the same one)."""

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
    ):
        self.root = Path(root)
        self.layout = layout
        self.keep_last = keep_last
        self.trainable_only = trainable_only

    def _sd_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # not strict with adapters only: the frozen weights are absent from the state dict on purpose
        return StateDictOptions(ignore_frozen_params=self.trainable_only, strict=not self.trainable_only)

    def _state_dicts(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

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
        """Write checkpoint ``step_<step>``; return its path. Collective."""
        import torch.distributed.checkpoint as dcp

        rank = dist.get_rank()
        final = self.root / f"step_{step}"
        tmp = self.root / f"step_{step}.tmp"
        t0 = time.perf_counter()
        if rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = self._state_dicts(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(
            {
                "step": step,
                "scheduler": scheduler.state_dict(),
                "dataloader": dataloader.state_dict() if hasattr(dataloader, "state_dict") else None,
                "rng": get_rng_state(),
                "extra": extra or {},
            },
            tmp / f"rank_{rank}.pt",
        )
        dist.barrier()
        if rank == 0:
            write_model_signature(tmp, model)  # checked at load (checkpoint_compat): same model?
            meta = {"step": step, "layout": self.layout.__dict__, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
            meta["trainable_only"] = self.trainable_only
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            self._prune()
        dist.barrier()
        logger.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for _, path in list_checkpoints(self.root)[: -self.keep_last]:
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
        """Restore everything from checkpoint directory ``path``; return its per-rank payload.

        Raises:
            ValueError: ``path`` is not a complete checkpoint, or it was written with another
                parallel layout.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        meta_file = path / "meta.json"
        if not meta_file.is_file():
            raise ValueError(
                f"{path} is not a complete checkpoint (no meta.json); point checkpoint.resume_from at a "
                f"step_<N> directory written by this recipe"
            )
        meta = json.loads(meta_file.read_text())
        check_model_signature(path, model)  # a checkpoint of another model: UserInputError, before any read
        saved = CheckpointLayout(**meta["layout"])
        if saved != self.layout:
            raise ValueError(
                f"checkpoint {path} was written with {saved.describe()} but this run has "
                f"{self.layout.describe()}; resume with the same distributed sizes and number of processes "
                f"(the data position and RNG state are per rank)"
            )
        if bool(meta.get("trainable_only", False)) != self.trainable_only:
            what = {True: "adapters only (a peft run)", False: "the whole model"}
            raise ValueError(
                f"checkpoint {path} holds {what[bool(meta.get('trainable_only', False))]} but this run saves "
                f"{what[self.trainable_only]}; resume with the peft section the checkpoint was written with"
            )
        rank = dist.get_rank()
        model_sd, optim_sd = self._state_dicts(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._sd_options(),
        )
        payload = torch.load(path / f"rank_{rank}.pt", weights_only=False)
        scheduler.load_state_dict(payload["scheduler"])
        if payload["dataloader"] is not None and hasattr(dataloader, "load_state_dict"):
            dataloader.load_state_dict(payload["dataloader"])
        set_rng_state(payload["rng"])
        dist.barrier()
        logger.info("resumed from %s (step %d)", path, payload["step"])
        return payload


class SigtermFlag:
    """Catch SIGTERM while active; :meth:`should_stop` agrees across ranks whether any got one.

    Use as a context manager around the training loop; the previous handler is restored on exit.
    A second SIGTERM while the flag is already set is passed to the previous handler (so an
    impatient second signal still terminates).
    """

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received and callable(self._previous):
            self._previous(signum, frame)
            return
        self.received = True
        logger.warning("SIGTERM received: will checkpoint and stop after this step")

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
        return bool(flag.item())
