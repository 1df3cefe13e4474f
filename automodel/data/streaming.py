"""Streaming data for sets bigger than RAM or disk cache: a ``datasets.IterableDataset``, tokenized on the fly.

    data:
      shuffle: false                   # streaming reads in file order (see Limits)
      dataset:
        _target_: automodel.data.streaming.StreamingHFDataset
        path: /data/big/*.jsonl
        format: text

Nothing is tokenized ahead of time and nothing is cached: each dp rank reads its own part of the
stream (``datasets.distributed.split_dataset_by_node``: whole files when their number is a multiple
of ``dp_size``, else every ``dp_size``-th record) and tokenizes records as the loader needs them,
with the same :func:`~automodel.data.hf_tokenize.tokenize_rows` as :class:`HFDataset`. Rows:

- ``format="text"``, ``pack=False``: the rank's documents + EOS concatenated and cut into rows of
  ``seq_len + 1`` tokens (``TextDataset``'s rows over this rank's documents);
- ``format="text"``, ``pack=True``: documents cut into pieces of at most ``seq_len`` inputs, packed;
- ``prompt_completion`` / ``messages``: one example per row, or packed with ``pack=True``.

Position and exact resume: the loader's ``state_dict()`` holds the ``datasets`` stream state taken
just before the record that holds the next unconsumed token/example, plus the offset inside that
record. ``load_state_dict`` reopens the stream there (``IterableDataset.load_state_dict``: for arrow
and parquet a seek, for json a re-read of the current file up to that record) and continues with
exactly the row an uninterrupted run would have produced next.

Epochs end together on every rank: each step the ranks agree (one ``all_reduce`` of one int on the
default group) whether every rank still has a full local batch (``drop_last=True``: else the epoch
ends for all) or any rank has a row (``drop_last=False``: ranks that ran out get all-ignored rows).

Limits: no shuffling (``shuffle=True`` is refused: a shuffle buffer cannot be restored exactly, so
pre-shuffle the files); no length (``len()`` is undefined, steps per epoch are unknown until the
stream ends); the dp shards can differ in size by up to a file, and the epoch stops at the
smallest; resuming needs the same files, ``dp_size``, ``local_batch_size`` and dataset arguments.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from transformers import PreTrainedTokenizerBase

from automodel.data.chat_template import record_chat_stops
from automodel.data.collator import Collator, empty_example
from automodel.data.dataset_common import RowsDataset, state_mismatches
from automodel.data.hf_dataset import choose_format, source_columns, tokenizer_fingerprint
from automodel.data.hf_source import load_hf_source
from automodel.data.hf_tokenize import first_conversation, tokenize_rows
from automodel.data.packing import pack_examples, round_up
from automodel.errors import UserInputError

__all__ = ["StreamingHFDataset", "StreamingDataLoader", "build_streaming_dataloader"]

logger = logging.getLogger(__name__)
_STATE_VERSION = 1


class StreamingHFDataset(RowsDataset, IterableDataset):
    """A streamed Hugging Face dataset; see the module docstring. Build loaders with ``build_dataloader``.

    Args: as :class:`~automodel.data.hf_dataset.HFDataset` (``path``, ``tokenizer``, ``seq_len``,
    ``split``, ``val_fraction``, ``format``, the ``*_column`` mapping, ``source``, ``hf_split``,
    ``name``, ``offline``, ``add_bos``, ``add_eos``, ``pack``, ``seq_pad_multiple``, ``cache_dir``),
    without the tokenization cache arguments.

    Attributes: ``streaming`` (True), ``pad_token_id``, ``seq_pad_multiple``, ``packed``, ``format``,
    ``identity`` (a hash of the arguments, checked on resume), ``chat_stop_ids`` (as ``HFDataset``'s).
    """

    streaming = True

    def __init__(
        self,
        path: Any,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        seq_len: int = 1024,
        split: str = "train",
        val_fraction: float = 0.05,
        format: str = "auto",
        text_column: str = "text",
        prompt_column: str = "prompt",
        completion_column: str = "completion",
        messages_column: str = "messages",
        source: str = "auto",
        hf_split: str = "train",
        name: str | None = None,
        offline: bool = True,
        add_bos: bool = True,
        add_eos: bool = True,
        pack: bool = False,
        seq_pad_multiple: int = 1,
        cache_dir: str | None = None,
    ) -> None:
        from datasets.fingerprint import Hasher

        self._init_rows(tokenizer, seq_len, split, val_fraction, pack, seq_pad_multiple)
        self.columns = source_columns(text_column, prompt_column, completion_column, messages_column)
        where = f"data source {path!r}"
        self.raw = load_hf_source(
            path,
            source=source,
            hf_split=hf_split,
            name=name,
            offline=offline,
            cache_dir=cache_dir,
            streaming=True,
        )
        columns, first = self.raw.column_names, []
        if columns is None:  # json streams know their columns only once read
            try:
                first = [next(iter(self.raw))]
            except StopIteration:
                raise UserInputError(f"{where} is empty; add data") from None
            columns = list(first[0])
        self.format = choose_format(format, list(columns), self.columns, where)
        if self.format == "messages" and not getattr(self.tokenizer, "chat_template", None):
            raise UserInputError(
                f"format='messages' needs a chat template but tokenizer {self.tokenizer.name_or_path!r} has none"
            )
        # the template's end-of-turn token(s), recorded on the tokenizer for the export (chat_template.py)
        self.chat_stop_ids = (
            record_chat_stops(self.tokenizer, first_conversation(first, self.format, self.columns), where)
            if self.format == "messages"
            else []
        )
        self.concat = self.format == "text" and not pack
        self._kwargs = dict(
            tokenizer=self.tokenizer,
            fmt=self.format,
            columns=self.columns,
            seq_len=self.seq_len,
            split=split,
            val_fraction=float(val_fraction),
            pieces=self.format == "text" and pack,
            add_bos=add_bos,
            add_eos=add_eos,
        )
        self.identity = Hasher.hash(
            [str(path), source, hf_split, name, tokenizer_fingerprint(self.tokenizer),
             {k: v for k, v in self._kwargs.items() if k != "tokenizer"}, self.seq_pad_multiple]
        )  # fmt: skip

    def shard(self, dp_rank: int, dp_size: int) -> Any:
        """This dp rank's part of the raw stream (a ``datasets.IterableDataset``)."""
        from datasets.distributed import split_dataset_by_node

        # always a new object: a shard that was positioned with load_state_dict keeps that start
        return split_dataset_by_node(self.raw, rank=dp_rank, world_size=dp_size)

    def units(self, row: dict[str, Any], index: int) -> list[Any]:
        """Tokenize one raw record: its examples (dicts of int64 tensors), or for concatenated text one
        ``[n]`` int64 token array (empty list: the record is skipped)."""
        out = tokenize_rows({k: [v] for k, v in row.items()}, [index], **self._kwargs)
        if self.concat:
            return [np.asarray(ids, dtype=np.int64) for ids in out["ids"]]
        return [
            {"input_ids": torch.tensor(i, dtype=torch.int64), "labels": torch.tensor(lab, dtype=torch.int64)}
            for i, lab in zip(out["input_ids"], out["labels"], strict=True)
        ]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """All rows of the whole (unsharded) stream, in order; training uses ``build_dataloader``."""
        return _RowCursor(self, self.shard(0, 1), None).rows()


class _RowCursor:
    """Reads rows from one raw stream shard and knows the exact position of the next unread unit."""

    def __init__(self, ds: StreamingHFDataset, raw: Any, position: dict[str, Any] | None) -> None:
        self.ds, self.raw = ds, raw
        self._ended = bool(position and position.get("end"))  # saved right at the end of the stream
        if self._ended:
            position = None
        if position is not None:
            raw.load_state_dict(copy.deepcopy(position["stream"]))
            self.read = int(position["read"])
        else:
            self.read = 0  # records read so far in this shard (for error messages)
        self._it = iter(raw)
        self._before: dict[str, Any] | None = None  # stream state before the current record
        self._units: list[Any] = []
        self._k = 0  # next unit of the current record (concat: next token offset)
        skip = int(position["offset"]) if position is not None else 0
        if self._fill() and skip:
            self._k = skip

    def _fill(self) -> bool:
        """Make sure a current record with unread units exists; False at the end of the stream."""
        while not self._units or self._k >= self._len():
            if self._ended:
                return False
            before = copy.deepcopy(self.raw.state_dict())
            try:
                row = next(self._it)
            except StopIteration:
                self._units, self._ended = [], True
                return False
            self._before, self._units, self._k = before, self.ds.units(row, self.read), 0
            self.read += 1
        return True

    def _len(self) -> int:
        return len(self._units[0]) if self.ds.concat else len(self._units)

    def position(self) -> dict[str, Any] | None:
        """Where the next row starts (None: at the end of the stream)."""
        if not self._fill():
            return None
        return {"stream": copy.deepcopy(self._before), "offset": self._k, "read": self.read - 1}

    def _next_example(self, fits: int | None) -> dict[str, torch.Tensor] | None:
        if not self._fill():
            return None
        ex = self._units[self._k]
        if fits is not None and round_up(ex["input_ids"].numel(), self.ds.seq_pad_multiple) > fits:
            return None
        self._k += 1
        return ex

    def next_row(self) -> dict[str, torch.Tensor] | None:
        """The next row, or None at the end of the stream (a partial text row at the end is dropped)."""
        ds = self.ds
        if ds.concat:
            width, parts, have = ds.seq_len + 1, [], 0
            while have < width:
                if not self._fill():
                    return None
                doc = self._units[0]
                take = doc[self._k : self._k + width - have]
                parts.append(take)
                have += len(take)
                self._k += len(take)
            row = torch.from_numpy(np.concatenate(parts))
            return {"input_ids": row[:-1].clone(), "labels": row[1:].clone()}
        if not ds.packed:
            return self._next_example(None)
        docs, used = [], 0
        while True:
            ex = self._next_example(None if not docs else ds.seq_len - used)
            if ex is None:
                break
            docs.append(ex)
            used += round_up(ex["input_ids"].numel(), ds.seq_pad_multiple)
        if not docs:
            return None
        (row,) = pack_examples(
            docs, seq_len=ds.seq_len, seq_pad_multiple=ds.seq_pad_multiple, pad_token_id=ds.pad_token_id
        )
        return row

    def rows(self) -> Iterator[dict[str, torch.Tensor]]:
        while (row := self.next_row()) is not None:
            yield row


def _agree(value: int, op: str) -> int:
    """``value`` reduced (min/max) over the default process group (itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
    return int(t.item())


class StreamingDataLoader:
    """Batches of one dp rank from a :class:`StreamingHFDataset`; resumable at the exact row.

    The same epoch API as :class:`~automodel.data.dataloader.ResumableDataLoader`: ``for batch in
    loader`` yields the rest of the current epoch; ``state_dict()`` after a step, ``load_state_dict``
    to continue. Every rank of the default process group must iterate in step (the end of an epoch
    is agreed on by a collective).
    """

    def __init__(
        self,
        dataset: StreamingHFDataset,
        *,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        collator: Collator,
        drop_last: bool,
    ) -> None:
        self.dataset = dataset
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.collator = collator
        self.drop_last = drop_last
        self.epoch = 0
        self.step_in_epoch = 0
        self._position: dict[str, Any] | None = None  # None = the start of the epoch
        self._generation = 0

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.step_in_epoch, self._position = int(epoch), 0, None
        self._generation += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self._generation += 1
        gen = self._generation
        raw = self.dataset.shard(self.dp_rank, self.dp_size)
        cursor = _RowCursor(self.dataset, raw, self._position)
        while True:
            if gen != self._generation:
                raise RuntimeError("this streaming loader iterator is stale: a newer one was started")
            rows = []
            while len(rows) < self.local_batch_size and (row := cursor.next_row()) is not None:
                rows.append(row)
            full = len(rows) == self.local_batch_size
            go = _agree(int(full), "min") if self.drop_last else _agree(int(bool(rows)), "max")
            if not go:
                if self.step_in_epoch == 0:
                    raise UserInputError(
                        f"the stream of {self.dataset.format} data yields no "
                        f"{'full ' if self.drop_last else ''}batch of {self.local_batch_size} rows on some dp "
                        f"rank (dp_size={self.dp_size}); add data, lower the batch size or seq_len"
                    )
                self.epoch, self.step_in_epoch, self._position = self.epoch + 1, 0, None
                return
            rows += [empty_example(self.dataset.packed)] * (self.local_batch_size - len(rows))
            self.step_in_epoch += 1
            self._position = cursor.position()
            if self._position is None:  # the stream ended exactly here: mark "at the end"
                self._position = {"end": True}
            yield self.collator(rows)

    def state_dict(self) -> dict[str, Any]:
        """``{"streaming": {...}}``: the epoch, step and stream position (plain, picklable values)."""
        return {
            "streaming": {
                "version": _STATE_VERSION,
                "epoch": self.epoch,
                "step": self.step_in_epoch,
                "position": copy.deepcopy(self._position),
                "dp_size": self.dp_size,
                "local_batch_size": self.local_batch_size,
                "drop_last": self.drop_last,
                "identity": self.dataset.identity,
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s position; ``UserInputError`` if the run differs."""
        s = state.get("streaming") if isinstance(state, dict) else None
        if not isinstance(s, dict) or s.get("version") != _STATE_VERSION:
            raise UserInputError(
                "the checkpoint's data position is not a streaming loader state (was it saved with a map-style "
                "dataset?); resume with the dataset it was saved with"
            )
        bad = state_mismatches(
            s, self.state_dict()["streaming"], ("dp_size", "local_batch_size", "drop_last", "identity")
        )
        if bad:
            raise UserInputError(
                "cannot resume the streaming loader exactly: "
                + "; ".join(bad)
                + ". Resume with the same data "
                "files and dataset arguments, dp size and batch size, or start a fresh run"
            )
        self.epoch, self.step_in_epoch = int(s["epoch"]), int(s["step"])
        self._position = copy.deepcopy(s["position"])
        self._generation += 1


def build_streaming_dataloader(
    dataset: StreamingHFDataset,
    *,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    pad_to_multiple_of: int = 1,
    pad_token_id: int | None = None,
    shuffle: bool = False,
    drop_last: bool = True,
    emit_attention_mask: bool = False,
    **_: Any,
) -> StreamingDataLoader:
    """The streaming counterpart of :func:`~automodel.data.dataloader.build_dataloader` (same arguments;
    ``seed`` is unused). Raises ``UserInputError`` for ``shuffle=True`` (see Limits)."""
    if shuffle:
        raise UserInputError(
            "streaming datasets are read in file order and cannot be shuffled with an exactly resumable "
            "position; set data.shuffle=false and shuffle the files beforehand (or use HFDataset, which "
            "memory-maps the data and shuffles exactly)"
        )
    for name, v, lo in (
        ("local_batch_size", local_batch_size, 1),
        ("dp_size", dp_size, 1),
        ("dp_rank", dp_rank, 0),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be < dp_size={dp_size}")
    m = dataset.seq_pad_multiple
    if pad_to_multiple_of % m != 0:
        raise ValueError(
            f"pad_to_multiple_of={pad_to_multiple_of} is not a multiple of the packed dataset's "
            f"seq_pad_multiple={m}; set data.pad_to_multiple_of to a multiple of {m}"
        )
    collator = Collator(
        dataset.pad_token_id if pad_token_id is None else pad_token_id,
        pad_to_multiple_of,
        emit_attention_mask,
    )
    return StreamingDataLoader(
        dataset,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        collator=collator,
        drop_last=drop_last,
    )
