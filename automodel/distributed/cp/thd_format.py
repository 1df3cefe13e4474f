"""Packed (THD) batches: BSHD -> THD conversion, chunking, and TE-compatible CP partition indices.

A *packed* BSHD batch is a dict of ``[B, S]`` tensors (``input_ids``, ``labels``, optional
``position_ids``, ``loss_mask``, ``attention_mask``; or ``[B, S, H]`` embeddings) plus
``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` int tensors: row ``b`` holds the packed sequences
whose real lengths are ``seq_lens[b]`` and whose slot widths (real tokens + padding) are
``seq_lens_padded[b]``, in order; ``seq_lens_padding_value`` (default ``-1000``) marks unused
entries. The padded slots of a row must cover the row exactly (``sum == S``).

The THD form flattens the batch to ``T = B*S`` tokens and describes the document boundaries with
two int32 offset tensors, as Transformer Engine's THD attention takes them: ``cu_seqlens_padded``
(cumulative *padded* lengths: where each document starts in the token stream, what the
context-parallel partition uses) and ``cu_seqlens`` (cumulative *real* lengths, from
``seq_lens``). ``padding_mask`` comes from the packing layout (each document's pad slots), never
from comparing token ids with a pad id (a real token may carry the pad id).

Difference from older NVIDIA NeMo AutoModel releases: they returned a single ``cu_seqlens`` that
held the *padded* offsets and derived ``padding_mask`` from ``input_ids == padding_token_id``;
here ``cu_seqlens`` holds the real offsets and ``cu_seqlens_padded`` the padded ones (the newer
reference's and TE's convention), and ``padding_token_id`` is accepted but unused.

Public names follow NVIDIA NeMo AutoModel's ``thd_utils`` (``process_input_for_thd``,
``split_batch_into_thd_chunks``) with these deliberate differences:

- bad input raises (a row not covered by its sequences, mismatched shapes, a batch size that
  ``num_chunks`` does not divide) instead of producing misaligned ``cu_seqlens`` or dropping rows;
- a missing ``position_ids`` is generated (restarting at 0 at every packed sequence); mRoPE
  ``position_ids`` ``[n_rope, B, S]`` (e.g. Qwen2-VL's ``[3, B, S]``) become ``[n_rope, T]``;
- ``max_seqlen`` is always returned.

:func:`thd_partition_indices` is a vectorized pure-torch equivalent of Transformer Engine's
``thd_get_partitioned_indices``; :func:`get_thd_partitioned_indices` uses TE's kernel when TE is
importable and the tensor is on CUDA, and the pure-torch one otherwise (identical results).
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.cp.layout import head_tail_indices

__all__ = [
    "THD_TOKEN_KEYS",
    "first_not_divisible",
    "get_thd_partitioned_indices",
    "packed_padding_mask",
    "process_input_for_thd",
    "split_batch_into_thd_chunks",
    "thd_partition_indices",
    "validate_thd_partition_args",
]

#: Token-aligned keys that are flattened from ``[B, S(, H)]`` to ``[T(, H)]``.
THD_TOKEN_KEYS: tuple[str, ...] = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "position_ids",
    "loss_mask",
    "attention_mask",
)
_CONSUMED_KEYS = ("seq_lens", "seq_lens_padded")
_PRODUCED_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "padding_mask")


# ---------------------------------------------------------------------------------------------
# BSHD -> THD
# ---------------------------------------------------------------------------------------------


def _primary_key(batch: dict[str, Any]) -> str:
    if "input_ids" in batch and batch["input_ids"] is not None:
        return "input_ids"
    if "inputs_embeds" in batch and batch["inputs_embeds"] is not None:
        return "inputs_embeds"
    raise KeyError("packed batch has neither 'input_ids' nor 'inputs_embeds'; one of them is required")


def _require(batch: dict[str, Any], key: str) -> torch.Tensor:
    if key not in batch or batch[key] is None:
        raise KeyError(
            f"packed batch is missing {key!r} (present: {sorted(batch)}); THD conversion needs "
            "'seq_lens' and 'seq_lens_padded' [B, P] from a packing collator, and 'labels'"
        )
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return value


def _valid_padded_lengths(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, batch_size: int, seq_len: int, sentinel: int
) -> torch.Tensor:
    """Validate the packing layout and return the padded lengths of all sequences, row-major, int64."""
    for name, t in (("seq_lens", seq_lens), ("seq_lens_padded", seq_lens_padded)):
        if t.dim() != 2 or t.shape[0] != batch_size:
            raise ValueError(
                f"{name} must be [B, P] with B={batch_size} (the batch size), got shape {tuple(t.shape)}"
            )
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if seq_lens.shape != seq_lens_padded.shape:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} and seq_lens_padded {tuple(seq_lens_padded.shape)} "
            "must have the same shape"
        )
    seq_lens = seq_lens.to(seq_lens_padded.device)
    valid = seq_lens_padded != sentinel
    if not torch.equal(valid, seq_lens != sentinel):
        bad = (valid != (seq_lens != sentinel)).nonzero()[0].tolist()
        raise ValueError(
            f"seq_lens and seq_lens_padded disagree on which entries are the padding sentinel "
            f"{sentinel} (first at [row, pack]={bad}); both must mark the same unused entries"
        )
    sl = seq_lens.to(device=seq_lens_padded.device, dtype=torch.int64)
    slp = seq_lens_padded.to(torch.int64)
    bad = valid & ((sl < 0) | (slp < sl))
    if bool(bad.any()):
        r, p = bad.nonzero()[0].tolist()
        raise ValueError(
            f"invalid packed sequence at [row, pack]=[{r}, {p}]: seq_lens={int(sl[r, p])}, "
            f"seq_lens_padded={int(slp[r, p])}; need 0 <= seq_lens <= seq_lens_padded "
            f"(unused entries must be exactly {sentinel})"
        )
    row_sums = torch.where(valid, slp, torch.zeros_like(slp)).sum(dim=1)
    wrong = row_sums != seq_len
    if bool(wrong.any()):
        r = int(wrong.nonzero()[0, 0])
        raise ValueError(
            f"row {r} of seq_lens_padded sums to {int(row_sums[r])} but each row holds S={seq_len} tokens; "
            "the padded sequences of a row must cover it exactly, otherwise cu_seqlens would misplace "
            "every later row (fold trailing row padding into the last sequence's seq_lens_padded)"
        )
    return slp[valid]


def _cu_seqlens(padded_lengths: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros(1, dtype=torch.int64, device=padded_lengths.device)
    return torch.cat([zero, torch.cumsum(padded_lengths, dim=0)]).to(torch.int32)


def _positions_from_cu(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """``[T] int64`` positions restarting at 0 at every boundary of ``cu_seqlens``."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=device, dtype=torch.int64) - starts


def packed_padding_mask(
    seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, seq_lens_padding_value: int = -1000
) -> torch.Tensor:
    """Which tokens of a packed batch are padding, from the layout alone (no token ids needed).

    Args:
        seq_lens / seq_lens_padded: ``[B, P]`` int real / padded lengths, ``seq_lens_padding_value``
            marking unused entries (validated by :func:`process_input_for_thd`, not here).

    Returns:
        ``[T] bool`` on ``seq_lens_padded``'s device, ``T = sum of valid seq_lens_padded``, row-major:
        True on every sequence's slack slots ``[start + seq_len, start + seq_len_padded)``.
    """
    valid = seq_lens_padded != seq_lens_padding_value
    real = seq_lens.to(valid.device, torch.int64)[valid]
    padded = seq_lens_padded.to(torch.int64)[valid]
    total = int(padded.sum())
    pos = _positions_from_cu(_cu_seqlens(padded), total, valid.device)
    return pos >= torch.repeat_interleave(real, padded, output_size=total)


def process_input_for_thd(
    batch: dict[str, Any],
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Convert a packed BSHD batch to THD (one flat token stream). Does not mutate ``batch``.

    Args:
        batch: packed BSHD batch:

            - ``input_ids``: ``[B, S]`` int token ids, or ``[B, S, H]`` embeddings (the reference's
              pipeline-parallel convention); alternatively ``inputs_embeds`` ``[B, S, H]``.
            - ``labels``: ``[B, S]`` (already shifted, ``-100`` = ignore). Required.
            - ``position_ids``: ``[B, S]`` or mRoPE ``[n_rope, B, S]``, optional; when missing (or
              None) positions are generated that restart at 0 at every packed sequence (from
              ``seq_lens_padded``).
            - ``loss_mask``, ``attention_mask``: ``[B, S]``, optional, flattened like the others.
            - ``seq_lens`` / ``seq_lens_padded``: ``[B, P]`` int, real / padded length of each packed
              sequence of each row; ``seq_lens_padding_value`` marks unused entries. Required.
              Each row's padded lengths must sum to ``S``.
        seq_lens_padding_value: sentinel for unused ``seq_lens`` entries (default ``-1000``).
        padding_token_id: accepted for the reference's signature and ignored: ``padding_mask``
            comes from the packing layout (a real token may carry the pad id).

    Returns:
        A new dict with

        - every key of :data:`THD_TOKEN_KEYS` present in ``batch`` flattened to ``[T]`` (``[T, H]``
          for embeddings, ``[n_rope, T]`` for mRoPE ``position_ids``), ``T = B*S``, dtype unchanged;
          ``position_ids`` always present (int64 when generated);
        - ``cu_seqlens_padded``: ``[N+1] int32``, ``[0] + cumsum(valid seq_lens_padded)`` row-major over
          the ``N`` sequences of the batch (e.g. ``[[4, 2], [6, -1000]] -> [0, 4, 6, 12]``): where each
          sequence starts in the token stream. Its slack tokens ``[seq_len, seq_len_padded)`` belong
          to it and come after its real tokens (causal attention of real tokens is unaffected;
          labels/loss_mask ignore them);
        - ``cu_seqlens``: ``[N+1] int32``, ``[0] + cumsum(valid seq_lens)``: the real lengths (e.g.
          ``seq_lens [[3, 2], [5, -1000]] -> [0, 3, 5, 10]``). Together with ``cu_seqlens_padded`` this
          is TE's THD-with-padding convention (``cu_seqlens_q`` / ``cu_seqlens_q_padded``);
        - ``max_seqlen``: 0-d ``int32`` tensor (as in the reference): the largest *padded* sequence
          length ``max(diff(cu_seqlens_padded))`` (0 for an empty batch), an upper bound for the real
          lengths as kernels need it;
        - ``padding_mask``: ``[T] bool``, True on each sequence's slack slots
          ``[start + seq_len, start + seq_len_padded)``, from the layout alone (the row's trailing
          padding is the last sequence's slack). An incoming ``padding_mask``, ``cu_seqlens``,
          ``cu_seqlens_padded`` or ``max_seqlen`` is replaced;
        - every other key (non-tensor, or a tensor this function does not know) copied unchanged;
          ``seq_lens`` / ``seq_lens_padded`` are consumed.

    Raises:
        KeyError: ``seq_lens``, ``seq_lens_padded``, ``labels`` or both ``input_ids`` and
            ``inputs_embeds`` missing.
        ValueError / TypeError: shapes that disagree with ``[B, S]``, an invalid packing layout.
    """
    del padding_token_id  # the layout decides padding, not the token ids
    primary = _primary_key(batch)
    x = batch[primary]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"batch[{primary!r}] must be a torch.Tensor, got {type(x).__name__}")
    if primary == "inputs_embeds" and x.dim() != 3:
        raise ValueError(f"inputs_embeds must be [B, S, H], got shape {tuple(x.shape)}")
    if x.dim() not in (2, 3):
        raise ValueError(f"{primary} must be [B, S] token ids or [B, S, H] embeddings, got {tuple(x.shape)}")
    _require(batch, "labels")
    seq_lens = _require(batch, "seq_lens")
    seq_lens_padded = _require(batch, "seq_lens_padded")
    bsz, seq_len = int(x.shape[0]), int(x.shape[1])
    total = bsz * seq_len
    device = x.device

    for key in THD_TOKEN_KEYS:
        t = batch.get(key)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(t).__name__}")
        if key == "position_ids" and t.dim() == 3:
            if tuple(t.shape[1:]) != (bsz, seq_len):
                raise ValueError(
                    f"mRoPE batch['position_ids'] must be [n_rope, B, S] with B={bsz}, S={seq_len} "
                    f"(from {primary}), got shape {tuple(t.shape)}"
                )
            continue
        embeds = key == "inputs_embeds" or (key == "input_ids" and t.dim() == 3)
        want_dim = 3 if embeds else 2
        if t.dim() != want_dim or tuple(t.shape[:2]) != (bsz, seq_len):
            what = (
                "[B, S, H]"
                if embeds
                else "[B, S] (or mRoPE [n_rope, B, S])"
                if key == "position_ids"
                else "[B, S]"
            )
            raise ValueError(
                f"batch[{key!r}] must be {what} with B={bsz}, S={seq_len} (from {primary}), "
                f"got shape {tuple(t.shape)}"
            )

    padded = _valid_padded_lengths(seq_lens, seq_lens_padded, bsz, seq_len, seq_lens_padding_value)
    cu_seqlens_padded = _cu_seqlens(padded)
    valid = seq_lens_padded != seq_lens_padding_value
    real = seq_lens.to(valid.device, torch.int64)[valid]
    cu_seqlens = _cu_seqlens(real)
    if padded.numel() > 0:
        max_seqlen = padded.max().to(torch.int32)
    else:
        max_seqlen = torch.zeros((), dtype=torch.int32, device=padded.device)

    result: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _CONSUMED_KEYS or key in _PRODUCED_KEYS:
            continue
        if key == "position_ids" and isinstance(value, torch.Tensor) and value.dim() == 3:
            result[key] = value.reshape(value.shape[0], total)  # mRoPE [n_rope, B, S] -> [n_rope, T]
        elif key in THD_TOKEN_KEYS and isinstance(value, torch.Tensor):
            result[key] = value.reshape(total, *value.shape[2:])
        else:
            result[key] = value
    if result.get("position_ids") is None:
        result["position_ids"] = _positions_from_cu(cu_seqlens_padded, total, device)

    result["cu_seqlens"] = cu_seqlens
    result["cu_seqlens_padded"] = cu_seqlens_padded
    result["max_seqlen"] = max_seqlen
    result["padding_mask"] = packed_padding_mask(seq_lens, seq_lens_padded, seq_lens_padding_value).to(device)
    return result


def split_batch_into_thd_chunks(
    batch: dict[str, Any],
    num_chunks: int,
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Split a packed BSHD batch into ``num_chunks`` groups of rows and convert each to THD.

    Chunk ``i`` holds rows ``[i*B/num_chunks, (i+1)*B/num_chunks)``; each is converted with
    :func:`process_input_for_thd` and the results are stacked. Does not mutate ``batch``.

    Args:
        batch: packed BSHD batch, as for :func:`process_input_for_thd`.
        num_chunks: number of row groups; must divide the batch size ``B`` (rows are never dropped).
            ``num_chunks == 1`` returns exactly :func:`process_input_for_thd`'s result (no chunk
            dimension), as the reference does.
        seq_lens_padding_value: sentinel for unused ``seq_lens`` entries, and the value used to
            right-pad ``cu_seqlens`` rows to a common length.
        padding_token_id: see :func:`process_input_for_thd`.

    Returns:
        For ``num_chunks > 1``: token tensors ``[num_chunks, T_c(, H)]`` with ``T_c = (B/num_chunks)*S``
        (``position_ids`` and ``padding_mask`` always present; mRoPE ``position_ids``
        ``[n_rope, num_chunks, T_c]``); ``cu_seqlens`` and ``cu_seqlens_padded``
        ``[num_chunks, N_max+1] int32`` (per chunk, starting at 0, right-padded with
        ``seq_lens_padding_value``); ``max_seqlen`` ``[num_chunks] int32``. Non-tensor keys, and tensors
        this module does not know, are copied unchanged (not split).

    Raises:
        ValueError: ``num_chunks < 1`` or ``B % num_chunks != 0``; plus everything
            :func:`process_input_for_thd` raises.
    """
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    if num_chunks == 1:
        return process_input_for_thd(batch, seq_lens_padding_value, padding_token_id)

    primary = _primary_key(batch)
    bsz = int(batch[primary].shape[0])
    if bsz % num_chunks != 0:
        raise ValueError(
            f"batch size {bsz} is not divisible by num_chunks={num_chunks}; rows are never dropped, so "
            f"use a batch size that is a multiple of {num_chunks} or a num_chunks that divides {bsz}"
        )
    rows = bsz // num_chunks
    row_keys = set(THD_TOKEN_KEYS) | set(_CONSUMED_KEYS)
    chunks = []
    for i in range(num_chunks):
        sub = {
            k: (
                v[:, i * rows : (i + 1) * rows]
                if k == "position_ids" and v.dim() == 3
                else v[i * rows : (i + 1) * rows]
            )
            for k, v in batch.items()
            if k in row_keys and isinstance(v, torch.Tensor)
        }
        chunks.append(process_input_for_thd(sub, seq_lens_padding_value, padding_token_id))

    result: dict[str, Any] = {
        k: v
        for k, v in batch.items()
        if k not in _CONSUMED_KEYS
        and k not in _PRODUCED_KEYS
        and not (k in row_keys and isinstance(v, torch.Tensor))
    }
    for key in chunks[0]:
        if key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
            continue
        # mRoPE [n_rope, T_c] position ids stack on the token dim's left: [n_rope, num_chunks, T_c]
        dim = 1 if key == "position_ids" and chunks[0][key].dim() == 2 else 0
        result[key] = torch.stack([c[key] for c in chunks], dim=dim)
    width = max(int(c["cu_seqlens_padded"].numel()) for c in chunks)
    for name in ("cu_seqlens", "cu_seqlens_padded"):
        cu = chunks[0][name]
        stacked = torch.full((num_chunks, width), seq_lens_padding_value, dtype=cu.dtype, device=cu.device)
        for i, c in enumerate(chunks):
            stacked[i, : c[name].numel()] = c[name]
        result[name] = stacked
    result["max_seqlen"] = torch.stack([c["max_seqlen"] for c in chunks])
    return result


# ---------------------------------------------------------------------------------------------
# CP partition indices (Transformer Engine's load-balanced "dual chunk" THD split)
# ---------------------------------------------------------------------------------------------


def validate_thd_partition_args(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> None:
    """Check the arguments of :func:`thd_partition_indices`; raise ``ValueError``/``TypeError`` naming the fix.

    The rules are TE's (``thd_get_partitioned_indices``): ``world_size > 0``, ``0 <= rank < world_size``,
    ``cu_seqlens_padded`` a 1-D integer tensor with at least 2 entries starting at 0, every entry
    divisible by ``2*world_size``, ``total_tokens > 0`` and divisible by ``2*world_size``; plus two that
    TE leaves unchecked (its kernel then reads garbage): non-decreasing, and ``total_tokens ==
    cu_seqlens_padded[-1]``.
    """
    for name, v in (("total_tokens", total_tokens), ("world_size", world_size), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be a python int, got {type(v).__name__} {v!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got {rank}")
    cu = cu_seqlens_padded
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"cu_seqlens_padded must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype.is_floating_point or cu.dtype == torch.bool or cu.is_complex():
        raise TypeError(f"cu_seqlens_padded must be an integer tensor (int32 like TE), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(
            f"cu_seqlens_padded must be 1-D with at least 2 entries ([0, ..., total]), got shape {tuple(cu.shape)}"
        )
    if total_tokens <= 0:
        raise ValueError(f"total_tokens must be > 0, got {total_tokens}")
    if total_tokens >= 2**31:
        raise ValueError(f"total_tokens={total_tokens} does not fit the int32 indices TE uses (< 2**31)")
    cu64 = cu.to(torch.int64)
    first, last = int(cu64[0]), int(cu64[-1])
    if first != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0, got {first}")
    diffs = cu64[1:] - cu64[:-1]
    if bool((diffs < 0).any()):
        i = int((diffs < 0).nonzero()[0, 0])
        raise ValueError(
            f"cu_seqlens_padded must be non-decreasing, but entry {i + 1} ({int(cu64[i + 1])}) < "
            f"entry {i} ({int(cu64[i])})"
        )
    if total_tokens != last:
        raise ValueError(
            f"total_tokens={total_tokens} must equal cu_seqlens_padded[-1]={last} "
            "(every token must belong to a sequence)"
        )
    divisor = 2 * world_size
    i = first_not_divisible(diffs, divisor)
    if i is not None:
        raise ValueError(
            f"sequence {i} has padded length {int(diffs[i])} (cu_seqlens_padded[{i}:{i + 2}] = "
            f"{int(cu64[i])}..{int(cu64[i + 1])}), not divisible by 2*world_size={divisor}; pad every "
            f"packed sequence to a multiple of {divisor}"
        )


def thd_partition_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """Pure-torch, vectorized equivalent of TE's ``thd_get_partitioned_indices``.

    Each sequence of padded length ``L`` starting at ``s`` is cut into ``2*world_size`` chunks of
    ``c = L / (2*world_size)`` tokens; ``rank`` takes chunk ``rank`` and chunk
    ``2*world_size - 1 - rank`` (load balance for causal attention), i.e. tokens
    ``[s + rank*c, s + (rank+1)*c)`` then ``[s + (2W-1-rank)*c, s + (2W-rank)*c)``, sequences in order.

    Example: ``cu=[0, 8, 24]``, ``world_size=2``: rank 0 -> ``[0,1,6,7, 8,9,10,11, 20,21,22,23]``,
    rank 1 -> ``[2,3,4,5, 12,...,19]``.

    Args:
        cu_seqlens_padded: ``[N+1]`` integer tensor (int32 or int64), boundaries of the ``N``
            sequences in the flat token stream; right-padding sentinels must be removed first.
        total_tokens: ``T == cu_seqlens_padded[-1]``.
        world_size: CP size ``W``.
        rank: this rank's index in the CP group.

    Returns:
        ``[T / W] int32`` token indices on ``cu_seqlens_padded``'s device (TE's dtype).

    Raises:
        ValueError / TypeError: see :func:`validate_thd_partition_args`.
    """
    validate_thd_partition_args(cu_seqlens_padded, total_tokens, world_size, rank)
    return _partition_indices(cu_seqlens_padded, total_tokens, world_size, rank)


def _partition_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """:func:`thd_partition_indices` without the argument checks (the caller has validated them): the
    head-tail formula of :func:`automodel.distributed.cp.layout.head_tail_indices`, in TE's int32."""
    del total_tokens  # == cu_seqlens_padded[-1] (validated)
    return head_tail_indices(cu_seqlens_padded, world_size, rank).to(torch.int32)


def first_not_divisible(lengths: torch.Tensor, divisor: int) -> int | None:
    """The index of the first entry of the 1-D integer ``lengths`` not divisible by ``divisor`` (``None``: all are)."""
    bad = (lengths % divisor) != 0
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def get_thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """This rank's THD token indices: TE's CUDA kernel when usable, else :func:`thd_partition_indices`.

    The arguments are validated first (clear ``ValueError`` rather than a device-side assert). TE's
    ``transformer_engine_torch.thd_get_partitioned_indices`` is imported lazily and used only when it
    is importable and ``cu_seqlens_padded`` is on CUDA; both paths return the same ``[T / W] int32``
    tensor on ``cu_seqlens_padded``'s device.
    """
    validate_thd_partition_args(cu_seqlens_padded, total_tokens, world_size, rank)
    if cu_seqlens_padded.is_cuda:
        try:
            import transformer_engine_torch as tex  # optional, CUDA only: imported lazily
        except ImportError:
            tex = None
        fn = getattr(tex, "thd_get_partitioned_indices", None) if tex is not None else None
        if fn is not None:
            cu32 = cu_seqlens_padded.to(torch.int32).contiguous()
            return fn(cu32, total_tokens, world_size, rank).to(cu_seqlens_padded.device)
    return _partition_indices(cu_seqlens_padded, total_tokens, world_size, rank)
