"""How a training split maps onto optimizer steps, in words, and the warning when one step needs
more rows than the split holds.

The sampler hands out *micro-batch grids* of ``local_batch_size * dp_size`` rows (one micro-step on
every dp rank); an optimizer step is ``grad_acc`` of them, ``global_batch_size`` rows. An epoch is the
split's rows once (``drop_last``: the rows that do not fill a last grid are left out that epoch). When
an epoch has fewer grids than one optimizer step needs, the step runs into the next epoch(s) and sees
rows twice or more: allowed, but said, with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EpochPlan", "epoch_plan"]


@dataclass(frozen=True)
class EpochPlan:
    """``line``: the data line of the run log; ``warning``: None, or why rows repeat within a step."""

    line: str
    warning: str | None


def epoch_plan(
    num_rows: int | None,
    *,
    global_batch_size: int,
    local_batch_size: int,
    dp_size: int,
    drop_last: bool,
    seq_len: int,
) -> EpochPlan:
    """The plan of a training split of ``num_rows`` rows (None: a streaming dataset of unknown length)."""
    grid = local_batch_size * dp_size
    grad_acc = global_batch_size // grid
    step = (
        f"an optimizer step takes {global_batch_size} rows (global batch = local {local_batch_size} x dp "
        f"{dp_size} x grad_acc {grad_acc}), seq_len {seq_len}"
    )
    if num_rows is None:
        return EpochPlan(f"data: streaming train split (length unknown); {step}", None)
    grids = num_rows // grid if drop_last else -(-num_rows // grid)
    used = grids * grid if drop_last else num_rows
    dropped = num_rows - used
    steps = grids / grad_acc
    steps_text = f"{steps:.0f}" if steps == int(steps) else f"{steps:.2f}"
    line = (
        f"data: {num_rows} train rows; {step}; one epoch = {steps_text} optimizer steps"
        + (f" ({dropped} rows left out each epoch: data.drop_last=true)" if dropped else "")
    )
    warning = None
    if 0 < grids < grad_acc:
        most = max(grid, grids * grid)
        warning = (
            f"the training split has {num_rows} rows ({used} per epoch) but one optimizer step takes "
            f"step_scheduler.global_batch_size={global_batch_size} rows, so every step sees rows about "
            f"{global_batch_size / used:.1f} times; set step_scheduler.global_batch_size={most} or lower "
            f"(a multiple of local_batch_size x dp = {grid}), or add training data"
        )
    return EpochPlan(line, warning)
