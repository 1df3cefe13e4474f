"""A map-style dataset on Hugging Face ``datasets``: tokenized once per node, cached on disk, memory-mapped.

    data:
      dataset:
        _target_: automodel.data.hf_dataset.HFDataset
        path: /data/sft.jsonl          # files/globs, a save_to_disk folder, or a cached hub id
        format: messages               # text | prompt_completion | messages | auto

Steps, on local rank 0 of each node while the node's other ranks wait (``node_first.py``):

1. open the source (:func:`~automodel.data.hf_source.load_hf_source`; ``datasets`` converts json/csv
   to arrow once and caches that too);
2. ``Dataset.map(tokenize_rows, batched=True, num_proc=...)`` into an arrow file named by a
   fingerprint of (the source's fingerprint, the tokenizer's vocabulary/merges/chat template/special
   tokens, every argument that changes the examples, a format version). The file holds both splits:
   each row carries its record's content-hash place ``split_u``, so the train and validation datasets
   of a run (and any ``val_fraction``) share one tokenization; each selects its rows by ``split_u``. A second run with the same
   inputs finds the file and tokenizes nothing (``tokenized_from_cache`` is True); any change gives
   a new fingerprint and a new file.

Then every rank opens the arrow file memory-mapped: a rank's RAM holds the row index, not the data.

Rows are exactly those of the in-memory datasets on the same records: ``format="text"`` gives the
rows of :class:`~automodel.data.text_dataset.TextDataset` (documents + EOS concatenated and cut into
``seq_len + 1`` token rows; ``pack=True``: documents cut into pieces and packed), ``prompt_completion``
and ``messages`` give the examples of :class:`~automodel.data.instruction_dataset.InstructionDataset`
(``prompt_response`` / ``messages``). ``split`` is the same content-hash train/validation split, so
the collator, packing, sampler and CP batching work unchanged.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from automodel.data.chat_template import record_chat_stops
from automodel.data.dataset_common import RowsDataset
from automodel.data.hf_source import load_hf_source, no_progress_bars
from automodel.data.hf_tokenize import HF_FORMATS, first_conversation, required_columns, tokenize_rows
from automodel.data.node_first import run_local_rank0_first
from automodel.data.packing import pack_examples, round_up
from automodel.errors import UserInputError

__all__ = ["HFDataset", "source_columns", "TOKENIZED_FORMAT_VERSION", "choose_format", "tokenizer_fingerprint"]

logger = logging.getLogger(__name__)

# Bump when tokenize_rows changes what it writes: old caches then stop matching.
TOKENIZED_FORMAT_VERSION = 2  # 2: one file for both splits (split_u column)
AUTO_NUM_PROC_MIN_ROWS = 20_000


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of everything in ``tokenizer`` that changes token ids or the chat rendering."""
    from datasets.fingerprint import Hasher

    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else Hasher.hash(tokenizer.get_vocab())
    return Hasher.hash(
        [
            type(tokenizer).__name__,
            vocab,
            getattr(tokenizer, "chat_template", None),
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
            sorted(tokenizer.get_added_vocab().items()),
        ]
    )


def choose_format(fmt: str, column_names: list[str], columns: dict[str, str], where: str) -> str:
    """Resolve ``format="auto"`` from the columns and check the needed columns exist.

    Raises ``UserInputError`` naming the missing column, the columns there are and the key to set.
    """
    if fmt not in (*HF_FORMATS, "auto"):
        raise UserInputError(
            f"data.dataset.format={fmt!r} is not one of {('auto', *HF_FORMATS)}; use text for documents, "
            "prompt_completion for prompt/completion columns, messages for chat rows"
        )
    if fmt == "auto":
        if columns["messages"] in column_names:
            fmt = "messages"
        elif columns["prompt"] in column_names and columns["completion"] in column_names:
            fmt = "prompt_completion"
        elif columns["text"] in column_names:
            fmt = "text"
        else:
            raise UserInputError(
                f"{where} has columns {column_names}: none of {columns['messages']!r} (messages), "
                f"{columns['prompt']!r}+{columns['completion']!r} (prompt_completion) or {columns['text']!r} "
                "(text); set data.dataset.format and the matching *_column key (text_column, prompt_column, "
                "completion_column, messages_column)"
            )
    key = {"text": "text_column", "prompt_completion": "prompt_column/completion_column"}.get(
        fmt, "messages_column"
    )
    for c in required_columns(fmt, columns):
        if c not in column_names:
            raise UserInputError(
                f"{where} has no column {c!r} (columns: {column_names}), which format={fmt!r} reads; set "
                f"data.dataset.{key} to the column that holds it, or choose another format"
            )
    return fmt


def _greedy_rows(lengths: np.ndarray, seq_len: int, multiple: int) -> np.ndarray:
    """Start index of every packed row (plus the end), packing examples greedily in order exactly like
    :func:`~automodel.data.packing.pack_examples`: ``[R + 1]`` int64."""
    starts, used = [0], 0
    for i, n in enumerate(lengths.tolist()):
        p = round_up(n, multiple)
        if used and used + p > seq_len:
            starts.append(i)
            used = 0
        used += p
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def source_columns(text: str, prompt: str, completion: str, messages: str) -> dict[str, str]:
    """The column mapping of :class:`HFDataset` and :class:`~automodel.data.streaming.StreamingHFDataset`."""
    return {"text": text, "prompt": prompt, "completion": completion, "messages": messages}


class HFDataset(RowsDataset, Dataset):
    """Rows from a Hugging Face ``datasets`` source, tokenized once per node and memory-mapped.

    Args:
        path: data files / globs (json, jsonl, parquet, arrow, csv), a ``save_to_disk`` folder, or a
            hub id present in the local cache (see :mod:`automodel.data.hf_source`).
        tokenizer: a tokenizer, or a name/path/None for ``load_tokenizer``.
        seq_len: input positions per row (>= 2).
        split: ``train`` / ``validation`` (by content hash, as ``TextDataset``) or ``all``.
        val_fraction: fraction held out for ``validation``.
        format: ``text``, ``prompt_completion``, ``messages`` or ``auto`` (from the columns).
        text_column, prompt_column, completion_column, messages_column: the column mapping.
        source, hf_split, name, offline: how to open ``path`` (``load_hf_source``); ``offline=True``
            never touches the network.
        add_bos, add_eos: ``prompt_completion`` only, as in ``InstructionDataset``.
        pack, seq_pad_multiple: pack examples per row (``packing.py``).
        num_proc: tokenizer processes on local rank 0; None = 1 below 20,000 rows, else the CPUs this
            process may use (at most 16).
        map_batch_size: rows per ``tokenize_rows`` call.
        cache_dir: ``datasets``' cache for converted sources and the tokenized file (default
            ``HF_DATASETS_CACHE``; the tokenized file goes next to the source's arrow files, or, when
            that folder is not writable, to ``HF_DATASETS_CACHE/automodel_tokenized``).

    Items: ``input_ids``/``labels`` ``[n]`` int64 (``[seq_len]`` for text rows), or packed rows
    (``position_ids``, ``seq_lens``, ``seq_lens_padded``). Attributes: ``pad_token_id``,
    ``seq_pad_multiple``, ``packed``, ``format``, ``num_examples``, ``num_truncated``,
    ``tokenized_from_cache``, ``cache_file``, ``chat_stop_ids`` (``messages``: the template's end-of-turn
    token ids, also recorded on the tokenizer for the export; else empty).
    """

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
        num_proc: int | None = None,
        map_batch_size: int = 1000,
        cache_dir: str | None = None,
    ) -> None:
        if num_proc is not None and (
            isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1
        ):
            raise UserInputError(f"data.dataset.num_proc={num_proc!r} must be null or an integer >= 1")
        self._init_rows(tokenizer, seq_len, split, val_fraction, pack, seq_pad_multiple)
        self.columns = source_columns(text_column, prompt_column, completion_column, messages_column)
        self.where = f"data source {path!r}"
        opts = dict(source=source, hf_split=hf_split, name=name, offline=offline, cache_dir=cache_dir)
        self.tokenized_from_cache = False

        def prepare() -> Any:
            with no_progress_bars():  # loading and tokenizing are logged instead
                return _prepare()

        def _prepare() -> Any:
            src = load_hf_source(path, **opts)
            fmt = choose_format(format, list(src.column_names), self.columns, self.where)
            if fmt == "messages" and not getattr(self.tokenizer, "chat_template", None):
                raise UserInputError(
                    f"format='messages' needs a chat template but tokenizer {self.tokenizer.name_or_path!r} has "
                    "none; use a tokenizer with a chat_template (the shipped default has one)"
                )
            tok = self._tokenize(src, fmt, split, val_fraction, add_bos, add_eos, num_proc, map_batch_size, cache_dir)
            return fmt, tok, first_conversation(src, fmt, self.columns)

        self.format, tok, conversation = run_local_rank0_first(prepare, "tokenizing " + self.where)
        # the template's end-of-turn token(s), recorded on the tokenizer for the export (chat_template.py)
        self.chat_stop_ids = (
            record_chat_stops(self.tokenizer, conversation, self.where) if self.format == "messages" else []
        )
        # one tokenized file for both splits: this split's rows are selected by their split_u column
        rows = np.arange(len(tok), dtype=np.int64)
        if split != "all":
            u = tok.data.column("split_u").to_numpy()
            rows = np.nonzero((u < float(val_fraction)) == (split == "validation"))[0]
            tok = tok.select(rows) if len(rows) != len(u) else tok
        self._tok = tok
        self.num_examples = len(tok)
        if self.num_examples == 0:
            raise UserInputError(
                f"split {split!r} of {self.where} has no rows (val_fraction={val_fraction}); add data, raise "
                "val_fraction, or use split='all' with a separate validation file"
            )
        # tok.data is the whole file (a select() only adds an index mapping): take this split's rows
        lengths = tok.data.column("n").to_numpy().astype(np.int64)[rows]
        self.num_truncated = (
            0 if self.format == "text" and not pack else int(np.sum(tok.data.column("truncated").to_numpy()[rows]))
        )
        if self.format == "text" and not pack:
            self._doc_ends = np.cumsum(lengths)
            self.num_tokens = int(self._doc_ends[-1])
            self._num_rows = self.num_tokens // (self.seq_len + 1)
            if self._num_rows == 0:
                raise UserInputError(
                    f"split {split!r} of {self.where} has {self.num_tokens} tokens, fewer than one row of "
                    f"seq_len+1={self.seq_len + 1}; lower data.seq_len, raise val_fraction, or add data"
                )
            self._np = tok.with_format("numpy", columns=["ids"])
        else:
            self._np = tok.with_format("numpy", columns=["input_ids", "labels"])
            if pack:
                self._row_starts = _greedy_rows(lengths, self.seq_len, self.seq_pad_multiple)
                self._num_rows = len(self._row_starts) - 1
            else:
                self._num_rows = self.num_examples
        if self.num_truncated:
            logger.info("%d of %d examples of %s truncated to seq_len+1=%d tokens", self.num_truncated,
                        self.num_examples, self.where, self.seq_len + 1)  # fmt: skip

    def _tokenize(
        self,
        src: Any,
        fmt: str,
        split: str,
        val_fraction: float,
        add_bos: bool,
        add_eos: bool,
        num_proc: int | None,
        map_batch_size: int,
        cache_dir: str | None,
    ) -> Any:
        from datasets import config as dconfig
        from datasets.fingerprint import Hasher

        pieces = fmt == "text" and self.packed
        kwargs = dict(
            tokenizer=self.tokenizer,
            fmt=fmt,
            columns=self.columns,
            seq_len=self.seq_len,
            split="all",  # both splits in one file (split_u), whichever split this instance reads
            val_fraction=0.5,  # unused with split="all"
            pieces=pieces,
            add_bos=add_bos,
            add_eos=add_eos,
            split_column=True,
        )
        fp = Hasher.hash(
            [
                TOKENIZED_FORMAT_VERSION,
                src._fingerprint,
                tokenizer_fingerprint(self.tokenizer),
                {k: v for k, v in kwargs.items() if k != "tokenizer"},
            ]
        )
        if num_proc is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            num_proc = 1 if len(src) < AUTO_NUM_PROC_MIN_ROWS else max(1, min(16, cpus))
        num_proc = max(1, min(num_proc, len(src)))
        if cache_dir is not None:
            folder = os.path.expanduser(cache_dir)
        elif src.cache_files and os.access(os.path.dirname(src.cache_files[0]["filename"]), os.W_OK):
            folder = os.path.dirname(src.cache_files[0]["filename"])  # read-only sources: see below
        else:
            folder = os.path.join(dconfig.HF_DATASETS_CACHE, "automodel_tokenized")
        os.makedirs(folder, exist_ok=True)
        self.cache_file = os.path.join(folder, f"automodel-tokenized-{fp}.arrow")
        stem = self.cache_file[: -len(".arrow")]
        # datasets reuses a complete set of shards written with any num_proc (or the single file)
        shards: dict[int, int] = {}
        for f in glob.glob(glob.escape(stem) + "_*_of_*.arrow"):
            n = f[: -len(".arrow")].rsplit("_of_", 1)[1]
            shards[int(n)] = shards.get(int(n), 0) + 1
        self.tokenized_from_cache = os.path.isfile(self.cache_file) or any(c == n for n, c in shards.items())
        logger.info(
            "%s %s (%d rows, format=%s) %s %s",
            "opening cached tokenized" if self.tokenized_from_cache else "tokenizing",
            self.where,
            len(src),
            fmt,
            "from" if self.tokenized_from_cache else f"with num_proc={num_proc} into",
            stem + ("*" if shards or num_proc > 1 else "") + ".arrow",
        )
        return src.map(
            tokenize_rows,
            batched=True,
            batch_size=map_batch_size,
            with_indices=True,
            remove_columns=list(src.column_names),
            fn_kwargs=kwargs,
            num_proc=num_proc if num_proc > 1 else None,
            new_fingerprint=fp,
            cache_file_name=self.cache_file,
            load_from_cache_file=True,
            desc=f"tokenizing ({fmt})",
        )

    def __len__(self) -> int:
        return self._num_rows

    def _example(self, i: int) -> dict[str, torch.Tensor]:
        ex = self._np[int(i)]
        return {
            "input_ids": torch.from_numpy(np.asarray(ex["input_ids"], dtype=np.int64)),
            "labels": torch.from_numpy(np.asarray(ex["labels"], dtype=np.int64)),
        }

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._num_rows <= index < self._num_rows:
            raise IndexError(f"row {index} out of range for {self._num_rows} rows")
        index %= self._num_rows
        if self.format == "text" and not self.packed:
            width = self.seq_len + 1
            start, stop = index * width, (index + 1) * width
            d0 = int(np.searchsorted(self._doc_ends, start, side="right"))
            d1 = int(np.searchsorted(self._doc_ends, stop - 1, side="right"))
            docs = self._np[d0 : d1 + 1]["ids"]
            stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
            offset = start - (int(self._doc_ends[d0 - 1]) if d0 > 0 else 0)
            row = torch.from_numpy(stream[offset : offset + width].copy())
            return {"input_ids": row[:-1].clone(), "labels": row[1:].clone()}
        if not self.packed:
            return self._example(index)
        a, b = int(self._row_starts[index]), int(self._row_starts[index + 1])
        (row,) = pack_examples(
            [self._example(i) for i in range(a, b)],
            seq_len=self.seq_len,
            seq_pad_multiple=self.seq_pad_multiple,
            pad_token_id=self.pad_token_id,
        )
        return row
