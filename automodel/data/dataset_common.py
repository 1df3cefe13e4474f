"""Argument checks and helpers shared by the datasets and the data loaders."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from automodel.data.splits import validate_split
from automodel.data.tokenizer import ensure_pad_token, load_tokenizer
from automodel.errors import UserInputError

__all__ = [
    "resolve_tokenizer",
    "check_seq_len",
    "check_pack_args",
    "check_positive_int",
    "state_mismatches",
    "RowsDataset",
]


def resolve_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None,
) -> PreTrainedTokenizerBase:
    """Accept a tokenizer object, or a name/path/None for :func:`load_tokenizer` (handy from YAML).

    The tokenizer must have an EOS token; a missing pad token is set to EOS (mutates it, see
    :func:`ensure_pad_token`).
    """
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tok = load_tokenizer(tokenizer)
    elif isinstance(tokenizer, PreTrainedTokenizerBase):
        tok = ensure_pad_token(tokenizer)
    else:
        raise TypeError(
            f"tokenizer must be a transformers tokenizer, a name/path or None, got {type(tokenizer).__name__}; "
            "pass automodel.data.load_tokenizer(...) or a tokenizer directory"
        )
    if tok.eos_token_id is None:
        raise UserInputError(
            f"tokenizer {tok.name_or_path!r} has no EOS token; documents are separated/terminated with EOS. "
            "Set tokenizer.eos_token or use a tokenizer that defines one"
        )
    return tok


def check_positive_int(name: str, value: object, minimum: int = 1, fix: str = "") -> int:
    """Return ``value`` as int if it is an int >= ``minimum``; raise ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserInputError(f"{name}={value!r} must be an integer >= {minimum}" + (f"; {fix}" if fix else ""))
    return int(value)


def check_seq_len(seq_len: object) -> int:
    """``seq_len`` is the number of input positions per row; it must be an int >= 2."""
    return check_positive_int(
        "seq_len", seq_len, 2, "a row needs at least 2 positions; set data.seq_len to e.g. 1024"
    )


def check_pack_args(pack: bool, seq_len: int, seq_pad_multiple: object) -> int:
    """Validate the packing arguments; returns ``seq_pad_multiple`` as an int (1 when not packing)."""
    if not isinstance(pack, bool):
        raise UserInputError(f"pack={pack!r} must be true or false")
    m = check_positive_int(
        "seq_pad_multiple", seq_pad_multiple, 1, "use 1, or 2*cp_size for THD context parallelism"
    )
    if not pack:
        if m != 1:
            raise UserInputError(
                f"seq_pad_multiple={m} only applies to packed rows (pack=true); set pack=true or "
                "seq_pad_multiple=1 (unpacked rows are padded by the collator's pad_to_multiple_of)"
            )
        return 1
    if seq_len % m != 0:
        raise UserInputError(
            f"seq_len={seq_len} is not divisible by seq_pad_multiple={m}; packed rows hold documents "
            f"padded to multiples of {m}, so set seq_len to a multiple of {m} (e.g. {(seq_len // m + 1) * m})"
        )
    return m


def state_mismatches(saved: Mapping[str, Any], now: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """``"key: checkpoint X != now Y"`` for each of ``keys`` whose value in a checkpoint's loader state
    ``saved`` differs from ``now``'s (in the order of ``keys``; a key missing from ``saved`` is None)."""
    return [f"{k}: checkpoint {saved.get(k)!r} != now {now[k]!r}" for k in keys if saved.get(k) != now[k]]


class RowsDataset:
    """The row arguments every dataset of this package takes, checked and kept by one method."""

    def _init_rows(
        self,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike | None,
        seq_len: int,
        split: str,
        val_fraction: float,
        pack: bool,
        seq_pad_multiple: int,
    ) -> None:
        """Check the arguments (``UserInputError`` naming the bad one) and set ``seq_len``,
        ``seq_pad_multiple``, ``packed``, ``split``, ``tokenizer`` (:func:`resolve_tokenizer`) and
        ``pad_token_id`` on ``self``."""
        self.seq_len = check_seq_len(seq_len)
        self.seq_pad_multiple = check_pack_args(pack, self.seq_len, seq_pad_multiple)
        validate_split(split, val_fraction)
        self.packed = pack
        self.split = split
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
