"""Build the per-rank THD batch that Transformer Engine's context-parallel attention consumes.

``make_cp_batch_for_te`` and ``_shard_thd_chunk_for_te`` keep the names and signatures of NVIDIA
NeMo AutoModel's ``cp_utils`` (``automodel.distributed.cp_utils`` re-exports them). Differences
from the reference, on purpose:

- the same keys come back with and without CP (``cp_size``/``cp_rank`` included when ``cp_mesh`` is
  None), and ``loss_mask`` is sharded and kept when the batch has one;
- both ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (padded offsets) are returned, int32
  and global, and ``padding_mask`` comes from the packing layout, not from the token ids (older
  reference releases returned the padded offsets under ``cu_seqlens`` and
  ``padding_mask = input_ids == padding_token_id``, which marks a real token that has the pad id);
- mRoPE ``position_ids`` ``[n_rope, B, S]`` become ``[n_rope, T/cp]`` (sharded on the token dim);
- the partition is computed by :func:`automodel.distributed.cp.thd_format.get_thd_partitioned_indices`
  (TE's kernel on CUDA when TE is installed, an exact pure-torch equivalent elsewhere), so this runs
  on CPU without TE;
- bad input raises before any sharding: a sequence length not divisible by ``2*cp_size``, a tensor
  key that cannot be sharded (it would otherwise vanish from the batch), an ``attention_mask`` that
  hides real tokens (THD attention cannot honour it); embeddings are never cast to int64.

Only ``torch``, ``torch.distributed``'s DeviceMesh API (``size()``, ``get_local_rank()``) and
:mod:`automodel.distributed.cp.thd_format` are used.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.cp.thd_format import (
    THD_TOKEN_KEYS,
    first_not_divisible,
    get_thd_partitioned_indices,
    packed_padding_mask,
    split_batch_into_thd_chunks,
)

__all__ = ["make_cp_batch_for_te", "shard_thd_chunk", "_shard_thd_chunk_for_te"]

#: Token tensors that are sharded (in this order) and returned; ``attention_mask`` is validated and dropped.
SHARDED_KEYS: tuple[str, ...] = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "position_ids",
    "padding_mask",
    "loss_mask",
)
_INT64_KEYS = ("input_ids", "labels", "position_ids")
_ACCEPTED_TENSOR_KEYS = frozenset(THD_TOKEN_KEYS) | {"seq_lens", "seq_lens_padded", "padding_mask"}


def _mesh_size_rank(cp_mesh: Any) -> tuple[int, int]:
    """``(cp_size, cp_rank)`` of a 1-D CP DeviceMesh; ``(1, 0)`` for None."""
    if cp_mesh is None:
        return 1, 0
    ndim = getattr(cp_mesh, "ndim", 1)
    if ndim != 1:
        raise ValueError(
            f"cp_mesh must be a 1-D DeviceMesh (e.g. device_mesh['cp']), got a {ndim}-D mesh "
            f"with dim names {getattr(cp_mesh, 'mesh_dim_names', None)}"
        )
    size = int(cp_mesh.size())
    if size <= 1:
        return 1, 0
    return size, int(cp_mesh.get_local_rank())


def shard_thd_chunk(
    chunk: dict[str, Any],
    cp_size: int,
    cp_rank: int,
    qkv_format: str = "thd",
    seq_lens_padding_value: int = -1000,
    padding_token_id: int = 0,
) -> dict[str, Any]:
    """Keep this CP rank's tokens of one THD chunk (the core of :func:`_shard_thd_chunk_for_te`).

    Args:
        chunk: one THD chunk as made by :func:`~automodel.distributed.cp.thd_format.process_input_for_thd`:
            token tensors ``[T(, H)]`` (mRoPE ``position_ids`` ``[n_rope, T]``), ``cu_seqlens_padded``
            ``[N+1]`` and ``cu_seqlens`` ``[N+1]`` (right-padding with ``seq_lens_padding_value``
            allowed). A chunk with only ``cu_seqlens`` (the older convention) is read as padded
            offsets with no padding. Not mutated.
        cp_size / cp_rank: CP group size and this rank's index in it. ``cp_size == 1`` shards nothing.
        qkv_format: must be ``"thd"``.
        seq_lens_padding_value: sentinel padding of ``cu_seqlens``/``cu_seqlens_padded``.
        padding_token_id: accepted for the reference's signature and ignored; a missing
            ``padding_mask`` is derived from ``cu_seqlens`` vs ``cu_seqlens_padded``.

    Returns:
        ``input_ids`` (and/or ``inputs_embeds``), ``labels``, ``position_ids``, ``padding_mask`` and, if
        present, ``loss_mask``: this rank's ``[T / cp_size(, H)]`` tokens (``[n_rope, T / cp_size]`` for
        mRoPE positions), in TE's order (for each sequence, chunks ``cp_rank`` and
        ``2*cp_size-1-cp_rank`` of ``2*cp_size``); integer ``input_ids``/``labels``/``position_ids`` as
        int64. Global: ``cu_seqlens`` and ``cu_seqlens_padded`` (int32, sentinel padding kept) and
        ``max_seqlen`` (0-d int32, largest padded sequence length): TE's CP attention takes the
        boundaries of the whole unsharded chunk. Plus ``qkv_format``, ``cp_size``, ``cp_rank``.

    Raises:
        ValueError: ``qkv_format != "thd"``, bad ``cp_size``/``cp_rank``, missing keys, a padded sequence
            length not divisible by ``2*cp_size``, ``cu_seqlens_padded`` not ending at ``T``, a real
            length larger than its padded length.
    """
    if qkv_format != "thd":
        raise ValueError(f"only qkv_format='thd' is supported, got {qkv_format!r}")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int with 0 <= cp_rank < cp_size={cp_size}, got {cp_rank!r}")
    for key in ("labels", "cu_seqlens"):
        if chunk.get(key) is None:
            raise KeyError(f"THD chunk is missing {key!r} (present: {sorted(chunk)})")
    primary = [k for k in ("input_ids", "inputs_embeds") if chunk.get(k) is not None]
    if not primary:
        raise KeyError("THD chunk has neither 'input_ids' nor 'inputs_embeds'")
    total = int(chunk[primary[0]].shape[0])
    del padding_token_id  # the layout decides padding, not the token ids

    cu_seqlens = chunk["cu_seqlens"]
    cu_seqlens_padded = chunk.get("cu_seqlens_padded")
    if cu_seqlens_padded is None:
        cu_seqlens_padded = cu_seqlens
    for name, c in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
        if c.dim() != 1:
            raise ValueError(f"{name} of one chunk must be 1-D, got shape {tuple(c.shape)}")
    cu = cu_seqlens_padded[cu_seqlens_padded != seq_lens_padding_value].to(torch.int64)
    if cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(
            f"cu_seqlens_padded must run from 0 to the chunk's token count {total}, got "
            f"{cu_seqlens_padded.tolist()}"
        )
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must be non-decreasing, got {cu_seqlens_padded.tolist()}")
    cu_real = cu_seqlens[cu_seqlens != seq_lens_padding_value].to(device=cu.device, dtype=torch.int64)
    real_lengths = cu_real[1:] - cu_real[:-1]
    if cu_real.numel() != cu.numel() or int(cu_real[0]) != 0 or bool((real_lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens {cu_seqlens.tolist()} and cu_seqlens_padded {cu_seqlens_padded.tolist()} must both "
            "start at 0, be non-decreasing and describe the same number of sequences"
        )
    if bool((real_lengths > lengths).any()):
        i = int((real_lengths > lengths).nonzero()[0, 0])
        raise ValueError(
            f"packed sequence {i} has real length {int(real_lengths[i])} > padded length {int(lengths[i])}; "
            "seq_lens must be <= seq_lens_padded for every sequence"
        )

    tokens = {k: chunk[k] for k in SHARDED_KEYS if chunk.get(k) is not None}
    if "padding_mask" not in tokens:
        real_end = torch.repeat_interleave(cu[:-1] + real_lengths, lengths, output_size=total)
        tokens["padding_mask"] = (torch.arange(total, device=cu.device) >= real_end).to(
            chunk[primary[0]].device
        )
    if "position_ids" not in tokens:
        raise KeyError("THD chunk is missing 'position_ids' (process_input_for_thd always provides them)")
    for key, t in tokens.items():
        n = t.shape[1] if (key == "position_ids" and t.dim() == 2) else t.shape[0]
        if n != total:
            raise ValueError(f"chunk[{key!r}] has {n} tokens but {primary[0]} has {total}")
    divisor = 2 * cp_size
    if cp_size > 1:
        i = first_not_divisible(lengths, divisor)
        if i is not None:
            raise ValueError(
                f"packed sequence {i} has padded length {int(lengths[i])}, not divisible by "
                f"2*cp_size={divisor}; THD context parallelism splits every sequence into {divisor} equal "
                f"chunks. Pad each packed sequence to a multiple of {divisor}: packed rows "
                f"data.dataset.seq_pad_multiple={divisor} (automatic with distributed.cp_method=thd), unpacked rows "
                f"data.pad_to_multiple_of={divisor}"
            )
        index = get_thd_partitioned_indices(cu.to(torch.int32), total, cp_size, cp_rank).long()
        tokens = {
            k: t.index_select(1 if (k == "position_ids" and t.dim() == 2) else 0, index.to(t.device))
            for k, t in tokens.items()
        }

    out: dict[str, Any] = {}
    for key in SHARDED_KEYS:
        if key in tokens:
            t = tokens[key]
            if key in _INT64_KEYS and not t.is_floating_point():
                t = t.to(torch.int64)
            elif key == "padding_mask":
                t = t.bool()
            out[key] = t.contiguous()
    out["cu_seqlens"] = cu_seqlens.to(torch.int32).contiguous()
    out["cu_seqlens_padded"] = cu_seqlens_padded.to(torch.int32).contiguous()
    max_len = lengths.max() if lengths.numel() else torch.zeros((), dtype=torch.int64, device=cu.device)
    out["max_seqlen"] = max_len.to(torch.int32)
    out["qkv_format"] = qkv_format
    out["cp_size"] = cp_size
    out["cp_rank"] = cp_rank
    return out


def _shard_thd_chunk_for_te(
    batch: dict[str, Any],
    cp_mesh: Any,
    qkv_format: str,
    seq_lens_padding_value: int,
    padding_token_id: int,
) -> dict[str, Any]:
    """Shard one THD chunk for this rank of ``cp_mesh`` (None or size 1: no sharding).

    Reference-compatible signature; the work is done by :func:`shard_thd_chunk` with
    ``(cp_mesh.size(), cp_mesh.get_local_rank())``. See it for inputs, outputs and errors.
    """
    cp_size, cp_rank = _mesh_size_rank(cp_mesh)
    return shard_thd_chunk(batch, cp_size, cp_rank, qkv_format, seq_lens_padding_value, padding_token_id)


def _check_attention_mask(batch: dict[str, Any], seq_lens_padding_value: int) -> None:
    """Raise if ``attention_mask`` hides a real token: THD attention can only drop sequence slack."""
    am = batch.get("attention_mask")
    if am is None:
        return
    slack = packed_padding_mask(batch["seq_lens"], batch["seq_lens_padded"], seq_lens_padding_value)
    hidden_real = (am.reshape(-1).to(slack.device) == 0) & ~slack
    if bool(hidden_real.any()):
        seq_len = int(am.shape[1])
        i = int(hidden_real.nonzero()[0, 0])
        raise ValueError(
            f"attention_mask hides real token(s) (first at row {i // seq_len}, column {i % seq_len}); THD "
            "attention takes document boundaries from seq_lens_padded and can only ignore each packed "
            "sequence's trailing padding [seq_len, seq_len_padded), so this mask cannot be honoured. "
            "Make attention_mask 0 only on that padding (or drop it)"
        )


def make_cp_batch_for_te(
    cp_mesh: Any,
    batch: dict[str, Any],
    qkv_format: str = "thd",
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
) -> dict[str, Any]:
    """Packed BSHD batch -> this CP rank's THD batch for Transformer Engine. Does not mutate ``batch``.

    Converts with :func:`~automodel.distributed.cp.thd_format.process_input_for_thd` (or
    :func:`~automodel.distributed.cp.thd_format.split_batch_into_thd_chunks` when ``num_chunks > 1``),
    then shards every chunk with :func:`_shard_thd_chunk_for_te`.

    Args:
        cp_mesh: 1-D CP DeviceMesh; None or size 1 means no CP (nothing sharded, ``cp_size=1``,
            ``cp_rank=0``).
        batch: packed BSHD batch: ``input_ids`` ``[B, S]`` (or ``[B, S, H]`` embeddings, or
            ``inputs_embeds``), ``labels``, ``seq_lens``/``seq_lens_padded`` ``[B, P]``, optional
            ``position_ids`` (``[B, S]`` or mRoPE ``[n_rope, B, S]``; generated per packed sequence
            when missing), ``loss_mask``,
            ``attention_mask`` (checked to hide only sequence padding, then dropped), ``padding_mask``
            (replaced). Non-tensor entries are ignored; any other tensor key raises.
        qkv_format: must be ``"thd"``.
        padding_token_id: accepted for the reference's signature; ``padding_mask`` comes from the
            packing layout (each sequence's slots ``[seq_len, seq_len_padded)``), not the token ids.
        num_chunks: row groups (must divide ``B``); > 1 adds a leading ``[num_chunks]`` dim to every
            tensor below.
        seq_lens_padding_value: sentinel of unused ``seq_lens`` entries and of ``cu_seqlens`` padding.

    Returns:
        Exactly the keys ``input_ids`` (``inputs_embeds`` instead when the batch has embeddings under
        that key), ``labels``, ``position_ids``, ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen``, ``qkv_format``,
        ``padding_mask``, ``cp_size``, ``cp_rank``, plus ``loss_mask`` when the batch has one.

        - Sharded (this rank's ``T / cp_size`` tokens, TE's load-balanced order): ``input_ids``,
          ``labels``, ``position_ids``, ``padding_mask``, ``loss_mask``: ``[T/cp]`` or
          ``[num_chunks, T_c/cp]`` (``[..., H]`` for embeddings; mRoPE positions ``[n_rope, T/cp]`` or
          ``[n_rope, num_chunks, T_c/cp]``); integer ids/labels/positions int64, ``padding_mask`` bool.
        - Global (describe the whole unsharded packed batch, as TE's CP attention expects):
          ``cu_seqlens`` (offsets of the real lengths ``seq_lens``) and ``cu_seqlens_padded`` (offsets of
          the padded lengths ``seq_lens_padded``, where each sequence starts in the token stream), both
          ``[N+1]`` int32 (``[num_chunks, N_max+1]``, right-padded with ``seq_lens_padding_value``), and
          ``max_seqlen`` 0-d int32 (``[num_chunks]``): the largest padded sequence length.
        - ``qkv_format`` str, ``cp_size`` / ``cp_rank`` python ints.

    Raises:
        ValueError: ``qkv_format != "thd"``; a padded sequence length not divisible by ``2*cp_size``
            (pad each packed sequence to a multiple of ``2*cp_size``, e.g. ``data.pad_to_multiple_of``);
            ``B % num_chunks != 0``; an unknown tensor key; an ``attention_mask`` hiding real tokens;
            anything :func:`~automodel.distributed.cp.thd_format.process_input_for_thd` rejects.
        KeyError: ``seq_lens``, ``seq_lens_padded``, ``labels`` or the token ids/embeddings missing.
    """
    if qkv_format != "thd":
        raise ValueError(f"only qkv_format='thd' is supported by make_cp_batch_for_te, got {qkv_format!r}")
    cp_size, cp_rank = _mesh_size_rank(cp_mesh)
    unknown = sorted(
        k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in _ACCEPTED_TENSOR_KEYS
    )
    if unknown:
        raise ValueError(
            f"make_cp_batch_for_te cannot shard batch key(s) {unknown}: it shards only the token tensors "
            f"{sorted(THD_TOKEN_KEYS)} of a packed batch (plus seq_lens/seq_lens_padded). Remove those "
            "keys, or shard them yourself, rather than have them silently dropped"
        )
    # Only the tensors we use go on: non-tensor entries (and an incoming padding_mask) are not carried.
    bshd = {k: v for k, v in batch.items() if k in THD_TOKEN_KEYS or k in ("seq_lens", "seq_lens_padded")}
    thd = split_batch_into_thd_chunks(bshd, num_chunks, seq_lens_padding_value, padding_token_id)
    _check_attention_mask(bshd, seq_lens_padding_value)
    thd.pop("attention_mask", None)

    def shard(chunk: dict[str, Any]) -> dict[str, Any]:
        return shard_thd_chunk(chunk, cp_size, cp_rank, qkv_format, seq_lens_padding_value, padding_token_id)

    if num_chunks == 1:
        return shard(thd)

    def mrope(key: str, v: torch.Tensor) -> bool:  # [n_rope, num_chunks, T_c] position ids
        return key == "position_ids" and v.dim() == 3

    shards = [
        shard({k: (v[:, i] if mrope(k, v) else v[i]) for k, v in thd.items() if isinstance(v, torch.Tensor)})
        for i in range(num_chunks)
    ]
    out: dict[str, Any] = {}
    for key, value in shards[0].items():
        if isinstance(value, torch.Tensor):
            dim = 1 if key == "position_ids" and value.dim() == 2 else 0
            out[key] = torch.stack([s[key] for s in shards], dim=dim)
        else:
            out[key] = value
    return out
