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

A model may still materialise its causal mask: Falcon (transformers >= 5.25) builds it with
``allow_is_causal_skip=False`` so that ALiBi variants can add their bias onto it, and hands the local
``[B, 1, n, n]`` mask to SDPA even without ALiBi. Torch's ring cannot take a mask (it dies in DTensor
sharding propagation), and that mask says nothing the ring does not compute already: causality over the
rank's shard, which the ring computes over the whole row. :func:`check_plain_causal_mask` proves that the
mask is exactly that (every allowed entry ``True`` / ``0``, every other one ``False`` / at most half the
dtype's lowest value) so that the router can drop it, and refuses any other mask (a bias, padding, a
document boundary): a mask ring would ignore must never change the numbers.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["check_plain_causal_mask", "no_packed_sequence_detection"]

_PROVEN: list[Any] = [None]  # a weak reference to the last mask proven plain causal (every layer gets the same)


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


def _is_plain_causal(mask: torch.Tensor, n_q: int, n_kv: int) -> bool:
    """Whether ``mask`` (``[..., n_q, n_kv]``, bool: ``True`` = attend; float: added to the scores) is exactly the
    causal mask of the last ``n_q`` of ``n_kv`` tokens."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (n_q, n_kv):
        return False
    allowed = torch.ones(n_q, n_kv, dtype=torch.bool, device=mask.device).tril(n_kv - n_q)
    if mask.dtype == torch.bool:
        return bool((mask == allowed).all())
    if not mask.is_floating_point():
        return False
    blocked = mask <= torch.finfo(mask.dtype).min / 2  # -inf or the dtype's lowest value: exp() is exactly 0
    return bool(((mask == 0) == allowed).all() and (blocked == ~allowed).all())


def check_plain_causal_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor, where: str) -> None:
    """Prove that ``mask``, the attention mask transformers built on this rank's shard, is plain causal over
    the shard, so that ring may drop it (module docstring). Reads only; remembers the last proven mask (a
    weak reference) so that the layers after the first cost nothing.

    Args:
        mask: ``[B | 1, H | 1, n, m]`` bool or float; query: ``[B, Hq, n, D]``; key: ``[B, Hkv, m, D]``.
        where: the attention module's class name, for the message.

    Raises:
        CPUnsupportedError: the mask is anything else (a position bias such as ALiBi, padding, documents).
    """
    proven = _PROVEN[0]
    if proven is not None and proven() is mask:
        return
    if not _is_plain_causal(mask, query.shape[-2], key.shape[-2]):
        from automodel.errors import CPUnsupportedError

        raise CPUnsupportedError(
            f"distributed.cp_method=ring: {where} was given an attention mask of shape {tuple(mask.shape)} "
            f"({mask.dtype}) that is not plain causal (a position bias, padding or document boundaries); ring "
            "computes plain causal attention over the whole row and cannot apply it. Use "
            "distributed.cp_method=ulysses or thd_docs, whose attention builds the mask itself"
        )
    _PROVEN[0] = weakref.ref(mask)
