"""Deterministic train/validation split by content hash.

A document (or instruction record) goes to ``validation`` iff the first 8 bytes of
``blake2b(key)``, read as a fraction of 2**64, are below ``val_fraction``. The split therefore
depends only on each item's own content: it is the same on every rank and every run, it does not
move when documents are appended or reordered, and exact duplicates always land on the same side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

from automodel.errors import UserInputError

__all__ = ["SPLITS", "validate_split", "split_fraction", "is_validation", "select_split"]

SPLITS = ("train", "validation", "all")
T = TypeVar("T")


def validate_split(split: str, val_fraction: float) -> None:
    """Raise ``ValueError`` unless ``split`` is one of :data:`SPLITS` and ``0 < val_fraction < 1``."""
    if split not in SPLITS:
        raise UserInputError(
            f"split={split!r} is not one of {SPLITS}; use 'train' or 'validation' to hold out "
            "val_fraction of the documents, or 'all' to use every document (e.g. a separate validation file)"
        )
    if split != "all" and not (isinstance(val_fraction, (int, float)) and 0.0 < float(val_fraction) < 1.0):
        raise UserInputError(
            f"val_fraction={val_fraction!r} must be a number strictly between 0 and 1 for split={split!r} "
            "(e.g. 0.05), or use split='all'"
        )


def split_fraction(key: str) -> float:
    """The item's place in [0, 1): the first 8 bytes of ``blake2b(key)`` as a fraction of 2**64. The item is
    in the validation split iff this is below ``val_fraction``."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")
    return h / 2.0**64


def is_validation(key: str, val_fraction: float) -> bool:
    """True iff the item whose content is ``key`` belongs to the validation split."""
    return split_fraction(key) < val_fraction


def select_split(items: Sequence[T], keys: Sequence[str], split: str, val_fraction: float) -> list[T]:
    """Return the items of ``split`` in their original order (``keys[i]`` is the content of ``items[i]``)."""
    validate_split(split, val_fraction)
    if split == "all":
        return list(items)
    want_val = split == "validation"
    return [it for it, k in zip(items, keys, strict=True) if is_validation(k, val_fraction) == want_val]
