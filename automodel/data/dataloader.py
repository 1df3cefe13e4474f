"""A resumable data loader: dataset + dp-aware batch sampler + collator, in the calling process.

Epoch API: ``for batch in loader`` yields the *remaining* batches of the current epoch (all of
them after a fresh start or an epoch boundary, the rest after ``load_state_dict``) and then stops;
the position has already rolled to the next epoch by then, so the usual training loop is

    while step < max_steps:
        for batch in loader:          # one (possibly partial) epoch
            ...; step += 1
            if step == max_steps: break

and a checkpoint stores ``loader.state_dict()`` taken after the step that consumed the batch;
``load_state_dict`` then makes the next ``iter(loader)`` continue with exactly the batch an
uninterrupted run would have seen next. ``len(loader)`` is the number of batches per epoch, the
same on every dp rank.

Batches are built in the calling process (no worker processes): the datasets here are
pre-tokenized in memory, so a batch is a few tensor copies, and the position bookkeeping stays
trivially exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from automodel.data.collator import Collator, empty_example
from automodel.data.sampler import FILLER_INDEX, DistributedBatchSampler
from automodel.errors import UserInputError

__all__ = ["ResumableDataLoader", "build_dataloader"]


class ResumableDataLoader:
    """Iterates dicts of CPU tensors (see ``collator.py``) for one dp rank; resumable exactly.

    Attributes: ``dataset``, ``sampler`` (:class:`DistributedBatchSampler`), ``collator``
    (:class:`Collator`), ``epoch`` (current epoch), ``step_in_epoch``.
    """

    def __init__(self, dataset: Dataset, sampler: DistributedBatchSampler, collator: Collator) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.collator = collator
        self._packed = bool(getattr(dataset, "packed", False))

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def step_in_epoch(self) -> int:
        return self.sampler.step

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch

    def _example(self, index: int) -> dict[str, torch.Tensor]:
        return empty_example(self._packed) if index == FILLER_INDEX else self.dataset[index]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for indices in self.sampler:
            yield self.collator([self._example(i) for i in indices])

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": {...epoch, step, seed, ...}}``: plain Python values (picklable, JSON-able)."""
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (checks that the data/seed/batch match)."""
        if not isinstance(state, dict) or "sampler" not in state:
            raise ValueError(f"not a data loader state (expected a dict with key 'sampler'): {state!r}")
        self.sampler.load_state_dict(state["sampler"])


def build_dataloader(
    dataset: Dataset,
    *,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    pad_to_multiple_of: int = 1,
    pad_token_id: int | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    emit_attention_mask: bool = False,
) -> ResumableDataLoader:
    """Build the loader for one dp rank.

    Args:
        dataset: a map-style dataset of example dicts (``TextDataset``, ``InstructionDataset``,
            ``HFDataset``, ...); a ``StreamingHFDataset`` gets a ``StreamingDataLoader`` instead.
        local_batch_size: rows per step on this rank.
        dp_rank, dp_size: data-parallel coordinate; context/tensor-parallel peers must pass the same
            ``dp_rank`` so they see the same rows (never the global rank).
        seed: seed of the per-epoch shuffles (int >= 0).
        pad_to_multiple_of: batch sequence length is rounded up to this; use ``2 * cp_size``
            (ring CP's load balancing splits a sequence into ``2 * cp_size`` chunks). For packed
            datasets it must be a multiple of the dataset's ``seq_pad_multiple``.
        pad_token_id: padding token; None = ``dataset.pad_token_id``.
        shuffle: reshuffle every epoch (use False for validation).
        drop_last: drop the last incomplete global batch; False fills it with all-ignored rows so each
            row is used exactly once (use for validation).
        emit_attention_mask: add a padding ``attention_mask`` to batches that have padding (only for
            runs without context parallelism; exactness never depends on it).

    Raises:
        ValueError: bad sizes/ranks, a dataset smaller than one global batch with ``drop_last``, or a
            ``pad_to_multiple_of`` incompatible with a packed dataset.
    """
    if getattr(dataset, "streaming", False):  # a StreamingHFDataset: no length, read in order
        from automodel.data.streaming import build_streaming_dataloader

        return build_streaming_dataloader(  # type: ignore[return-value]
            dataset, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size,
            pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id, shuffle=shuffle,
            drop_last=drop_last, emit_attention_mask=emit_attention_mask,
        )  # fmt: skip
    if pad_token_id is None:
        pad_token_id = getattr(dataset, "pad_token_id", None)
        if pad_token_id is None:
            raise ValueError(
                f"{type(dataset).__name__} has no pad_token_id attribute; pass pad_token_id= (e.g. tokenizer.pad_token_id)"
            )
    m = getattr(dataset, "seq_pad_multiple", 1)
    if isinstance(pad_to_multiple_of, int) and pad_to_multiple_of >= 1 and pad_to_multiple_of % m != 0:
        raise UserInputError(
            f"pad_to_multiple_of={pad_to_multiple_of} is not a multiple of the packed dataset's "
            f"seq_pad_multiple={m}: the row padding is added to the last document, which must stay a "
            f"multiple of {m}; set data.pad_to_multiple_of to a multiple of {m}"
        )
    if hasattr(dataset, "make_collator"):  # e.g. image-text data (automodel.data.vlm_dataset)
        collator = dataset.make_collator(pad_token_id, pad_to_multiple_of)
    else:
        collator = Collator(pad_token_id, pad_to_multiple_of, emit_attention_mask)
    sampler = DistributedBatchSampler(
        len(dataset),
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    return ResumableDataLoader(dataset, sampler, collator)
