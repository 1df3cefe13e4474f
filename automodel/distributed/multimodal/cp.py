"""Multimodal context parallelism: vision inputs split across CP ranks, embeddings gathered back.

Megatron's multimodal CP names and documented behaviour, for any process group (default: the CP
group of a mesh, or the default group). Under CP every rank of a CP group holds the same batch; the
language model then runs on each rank's share of the tokens. Without these helpers every rank would
also encode every image. Instead:

1. each rank encodes only its share of the images (``split_to_context_parallel_ranks`` for
   fixed-size samples along dim 0, ``split_to_context_parallel_ranks_dynamic_res`` for images of
   different sizes, kept whole, and videos cut only between tubelets);
2. the per-rank embeddings are gathered with :class:`GatherFromContextParallelRanks` (all-gather in
   the forward, reduce-scatter in the backward), so every rank holds the embeddings of all images and
   can merge them into its token sequence;
3. the backward is exact for the usual CP objective (the loss is the SUM over ranks of each rank's
   token losses): rank ``r``'s gathered embeddings receive only the gradient of rank ``r``'s tokens;
   the reduce-scatter sums those partial gradients over the group and hands each rank the full
   gradient of the embeddings it produced. Parameter gradients of the encoder are then summed over the
   CP group like every other parameter (FSDP over ``dp_shard_cp`` does it).

Dynamic resolution (see :mod:`automodel.distributed.multimodal.dynamic_res`) is re-exported here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# the shared collectives and the dynamic-resolution API are part of this module's API (re-exported)
from automodel.distributed.multimodal.comm import (
    GatherFromContextParallelRanks,
    PackedSeqParams,
    resolve_group,
)
from automodel.distributed.multimodal.dynamic_res import (
    DynamicResSplit,
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    gather_from_context_parallel_ranks_dynamic_res,
    split_to_context_parallel_ranks_dynamic_res,
)
from automodel.distributed.sp.padding import get_padding

__all__ = [
    "PackedSeqParams",
    "get_padding",
    "get_packed_seq_params",
    "resolve_group",
    "split_to_context_parallel_ranks",
    "GatherFromContextParallelRanks",
    "gather_from_context_parallel_ranks",
    "split_to_context_parallel_ranks_dynamic_res",
    "gather_from_context_parallel_ranks_dynamic_res",
    "DynamicResSplit",
    "_compute_tubelet_aware_split_points",
    "_split_num_frames",
]


# ---------------------------------------------------------------------------------------------------------
# packed sequence parameters


def get_packed_seq_params(
    tokens: torch.Tensor,
    img_seq_len: int,
    padding_needed: int,
    cp_size: int,
    use_packed_sequence: bool = False,
) -> PackedSeqParams:
    """Boundaries of the language-model rows of a multimodal batch (Megatron's ``get_packed_seq_params``).

    Every row of the LM input is ``L = tokens.shape[1] + img_seq_len`` long (text tokens plus image
    embeddings), of which the last ``padding_needed`` are padding (from :func:`get_padding`).

    Args:
        tokens: ``[B, S_text]`` text tokens (only the shape and device are used).
        img_seq_len: image embeddings per row (>= 0).
        padding_needed: padding at the end of every row, ``0 <= padding_needed < L``.
        cp_size: CP size (>= 1).
        use_packed_sequence: rows hold packed documents; forces the padded THD description under CP.

    Returns:
        :class:`PackedSeqParams` with ``cu_seqlens_q = [0, L-p, 2(L-p), ...]``; under CP with padding
        or packing also ``cu_seqlens_q_padded = [0, L, 2L, ...]`` and ``qkv_format="thd"`` (CP attention
        with a padding mask needs the THD layout); else ``None`` and ``"sbhd"``.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S_text], got shape {tuple(tokens.shape)}")
    for name, value, low in (("img_seq_len", img_seq_len, 0), ("padding_needed", padding_needed, 0),
                             ("cp_size", cp_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    batch, padded_len = tokens.shape[0], tokens.shape[1] + img_seq_len
    if padding_needed >= padded_len and padded_len > 0:
        raise ValueError(
            f"padding_needed={padding_needed} leaves no real token in rows of {padded_len} "
            f"({tokens.shape[1]} text + {img_seq_len} image); it must be < {padded_len}"
        )
    valid_len = padded_len - padding_needed
    idx = torch.arange(batch + 1, dtype=torch.int32, device=tokens.device)
    cu = idx * valid_len
    cu_padded = None
    qkv_format = "sbhd"
    if cp_size > 1 and (padding_needed > 0 or use_packed_sequence):
        cu_padded = idx * padded_len
        qkv_format = "thd"
    return PackedSeqParams(cu, cu, cu_padded, cu_padded, padded_len, padded_len, qkv_format)


# ---------------------------------------------------------------------------------------------------------
# fixed-size samples


def split_to_context_parallel_ranks(
    global_t: torch.Tensor, pad_value: float = 0, group: Any = None
) -> tuple[torch.Tensor, int]:
    """This rank's block of samples along dim 0, the last rank padded.

    Args:
        global_t: ``[N, ...]`` identical on every rank of ``group`` (e.g. ``[N, C, H, W]`` images).
        pad_value: value of the padding samples.
        group: ProcessGroup, DeviceMesh (its ``"cp"`` dim) or ``None`` (default group).

    Returns:
        ``(local_t, global_pad)``: ``local_t`` is ``[ceil(N/W), ...]``, rank ``r`` holding samples
        ``[r*k, (r+1)*k)`` with ``k = ceil(N/W)``; ``global_pad = k*W - N`` padding samples sit at the end
        (so with fewer samples than ranks the last ranks hold only padding). Pass ``global_pad`` to
        :func:`gather_from_context_parallel_ranks`. Not differentiable across ranks: the input is
        replicated, so a plain slice is its own exact gradient path.
    """
    if global_t.dim() < 1 or global_t.size(0) < 1:
        raise ValueError(f"global_t must be [N, ...] with N >= 1 samples, got shape {tuple(global_t.shape)}")
    _, world, rank = resolve_group(group)
    n = global_t.size(0)
    per_rank = math.ceil(n / world)
    global_pad = per_rank * world - n
    if global_pad:
        pad = global_t.new_full((global_pad, *global_t.shape[1:]), pad_value)
        global_t = torch.cat([global_t, pad], dim=0)
    return global_t.narrow(0, rank * per_rank, per_rank), global_pad


def gather_from_context_parallel_ranks(
    local_t: torch.Tensor, global_pad: int, group: Any = None, dim: int = 1
) -> torch.Tensor:
    """Inverse of :func:`split_to_context_parallel_ranks` (with autograd): all blocks, padding dropped.

    Megatron gathers along the SECOND dim (its encoders emit ``[tokens, k, H]`` for ``k`` samples), so
    ``dim=1`` is the default here too; pass ``dim=0`` for a tensor that keeps the samples first.

    Args:
        local_t: this rank's ``k`` samples along ``dim`` (any tensor computed from its block sample by
            sample, e.g. ``[T, k, H]`` embeddings), equally shaped on every rank.
        global_pad: the padding samples at the end, as returned by the split.
        group: as in the split; dim: the sample dim.

    Returns:
        ``k*W - global_pad`` samples along ``dim``. Backward: reduce-scatter (see
        :class:`GatherFromContextParallelRanks`).
    """
    pg, world, _ = resolve_group(group)
    if world == 1:
        return local_t.narrow(dim, 0, local_t.size(dim) - global_pad)
    total = local_t.size(dim) * world
    if not 0 <= global_pad < total:
        raise ValueError(f"global_pad={global_pad} must be in [0, {total}) for {world} blocks of {local_t.size(dim)}")
    full = GatherFromContextParallelRanks.apply(local_t, pg, dim)
    return full.narrow(dim, 0, total - global_pad)
