"""Megatron's dynamic-resolution split, its frame helpers, and their exact behaviour.

``split_to_context_parallel_ranks_dynamic_res`` called with Megatron's inputs (patched vision tokens
``global_t [1, T, hidden]``, per-image ``global_imgs_sizes``, a ``PackedSeqParams`` whose
``cu_seqlens_q`` gives every image's token count) comes here and returns Megatron's 6-tuple:

* Without ``temporal_patch_size > 1``: every rank takes ``n // W`` consecutive images, the last rank
  the rest. With fewer images than ranks, dummy images (all-zero, ``int(patch_dim**2 * 3 / hidden)``
  tokens, size ``[patch_dim, patch_dim]``) are appended so every rank encodes one; the number of
  dummies is the ``num_padded_ranks`` to pass to the gather.
* With tubelets: ``num_frames`` (frames per medium; one image entry per frame) is cut at the split
  points of :func:`_compute_tubelet_aware_split_points`; ranks left empty get dummies (retried until
  none is empty), the last real frame is forced to be a cut, and ``num_padded_ranks`` counts the
  trailing ranks holding only dummies.
* ``fp8_enabled``: the local tokens are padded to a multiple of 16 with a zero "image" of
  ``16 * 16 * 3`` features, recorded as an extra ``[16, 16 * pad]`` size and a last ``cu_seqlens`` entry.

Kept as Megatron does it, including that the FP8 pad image has ``768`` features (so it needs
``hidden == 768``, Megatron's patch layout) and that the image split balances by count, not by
tokens; automodel's own split (balanced by patches, whole images, tubelet-aware) takes the HF
processor's ``pixel_values`` / ``grid_thw`` instead (:mod:`automodel.distributed.multimodal.dynamic_res`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from automodel.distributed.multimodal.comm import PackedSeqParams, resolve_group
from automodel.distributed.sp.padding import get_padding

__all__ = ["_compute_tubelet_aware_split_points", "_split_num_frames", "megatron_split_dynamic_res"]


def _compute_tubelet_aware_split_points(
    num_frames: list[int], temporal_patch_size: int, cp_size: int, total_frames: int
) -> list[int]:
    """Megatron's split points: each cut moved from the even frame target to the nearest allowed boundary.

    For ``k = 1 .. cp_size-1`` the target is ``int(k * total_frames / cp_size)``; inside a medium of at
    most one tubelet the cut goes to the nearer media boundary (the end on a tie); inside a longer
    video to the nearest tubelet boundary (Python ``round``), at least one tubelet from either end and
    never past the medium's end. Cuts never go backwards, so the result is monotonic for any frame
    count, including videos whose frame count is not a multiple of ``temporal_patch_size`` (their last
    tubelet is short). Examples: ``([16], 4, 4, 16) -> [0, 4, 8, 12, 16]``,
    ``([4, 2], 4, 2, 6) -> [0, 4, 6]``, ``([1, 8, 1], 2, 3, 10) -> [0, 3, 5, 10]``.

    Unlike Megatron, an empty ``num_frames`` or ``cp_size < 1`` raises ``ValueError`` (Megatron fails
    with an ``IndexError``). Our balance rule is :func:`tubelet_balanced_split_points`.
    """
    if not num_frames or cp_size < 1 or temporal_patch_size < 1:
        raise ValueError(
            f"need media (got num_frames={list(num_frames)}), cp_size >= 1 and temporal_patch_size >= 1 "
            f"(got {cp_size}, {temporal_patch_size})"
        )
    t = temporal_patch_size
    bounds = [0]
    for n in num_frames:
        bounds.append(bounds[-1] + int(n))
    points = [0]
    for k in range(1, cp_size):
        target = int(k * (total_frames / cp_size))
        i = next((j for j in range(len(num_frames)) if bounds[j + 1] > target), len(num_frames) - 1)
        start, end = bounds[i], bounds[i + 1]
        tubelets = math.ceil(int(num_frames[i]) / t)
        if tubelets <= 1:
            point = start if target - start < end - target else end
        else:
            idx = max(1, min(round((target - start) / t), tubelets - 1))
            point = min(start + idx * t, end)
        points.append(max(point, points[-1]))
    points.append(total_frames)
    return points


def _split_num_frames(num_frames: list[int], lb: int, ub: int) -> list[int]:
    """Per-media frame counts clipped to the frame range ``[lb, ub)``; media outside it are left out.

    E.g. ``([4, 2], 2, 6) -> [2, 2]``, ``([16], 4, 8) -> [4]``, ``([4, 2], 4, 9) -> [2]`` (a range past
    the end is clipped), ``([4, 2], 4, 4) -> []`` and ``([], 0, 3) -> []``.
    """
    out, start = [], 0
    for n in num_frames:
        end = start + int(n)
        piece = min(ub, end) - max(lb, start)
        if piece > 0:
            out.append(piece)
        start = end
    return out


def megatron_split_dynamic_res(
    global_t: torch.Tensor,
    global_imgs_sizes: torch.Tensor,
    global_packed_seq_params: Any,
    fp8_enabled: bool = False,
    patch_dim: int = 16,
    num_frames: Any = None,
    temporal_patch_size: int = 1,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams, bool, int, torch.Tensor | None]:
    """Megatron's split (module docstring): ``(local_t, local_imgs_sizes, local_packed_seq_params,
    has_padding, num_padded_ranks, local_num_frames)``.

    ``local_t`` is a slice of ``global_t`` (dummies and the FP8 pad appended), so gradients flow back into
    ``global_t``; ``local_num_frames`` is ``None`` without tubelets, else int32 frames per local medium.

    Raises:
        ValueError: ``temporal_patch_size > 1`` without ``num_frames`` (Megatron asserts).
    """
    _, world, rank = resolve_group(group)
    tubelets = temporal_patch_size > 1
    if tubelets and num_frames is None:
        raise ValueError(f"num_frames is required with temporal_patch_size={temporal_patch_size} (frames per medium)")
    frames = None
    if tubelets:
        frames = [int(v) for v in (num_frames.tolist() if hasattr(num_frames, "tolist") else num_frames)]
    cu = global_packed_seq_params.cu_seqlens_q
    seqlens = cu[1:] - cu[:-1]
    sizes, t = global_imgs_sizes, global_t
    units = sum(math.ceil(f / temporal_patch_size) for f in frames) if frames is not None else len(sizes)
    dummies = max(0, world - units)
    dummy_len = int(patch_dim * patch_dim * 3 / int(t.shape[2]))
    dummy_size = torch.tensor([[patch_dim, patch_dim]], device=sizes.device, dtype=sizes.dtype)

    def add_dummies(n: int) -> None:
        nonlocal t, sizes, seqlens, frames
        if n <= 0:
            return
        sizes = torch.cat([sizes] + [dummy_size] * n, dim=0)
        t = torch.cat([t, t.new_zeros((1, dummy_len * n, t.shape[2]))], dim=1)
        seqlens = torch.cat([seqlens, seqlens.new_full((n,), dummy_len)])
        if frames is not None:
            frames = frames + [1] * n

    add_dummies(dummies)
    total = len(sizes)
    padded_ranks = dummies
    local_frames = None
    if frames is not None:
        for _ in range(world):
            total = len(sizes)
            points = _compute_tubelet_aware_split_points(frames, temporal_patch_size, world, total)
            empty = sum(points[k] == points[k + 1] for k in range(world))
            if not empty:
                break
            add_dummies(empty)
            dummies += empty
        real = total - dummies
        if dummies and real not in points:
            k = next((k for k in range(world) if points[k] < real < points[k + 1]), None)
            if k is not None:
                points[k + 1] = real
        padded_ranks = 0
        if dummies:
            for i in range(world - 1, -1, -1):
                if points[i] < real:
                    break
                padded_ranks += 1
        lb, ub = points[rank], points[rank + 1]
        local_frames = _split_num_frames(frames, lb, ub)
    else:
        per = total // world
        lb = rank * per
        ub = (rank + 1) * per if rank < world - 1 else len(seqlens) + 1

    local_lens = torch.cat([torch.zeros(1, dtype=seqlens.dtype, device=seqlens.device), seqlens[lb:ub]])
    cu_local = torch.cumsum(local_lens, dim=0).to(torch.int32)
    final = int(cu_local[-1])
    pad_img = None
    if fp8_enabled:
        pad = get_padding(final, 1, 1, False, fp8_enabled=True)
        patch_dim = 16
        if pad > 0:
            pad_img = t.new_zeros((1, pad, patch_dim * patch_dim * 3))
            cu_local = torch.cat([cu_local, cu_local.new_tensor([final + pad])])
    has_padding = pad_img is not None
    max_len = local_lens.max().to(torch.int32)
    params = PackedSeqParams(cu_local, cu_local, None, None, max_len, max_len, "thd")  # type: ignore[arg-type]
    local_sizes = sizes[lb:ub]
    if has_padding:
        local_sizes = torch.cat([local_sizes, local_sizes.new_tensor([[patch_dim, patch_dim * pad]])])
    offset = int(seqlens[:lb].sum()) if lb > 0 else 0
    if has_padding:
        local_t = torch.cat([t[:, offset + int(cu_local[0]) : offset + int(cu_local[-2])], pad_img], dim=1)
    else:
        local_t = t[:, offset + int(cu_local[0]) : offset + int(cu_local[-1])]
    frames_out = None
    if local_frames is not None:
        frames_out = torch.tensor(local_frames, dtype=torch.int32, device=sizes.device)
    return local_t, local_sizes, params, has_padding, padded_ranks, frames_out
