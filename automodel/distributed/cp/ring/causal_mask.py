"""Make stock Hugging Face models see plain causal attention under ring CP.

The trap: with head-tail load balancing, rank 0 of a cp=2 group holds the position ids
``0..7, 24..31`` of a 32-token row and rank 1 holds ``8..23``. transformers (>= 4.54, which added
packed-sequence detection to ``transformers.masking_utils``) reads any jump in ``position_ids`` as a
boundary between *packed sequences* and builds a block-diagonal attention mask for it — on rank 0
only. Ring attention computes plain causal attention over the whole (global) row and cannot take a
mask, so that run dies in DTensor sharding propagation (or, on a kernel that accepted a mask, would
be silently wrong).

:func:`no_packed_sequence_detection` switches that detection off while it is active, so every
rank builds no mask and SDPA runs with ``is_causal=True``. The jump in position ids is exactly what
load balancing produces and the rotary embedding still sees the correct global positions.

Covered: transformers 4.54 .. 5.x (``masking_utils.find_packed_sequence_indices``; tested on
5.23). Older versions have no packed-sequence detection, so nothing needs patching and this is a
no-op; so it is when transformers is not installed. If a future version renames the function, the
ring parity test (tests/test_cp_parity.py) fails rather than the training silently changing.

Packed multi-document rows are *not* supported by the ring path (``make_cp_batch_and_ctx``
rejects them); use the THD path or Ulysses for those.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

__all__ = ["no_packed_sequence_detection"]


def _no_packed_sequences(position_ids):  # noqa: ANN001, ANN202 - mirrors the patched function
    return None


@contextlib.contextmanager
def no_packed_sequence_detection() -> Iterator[None]:
    """Inside this block, transformers treats every row as one sequence (no packed-sequence mask).

    Mutates ``transformers.masking_utils.find_packed_sequence_indices`` (module global) and restores
    it on exit. Safe to nest.
    """
    try:
        masking_utils = importlib.import_module("transformers.masking_utils")
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _no_packed_sequences
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
