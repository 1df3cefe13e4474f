"""The CP self-check (``recipe.cp_self_check``) on 2 gloo ranks (see tests/test_self_check.py).

Every run is a shipped config (``configs/cp.yaml``: ring; ``configs/cp_ulysses.yaml``) with the
tiny fp32 overrides of ``tests/workers/recipe_worker.py``. Returns per case the self-check's report
(or the error message it raised) and, for the ring case, the losses of 2 training steps with and
without the self-check (they must be identical: the check leaves the run untouched).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from automodel.config import load_config
from automodel.training.trainer import FinetuneTrainer
from tests.workers.recipe_worker import CP, PACKED, TINY, ULYSSES

TWO_STEPS = ["step_scheduler.max_steps=2", "step_scheduler.val_every_steps=null"]
# a self-check slice shorter than the rows (seq_len 128): 2 micro-batches x 2 rows x 64 tokens
CHECK = ["recipe.cp_self_check=true", "recipe.cp_self_check_tokens=60", "distributed.cp_size=2"]
# the broken normaliser replaces the plain loss (token_cross_entropy_sum): keep loss.chunk_tokens' auto from
# choosing the chunked loss, which would not call it
PLAIN_LOSS = ["loss.chunk_tokens=null"]


def _trainer(out: Path, name: str, config: str, overrides: list[str], world: int) -> FinetuneTrainer:
    argv = ["--config", config, *TINY, *TWO_STEPS, f"recipe.output_dir={out / name}", *overrides]
    return FinetuneTrainer(load_config(argv, world_size=world))


def _weights(trainer: FinetuneTrainer) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}


def _mean_normalised_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A broken normaliser: the *mean* CE over the tokens this rank sees where the pipeline wants the sum.

    Without CP it only rescales the loss by a constant; with CP every rank averages its own shard,
    so the summed contributions come out about ``cp_size`` times too large (the classic CP bug).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="mean"
    )


class _EvalLossTimesCP(FinetuneTrainer):
    """The 'eval loss x cp_size' bug: each CP rank's shard mean is summed over the CP group in validation."""

    def validate(self) -> float:
        from automodel.distributed.cp.bind import no_cp_batch_and_ctx

        loss = super().validate()
        return loss if self.cp_fn is no_cp_batch_and_ctx else loss * self.cfg.distributed.cp_size


def main(rank: int, world_size: int, out: str) -> dict:
    out_dir = Path(out)
    results: dict = {}

    # ring (configs/cp.yaml): the check passes, leaves weights/optimizer untouched, training is unchanged
    checked = _trainer(out_dir, "ring", CP, CHECK, world_size)
    checked.setup()
    before = _weights(checked)
    results["ring"] = dict(checked.cp_self_check_report)
    results["ring"]["weights_untouched"] = all(
        torch.equal(before[n], w) for n, w in _weights(checked).items()
    )
    results["ring"]["grads_none"] = all(p.grad is None for p in checked.model.parameters())
    results["ring"]["optimizer_state_empty"] = len(checked.optimizer.state) == 0
    results["ring"]["scheduler_epoch"] = checked.scheduler.last_epoch
    results["ring"]["losses"] = dict(checked.train().losses)
    results["ring"]["json"] = (checked.run_dir / "cp_self_check.json").is_file()
    del checked
    plain = _trainer(out_dir, "ring_plain", CP, ["distributed.cp_size=2"], world_size)
    results["ring"]["losses_without_check"] = dict(plain.run().losses)
    del plain

    # Ulysses (configs/cp_ulysses.yaml), plain rows and packed rows (documents cut at the slice end)
    for name, extra in (("ulysses", []), ("ulysses_packed", PACKED)):
        trainer = _trainer(out_dir, name, ULYSSES, [*CHECK, *extra], world_size)
        trainer.setup()
        results[name] = dict(trainer.cp_self_check_report)
        results[name]["attn_after"] = trainer.model.config._attn_implementation
        del trainer

    # the other shipped CPU configs: LoRA (ring) and the VLM (its own tiny model; ring and Ulysses, where the
    # reference must still encode the images and give the text model its own attention back)
    vlm = ["configs/vlm_cp.yaml", *TWO_STEPS, "lr_scheduler.warmup_steps=2", "recipe.cp_self_check=true", "checkpoint.enabled=false",
           "export.enabled=false", "logging.progress_bar=false", "logging.plot=false"]  # fmt: skip
    for name, argv in (
        ("lora", ["configs/cp_lora.yaml", *TINY, *TWO_STEPS, *CHECK]),
        ("vlm_ring", vlm),
        ("vlm_ulysses", [*vlm, "distributed.cp_method=ulysses"]),
    ):
        trainer = FinetuneTrainer(
            load_config(["--config", *argv, f"recipe.output_dir={out_dir / name}"], world_size=world_size)
        )
        trainer.setup()
        results[name] = dict(trainer.cp_self_check_report)
        del trainer

    # a broken validation reduction makes the check abort before training
    argv = ["--config", CP, *TINY, *TWO_STEPS, f"recipe.output_dir={out_dir / 'eval_bug'}", *CHECK]
    try:
        _EvalLossTimesCP(load_config(argv, world_size=world_size)).setup()
        results["eval_bug"] = {"raised": None}
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
        results["eval_bug"] = {"raised": type(e).__name__, "message": str(e)}

    # a broken normaliser makes the check abort before training
    import automodel.training.step as step

    original = step.token_cross_entropy_sum
    step.token_cross_entropy_sum = _mean_normalised_ce
    try:
        broken = _trainer(out_dir, "broken", CP, [*CHECK, *PLAIN_LOSS], world_size)
        try:
            broken.setup()
            results["broken"] = {"raised": None}
        except Exception as e:  # noqa: BLE001 - the test asserts on the type and the message
            results["broken"] = {
                "raised": type(e).__name__,
                "message": str(e),
                "is_value_error": isinstance(e, ValueError),
            }
        results["recipe"] = _recipe_exit(out_dir)
    finally:
        step.token_cross_entropy_sum = original
    return results


def _recipe_exit(out_dir: Path) -> dict:
    """``recipes/finetune.py``'s ``main`` on the broken normaliser: its exit code and what it printed."""
    import contextlib
    import importlib.util
    import io

    import torch.distributed as dist

    path = Path(__file__).resolve().parents[2] / "recipes" / "finetune.py"
    spec = importlib.util.spec_from_file_location("finetune_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    argv = ["--config", CP, *TINY, *TWO_STEPS, f"recipe.output_dir={out_dir / 'recipe'}", *CHECK, *PLAIN_LOSS]
    printed = io.StringIO()
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # the test harness still needs the group
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = recipe.main(argv)
    finally:
        dist.destroy_process_group = destroy
    return {"exit_code": code, "printed": printed.getvalue()}
