"""PEFT LoRA through the recipe on gloo ranks (see tests/test_peft_recipe.py).

Every run is ``configs/cp_lora.yaml`` with the same tiny fp32 overrides (6 steps, same seed and
global batch), so runs with different cp sizes and CP methods must produce the same losses.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from automodel.config import load_config
from automodel.training.trainer import FinetuneTrainer, TrainHooks
from tests.workers.recipe_worker import TINY as RECIPE_TINY
from tests.workers.recipe_worker import _full_state

CONFIG = "configs/cp_lora.yaml"
STEPS = 6
# tests/workers/recipe_worker.py's tiny overrides, with this module's step count and validation cadence
_OWN = {
    "step_scheduler.max_steps": str(STEPS),
    "step_scheduler.val_every_steps": "3",
    "step_scheduler.val_max_batches": "1",
    "model.config.num_key_value_heads": "4",  # 2 KV heads per rank at cp=2: the Ulysses run takes 2 head groups
}
TINY = [o for o in RECIPE_TINY if o.split("=", 1)[0] not in _OWN] + [f"{k}={v}" for k, v in _OWN.items()]


def write_corpus(out: Path, docs: int = 400) -> Path:
    """The first ``docs`` documents of the shipped corpus as jsonl (enough rows for 6 steps, and
    every run tokenizes a tenth of the whole corpus)."""
    import gzip

    from automodel.data.text_dataset import __file__ as data_file

    src = Path(data_file).parent / "assets" / "corpus" / "default_corpus.jsonl.gz"
    with gzip.open(src, "rt") as f:
        lines = [next(f) for _ in range(docs)]
    path = out / "corpus.jsonl"
    path.write_text("".join(lines))
    return path


def _trainer(world: int, out: Path, name: str, overrides: list[str], hooks: TrainHooks | None = None):
    corpus = f"data.dataset.path={out / 'corpus.jsonl'}"
    argv = ["--config", CONFIG, *TINY, corpus, f"recipe.output_dir={out / name}", *overrides]
    trainer = FinetuneTrainer(load_config(argv, world_size=world), hooks)
    trainer.setup()
    return trainer


def _summary(trainer: FinetuneTrainer, result) -> dict:
    return {
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "grad_norms": dict(result.grad_norms),
        "final_step": result.final_step,
        "stopped_by_sigterm": result.stopped_by_sigterm,
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "attn_impl": trainer.model.config._attn_implementation,
        "lr_last": trainer.optimizer.param_groups[0]["lr"],
        "headwise": (trainer.technique_report or {}).get("headwise_ulysses"),  # the run log's technique line
        "tiled_layer": (trainer.technique_report or {}).get("tiled_layer"),
        "head_groups": (trainer.technique_report or {}).get("attention_head_groups"),
    }


def _run(world: int, out: Path, name: str, overrides: list[str], hooks: TrainHooks | None = None) -> dict:
    trainer = _trainer(world, out, name, overrides, hooks)
    summary = _summary(trainer, trainer.train())
    state = _full_state(trainer.model)
    summary["adapters"] = {k: v for k, v in state.items() if ".lora_" in k} if trainer.rank == 0 else None
    return summary


def _grad_and_optimizer_owners(trainer: FinetuneTrainer) -> dict:
    """Which parameters get a gradient from one more micro-batch, and which have optimizer state."""
    from automodel.training.step import prepare_batch, run_micro_batch

    names = {id(p): n for n, p in trainer.model.named_parameters()}
    batch = prepare_batch(next(iter(trainer.train_loader)), trainer.device)
    run_micro_batch(
        trainer.model,
        batch,
        device_mesh=trainer.mesh,
        cp_fn=trainer.cp_fn,
        train_context=trainer.train_context,
        num_label_tokens=1000.0,
    )
    with_grad = sorted(n for n, p in trainer.model.named_parameters() if p.grad is not None)
    nonzero = sorted(
        n
        for n, p in trainer.model.named_parameters()
        if p.grad is not None and p.grad.to_local().abs().sum() > 0
    )
    trainer.optimizer.zero_grad(set_to_none=True)
    in_optimizer = sorted(names[id(p)] for g in trainer.optimizer.param_groups for p in g["params"])
    with_state = sorted(names[id(p)] for p in trainer.optimizer.state)
    return {
        "params": sorted(names.values()),
        "with_grad": with_grad,
        "nonzero_grad": nonzero,
        "in_optimizer": in_optimizer,
        "with_state": with_state,
        "requires_grad": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
    }


def _logits_checks(trainer: FinetuneTrainer, export_dir: Path, rank: int) -> dict | None:
    """The trained model's logits against the merged export and the adapter on its base (rank 0)."""
    g = torch.Generator().manual_seed(7)
    probe = torch.randint(0, 1024, (2, 48), generator=g)
    with torch.no_grad():
        trained = trainer.model(input_ids=probe).logits.detach().clone()
    if rank != 0:
        return None
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(export_dir / "merged"))
    base = AutoModelForCausalLM.from_pretrained(str(export_dir / "base"))
    with torch.no_grad():
        base_logits = base(input_ids=probe).logits
        adapted = PeftModel.from_pretrained(base, str(export_dir / "adapter"))
        adapter_logits = adapted(input_ids=probe).logits
        merged_logits = merged(input_ids=probe).logits
    return {
        "merged_class": type(merged).__name__,
        "merged_keys": sorted(merged.state_dict()),
        "merged_diff": (merged_logits - trained).abs().max().item(),
        "adapter_diff": (adapter_logits - trained).abs().max().item(),
        "base_diff": (base_logits - trained).abs().max().item(),  # the adapters changed the model
        "scale": trained.abs().max().item(),
    }


def _sigterm_at(step_to_stop: int) -> TrainHooks:
    def hook(step: int, record: dict) -> None:
        if step == step_to_stop:
            os.kill(os.getpid(), signal.SIGTERM)

    return TrainHooks(on_step_end=hook)


def single(rank: int, world_size: int, out: str) -> dict:
    """World 1: the single-device LoRA reference (cp_size=1)."""
    return {"ref": _run(world_size, Path(out), "ref", ["distributed.cp_size=1"])}


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2: ring cp=2 with activation checkpointing and the export; Ulysses cp=2 in 2 head groups with
    checkpointing and activation offload; ring cp=2 with checkpointing, activation offload and the tiled layer; cp=1 over
    FSDP2's 2 ranks with the attention in 2 head groups and the tiled layer; ring cp=2 stopped by SIGTERM after step 3
    and resumed from its adapter-only checkpoint."""
    out_dir = Path(out)
    results: dict = {}
    ring = ["distributed.cp_size=2", "model.activation_checkpointing=true"]

    trainer = _trainer(
        world_size, out_dir, "ring_cp2", [*ring, "export.enabled=true", "checkpoint.save_final=true"]
    )
    before = _full_state(trainer.model)
    result = trainer.train()
    results["ring_cp2"] = _summary(trainer, result)
    after = _full_state(trainer.model)
    frozen = [k for k in before if ".lora_" not in k]
    results["ring_cp2"]["frozen_keys"] = frozen
    results["ring_cp2"]["frozen_changed"] = [k for k in frozen if not torch.equal(before[k], after[k])]
    results["ring_cp2"]["adapters_changed"] = sorted(
        k for k in before if ".lora_" in k and not torch.equal(before[k], after[k])
    )
    results["ring_cp2"]["adapters"] = {k: v for k, v in after.items() if ".lora_" in k} if rank == 0 else None
    ckpt = result.last_checkpoint
    if rank == 0:
        import torch.distributed.checkpoint as dcp

        results["ring_cp2"]["ckpt_keys"] = sorted(
            dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
        )
    results["owners"] = _grad_and_optimizer_owners(trainer)
    results["export"] = _logits_checks(trainer, Path(result.export_dir), rank)
    del trainer

    # headwise Ulysses (2 head groups) with LoRA, FSDP2, checkpointing and activation offload: still the reference
    results["ulysses_cp2"] = _run(
        world_size, out_dir, "ulysses_cp2", ["distributed.cp_size=2", "distributed.cp_method=ulysses",
                                             "distributed.ulysses_head_chunks=2", "model.activation_checkpointing=true",
                                             "model.activation_offload=true"],
    )

    # model.tiled_layer (tiles of 24 tokens) with LoRA, FSDP2, ring, checkpointing and activation offload
    results["tiled_cp2"] = _run(world_size, out_dir, "tiled_cp2", [*ring, "model.activation_offload=true",
                                                                   "model.tiled_layer=24"])  # fmt: skip

    # model.attention_head_chunks (cp_size=1, 2 head groups) with LoRA, FSDP2 over the 2 ranks, checkpointing and the
    # tiled layer: the single-device reference too
    results["groups_dp2"] = _run(world_size, out_dir, "groups_dp2", ["distributed.cp_size=1",
                                                                     "model.attention_head_chunks=2",
                                                                     "model.activation_checkpointing=true",
                                                                     "model.tiled_layer=24"])  # fmt: skip

    first = _run(world_size, out_dir, "resume", ring, hooks=_sigterm_at(3))
    first.pop("adapters")
    results["resume_first"] = first
    results["resume_second"] = _run(world_size, out_dir, "resume", [*ring, "checkpoint.resume=true"])
    return results
