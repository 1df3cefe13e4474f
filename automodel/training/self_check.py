"""CP self-check: one step of the configured pipeline with context parallelism and without, compared.

Every CP tool has shipped a silent CP bug at some point (packed rows attending across documents, an
eval loss multiplied by ``cp_size``, gradients scaled wrongly over dp x cp). With
``recipe.cp_self_check: true`` the trainer runs :func:`run_cp_self_check` after setup (and resume),
before the first training step:

1. a slice of the real training data: the first ``min(grad_acc, 2)`` micro-batches a fresh loader
   gives this dp rank (same dataset, collator, padding and sampler as training; the training
   loader is not touched), every row cut to its first ``recipe.cp_self_check_tokens`` tokens
   (rounded up to the CP padding multiple; packed rows keep their document boundaries);
2. **with CP**: :meth:`FinetuneTrainer.train_step` exactly as training runs it (label counting over
   dp, the configured CP method, the loss normaliser, grad accumulation, FSDP2's reduce-scatter,
   the grad norm), except that the optimizer and LR-scheduler steps are replaced by no-ops;
3. **without CP**, on the same ranks, with the same weights and rows: the same ``train_step`` with
   the ``cp_size == 1`` batch function (and, for a method that switched the model's attention, the
   model's own attention restored for this run), so every rank computes the whole slice itself. The
   reference is exact by construction: on packed rows it never runs the model's own forward (which
   may let the documents attend to each other: gpt-oss does) but a CP method's document-aware
   attention on the one rank (:func:`~automodel.distributed.cp.bind.bind_cp_method` with
   ``trust_own_forward=False``: each document computed as if alone, proven against the documents run
   alone in ``tests/test_packed_cp1.py``).
   The sums over the CP ranks (FSDP2's gradient reduce-scatter, the CE all-reduce) then count that
   identical computation ``cp_size`` times, so the reference loss and grad norm are the reported
   figures divided by ``cp_size``;
4. the same for :meth:`FinetuneTrainer.validate` on the slice (forward only, the eval loss's own
   reduction), with CP and without;
5. compare the loss, the validation loss, the grad norm (before clipping) and the label-token
   count, log the figures
   (and write them to ``<run dir>/cp_self_check.json`` on rank 0), and raise
   :class:`CPSelfCheckError` if they differ beyond the tolerance of the compute dtype.

Nothing of the run changes: no optimizer or scheduler step, gradients are set to ``None``
afterwards, the global RNG states are restored, and a run with the self-check trains exactly like
one without it. Cost: two forward/backward passes over ``min(grad_acc, 2) x local_batch_size`` rows
of ``cp_self_check_tokens`` tokens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from automodel.errors import UserInputError

__all__ = ["CPSelfCheckError", "SELF_CHECK_RTOL", "run_cp_self_check", "truncate_batch"]

logger = logging.getLogger("automodel.training")

# Relative tolerances (loss, grad norm) by the dtype the model computes in. fp32: a decade above the
# CP parity bar (loss 1e-5, grads 1e-4), because the check runs real configs on any kernel; the bugs
# it is for change the figures by percents to factors of cp_size.
SELF_CHECK_RTOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-8),
    torch.float32: (1e-4, 1e-3),
    torch.bfloat16: (2e-2, 5e-2),
    torch.float16: (1e-2, 3e-2),
}
_SEQ_LENS_PAD = -1000  # automodel.data.collator's sentinel for "no document"


class CPSelfCheckError(UserInputError):
    """The CP self-check found that CP and the single-device computation disagree: the run does not start.

    It is not a typo in the config but a detected CP bug or a setup this CP method does not compute
    exactly; either way the user's config cannot be trained as is, so it is reported like a config
    error (one ``error:`` line, exit code 2) with the figures and what to do.
    """


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def truncate_batch(batch: dict[str, Any], tokens: int) -> dict[str, Any]:
    """The first ``tokens`` positions of every row of a collated batch (a new dict; ``batch`` is not mutated).

    ``[B, S]`` tensors (``input_ids``, ``labels`` (already shifted, so a prefix is exact),
    ``position_ids``, ``attention_mask``, ``loss_mask``) are sliced to ``[B, tokens]``. Packed rows'
    ``seq_lens`` / ``seq_lens_padded`` (``[B, P]`` int64, ``-1000`` = no document) are cut at the same
    point: documents that start at or after ``tokens`` are dropped, the one crossing it is
    shortened, so ``sum(seq_lens_padded[b]) == tokens`` and the boundaries before it are unchanged.
    ``tokens >= S`` returns a shallow copy.
    """
    seq = batch["input_ids"].shape[1]
    if tokens >= seq:
        return dict(batch)
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if k in ("seq_lens", "seq_lens_padded"):
            continue
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq:
            out[k] = v[:, :tokens]
        else:
            out[k] = v
    if "seq_lens_padded" in batch:
        padded, lens = batch["seq_lens_padded"], batch.get("seq_lens", batch["seq_lens_padded"])
        new_padded = torch.full_like(padded, _SEQ_LENS_PAD)
        new_lens = torch.full_like(lens, _SEQ_LENS_PAD)
        for b in range(padded.shape[0]):
            start = 0
            for j in range(padded.shape[1]):
                lp = int(padded[b, j])
                if lp == _SEQ_LENS_PAD or start >= tokens:
                    break
                take = min(lp, tokens - start)
                new_padded[b, j] = take
                new_lens[b, j] = min(int(lens[b, j]), take)
                start += lp
        out["seq_lens_padded"] = new_padded
        if "seq_lens" in batch:
            out["seq_lens"] = new_lens
    return out


def _slice_batches(trainer: Any, tokens: int) -> tuple[list[dict[str, Any]], int]:
    """The self-check's micro-batches from a fresh loader over the training set, and the row length used."""
    from automodel.data import build_dataloader
    from automodel.training.row_padding import pad_multiple

    cfg = trainer.cfg
    multiple = pad_multiple(cfg)
    row = max(multiple, -(-tokens // multiple) * multiple)  # round up to the CP padding multiple
    loader = build_dataloader(
        trainer.train_dataset,
        local_batch_size=cfg.step_scheduler.local_batch_size,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
        dp_rank=trainer.dp_rank,
        dp_size=trainer.dp_size,
        seed=cfg.recipe.seed,
        pad_to_multiple_of=multiple,
        pad_token_id=trainer.tokenizer.pad_token_id,
    )
    n_micro = min(trainer.grad_acc, 2)
    batches = []
    for batch in loader:
        batches.append(truncate_batch(batch, row))
        if len(batches) == n_micro:
            break
    if not batches:
        raise RuntimeError("recipe.cp_self_check: the training data loader yields no batches")
    return batches, min(row, batches[0]["input_ids"].shape[1])


class _SliceLoader:
    """Stands in for the trainer's validation loader: the self-check's micro-batches, every epoch."""

    def __init__(self, batches: list[dict[str, Any]]):
        self._batches = batches

    def set_epoch(self, epoch: int) -> None:
        return None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter([dict(b) for b in self._batches])


@contextlib.contextmanager
def _validating_on(trainer: Any, batches: list[dict[str, Any]]) -> Iterator[None]:
    val_loader = trainer.val_loader
    trainer.val_loader = _SliceLoader(batches)
    try:
        yield
    finally:
        trainer.val_loader = val_loader


class _NoStepOptimizer:
    """The trainer's optimizer with ``step`` a no-op (``zero_grad`` and ``param_groups`` are the real ones)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)


class _NoStepScheduler:
    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


def _reshard(model: torch.nn.Module) -> None:
    """Free FSDP2's unsharded parameters (an eval forward without ``reshard_after_forward`` keeps them)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def _frozen_run_state(trainer: Any) -> Iterator[None]:
    """No optimizer/scheduler step; afterwards RNG states restored, gradients ``None``, parameters resharded."""
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    trainer.optimizer, trainer.scheduler = _NoStepOptimizer(optimizer), _NoStepScheduler()
    try:
        yield
    finally:
        trainer.optimizer, trainer.scheduler = optimizer, scheduler
        trainer.model.zero_grad(set_to_none=True)
        _reshard(trainer.model)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _without_cp(trainer: Any) -> Iterator[None]:
    """The trainer's ``cp_size == 1`` pipeline: its ``no_cp_fn`` (a VLM still encodes its images) and the
    model's own attention back where the CP method prepared it (``trainer.cp_prepared.undo()``); on packed
    rows (not a VLM) a CP method's document-aware attention on the one rank instead of the model's own
    forward, whatever that forward does with documents (the reference is exact by construction)."""
    from automodel.config.cp_auto import packed_rows
    from automodel.distributed.cp.bind import bind_cp_method, no_cp_batch_and_ctx
    from automodel.distributed.cp.method import PreparedModel

    cp_fn = trainer.cp_fn
    trainer.cp_fn = trainer.no_cp_fn
    trainer.cp_prepared.undo()
    reference = PreparedModel()
    try:
        if packed_rows(trainer.cfg) and trainer.no_cp_fn is no_cp_batch_and_ctx:
            trainer.cp_fn, reference = bind_cp_method(
                trainer.cp_method, trainer.model, trainer.mesh, 1, packed=True, trust_own_forward=False
            )
            logger.info("cp self-check: the reference on packed rows: %s", reference.single_rank)
        yield
    finally:
        reference.undo()
        trainer.cp_fn = cp_fn
        trainer.cp_prepared.redo()


def _other_methods(trainer: Any, method: str) -> str:
    """The other registered methods that run the model exactly under this run's sizes, row length and packing
    (the registry's :func:`~automodel.distributed.cp.registry.alternatives`; all others without a profile), joined by
    `` | ``; empty: none."""
    from automodel.config.cp_auto import packed_rows
    from automodel.distributed.cp import cp_methods
    from automodel.distributed.cp.registry import alternative_label, alternatives

    profile = getattr(trainer, "model_profile", None)
    if profile is None:
        return " | ".join(n for n in cp_methods() if n != method)
    d = trainer.cfg.distributed
    found = alternatives(
        profile, exclude=method, cp_size=d.cp_size, tp_size=d.tp_size, seq_len=trainer.cfg.data.seq_len,
        packed=packed_rows(trainer.cfg),
    )  # fmt: skip
    return " | ".join(alternative_label(m, o) for m, o in found)


def _compute_dtype(trainer: Any) -> torch.dtype:
    from automodel.models.loader import torch_dtype

    param_dtype = trainer.cfg.fsdp.param_dtype
    if param_dtype == "auto":
        param_dtype = "bfloat16" if trainer.device.type == "cuda" else None
    return torch_dtype(param_dtype or trainer.cfg.model.dtype)


def run_cp_self_check(trainer: Any) -> dict[str, Any] | None:
    """Run the CP self-check on a set-up :class:`~automodel.training.trainer.FinetuneTrainer` (all ranks).

    Returns the figures (``loss_cp``, ``loss_ref``, ``loss_rel``, ``val_loss_*``, ``grad_norm_cp``,
    ``grad_norm_ref``, ``grad_norm_rel``, ``label_tokens_cp``, ``label_tokens_ref``, tolerances,
    ``tokens`` per row, ``micro_batches``, ``rows``, ``seconds``, ``passed``), or ``None`` when
    ``cp_size == 1`` (nothing to compare). Mutates nothing of the run (see the module docstring).

    Raises:
        CPSelfCheckError: the loss, the validation loss or the grad norm differ beyond
            :data:`SELF_CHECK_RTOL` for the compute dtype, the label-token counts differ, or a
            figure is not finite; the message gives the figures and what to do.
    """
    cfg = trainer.cfg
    cp = cfg.distributed.cp_size
    method = cfg.distributed.cp_method
    if cp <= 1:
        logger.info("cp self-check: skipped (distributed.cp_size=1: there is no CP to compare)")
        return None
    t0 = time.perf_counter()
    batches, row = _slice_batches(trainer, cfg.recipe.cp_self_check_tokens)
    with _frozen_run_state(trainer), _validating_on(trainer, batches):
        with_cp = trainer.train_step([dict(b) for b in batches])
        trainer.model.zero_grad(set_to_none=True)
        val_cp = trainer.validate()
        with _without_cp(trainer):
            ref = trainer.train_step([dict(b) for b in batches])
            val_ref = trainer.validate()
    dtype = _compute_dtype(trainer)
    loss_tol, norm_tol = SELF_CHECK_RTOL.get(dtype, SELF_CHECK_RTOL[torch.float32])
    report: dict[str, Any] = {
        "cp_method": method,
        "cp_size": cp,
        "compute_dtype": str(dtype).removeprefix("torch."),
        "micro_batches": len(batches),
        "rows": sum(int(b["input_ids"].shape[0]) for b in batches),
        "tokens": row,
        "loss_cp": with_cp["loss"],
        "loss_ref": ref["loss"] / cp,  # every CP rank computed the whole slice: summed cp times
        "grad_norm_cp": with_cp["grad_norm"],
        "grad_norm_ref": ref["grad_norm"] / cp,
        "val_loss_cp": val_cp,
        "val_loss_ref": val_ref / cp,  # the CE sum is all-reduced over dp x cp, the label count over dp
        "label_tokens_cp": with_cp["label_tokens"],
        "label_tokens_ref": ref["label_tokens"],
        "loss_rtol": loss_tol,
        "grad_norm_rtol": norm_tol,
    }
    report["loss_rel"] = _rel(report["loss_cp"], report["loss_ref"])
    report["grad_norm_rel"] = _rel(report["grad_norm_cp"], report["grad_norm_ref"])
    report["val_loss_rel"] = _rel(report["val_loss_cp"], report["val_loss_ref"])
    problems = []
    if report["label_tokens_cp"] != report["label_tokens_ref"]:
        problems.append(
            f"label tokens {report['label_tokens_cp']} with CP vs {report['label_tokens_ref']} without"
        )
    if not report["loss_rel"] <= loss_tol:
        problems.append(
            f"loss {report['loss_cp']:.8g} with CP vs {report['loss_ref']:.8g} without "
            f"(rel {report['loss_rel']:.3g} > {loss_tol:g})"
        )
    if not report["val_loss_rel"] <= loss_tol:
        problems.append(
            f"validation loss {report['val_loss_cp']:.8g} with CP vs {report['val_loss_ref']:.8g} without "
            f"(rel {report['val_loss_rel']:.3g} > {loss_tol:g})"
        )
    if not report["grad_norm_rel"] <= norm_tol:
        problems.append(
            f"grad norm {report['grad_norm_cp']:.8g} with CP vs {report['grad_norm_ref']:.8g} without "
            f"(rel {report['grad_norm_rel']:.3g} > {norm_tol:g})"
        )
    report["passed"] = not problems
    report["seconds"] = time.perf_counter() - t0
    summary = (
        f"cp self-check (cp_method={method}, cp_size={cp}, {report['compute_dtype']}, {report['micro_batches']} micro-batches, "
        f"{report['rows']} rows x {row} tokens): loss {report['loss_cp']:.6f} vs {report['loss_ref']:.6f} "
        f"(rel {report['loss_rel']:.2g}), validation loss {report['val_loss_cp']:.6f} vs {report['val_loss_ref']:.6f} "
        f"(rel {report['val_loss_rel']:.2g}), grad norm {report['grad_norm_cp']:.6f} vs "
        f"{report['grad_norm_ref']:.6f} (rel {report['grad_norm_rel']:.2g}), label tokens "
        f"{report['label_tokens_cp']} vs {report['label_tokens_ref']}: "
        f"{'passed' if not problems else 'FAILED'} in {report['seconds']:.1f}s"
    )
    (logger.info if not problems else logger.error)(summary)
    if trainer.rank == 0:
        (trainer.run_dir / "cp_self_check.json").write_text(json.dumps(report, indent=2))
    if problems:
        others = _other_methods(trainer, method)
        try_ = (
            f"Try another distributed.cp_method ({others}) or a different model.attn_implementation"
            if others
            else "No other distributed.cp_method runs this model exactly: try a different model.attn_implementation"
        )
        raise CPSelfCheckError(
            f"recipe.cp_self_check: one step with distributed.cp_method={method} over cp_size={cp} does not "
            f"match the same step without CP on the same {report['rows']} rows x {row} tokens: "
            f"{'; '.join(problems)}. This config would train on wrong losses or gradients. {try_}, "
            "check data packing against the method's limits (docs/recipe.md), "
            f"and report it with {trainer.run_dir / 'cp_self_check.json'}; recipe.cp_self_check=false skips "
            f"the check"
        )
    return report
