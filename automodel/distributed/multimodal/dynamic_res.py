"""Dynamic-resolution vision CP: whole images per rank, balanced by patch count, tubelet-aware.

Images of different sizes arrive in the packed (THD) layout that dynamic-resolution encoders use
(Qwen2-VL, NaViT-style): ``pixel_values [P, D]`` holds the patches of every medium back to back and
``grid_thw [N, 3]`` gives each medium's ``(t, h, w)`` patch grid (``P == sum(t*h*w)``).

**Units.** A split between ranks may only fall between *units*: an image (``t == 1``) is one unit;
a video of ``t`` frames is ``t / temporal_patch_size`` tubelets, each a unit of
``temporal_patch_size*h*w`` patches (``split_videos=False`` makes the whole video one unit, for encoders
whose attention spans all frames). A video of ``t`` frames must have ``t % temporal_patch_size == 0``
or ``t < temporal_patch_size`` (one short tubelet the encoder pads); anything else cuts a tubelet and
is rejected. In Qwen2-VL's layout ``t`` already counts tubelets (the processor groups the frames)
and its vision attention never crosses a temporal patch, so ``temporal_patch_size=1`` is exact there.

**Balance rule (by patches, not by images).** Ranks receive contiguous runs of units, in order. Of all
such splits, the one with the smallest largest per-rank patch count is chosen; ties go to the split
with the smallest sum of squared per-rank counts, then to the one that fills earlier ranks first.
Rank ``r`` thus holds patches ``[split_points[r], split_points[r+1])``.

**Dummies.** A rank left without patches (fewer units than ranks) encodes one dummy image of grid
``(1, m, m)`` (``m = spatial_merge_size``: the smallest image the encoder accepts, ``m*m`` patches,
one output row) filled with ``dummy_value``, so that every rank runs the encoder (collectives inside
it and FSDP stay in step). Its output is dropped by the gather and gets no gradient.

**FP8 padding.** With ``fp8_enabled`` each rank's patch count is padded (zero rows at the end) to a
multiple of ``lcm(16, m*m)`` (``lcm(32, m*m)`` for ``fp8_recipe="mxfp8"``), what FP8 GEMMs need;
``cu_seqlens_padded`` describes it, the gather drops the padded output rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel.distributed.multimodal.comm import GatherFromContextParallelRanks, resolve_group
from automodel.distributed.multimodal.megatron_split import (
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    megatron_split_dynamic_res,
)
from automodel.distributed.sp.padding import get_padding_multiple
from automodel.distributed.torch_internals import all_gather_single

__all__ = [
    "DynamicResSplit",
    "split_to_context_parallel_ranks_dynamic_res",
    "gather_from_context_parallel_ranks_dynamic_res",
    "balanced_split_points",
    "check_grid",
    "tubelet_balanced_split_points",
    "_compute_tubelet_aware_split_points",
    "_split_num_frames",
]


# ---------------------------------------------------------------------------------------------------------
# planning (pure python)


def balanced_split_points(unit_sizes: list[int], parts: int) -> list[int]:
    """``parts + 1`` offsets cutting ``unit_sizes`` (in order) into contiguous runs, by the balance rule.

    Minimises the largest run, then the sum of squared runs; ties fill earlier parts first. Offsets are
    in the units' own measure (patches or frames): ``[0, ..., sum(unit_sizes)]``.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    prefix = [0]
    for s in unit_sizes:
        prefix.append(prefix[-1] + int(s))
    n = len(unit_sizes)
    inf = float("inf")
    # 1) smallest achievable maximum
    best = [0.0] + [inf] * n  # best[j]: min over splits of units[:j] into k parts of the max part
    for _ in range(parts - 1):
        nxt = [inf] * (n + 1)
        for j in range(n + 1):
            for i in range(j + 1):
                v = max(best[i], prefix[j] - prefix[i])
                if v < nxt[j]:
                    nxt[j] = v
        best = nxt
    limit = min(max(best[i], prefix[n] - prefix[i]) for i in range(n + 1))
    # 2) smallest sum of squares with every part <= limit; ties -> later cut (earlier parts fuller)
    cost = [0.0] + [inf] * n
    choice: list[list[int]] = []
    for _ in range(parts):
        nxt, arg = [inf] * (n + 1), [0] * (n + 1)
        for j in range(n + 1):
            for i in range(j + 1):
                load = prefix[j] - prefix[i]
                if load > limit or cost[i] == inf:
                    continue
                v = cost[i] + load * load
                if v <= nxt[j]:
                    nxt[j], arg[j] = v, i
        cost = nxt
        choice.append(arg)
    cuts, j = [n], n
    for arg in reversed(choice):
        j = arg[j]
        cuts.append(j)
    return [prefix[c] for c in reversed(cuts)]


def _tubelet_units(frames: int, temporal_patch_size: int, what: str) -> list[int]:
    """Frames per unit of one medium of ``frames`` frames (see the module docstring)."""
    if frames < 1:
        raise ValueError(f"{what} has {frames} frames; every medium needs >= 1")
    if frames <= temporal_patch_size:
        return [frames]
    if frames % temporal_patch_size:
        raise ValueError(
            f"{what} has {frames} frames, not a multiple of temporal_patch_size={temporal_patch_size}: its "
            f"last tubelet would be cut. Pad the video to {math.ceil(frames / temporal_patch_size) * temporal_patch_size}"
            f" frames (repeat the last frame) or drop {frames % temporal_patch_size}"
        )
    return [temporal_patch_size] * (frames // temporal_patch_size)


def tubelet_balanced_split_points(
    num_frames: list[int], temporal_patch_size: int, cp_size: int, total_frames: int
) -> list[int]:
    """``cp_size + 1`` frame indices cutting the media only at media or tubelet boundaries, by our balance rule.

    Args:
        num_frames: frames of each medium, in order (an image counts 1).
        temporal_patch_size: frames per tubelet (>= 1).
        cp_size: number of ranks.
        total_frames: ``sum(num_frames)`` (checked).

    Returns:
        Non-decreasing ``[0, ..., total_frames]`` with the smallest largest part (module docstring), e.g.
        ``([1, 8, 1], 2, 3, 10) -> [0, 3, 7, 10]``. Megatron's rule is
        :func:`_compute_tubelet_aware_split_points`.

    Raises:
        ValueError: a frame count that would cut a tubelet, or ``total_frames != sum(num_frames)``.
    """
    if temporal_patch_size < 1 or cp_size < 1:
        raise ValueError(f"temporal_patch_size and cp_size must be >= 1, got {temporal_patch_size}, {cp_size}")
    if sum(num_frames) != total_frames:
        raise ValueError(f"total_frames={total_frames} but num_frames {list(num_frames)} sum to {sum(num_frames)}")
    units: list[int] = []
    for i, n in enumerate(num_frames):
        units += _tubelet_units(int(n), temporal_patch_size, f"medium {i}")
    return balanced_split_points(units, cp_size)


# ---------------------------------------------------------------------------------------------------------
# the split


@dataclass
class DynamicResSplit:
    """How the media were split, what this rank holds, and what the gather needs.

    Attributes:
        world_size, rank: the group.
        spatial_merge_size: ``m``; the encoder emits one row per ``m*m`` patches.
        split_points: ``[W+1]`` patch offsets; rank ``r`` holds global patches ``[sp[r], sp[r+1])``.
        patches_per_rank: real patches per rank.
        padded_patches_per_rank: patches each rank encodes (real + dummy + FP8 padding).
        has_dummy: per rank, whether it encodes a dummy image.
        local_grid_thw: ``[n, 3]`` int64 grids of this rank's pieces (a video piece keeps its ``h, w``
            and has the frames it holds), the dummy last.
        local_media: per real piece ``(medium index, first frame, end frame)``.
        local_cu_seqlens: ``[n+1]`` int32 patch offsets of the pieces (one segment per piece).
        local_cu_seqlens_padded: as ``local_cu_seqlens`` with the last offset at the padded count.
    """

    world_size: int
    rank: int
    spatial_merge_size: int
    split_points: list[int]
    patches_per_rank: list[int]
    padded_patches_per_rank: list[int]
    has_dummy: list[bool]
    local_grid_thw: torch.Tensor
    local_media: list[tuple[int, int, int]] = field(default_factory=list)
    local_cu_seqlens: torch.Tensor | None = None
    local_cu_seqlens_padded: torch.Tensor | None = None

    @property
    def rows_per_output(self) -> int:
        return self.spatial_merge_size**2

    @property
    def tokens_per_rank(self) -> list[int]:
        """Real output rows (embeddings) per rank."""
        return [p // self.rows_per_output for p in self.patches_per_rank]

    @property
    def padded_tokens_per_rank(self) -> list[int]:
        """Output rows each rank's encoder produces (real + dummy + padding)."""
        return [p // self.rows_per_output for p in self.padded_patches_per_rank]


def check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor, m: int) -> list[tuple[int, int, int]]:
    """Validate ``pixel_values [P, D]`` against ``grid_thw [N, 3]`` and the merge size ``m``; return the grids.

    Raises ``ValueError`` naming the medium when ``P != sum(t*h*w)``, a size is not positive, or ``h``/``w``
    is not a multiple of ``m``.
    """
    if grid_thw.dim() != 2 or grid_thw.size(1) != 3 or grid_thw.size(0) < 1:
        raise ValueError(f"grid_thw must be [N, 3] (t, h, w per medium) with N >= 1, got shape {tuple(grid_thw.shape)}")
    if pixel_values.dim() != 2:
        raise ValueError(f"pixel_values must be [P, D] packed patches, got shape {tuple(pixel_values.shape)}")
    grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < 1 or w < 1:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)} has a non-positive size")
        if h % m or w % m:
            raise ValueError(
                f"grid_thw[{i}] = {(t, h, w)}: h and w must be multiples of spatial_merge_size={m} (the encoder "
                f"merges {m}x{m} patches); resize the image to a multiple of {m} patches"
            )
    total = sum(t * h * w for t, h, w in grids)
    if pixel_values.size(0) != total:
        raise ValueError(
            f"pixel_values has {pixel_values.size(0)} patch rows but grid_thw describes {total} patches "
            f"(sum of t*h*w over {len(grids)} media {grids}); pass the pixel_values and grid_thw the processor "
            "returned together"
        )
    return grids


def split_to_context_parallel_ranks_dynamic_res(
    global_t: torch.Tensor,
    global_imgs_sizes: torch.Tensor,
    global_packed_seq_params: Any = None,
    fp8_enabled: bool = False,
    patch_dim: int = 16,
    num_frames: Any = None,
    temporal_patch_size: int = 1,
    *,
    group: Any = None,
    spatial_merge_size: int = 1,
    split_videos: bool = True,
    split_points: list[int] | None = None,
    fp8_recipe: str | None = None,
    dummy_value: float = 0.0,
) -> tuple[torch.Tensor, DynamicResSplit]:
    """This rank's whole images (and video tubelets) out of a packed dynamic-resolution batch.

    Megatron's parameter names and order, two forms. automodel's: the HF processor's layout
    (``global_t`` = ``pixel_values [P, D]``, ``global_imgs_sizes`` = ``grid_thw [N, 3]``), from which the
    per-image sequence lengths and frame counts follow, so ``global_packed_seq_params``, ``patch_dim``
    and ``num_frames`` stay unset; balanced by patches, returns ``(local, DynamicResSplit)``. Megatron's:
    a ``PackedSeqParams`` third selects Megatron's split (by image count, dummies, FP8 pad), returning its
    6-tuple; see :mod:`automodel.distributed.multimodal.megatron_split`.

    Args:
        global_t: ``[P, D]`` packed patches of all media (``pixel_values``), identical on every rank.
        global_imgs_sizes: ``[N, 3]`` int ``(t, h, w)`` per medium (``grid_thw``), ``P == sum(t*h*w)``.
        global_packed_seq_params, patch_dim, num_frames: Megatron's inputs; must stay at their defaults.
        group: ProcessGroup, DeviceMesh (its ``"cp"`` dim) or ``None`` (default group).
        spatial_merge_size: ``m``: the encoder merges ``m x m`` patches into one output row.
        temporal_patch_size: frames per tubelet in ``t`` (1 for Qwen2-VL's layout, see module docs).
        split_videos: allow cuts between the tubelets of a video (exact only for encoders whose
            attention stays within a tubelet / temporal patch).
        split_points: ``[W+1]`` patch offsets chosen by the caller instead of the balance rule; each
            must fall between units.
        fp8_enabled, fp8_recipe: pad every rank's patches for FP8 GEMMs (module docstring).
        dummy_value: fill value of dummy images.

    Returns:
        ``(local_pixel_values [padded_patches_per_rank[rank], D], split)``; feed the encoder
        ``local_pixel_values`` with ``split.local_grid_thw`` and gather its output with
        :func:`gather_from_context_parallel_ranks_dynamic_res`. The input is not mutated.

    Raises:
        ValueError: ``pixel_values`` inconsistent with ``grid_thw``, a grid not divisible by ``m``, a
        tubelet-incompatible frame count, or a caller-supplied split that cuts a unit.
        TypeError: Megatron-only arguments without a ``PackedSeqParams``.
    """
    if hasattr(global_packed_seq_params, "cu_seqlens_q"):
        return megatron_split_dynamic_res(  # type: ignore[return-value]
            global_t, global_imgs_sizes, global_packed_seq_params, fp8_enabled, patch_dim, num_frames,
            temporal_patch_size, group,
        )
    if global_packed_seq_params is not None or num_frames is not None or patch_dim != 16:
        raise TypeError(
            "split_to_context_parallel_ranks_dynamic_res: global_packed_seq_params, patch_dim and num_frames belong "
            "to Megatron's form (global_packed_seq_params must then have cu_seqlens_q); automodel's form takes "
            "pixel_values [P, D] and grid_thw [N, 3] and the group as group=. See docs/seed_api.md"
        )
    pixel_values, grid_thw = global_t, global_imgs_sizes
    _, world, rank = resolve_group(group)
    m = int(spatial_merge_size)
    if m < 1 or temporal_patch_size < 1:
        raise ValueError(f"spatial_merge_size and temporal_patch_size must be >= 1, got {m}, {temporal_patch_size}")
    grids = check_grid(pixel_values, grid_thw, m)

    # units and their patch boundaries
    unit_sizes: list[int] = []
    unit_owner: list[int] = []  # medium of each unit
    for i, (t, h, w) in enumerate(grids):
        kind = "image" if t == 1 else "video"
        frames = [t] if not split_videos else _tubelet_units(t, temporal_patch_size, f"{kind} {i} (grid_thw {(t, h, w)})")
        for f in frames:
            unit_sizes.append(f * h * w)
            unit_owner.append(i)
    bounds = [0]
    for s in unit_sizes:
        bounds.append(bounds[-1] + s)

    if split_points is None:
        points = balanced_split_points(unit_sizes, world)
    else:
        points = [int(p) for p in split_points]
        if len(points) != world + 1 or points[0] != 0 or points[-1] != bounds[-1] or points != sorted(points):
            raise ValueError(
                f"split_points must be {world + 1} non-decreasing patch offsets from 0 to {bounds[-1]}, got {points}"
            )
        allowed = set(bounds)
        for p in points:
            if p not in allowed:
                u = next(k for k in range(len(unit_sizes)) if bounds[k] < p < bounds[k + 1])
                i = unit_owner[u]
                start = sum(t * h * w for t, h, w in grids[:i])
                t, h, w = grids[i]
                raise ValueError(
                    f"split point {p} cuts medium {i} (grid_thw {(t, h, w)}, patches [{start}, {start + t * h * w})) "
                    f"across CP ranks; an image stays whole on one rank and a video may only be cut between "
                    f"tubelets. Allowed split points: {bounds}"
                )

    multiple = get_padding_multiple(fp8_enabled=True, fp8_recipe=fp8_recipe) if fp8_enabled else 1
    multiple = math.lcm(multiple, m * m)
    dummy = m * m
    real = [points[r + 1] - points[r] for r in range(world)]
    has_dummy = [n == 0 for n in real]
    padded = []
    for n, d in zip(real, has_dummy):
        n = n + (dummy if d else 0)
        padded.append(-(-n // multiple) * multiple)

    lo, hi = points[rank], points[rank + 1]
    pieces, media = [], []
    start = 0
    for i, (t, h, w) in enumerate(grids):
        end = start + t * h * w
        a, b = max(lo, start), min(hi, end)
        if b > a:
            f0, f1 = (a - start) // (h * w), (b - start) // (h * w)
            pieces.append((f1 - f0, h, w))
            media.append((i, f0, f1))
        start = end
    if has_dummy[rank]:
        pieces.append((1, m, m))
    local = pixel_values[lo:hi]
    extra = padded[rank] - real[rank]
    if extra:
        fill = local.new_zeros((extra, pixel_values.size(1)))
        if has_dummy[rank]:
            fill[:dummy] = dummy_value
        local = torch.cat([local, fill], dim=0)
    seg = torch.tensor([t * h * w for t, h, w in pieces], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), seg.cumsum(0, dtype=torch.int32)]).to(pixel_values.device)
    cu_padded = cu.clone()
    cu_padded[-1] = padded[rank]
    split = DynamicResSplit(
        world_size=world, rank=rank, spatial_merge_size=m, split_points=points,
        patches_per_rank=real, padded_patches_per_rank=padded, has_dummy=has_dummy,
        local_grid_thw=torch.tensor(pieces, dtype=torch.long, device=grid_thw.device).reshape(-1, 3),
        local_media=media, local_cu_seqlens=cu, local_cu_seqlens_padded=cu_padded,
    )
    return local, split


def gather_from_context_parallel_ranks_dynamic_res(
    local_t: torch.Tensor, num_padded_imgs: DynamicResSplit | int = 0, group: Any = None
) -> torch.Tensor:
    """Every rank's real encoder output rows, in global media order, with autograd.

    Args:
        local_t: ``[split.padded_tokens_per_rank[rank], ...]`` the encoder's output for the local
            pixel values (one row per ``m*m`` patches; dummy and padding rows last).
        num_padded_imgs: the :class:`DynamicResSplit` from :func:`split_to_context_parallel_ranks_dynamic_res`
            on the same group; or, Megatron's form, an int: every rank's ``local_t`` (any number of rows,
            other dims equal) is gathered along dim 0 in rank order and the blocks of the last
            ``num_padded_imgs`` ranks (those that encoded only a dummy) are dropped.

    Returns:
        ``[sum(split.tokens_per_rank), ...]``, identical on every rank: the rows the encoder would give
        on the whole batch. Backward: each rank receives the group's summed gradient of its own rows
        (reduce-scatter); dummy and padding rows get zero.
    """
    if not isinstance(num_padded_imgs, DynamicResSplit):
        return _gather_rows_dropping_last_ranks(local_t, int(num_padded_imgs), group)
    local_embeds, split = local_t, num_padded_imgs
    pg, world, rank = resolve_group(group)
    if world != split.world_size or rank != split.rank:
        raise ValueError(
            f"the split was made for rank {split.rank} of {split.world_size} but this is rank {rank} of {world}; "
            "use the same group for split and gather"
        )
    expected = split.padded_tokens_per_rank[rank]
    if local_embeds.size(0) != expected:
        raise ValueError(
            f"local_embeds has {local_embeds.size(0)} rows but the encoder should emit {expected} on rank {rank} "
            f"({split.padded_patches_per_rank[rank]} patches / {split.rows_per_output} patches per row)"
        )
    if world == 1:
        return local_embeds.narrow(0, 0, split.tokens_per_rank[0])
    biggest = max(split.padded_tokens_per_rank)
    x = local_embeds
    if x.size(0) < biggest:
        x = torch.cat([x, x.new_zeros((biggest - x.size(0), *x.shape[1:]))], dim=0)
    full = GatherFromContextParallelRanks.apply(x, pg, 0)
    parts = [full.narrow(0, r * biggest, n) for r, n in enumerate(split.tokens_per_rank) if n > 0]
    return torch.cat(parts, dim=0)


def _gather_rows_dropping_last_ranks(local_t: torch.Tensor, num_padded: int, group: Any) -> torch.Tensor:
    """Megatron's dynamic-resolution gather: rows of every rank (sizes exchanged), last ``num_padded`` dropped."""
    pg, world, _ = resolve_group(group)
    if not 0 <= num_padded < world or num_padded and world == 1:
        raise ValueError(f"num_padded_imgs={num_padded} must be in [0, {world}) (ranks in the group)")
    if world == 1:
        return local_t
    mine = torch.tensor([local_t.size(0)], dtype=torch.int64, device=local_t.device)
    every = torch.empty(world, dtype=torch.int64, device=local_t.device)
    # torch_internals.all_gather_single: all_gather_into_tensor on torch < 2.13
    all_gather_single(every, mine, group=pg)
    rows = every.tolist()
    biggest = max(rows)
    x = local_t
    if x.size(0) < biggest:
        x = torch.cat([x, x.new_zeros((biggest - x.size(0), *x.shape[1:]))], dim=0)
    full = GatherFromContextParallelRanks.apply(x, pg, 0)
    keep = world - num_padded
    return torch.cat([full.narrow(0, r * biggest, rows[r]) for r in range(keep)], dim=0)
