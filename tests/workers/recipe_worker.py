"""The fine-tuning recipe end to end on gloo ranks (see tests/test_recipe_parity.py).

Every run is ``configs/cp.yaml`` with the same tiny overrides (fp32, 8 steps, same seed and global
batch), so runs with different dp / cp must produce the same losses and weights. One launched
group runs several recipes one after the other; each returns what the tests assert on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from automodel.config import load_config
from automodel.training.trainer import FinetuneTrainer, TrainHooks

# Tiny and fast, but every piece is real: 2 decoder layers, GQA, tied embeddings, 8 steps of
# AdamW with warmup + cosine, 4 micro-batches per step (grad accumulation), validation, clipping.
TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.dtype=float32",
    "fsdp.param_dtype=float32",
    "data.seq_len=128",
    "step_scheduler.global_batch_size=8",
    "step_scheduler.local_batch_size=2",
    "step_scheduler.max_steps=8",
    "step_scheduler.val_every_steps=4",
    "step_scheduler.val_max_batches=2",
    "step_scheduler.ckpt_every_steps=null",
    "lr_scheduler.warmup_steps=2",
    "checkpoint.save_final=false",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
    "recipe.cp_self_check=false",  # on by default at cp > 1; its own tests (and the toy method's run) turn it on
]


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


CP = "configs/cp.yaml"
ULYSSES = "configs/cp_ulysses.yaml"  # cp.yaml with distributed.cp_method=ulysses
# Whole documents packed per row (seq_lens / restarting position_ids; longer rows hold more of them),
# with the eager kernel: Ulysses runs it as its inner kernel, so both inner kernels are covered.
PACKED = ["+data.dataset.pack=true", "data.seq_len=256", "model.attn_implementation=eager"]
# a sliding-window model (Mistral, window 16 < the 128-token rows): ring runs its windowed layers on the halo kernel
SLIDING = ["model.config._target_=transformers.MistralConfig", "+model.config.sliding_window=16"]
# activation offload (needs checkpointing) and the optimizer's state and step on the host
OFFLOAD = ["model.activation_checkpointing=true", "model.activation_offload=true", "fsdp.offload=optimizer"]
# packed rows of a tiny gpt-oss (eager attention with sinks, sliding and full layers), whose own forward lets a
# packed row's documents attend to each other: at cp_size=1 a method's document-aware attention runs on the one
# rank instead (automodel.distributed.cp.bind), so cp=1 and cp=2 compute each document alone; 4 steps
GPTOSS_PACKED = [
    *PACKED,
    "model.config._target_=transformers.GptOssConfig",
    "+model.config.head_dim=16",
    "+model.config.num_local_experts=4",
    "+model.config.num_experts_per_tok=2",
    "+model.config.sliding_window=16",
    "step_scheduler.max_steps=4",
]
# Mamba (v1) under FSDP2 (issue 43): fully_shard once crashed on it ("Cannot concatenate overlapping meshes") at
# cp=2 and at cp=1 with dp_shard=2; the keys of cp.yaml's Llama that MambaConfig does not take are deleted; 4 steps
MAMBA_DROP = ("num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rope_theta")
MAMBA = [
    "model.config._target_=transformers.MambaConfig",
    *(f"~model.config.{key}" for key in MAMBA_DROP),
    "+model.config.state_size=8",
    "+model.config.use_mambapy=true",
    "model.attn_implementation=eager",
    "step_scheduler.max_steps=4",
]


def _trainer(
    world: int,
    out: Path,
    name: str,
    overrides: list[str],
    hooks: TrainHooks | None = None,
    config: str = CP,
) -> FinetuneTrainer:
    """The trainer of ``config`` with the tiny overrides, writing to ``out/name`` (not set up yet)."""
    tiny = TINY
    if "model.config._target_=transformers.MambaConfig" in overrides:
        tiny = [t for t in TINY if t.split("=")[0].removeprefix("model.config.") not in MAMBA_DROP]
    argv = ["--config", config, *tiny, f"recipe.output_dir={out / name}", *overrides]
    return FinetuneTrainer(load_config(argv, world_size=world), hooks)


def _run(
    world: int,
    out: Path,
    name: str,
    overrides: list[str],
    hooks: TrainHooks | None = None,
    config: str = CP,
):
    trainer = _trainer(world, out, name, overrides, hooks, config)
    result = trainer.run()
    return trainer, result


def _summary(trainer: FinetuneTrainer, result) -> dict:
    state = _full_state(trainer.model)
    return {
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "grad_norms": dict(result.grad_norms),
        "final_step": result.final_step,
        "stopped_by_sigterm": result.stopped_by_sigterm,
        "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
        "run_dir": str(result.run_dir),
        "state": state if trainer.rank == 0 else None,
        "lr_last": trainer.optimizer.param_groups[0]["lr"],
        "cp_method": trainer.cfg.distributed.cp_method,
        "inner_attn": trainer.inner_attn,
        "attn_impl": trainer.model.config._attn_implementation,
        "packed_docs": _packed_docs(trainer.train_dataset),
        "techniques": trainer.technique_report,  # what checkpointing / offload / tiled MLP did in step 1
        "technique_log": _technique_log(Path(result.run_dir) / "logs" / f"rank_{trainer.rank}.log"),
        "fsdp2": all(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
    }


def _technique_log(path: Path) -> list[str]:
    """The run log's lines about what each technique did (automodel.training.technique_report)."""
    keys = ("activation checkpointing:", "activation offload:", "tiled MLP:", "tiled final norm:", "tiled layer norms:",
            "not recomputed", "to the host, more", "checkpoint groups:")
    return [line for line in path.read_text().splitlines() if any(k in line for k in keys)]


def _packed_docs(dataset) -> int | None:
    """Documents in the first 8 rows of a packed dataset (None: rows are not packed)."""
    if not getattr(dataset, "packed", False):
        return None
    return sum(int(dataset[i]["seq_lens"].numel()) for i in range(min(8, len(dataset))))


def single(rank: int, world_size: int, out: str, pretrained: str) -> dict:
    """World 1: the reference (cp=1, dp=1), the same with activation checkpointing (and with both offloads), a run that
    starts from the exported model of the cp=2 run (``pretrained``) with lr=0, so its final weights
    must be exactly the exported ones, and the packed-rows reference."""
    out_dir = Path(out)
    ref = _summary(*_run(world_size, out_dir, "ref", ["distributed.cp_size=1"]))
    ac = _summary(
        *_run(world_size, out_dir, "ac", ["distributed.cp_size=1", "model.activation_checkpointing=true"])
    )
    from_pretrained = _summary(
        *_run(
            world_size,
            out_dir,
            "from_pretrained",
            [
                "distributed.cp_size=1",
                f"model.pretrained_model_name_or_path={pretrained}",  # model.config stays: it must match
                "optimizer.lr=0.0",
                "step_scheduler.max_steps=1",
                "lr_scheduler.warmup_steps=1",  # at most max_steps (the config check); lr is 0 anyway
                "step_scheduler.val_every_steps=null",
            ],
        )
    )
    # both offloads at cp=1 (issue 35): the checkpointed layer inputs on the host, optimizer state and step too
    offload = _summary(*_run(world_size, out_dir, "offload", ["distributed.cp_size=1", *OFFLOAD]))
    # packed rows at cp=1: transformers masks documents from the restarting position_ids
    packed_ref = _summary(*_run(world_size, out_dir, "packed_ref", ["distributed.cp_size=1", *PACKED]))
    sliding_ref = _summary(*_run(world_size, out_dir, "sliding_ref", ["distributed.cp_size=1", *SLIDING]))
    gptoss_packed_ref = _summary(
        *_run(world_size, out_dir, "gptoss_packed_ref", ["distributed.cp_size=1", *GPTOSS_PACKED])
    )
    mamba_ref = _summary(*_run(world_size, out_dir, "mamba_ref", ["distributed.cp_size=1", *MAMBA]))
    return {
        "mamba_ref": mamba_ref,
        "ref": ref, "ac": ac, "from_pretrained": from_pretrained, "packed_ref": packed_ref, "sliding_ref": sliding_ref,
        "offload": offload,
        "gptoss_packed_ref": gptoss_packed_ref,
    }


def _sigterm_at(step_to_stop: int) -> TrainHooks:
    def hook(step: int, record: dict) -> None:
        if step == step_to_stop:
            os.kill(os.getpid(), signal.SIGTERM)

    return TrainHooks(on_step_end=hook)


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2: cp=2 (with plot, export, metrics), dp=2, dp=2 stopped by SIGTERM at 4 + resumed, and
    Ulysses cp=2 on plain and on packed rows; the offload runs (ring cp=2 with both offloads, resumes with and
    without optimizer offload, Ulysses cp=2 with fsdp.offload=all)."""
    out_dir = Path(out)
    results: dict = {}

    # cp=2, dp=1 — also exports the model and writes metrics + plot
    trainer, result = _run(
        world_size,
        out_dir,
        "cp2",
        ["distributed.cp_size=2", "export.enabled=true", "logging.plot=true", "checkpoint.save_final=true"],
    )
    results["cp2"] = _summary(trainer, result)
    # the trained (FSDP, CP-trained) model and the exported HF directory must give the same logits
    g = torch.Generator().manual_seed(7)
    probe = torch.randint(0, 1024, (2, 48), generator=g)
    with torch.no_grad():
        trained_logits = trainer.model(input_ids=probe).logits.detach().clone()
    if rank == 0:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(result.export_dir))
        with torch.no_grad():
            exported_logits = loaded(input_ids=probe).logits
        results["export"] = {
            "dir": str(result.export_dir),
            "class": type(loaded).__name__,
            "max_abs_diff": (exported_logits - trained_logits).abs().max().item(),
            "logits_scale": trained_logits.abs().max().item(),
        }
    del trainer

    # ring cp=2 on a sliding-window model
    results["sliding_cp2"] = _summary(*_run(world_size, out_dir, "sliding_cp2", ["distributed.cp_size=2", *SLIDING]))

    # ring cp=2 with FSDP2, activation checkpointing and model.tiled_mlp (tiles of 24 of the rank's 2 x 64 tokens)
    trainer, result = _run(
        world_size,
        out_dir,
        "tiled_cp2",
        ["distributed.cp_size=2", "model.activation_checkpointing=true", "model.tiled_mlp=24"],
    )
    results["tiled_cp2"] = _summary(trainer, result)
    from automodel.models.tiled_mlp import tile_counts

    results["tiled_cp2"]["tiled_mlps"] = len(tile_counts(trainer.model))  # the MLPs (the final norm counted apart)
    del trainer

    # cp=1, dp=2
    results["dp2"] = _summary(*_run(world_size, out_dir, "dp2", ["distributed.cp_size=1"]))

    # dp=2: SIGTERM after step 4 -> checkpoint + stop; then resume for steps 5..8
    first = _summary(*_run(world_size, out_dir, "resume", ["distributed.cp_size=1"], hooks=_sigterm_at(4)))
    second = _summary(
        *_run(world_size, out_dir, "resume", ["distributed.cp_size=1", "checkpoint.resume=true"])
    )
    first.pop("state")
    results["resume_first"] = first
    results["resume_second"] = second

    # offload: ring cp=2 with both offloads; Ulysses cp=2 (below) with FSDP2's parameter offload. Checkpoints: a
    # run with optimizer offload stopped at 4 and resumed with it; its step-4 checkpoint resumed without
    # offload; the step-4 checkpoint of the run without offload (above) resumed with it
    results["offload_cp2"] = _summary(*_run(world_size, out_dir, "offload_cp2", ["distributed.cp_size=2", *OFFLOAD]))
    off = ["distributed.cp_size=1", "fsdp.offload=optimizer"]
    off_first = _summary(*_run(world_size, out_dir, "offload_resume", off, hooks=_sigterm_at(4)))
    off_first.pop("state")
    results["offload_resume_first"] = off_first
    results["offload_resume_second"] = _summary(
        *_run(world_size, out_dir, "offload_resume", [*off, "checkpoint.resume=true"])
    )
    results["offload_to_plain"] = _summary(*_run(
        world_size, out_dir, "offload_to_plain", ["distributed.cp_size=1", f"checkpoint.resume_from={off_first['last_checkpoint']}"]
    ))  # fmt: skip
    results["plain_to_offload"] = _summary(
        *_run(world_size, out_dir, "plain_to_offload", [*off, f"checkpoint.resume_from={first['last_checkpoint']}"])
    )

    # A toy method registered here (tests/toy_cp_method.py), run by the recipe with no other edit; the
    # dry run plans it too (its memory terms and description come from the interface)
    from automodel.training.dry_run import dry_run_report
    from tests.toy_cp_method import NAME, register

    register()
    toy = ["distributed.cp_size=2", f"distributed.cp_method={NAME}", "recipe.cp_self_check=true"]
    results["toy_cp2"] = _summary(*_run(world_size, out_dir, "toy_cp2", toy))
    argv = ["--config", CP, *TINY, f"recipe.output_dir={out_dir / 'toy_dry'}", *toy, "recipe.dry_run=true"]
    results["toy_dry_run"] = dry_run_report(load_config(argv, world_size=world_size)) if rank == 0 else None

    # Ulysses cp=2 (configs/cp_ulysses.yaml), plain rows and packed rows
    results["ulysses_cp2"] = _summary(
        *_run(world_size, out_dir, "ulysses_cp2", ["distributed.cp_size=2"], config=ULYSSES)
    )
    results["ulysses_packed_cp2"] = _summary(
        *_run(
            world_size,
            out_dir,
            "ulysses_packed_cp2",
            # also with activation checkpointing: attention is recomputed in backward, inside the context
            ["distributed.cp_size=2", *PACKED, "model.activation_checkpointing=true"],
            config=ULYSSES,
        )
    )
    results["offload_all_grp2_ulysses_cp2"] = _summary(*_run(
        world_size, out_dir, "offload_all_grp2_ulysses_cp2",
        # with checkpoint groups of 2 (model.checkpoint_group_layers): only layer 0's input offloaded, layer 1's rebuilt
        ["distributed.cp_size=2", *OFFLOAD[:2], "fsdp.offload=all", "model.checkpoint_group_layers=2"], config=ULYSSES,
    ))  # fmt: skip
    # packed gpt-oss at cp=2 with the self-check, whose reference is exact by construction (gptoss_packed_ref: cp=1)
    gptoss = ["distributed.cp_size=2", "distributed.cp_method=thd_docs", "recipe.cp_self_check=true", *GPTOSS_PACKED]
    results["gptoss_packed_cp2"] = _summary(*_run(world_size, out_dir, "gptoss_packed_cp2", gptoss))
    # Mamba with FSDP2 (on by default): cp=2, and cp=1 with dp_shard=2
    results["mamba_cp2"] = _summary(*_run(world_size, out_dir, "mamba_cp2", ["distributed.cp_size=2", *MAMBA]))
    results["mamba_dp2"] = _summary(*_run(world_size, out_dir, "mamba_dp2", ["distributed.cp_size=1", *MAMBA]))
    return results
