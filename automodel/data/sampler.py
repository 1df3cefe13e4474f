"""Deterministic, resumable batch sampler over the data-parallel ranks.

Rows are handed out in *global batches* of ``G = local_batch_size * dp_size`` rows. In epoch
``e`` the row order is a permutation drawn from ``numpy.random.Generator(PCG64([seed, e]))``
(identity when ``shuffle=False``); global batch ``k`` is ``order[k*G : (k+1)*G]`` and dp rank ``r``
takes the contiguous slice ``[r*B : (r+1)*B]`` of it (``B = local_batch_size``). Hence:

- ranks of one dp group (e.g. the context-parallel ranks that share a sequence) pass the same
  ``dp_rank`` and get the same rows; different dp ranks get disjoint rows;
- the *global* batch at each step depends only on ``(seed, epoch, step, G)``, not on how ``G`` is
  split across ranks, so ``dp_size=2, B=2`` sees the same rows per step as ``dp_size=1, B=4``, and
  a run may resume with another ``dp_size`` as long as ``G`` is unchanged;
- a run may even resume with another ``G`` (elastic resume: ``dp_size`` changed, grad accumulation
  absorbs it) when the position maps exactly: an epoch spans the same rows at both ``G``
  (``batches_per_epoch * G`` equal) and the rows consumed in the current epoch are a whole number
  of new batches. Then the sampler is exactly where an uninterrupted run with the new ``G`` would
  be, since both consumed the same rows of the same per-epoch permutations;
- ``drop_last=True`` drops the last incomplete global batch of each epoch; ``drop_last=False``
  completes it with filler index ``-1`` (an empty example whose labels are all -100, so every
  row is seen exactly once per epoch and every rank runs the same number of steps).

The position is ``(epoch, step)`` = global batches consumed in the epoch; it advances when a batch
is handed out, and rolls over to ``(epoch + 1, 0)`` right after an epoch's last batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from automodel.data.dataset_common import state_mismatches
from automodel.errors import UserInputError

__all__ = ["DistributedBatchSampler", "FILLER_INDEX"]

FILLER_INDEX = -1
_STATE_VERSION = 1


def _int(name: str, value: object, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; {fix}")
    return int(value)


class DistributedBatchSampler:
    """Yields this dp rank's list of row indices for each step (see module docstring).

    Args:
        num_rows: dataset length.
        local_batch_size: rows per step on this rank (``B``).
        dp_rank, dp_size: this rank's data-parallel coordinate (NOT the global rank: CP/TP peers
            pass the same ``dp_rank``).
        seed: base seed (int >= 0) of the per-epoch permutations.
        shuffle: permute rows each epoch (else dataset order every epoch).
        drop_last: drop the last incomplete global batch (else fill it with ``FILLER_INDEX``).
    """

    def __init__(
        self,
        num_rows: int,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.num_rows = _int("num_rows", num_rows, 1, "the dataset is empty; add data or lower seq_len")
        self.local_batch_size = _int("local_batch_size", local_batch_size, 1, "set a positive batch size")
        self.dp_size = _int("dp_size", dp_size, 1, "dp_size is the number of data-parallel replicas")
        self.dp_rank = _int("dp_rank", dp_rank, 0, "dp_rank is this rank's data-parallel index")
        if self.dp_rank >= self.dp_size:
            raise ValueError(
                f"dp_rank={dp_rank} must be < dp_size={dp_size}; pass the rank's index in the data-parallel "
                "group (e.g. from the device mesh), not its global rank"
            )
        self.seed = _int("seed", seed, 0, "use a non-negative integer seed")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.global_batch_size = self.local_batch_size * self.dp_size
        if self.drop_last and self.num_rows < self.global_batch_size:
            raise UserInputError(
                f"the dataset has {self.num_rows} rows, fewer than one global batch of {self.global_batch_size} "
                f"(local_batch_size={self.local_batch_size} x dp_size={self.dp_size}), so drop_last=True would "
                "yield nothing; lower the batch size or seq_len, add data, or use drop_last=False"
            )
        self.epoch = 0
        self.step = 0
        self._generation = 0

    @property
    def batches_per_epoch(self) -> int:
        """Steps per epoch (the same on every dp rank)."""
        if self.drop_last:
            return self.num_rows // self.global_batch_size
        return -(-self.num_rows // self.global_batch_size)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch``: ``[num_rows]`` int64 permutation (same on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_rows, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64([self.seed, int(epoch)]))
        return rng.permutation(self.num_rows).astype(np.int64)

    def local_indices(self, epoch: int, step: int) -> list[int]:
        """This rank's row indices for global batch ``step`` of ``epoch`` (``FILLER_INDEX`` = filler)."""
        if not 0 <= step < self.batches_per_epoch:
            raise IndexError(f"step {step} outside [0, {self.batches_per_epoch})")
        return self._slice(self.epoch_order(epoch), step)

    def _slice(self, order: np.ndarray, step: int) -> list[int]:
        start = step * self.global_batch_size + self.dp_rank * self.local_batch_size
        stop = start + self.local_batch_size
        return [int(order[i]) if i < self.num_rows else FILLER_INDEX for i in range(start, stop)]

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch = _int("epoch", epoch, 0, "epochs count from 0")
        self.step = 0
        self._generation += 1  # invalidate live iterators

    def __iter__(self) -> Iterator[list[int]]:
        """Yield the remaining local batches of the current epoch, advancing the position.

        Only the newest iterator is live: starting a new one makes an older one raise
        ``RuntimeError`` on its next step (two iterators would both advance the position).
        """
        self._generation += 1
        gen = self._generation
        epoch = self.epoch
        order = self.epoch_order(epoch)
        while True:
            if gen != self._generation:
                raise RuntimeError(
                    "this sampler iterator is stale: a newer iterator was started or the position was reset"
                )
            if self.epoch != epoch or self.step >= self.batches_per_epoch:
                return
            idx = self._slice(order, self.step)
            self.step += 1
            if self.step == self.batches_per_epoch:
                self.epoch, self.step = epoch + 1, 0
            yield idx

    def state_dict(self) -> dict[str, Any]:
        """Position and the settings that must match on resume (plain ints/bools, picklable)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "num_rows": self.num_rows,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position. Raises ``ValueError`` if the seed, dataset length, shuffle
        or drop_last differ (the resumed rows would silently differ); ``dp_size`` may differ (the
        global batches do not depend on it), and so may ``G`` where :meth:`map_step` maps the
        position exactly."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"unknown sampler state version {state.get('version')!r}; expected {_STATE_VERSION}"
            )
        bad = state_mismatches(state, self.state_dict(), ("seed", "num_rows", "shuffle", "drop_last"))
        if bad:
            raise ValueError(
                "cannot resume the data loader exactly: " + "; ".join(bad) + ". Resume with the same data, "
                "seq_len, seed and global batch size (local_batch_size * dp_size), or start a fresh run"
            )
        epoch, step = _int("epoch", state["epoch"], 0, ""), _int("step", state["step"], 0, "")
        step = self.map_step(step, _int("global_batch_size", state["global_batch_size"], 1, ""))
        if step >= self.batches_per_epoch:
            raise ValueError(f"checkpoint step {step} >= batches_per_epoch {self.batches_per_epoch}")
        self.epoch, self.step = epoch, step
        self._generation += 1  # invalidate live iterators

    def map_step(self, step: int, saved_global_batch_size: int) -> int:
        """Step in the current epoch at this sampler's ``G`` that equals ``step`` batches of
        ``saved_global_batch_size`` rows (the identity when ``G`` is unchanged).

        Raises ``ValueError`` when no step is exact: an epoch would span other rows (``drop_last``
        cuts ``num_rows`` to a multiple of ``G``), or the rows consumed so far in the epoch are not
        a whole number of new global batches.
        """
        g_old, g_new = saved_global_batch_size, self.global_batch_size
        if g_old == g_new:
            return step
        n = self.num_rows
        span_old = (n // g_old if self.drop_last else -(-n // g_old)) * g_old
        span_new = self.batches_per_epoch * g_new
        rows = step * g_old
        if span_old != span_new or rows % g_new:
            why = (
                f"an epoch spans {span_old} rows at {g_old} rows per batch but {span_new} at {g_new}"
                if span_old != span_new
                else f"{rows} rows of the epoch are consumed, not a whole number of batches of {g_new}"
            )
            raise ValueError(
                f"global_batch_size: checkpoint {g_old} != now {g_new} rows per data-loader batch "
                f"(local_batch_size * dp_size) and the data position cannot be mapped exactly: {why}. "
                f"Resume with local_batch_size * dp_size = {g_old} (grad accumulation absorbs the dp "
                f"change), or start a fresh run"
            )
        return rows // g_new
