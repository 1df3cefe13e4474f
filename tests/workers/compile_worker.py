"""Compiled autograd and ``model.compile`` through the recipe on gloo ranks (see tests/test_compile_recipe.py).

Every run is ``configs/cp.yaml`` with the tiny fp32 overrides of :mod:`tests.workers.recipe_worker`,
shortened to 6 steps without validation, and ``fsdp.enabled=false`` (replicated data parallelism)
wherever compiled autograd is on.
"""

from __future__ import annotations

from pathlib import Path

from automodel.training.trainer import TrainHooks
from tests.workers.recipe_worker import CP, ULYSSES, _run

STEPS = 6
SHORT = [
    f"step_scheduler.max_steps={STEPS}",
    "step_scheduler.val_every_steps=null",
    "data.seq_len=64",
]
CA = ["distributed.enable_compiled_autograd=true", "fsdp.enabled=false"]
#: the compiled-autograd runs and their eager references use one decoder layer: compiled autograd traces the whole
#: backward at the first step (~10 s of a 2-layer model's ~15 s run on 2 cores, half of it with one layer)
ONE_LAYER = ["model.config.num_hidden_layers=1"]
PACKED_CFG = "configs/cp_packed.yaml"  # packed documents (cp_method=thd_docs; the thd runs set thd)
PACKED_REF = ["+data.dataset.seq_pad_multiple=4", "data.pad_to_multiple_of=4"]


def _records() -> tuple[list[dict], TrainHooks]:
    records: list[dict] = []
    return records, TrainHooks(on_step_end=lambda step, record: records.append(dict(record)))


def _grad_info(model) -> dict:
    """Type and placement of every gradient, and their values (full tensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        out[name] = {
            "type": type(g).__name__,
            "placements": [str(x) for x in g.placements] if isinstance(g, DTensor) else None,
            "full": (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone(),
        }
    return out


def _go(world: int, out: Path, name: str, overrides: list[str], config: str = CP) -> dict:
    records, hooks = _records()
    trainer, result = _run(world, out, name, [*SHORT, *overrides], hooks=hooks, config=config)
    return {
        "losses": dict(result.losses),
        "compile_time_s": [r["compile_time_s"] for r in records],
        "graphs_compiled": [r["graphs_compiled"] for r in records],
        "step_time_s": [r["step_time_s"] for r in records],
        "techniques": trainer.technique_report,
    }


def _one_backward(trainer, batch, compiled_autograd: bool) -> dict:
    """Gradients (type, placement, full values) after one micro-batch's backward, eager or compiled."""
    import functools

    from automodel.distributed.cp_utils import get_train_context
    from automodel.training.step import prepare_batch, run_micro_batch
    from automodel.training.trainer import _with_eager_attention_backward

    trainer.model.zero_grad(set_to_none=True)
    ctx = functools.partial(
        get_train_context, False, compiled_autograd, compiled_autograd_backend=trainer.cfg.model.compile_backend
    )
    cp_fn = trainer.cp_fn
    if compiled_autograd and trainer.cfg.distributed.cp_size > 1 and not trainer.cfg.distributed.enable_compiled_autograd:
        cp_fn = _with_eager_attention_backward(cp_fn, trainer.model)
    p = trainer._fixed_length(prepare_batch(batch, trainer.device))
    run_micro_batch(trainer.model, p, device_mesh=trainer.mesh, cp_fn=cp_fn, train_context=ctx, num_label_tokens=100.0)
    return _grad_info(trainer.model)


def gradients(rank: int, world_size: int, out: str) -> dict:
    """Ring cp=2, one micro-batch: the gradients of compiled runs next to the eager ones.

    - FSDP2 eager vs FSDP2 with ``model.compile`` (DTensor gradients, same placements);
    - replicated eager vs replicated under compiled autograd (plain tensors);
    - replicated eager vs FSDP2 eager (the values agree across the two data-parallel modes);
    - ``all_reduce_gradients`` refuses FSDP2's sharded gradients (TypeError).
    """
    from automodel.config import load_config
    from automodel.distributed.replicate import all_reduce_gradients
    from automodel.training.trainer import FinetuneTrainer
    from tests.workers.recipe_worker import TINY

    def trainer_for(name: str, overrides: list[str]) -> FinetuneTrainer:
        argv = ["--config", CP, *TINY, *SHORT, f"recipe.output_dir={Path(out) / name}", "distributed.cp_size=2",
                "model.compile_backend=aot_eager", *overrides]  # fmt: skip
        trainer = FinetuneTrainer(load_config(argv, world_size=world_size))
        trainer.setup()
        return trainer

    fsdp = trainer_for("g_fsdp", [])
    batch = next(fsdp._train_batches())
    res = {"fsdp_eager": _one_backward(fsdp, batch, False)}
    try:
        all_reduce_gradients(fsdp.model, fsdp.dp_cp_group)
        res["refused"] = None
    except TypeError as e:
        res["refused"] = str(e)
    res["fsdp_compiled"] = _one_backward(trainer_for("g_fsdp_mc", ["model.compile=true"]), batch, False)
    rep = trainer_for("g_rep", ["fsdp.enabled=false", *ONE_LAYER])
    res["rep_eager"] = _one_backward(rep, batch, False)
    res["rep_ca"] = _one_backward(rep, batch, True)
    both = trainer_for("g_rep_both", ["fsdp.enabled=false", "model.compile=true", *ONE_LAYER])
    res["rep_both"] = _one_backward(both, batch, True)
    return res


def single(rank: int, world_size: int, out: str) -> dict:
    """World 1: the eager cp=1 references over 6 steps, and with one layer over 6 and over 10 steps (the compiled-
    autograd runs'; the LR schedule spans max_steps)."""
    return {
        "ref": _go(world_size, Path(out), "ref", ["distributed.cp_size=1"]),
        "ref_1l": _go(world_size, Path(out), "ref_1l", ["distributed.cp_size=1", *ONE_LAYER]),
        "ref10_1l": _go(world_size, Path(out), "ref10_1l",
                        ["distributed.cp_size=1", "step_scheduler.max_steps=10", *ONE_LAYER]),  # fmt: skip
        # the same packed rows as thd at cp=2 (documents padded to 2*cp by hand)
        "packed_ref": _go(world_size, Path(out), "packed_ref", ["distributed.cp_size=1", *PACKED_REF], PACKED_CFG),
    }


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2, cp=2: compiled autograd (ulysses; ring's in :func:`gradients`, one micro-batch's gradients
    against eager, and with model.compile below), model.compile (ring, ulysses; FSDP2), both together (ring, 10
    steps: the recompile count), the gradient checks of :func:`gradients`, and a replicated run's checkpoint,
    resume and export (:func:`replicated_checkpoint`)."""
    out_dir = Path(out)
    aot = ["distributed.cp_size=2", "model.compile_backend=aot_eager"]
    runs = {
        "ulysses_ca": (ULYSSES, [*aot, *CA, *ONE_LAYER]),
        "ring_compile": (CP, [*aot, "model.compile=true"]),
        # with activation checkpointing: the compiled block forward is recomputed in the backward; with
        # activation offload and the tiled MLP (tiles of 16 of the rank's 2 x 32 tokens) too, under FSDP2
        "ulysses_compile": (ULYSSES, [*aot, "model.compile=true", "model.activation_checkpointing=true",
                                      "model.activation_offload=true", "model.tiled_mlp=16"]),  # fmt: skip
        "ring_both": (CP, [*aot, *CA, "model.compile=true", "step_scheduler.max_steps=10", *ONE_LAYER]),
        "thd_compile": (PACKED_CFG, [*aot, "model.compile=true", "distributed.cp_method=thd"]),  # packed documents, FSDP2
        # the one inductor run (C++ code generated on CPU): ~15-25 s of compilation on 2 cores
        "ulysses_compile_inductor": (ULYSSES, ["distributed.cp_size=2", "model.compile=true"]),
    }
    results = {name: _go(world_size, out_dir, name, overrides, config) for name, (config, overrides) in runs.items()}
    results["gradients"] = gradients(rank, world_size, out)
    results["replicated_checkpoint"] = replicated_checkpoint(rank, world_size, out)
    return results


def experiment(rank: int, world_size: int, out: str, runs: list) -> dict:
    """Run each ``(name, overrides, config)`` of ``runs``; a failure is returned as its message."""
    import traceback

    results = {}
    for name, overrides, config in runs:
        try:
            results[name] = _go(world_size, Path(out), name, overrides, config)
        except Exception as e:  # noqa: BLE001 - experiments report the failure
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "tb": traceback.format_exc()[-3000:]}
    return results


def replicated_checkpoint(rank: int, world_size: int, out: str) -> dict:
    """``fsdp.enabled=false`` at cp=2: 4 steps with a checkpoint at 2 and the export, then resume from 2."""
    out_dir = Path(out)
    common = [*SHORT, "distributed.cp_size=2", "fsdp.enabled=false", "step_scheduler.max_steps=4",
              "step_scheduler.ckpt_every_steps=2", "checkpoint.keep_last=null"]  # fmt: skip
    _, full = _run(world_size, out_dir, "rep_ckpt", [*common, "export.enabled=true", "checkpoint.save_final=true"])
    _, resumed = _run(
        world_size, out_dir, "rep_resume",
        [*common, f"checkpoint.resume_from={full.run_dir}/checkpoints/step_2"],
    )  # fmt: skip
    return {
        "losses": dict(full.losses),
        "resumed": dict(resumed.losses),
        "export": str(full.export_dir) if full.export_dir else None,
    }
