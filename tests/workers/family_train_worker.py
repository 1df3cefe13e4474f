"""A few recipe training steps of each family's tiny config on 2 gloo ranks, FSDP2 on (issue 41).

Each config is a recipe config written by :func:`tests.test_plan_families.family_config` (``configs/cp.yaml`` with
the family's ``model.config``, its attention implementation and the default ``loss.chunk_tokens: auto``), trained
through :class:`~automodel.training.trainer.FinetuneTrainer` at ``distributed.cp_size=1`` (so ``dp_shard`` = 2:
FSDP2 over both ranks) for :data:`STEPS` steps. Families run one after the other in the one launch; a family
whose run raises on every rank is recorded and the next one runs (an error on one rank only would leave the other
waiting: the launch's timeout catches that, and scripts/family_sweep.py reruns that batch one family per launch).
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path

from automodel.config import load_config
from automodel.errors import UserInputError
from automodel.training.trainer import FinetuneTrainer

STEPS = 2
OVERRIDES = [
    "distributed.cp_size=1",  # dp_shard -1: FSDP2 over the 2 ranks
    "model.dtype=float32",
    "fsdp.param_dtype=float32",
    "data.seq_len=64",
    "step_scheduler.global_batch_size=2",
    "step_scheduler.local_batch_size=1",
    f"step_scheduler.max_steps={STEPS}",
    "step_scheduler.val_every_steps=null",
    "step_scheduler.ckpt_every_steps=null",
    "lr_scheduler.warmup_steps=1",
    "checkpoint.save_final=false",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
    "recipe.cp_self_check=false",
]


def train_one(name: str, config: str, out: Path, world_size: int, extra: tuple[str, ...] = ()) -> dict:
    """``{"status": "trained" | "refused" | "crashed", ...}`` for one family's config (every rank returns its own)."""
    argv = ["--config", config, *OVERRIDES, f"recipe.output_dir={out / name.replace('@', '_')}", *extra]
    try:
        trainer = FinetuneTrainer(load_config(argv, world_size=world_size))
        result = trainer.run()
    except UserInputError as e:  # what the recipe prints as one error: line
        return {"status": "refused", "reason": str(e).splitlines()[0]}
    except Exception as e:  # noqa: BLE001 - recorded per family: the sweep reports every crash
        return {"status": "crashed", "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                "traceback": traceback.format_exc()[-4000:]}  # fmt: skip
    losses = dict(result.losses)
    fsdp = type(trainer.model).__name__.startswith("FSDP")
    finite = bool(losses) and all(math.isfinite(v) for v in losses.values())
    status = "trained" if sorted(losses) == list(range(1, STEPS + 1)) and finite and fsdp else "crashed"
    return {"status": status, "losses": losses, "fsdp2": fsdp, "chunk_tokens": trainer.cfg.loss.chunk_tokens,
            **({} if status == "trained" else {"error": f"losses {losses}, FSDP2 {fsdp}"})}  # fmt: skip


def main(rank: int, world_size: int, configs: list[tuple[str, str]], out: str, extra: tuple[str, ...] = ()) -> dict:
    """Train each ``(name, config path)`` in turn; returns name -> :func:`train_one`'s answer."""
    return {name: train_one(name, config, Path(out), world_size, tuple(extra)) for name, config in configs}
