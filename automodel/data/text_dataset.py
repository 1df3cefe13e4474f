"""Pre-training style text data: documents -> token stream -> fixed rows (or packed rows).

Default (``pack=False``): the documents of the split are tokenized, each followed by EOS, and
concatenated into one stream, which is cut into non-overlapping rows of ``seq_len + 1`` tokens
(the remainder shorter than a row is dropped). Row ``r`` is
``stream[r*(seq_len+1) : (r+1)*(seq_len+1)]`` and becomes ``input_ids = row[:-1]``,
``labels = row[1:]`` (both ``[seq_len]`` int64, every label real). Attention runs across document
boundaries within a row, as usual for pre-training on concatenated text.

``pack=True``: each document (+ EOS) is its own sequence, cut into pieces of at most ``seq_len``
inputs when longer, and whole sequences are packed into rows with ``seq_lens`` /
``seq_lens_padded`` metadata (see ``packing.py``) so a THD/varlen attention can keep documents
apart.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from automodel.data.dataset_common import RowsDataset
from automodel.data.encode_cache import encode_documents
from automodel.data.examples import shift_example, split_long_sequence
from automodel.data.file_readers import detect_format, read_jsonl, read_text_documents, resolve_files
from automodel.data.packing import pack_examples
from automodel.data.splits import select_split
from automodel.data.tokenizer import assets_dir
from automodel.errors import UserInputError

__all__ = ["TextDataset", "default_corpus_path", "load_documents"]


def default_corpus_path() -> str:
    """Path of the shipped synthetic corpus (``{"text": ...}`` JSON lines, gzipped)."""
    return str(assets_dir() / "corpus" / "default_corpus.jsonl.gz")


def load_documents(
    path: str | os.PathLike | Sequence[str | os.PathLike] | None,
    *,
    file_format: str = "auto",
    text_field: str = "text",
    doc_separator: str | None = None,
) -> list[str]:
    """Read every document from ``path`` (None = the shipped corpus), in file order.

    ``jsonl`` files: one document per line, taken from ``text_field`` (must be a string).
    ``text`` files: one document per file, or split on ``doc_separator``.
    """
    files = resolve_files(default_corpus_path() if path is None else path)
    docs: list[str] = []
    for f in files:
        fmt = detect_format(f, file_format)
        if fmt == "text":
            docs.extend(read_text_documents(f, doc_separator))
            continue
        for lineno, rec in read_jsonl(f):
            if text_field not in rec:
                raise UserInputError(
                    f"{f}:{lineno} has no field {text_field!r} (fields: {sorted(rec)}); set "
                    "data.text_field to the field that holds the text"
                )
            text = rec[text_field]
            if not isinstance(text, str):
                raise UserInputError(
                    f"{f}:{lineno} field {text_field!r} is a {type(text).__name__}, not a string; "
                    "each record's text must be a string"
                )
            if text.strip():
                docs.append(text)
    return docs


class TextDataset(RowsDataset, Dataset):
    """Fixed-length (or packed) language-modelling rows from local text, jsonl, or the default corpus.

    Args:
        path: a ``.jsonl``/``.txt``/``.md`` file (optionally ``.gz``), a directory of them, a list,
            or None for the shipped synthetic corpus.
        tokenizer: a tokenizer, or a name/path/None passed to ``load_tokenizer`` (None = shipped one).
        seq_len: input positions per row (>= 2). Rows hold ``seq_len + 1`` tokens before the shift.
        split: ``"train"``, ``"validation"`` (documents chosen by content hash, see ``splits.py``),
            or ``"all"``.
        val_fraction: fraction of documents held out for ``"validation"``.
        file_format: ``"auto"`` (by suffix), ``"jsonl"`` or ``"text"``.
        text_field: jsonl field holding the document text.
        doc_separator: for text files, split a file into documents on this string (None: one
            document per file).
        pack: pack whole documents per row with ``seq_lens``/``seq_lens_padded`` metadata instead
            of cutting a concatenated stream.
        seq_pad_multiple: with ``pack``, pad each document to a multiple of this (2*cp_size for
            THD context parallelism); must divide ``seq_len``.

    Items: ``dict`` of 1-D int64 tensors, ``input_ids`` and ``labels`` ``[seq_len]`` (packed rows:
    ``[R]`` with R <= seq_len, plus ``position_ids`` ``[R]``, ``seq_lens``/``seq_lens_padded`` ``[P]``).
    Attributes: ``pad_token_id``, ``seq_pad_multiple``, ``packed``, ``num_documents``,
    ``num_tokens`` (tokens of the split including EOS separators).
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        tokenizer: PreTrainedTokenizerBase | str | None = None,
        seq_len: int = 1024,
        split: str = "train",
        val_fraction: float = 0.05,
        file_format: str = "auto",
        text_field: str = "text",
        doc_separator: str | None = None,
        pack: bool = False,
        seq_pad_multiple: int = 1,
    ) -> None:
        self._init_rows(tokenizer, seq_len, split, val_fraction, pack, seq_pad_multiple)
        eos = int(self.tokenizer.eos_token_id)
        where = "the default corpus" if path is None else repr(path)

        docs = load_documents(
            path, file_format=file_format, text_field=text_field, doc_separator=doc_separator
        )
        docs = select_split(docs, docs, split, val_fraction)
        if not docs:
            raise UserInputError(
                f"split {split!r} of {where} has no documents (val_fraction={val_fraction}); add data, raise "
                "val_fraction, or use split='all' with a separate validation file"
            )
        self.num_documents = len(docs)
        encoded = encode_documents(self.tokenizer, docs)  # memoised per process (exact key)
        self.num_tokens = sum(len(e) + 1 for e in encoded)

        if not pack:
            # every document followed by EOS, in order
            ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
            stream = np.insert(np.concatenate(encoded) if encoded else np.zeros(0, np.int64), ends, eos)
            n_rows = len(stream) // (self.seq_len + 1)
            if n_rows == 0:
                raise UserInputError(
                    f"split {split!r} of {where} has {len(stream)} tokens, fewer than one row of "
                    f"seq_len+1={self.seq_len + 1}; lower data.seq_len, raise val_fraction, or add data"
                )
            self._rows = torch.from_numpy(stream[: n_rows * (self.seq_len + 1)]).view(
                n_rows, self.seq_len + 1
            )
            self._packed_rows: list[dict] = []
        else:
            pieces = []
            for e in encoded:
                x = np.append(e, eos).astype(np.int64, copy=False)
                pieces += [shift_example(x[s:t]) for s, t in split_long_sequence(len(x), self.seq_len)]
            if not pieces:
                raise UserInputError(f"split {split!r} of {where} has no document with at least 2 tokens")
            self._packed_rows = pack_examples(
                pieces,
                seq_len=self.seq_len,
                seq_pad_multiple=self.seq_pad_multiple,
                pad_token_id=self.pad_token_id,
            )
            self._rows = torch.empty(0, self.seq_len + 1, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self._packed_rows) if self.packed else self._rows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.packed:
            return {k: v.clone() for k, v in self._packed_rows[index].items()}
        row = self._rows[index]
        return {"input_ids": row[:-1].clone(), "labels": row[1:].clone()}
