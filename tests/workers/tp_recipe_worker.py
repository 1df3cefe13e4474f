"""Tensor parallelism through the recipe on gloo ranks (see tests/test_tp_recipe.py).

Every run is ``configs/cp.yaml`` with recipe_worker's tiny fp32 overrides (tied embeddings, GQA,
grad accumulation, validation, clipping) for :data:`STEPS` steps, so runs at any dp / cp / tp must
reproduce the single-device losses and weights. Three launched groups: ``single`` (the world-1
reference and the packed-rows reference), ``pair`` (world 2: tp=2 with and without loss parallel,
with sequence parallel, resume from a TP checkpoint, export) and ``quad`` (world 4: tp x cp with
ring, Ulysses and THD, dp x tp).
"""

from __future__ import annotations

from pathlib import Path

import torch

from automodel.training.trainer import TrainHooks
from tests.workers.recipe_worker import CP, _sigterm_at, _summary, _trainer

STEPS = 6
# on top of recipe_worker's TINY: STEPS steps with validation at step 3 and 6
TP_STEPS = [f"step_scheduler.max_steps={STEPS}", "step_scheduler.val_every_steps=3"]
LP = ["distributed.enable_loss_parallel=true"]
PACKED = "configs/cp_packed.yaml"  # cp.yaml with whole documents packed per row (the thd run sets cp_method=thd)
PACKED_TINY = ["data.seq_len=256"]


def _run(
    world: int,
    out: Path,
    name: str,
    overrides: list[str],
    hooks: TrainHooks | None = None,
    config: str = CP,
):
    trainer = _trainer(world, out, name, [*TP_STEPS, *overrides], hooks, config)
    trainer.setup()
    seen: list[tuple] = []  # (local shape, is DTensor) of the LM head's output in every training forward

    def record(module, args, output) -> None:
        local = output.to_local() if hasattr(output, "to_local") else output
        seen.append((tuple(local.shape), hasattr(output, "to_local")))

    handle = trainer.model.get_output_embeddings().register_forward_hook(record)
    result = trainer.train()
    handle.remove()
    summary = _summary(trainer, result)
    summary["head_outputs"] = sorted(set(seen))
    summary["self_check"] = getattr(trainer, "cp_self_check_report", None)
    return trainer, result, summary


def _logits(model: torch.nn.Module, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=probe).logits
    return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).detach().clone()


def single(rank: int, world_size: int, out: str) -> dict:
    """World 1: the reference (dp = cp = tp = 1)."""
    _, _, ref = _run(world_size, Path(out), "ref", ["distributed.cp_size=1"])
    # packed rows at cp=1 (transformers masks documents from the restarting position_ids), every
    # document padded to 2*cp = 4 as the tp=2 x cp=2 THD run pads it, so that the rows hold the same documents
    pad = ["+data.dataset.seq_pad_multiple=4", "data.pad_to_multiple_of=4"]
    _, _, packed = _run(
        world_size, Path(out), "packed_ref", ["distributed.cp_size=1", *PACKED_TINY, *pad], config=PACKED
    )
    return {"ref": ref, "packed_ref": packed}


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2: tp=2 (gathered logits), tp=2 + loss parallel (+ export, checkpoint), tp=2 + loss parallel
    + sequence parallel, and tp=2 + loss parallel stopped by SIGTERM after step 3 and resumed."""
    out_dir = Path(out)
    tp2 = ["distributed.cp_size=1", "distributed.tp_size=2"]
    results: dict = {}
    results["tp2"] = _run(world_size, out_dir, "tp2", tp2)[2]

    trainer, result, summary = _run(
        world_size, out_dir, "tp2_lp", [*tp2, *LP, "export.enabled=true", "checkpoint.save_final=true"]
    )
    results["tp2_lp"] = summary
    # the exported HF directory must give the TP-trained model's logits
    probe = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(7))
    trained = _logits(trainer.model, probe)
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(result.export_dir))
        results["export"] = {
            "max_abs_diff": (_logits(loaded, probe) - trained).abs().max().item(),
            "scale": trained.abs().max().item(),
            "tied": loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight,
        }
    del trainer

    results["tp2_lp_sp_ac"] = _run(
        world_size,
        out_dir,
        "tp2_lp_sp_ac",
        [*tp2, *LP, "distributed.sequence_parallel=true", "model.activation_checkpointing=true"],
    )[2]
    # the same with activation offload (the layer inputs are sequence-parallel shards) and FSDP2's parameter
    # offload of the 2-D (dp_shard_cp x tp) parameters
    results["tp2_lp_sp_offload"] = _run(
        world_size,
        out_dir,
        "tp2_lp_sp_offload",
        [*tp2, *LP, "distributed.sequence_parallel=true", "model.activation_checkpointing=true",
         "model.activation_offload=true", "fsdp.offload=all"],
    )[2]  # fmt: skip

    first = _run(world_size, out_dir, "resume", [*tp2, *LP], hooks=_sigterm_at(3))[2]
    first.pop("state")
    results["resume_first"] = first
    results["resume_second"] = _run(world_size, out_dir, "resume", [*tp2, *LP, "checkpoint.resume=true"])[2]
    return results


def quad(rank: int, world_size: int, out: str) -> dict:
    """World 4: tp=2 x cp=2 with loss parallel under ring, Ulysses and THD (packed rows), and dp=2 x tp=2."""
    out_dir = Path(out)
    tp2cp2 = ["distributed.cp_size=2", "distributed.tp_size=2", *LP]
    # the tp=2 checkpoint of `pair` (step 3 of 6) resumed at dp=2 x tp=2: DCP reshards the 2-D parameters
    step3 = out_dir / "resume" / "checkpoints" / "step_3"
    elastic = ["distributed.cp_size=1", "distributed.tp_size=2", *LP, f"checkpoint.resume_from={step3}"]
    return {
        "elastic_dp2_tp2": _run(world_size, out_dir, "elastic_dp2_tp2", elastic)[2],
        # with the CP self-check (one step with CP and without it, same TP ranks) before training
        "tp2_cp2_ring": _run(
            world_size, out_dir, "tp2_cp2_ring", [*tp2cp2, "recipe.cp_self_check=true", "recipe.cp_self_check_tokens=64"]
        )[2],
        "tp2_cp2_ulysses": _run(
            world_size, out_dir, "tp2_cp2_ulysses", [*tp2cp2, "distributed.cp_method=ulysses"]
        )[2],
        "tp2_cp2_thd": _run(
            world_size, out_dir, "tp2_cp2_thd", [*tp2cp2, *PACKED_TINY, "distributed.cp_method=thd"], config=PACKED
        )[2],
        "dp2_tp2": _run(world_size, out_dir, "dp2_tp2", ["distributed.cp_size=1", "distributed.tp_size=2"])[2],
    }
