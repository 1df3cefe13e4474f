"""configs/cp_packed.yaml as shipped (cp_method=thd_docs) in the recipe at several cp sizes (see
tests/test_doc_recipe.py): only the step count (with a warmup that fits in it: a warmup longer than the
run is refused), the output directory and what the run writes are overridden, so the rows, the model
and the CP self-check (on at cp > 1) are the shipped ones."""

from __future__ import annotations

from pathlib import Path

from automodel.config import load_config
from automodel.training.trainer import FinetuneTrainer

PACKED_CFG = "configs/cp_packed.yaml"
RUN = [
    "step_scheduler.max_steps=8",
    "lr_scheduler.warmup_steps=2",
    "checkpoint.save_final=false",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
]


def shipped(rank: int, world_size: int, out: str) -> dict:
    """cp_size = world_size; per-step losses, the first rows' documents and the self-check figures."""
    name = f"cp{world_size}"
    argv = ["--config", PACKED_CFG, f"distributed.cp_size={world_size}", f"recipe.output_dir={Path(out) / name}", *RUN]
    trainer = FinetuneTrainer(load_config(argv, world_size=world_size))
    result = trainer.run()
    rows = [trainer.train_dataset[i] for i in range(4)]
    check = Path(result.run_dir) / "cp_self_check.json"
    logs = sorted((Path(result.run_dir) / "logs").glob("rank_0*.log"))
    lines = [line for p in logs for line in p.read_text().splitlines()]
    world = [line for line in lines if "world " in line]
    return {
        "losses": dict(result.losses),
        "grad_norms": dict(result.grad_norms),
        "cp_method": trainer.cfg.distributed.cp_method,
        "attn_impl": trainer.model.config._attn_implementation,
        "rows": [{k: v.tolist() for k, v in row.items()} for row in rows],
        "self_check": check.read_text() if rank == 0 and check.exists() else None,
        "world_line": next((line for line in world if "cp_method" in line), None),  # the run's first CP log line
        "profile_line": next((line for line in lines if "model profile: " in line), None),
        "method_line": next((line for line in lines if ": cp_method " in line), None),  # the method and why
    }
