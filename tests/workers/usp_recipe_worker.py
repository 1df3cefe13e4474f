"""configs/cp_packed.yaml with ``cp_method: usp`` in the recipe on gloo ranks (see tests/test_usp.py).

``quad`` (4 ranks; run inside the simulated two-node launch of tests/workers/usp_worker.py): usp
cp=4 = ulysses 2 x ring 2 on packed rows (packed as at cp=1: usp's batch function pads each document
to 2*cp=8, with the CP self-check) and on plain rows, plus the dry run's report for 2 nodes x 2.
``single`` (1 rank): the same runs at cp=1, on the same packed rows (no padding by hand). The model has 6 query heads (Ulysses alone cannot split them over cp=4) and 3 KV heads (not
divisible by ulysses_size 2: replicated). Every run: recipe_worker's tiny fp32 overrides, 2 steps of 4 rows; the plain usp run with activation checkpointing
and offload (exact: its reference runs without them).
"""

from __future__ import annotations

from pathlib import Path

from tests.workers.recipe_worker import TINY, _run, _summary

PACKED_CFG = "configs/cp_packed.yaml"
MODEL = [
    "model.config.hidden_size=48",
    "model.config.num_attention_heads=6",
    "model.config.num_key_value_heads=3",
    "step_scheduler.max_steps=2",
    "step_scheduler.val_every_steps=2",
    "step_scheduler.val_max_batches=1",
    "step_scheduler.global_batch_size=4",  # grad_acc 2 at dp 1: half the micro-steps of recipe_worker's runs
]
PACKED = [*MODEL, "data.seq_len=256"]
PLAIN = [*MODEL, "data.dataset.pack=false", "data.seq_len=128"]
USP = ["distributed.cp_size=4", "distributed.cp_method=usp", "distributed.ulysses_size=2"]
# checkpointing with activation offload under FSDP2 on the plain run (issue 41: each observably on under usp too)
OFFLOAD = ["model.activation_checkpointing=true", "model.activation_offload=true"]


def _with_padding(trainer, result) -> dict:
    out = _summary(trainer, result)
    out["seq_pad_multiple"] = getattr(trainer.train_dataset, "seq_pad_multiple", None)
    return out


def quad(rank: int, world_size: int, out: str) -> dict:
    from automodel.config import load_config
    from automodel.training.dry_run import dry_run_report

    out_dir = Path(out)
    results = {
        "usp_packed": _with_padding(
            *_run(world_size, out_dir, "usp_packed", [*USP, *PACKED, "recipe.cp_self_check=true"], config=PACKED_CFG)
        ),
        "usp_plain": _with_padding(*_run(world_size, out_dir, "usp_plain", [*USP, *PLAIN, *OFFLOAD], config=PACKED_CFG)),
    }
    if rank == 0:
        argv = [
            "--config", PACKED_CFG, *TINY, *USP, *PACKED, f"recipe.output_dir={out_dir / 'dry'}",
            "recipe.dry_run=true", "recipe.plan_nnodes=2",
        ]  # fmt: skip
        results["dry_run"] = dry_run_report(load_config(argv, world_size=world_size))
    return results


def single(rank: int, world_size: int, out: str) -> dict:
    out_dir = Path(out)
    ref = ["distributed.cp_size=1", *PACKED]  # the same packed rows: usp pads documents in its own layout
    return {
        "packed_ref": _with_padding(*_run(world_size, out_dir, "packed_ref", ref, config=PACKED_CFG)),
        "plain_ref": _with_padding(
            *_run(world_size, out_dir, "plain_ref", ["distributed.cp_size=1", *PLAIN], config=PACKED_CFG)
        ),
    }

