"""Elastic resume: which layout changes continue a run exactly, and RNG that does not depend on layout.

A checkpoint written with one parallel layout (world size, dp, cp) resumes with another when the
continued run equals an uninterrupted run at the new layout:

- **Model and optimizer**: ``torch.distributed.checkpoint`` reshards the FSDP2 ``DTensor`` state
  (and plain tensors at world 1) on load: always exact.
- **LR scheduler and step**: identical on every rank; read from rank 0's file.
- **Data position**: the sampler's global batches do not depend on dp; a changed
  ``local_batch_size * dp_size`` is mapped by :meth:`DistributedBatchSampler.map_step` or refused.
- **Global batch size** (``step_scheduler.global_batch_size``): must be unchanged, since an optimizer
  step over another number of rows is another run.
- **RNG**: per-rank generator states cannot be mapped to another number of ranks. Instead the
  trainer reseeds every rank at the start of every step from ``(recipe.seed, step, rank)``
  (:func:`reseed_for_step`), so the random numbers of step ``k`` on rank ``r`` (dropout masks) do not
  depend on what ran before: a run resumed at step ``k - 1`` at layout L draws exactly what an
  uninterrupted run at L draws at step ``k``. The sampler has its own generators (seeded by
  ``(seed, epoch)``) and model init uses ``recipe.seed``; nothing else in training is random.

What "exact" means: without dropout the loss and gradients do not depend on the layout (to fp32
round-off: the parity contract), so the continued steps equal an uninterrupted run at the new
layout to round-off. With dropout > 0 the masks are drawn per rank, so runs at two layouts differ
from step 1 on, with or without a resume: a run resumed at another layout continues with exactly the
new layout's masks for the remaining steps, but its earlier steps used the old layout's masks, so
it equals no single-layout run. That is allowed (no single-layout reference exists to match), and
:func:`warn_if_dropout` logs it at resume.

Anything else (another seed, dataset, shuffle or drop_last) is refused with a
:class:`~automodel.errors.UserInputError` that names both layouts and the fix, before the
checkpoint's weights are read.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from automodel.errors import UserInputError

__all__ = ["step_seed", "reseed_for_step", "check_resume_compatible", "dropout_settings", "warn_if_dropout"]

logger = logging.getLogger(__name__)


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for ``(seed, step, rank)``, well mixed (``numpy.random.SeedSequence``)."""
    state = np.random.SeedSequence([int(seed), int(step), int(rank)]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def reseed_for_step(seed: int, step: int, rank: int) -> None:
    """Seed Python, numpy and torch (CPU and CUDA) of this process for optimizer step ``step``
    (0-based: the step about to run). Mutates the global generators."""
    s = step_seed(seed, step, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)  # also seeds every CUDA device


def check_resume_compatible(
    path: Any,
    meta: dict[str, Any],
    saved_layout_desc: str,
    layout_desc: str,
    global_batch_size: int | None,
) -> None:
    """Refuse, before loading anything, a resume that cannot continue the run exactly.

    Args:
        path: the checkpoint directory (for the message).
        meta: its ``meta.json``.
        saved_layout_desc, layout_desc: the two layouts in words.
        global_batch_size: this run's ``step_scheduler.global_batch_size`` (None: not checked).

    Raises:
        UserInputError: the global batch size changed.
    """
    saved_gbs = meta.get("global_batch_size")
    if global_batch_size is not None and saved_gbs is not None and saved_gbs != global_batch_size:
        raise UserInputError(
            f"checkpoint {path} was written with step_scheduler.global_batch_size={saved_gbs} "
            f"({saved_layout_desc}) but this run has global_batch_size={global_batch_size} ({layout_desc}): "
            f"every later optimizer step would average over another number of rows, so the run would not "
            f"continue the checkpointed one; resume with step_scheduler.global_batch_size={saved_gbs} "
            f"(local_batch_size and the dp size may change: grad accumulation absorbs them), or start a "
            f"fresh run"
        )


def dropout_settings(model: torch.nn.Module) -> dict[str, float]:
    """Non-zero dropout probabilities of ``model``: ``nn.Dropout`` modules and ``*dropout*`` /
    ``*pdrop*`` fields of its Hugging Face config (attention dropout is a config field, not a module)."""
    found: dict[str, float] = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        for key, value in config.to_dict().items():
            if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
                found[f"config.{key}"] = float(value)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            found[name or "model"] = float(module.p)
    return found


def warn_if_dropout(model: torch.nn.Module, saved_layout_desc: str, layout_desc: str) -> None:
    """Log (warning) that a layout change under dropout continues with the new layout's masks."""
    found = dropout_settings(model)
    if found:
        logger.warning(
            "elastic resume with dropout (%s): the steps from here on draw exactly the dropout masks of "
            "%s, but the steps before the checkpoint drew those of %s, so this run equals no run at a single "
            "layout (dropout masks are per rank: runs at two layouts differ anyway); set the dropout to 0 "
            "for a layout-independent run",
            ", ".join(f"{k}={v}" for k, v in sorted(found.items())),
            layout_desc,
            saved_layout_desc,
        )
