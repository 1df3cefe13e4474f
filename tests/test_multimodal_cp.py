"""Multimodal CP primitives: single-process planning/validation tests and ONE 2-rank gloo group.

The gloo group (tests/workers/multimodal_worker.py) checks, in fp32 and fp64, that split -> encode the
local share -> gather gives the single-process encoder output and, with the CP loss (each rank's share
of the rows, summed over ranks), every encoder gradient: fixed-size samples (uneven count, fewer than
ranks) and dynamic resolution (uneven images, fewer images than ranks with a dummy, videos cut between
tubelets in both layouts, whole videos, FP8 / MXFP8 padding, a caller-supplied split, a bad split).
"""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.multimodal.cp import (
    PackedSeqParams,
    _compute_tubelet_aware_split_points,
    _split_num_frames,
    gather_from_context_parallel_ranks,
    get_packed_seq_params,
    get_padding,
    split_to_context_parallel_ranks,
    split_to_context_parallel_ranks_dynamic_res,
)
from automodel.distributed.multimodal.dynamic_res import balanced_split_points, tubelet_balanced_split_points
from automodel.distributed.sp import padding
from tests.dist_harness import run_distributed

# ------------------------------------------------------------------------------------------------
# single process


def test_get_padding_is_the_shared_rule():
    assert get_padding is padding.get_padding
    assert get_padding(99, cp_size=2, fp8_enabled=True) == 1  # Megatron's single rule
    assert padding.get_padding_lcm(99, cp_size=2, fp8_enabled=True) == 29


def test_packed_seq_params():
    tokens = torch.zeros(2, 10, dtype=torch.long)
    p = get_packed_seq_params(tokens, img_seq_len=6, padding_needed=3, cp_size=2)
    assert p.cu_seqlens_q.tolist() == [0, 13, 26] and p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_kv_padded.tolist() == [0, 16, 32]
    assert (p.max_seqlen_q, p.max_seqlen_kv, p.qkv_format) == (16, 16, "thd")
    p = get_packed_seq_params(tokens, 6, 0, cp_size=2)  # no padding: plain rows
    assert p.cu_seqlens_q_padded is None and p.qkv_format == "sbhd" and p.cu_seqlens_q.tolist() == [0, 16, 32]
    p = get_packed_seq_params(tokens, 6, 0, cp_size=2, use_packed_sequence=True)
    assert p.qkv_format == "thd" and p.cu_seqlens_q_padded.tolist() == [0, 16, 32]
    assert get_packed_seq_params(tokens, 6, 3, cp_size=1).qkv_format == "sbhd"
    with pytest.raises(ValueError, match="padding_needed=16 leaves no real token"):
        get_packed_seq_params(tokens, 6, 16, cp_size=2)


def test_tubelet_split_points_megatron_examples():
    assert _compute_tubelet_aware_split_points([16], 4, 4, 16) == [0, 4, 8, 12, 16]
    assert _compute_tubelet_aware_split_points([4, 2], 4, 2, 6) == [0, 4, 6]
    # Megatron's rule: the nearest tubelet boundary to the even target (int(10/3)=3 -> 3, int(20/3)=6 -> 5)
    assert _compute_tubelet_aware_split_points([1, 8, 1], 2, 3, 10) == [0, 3, 5, 10]
    assert tubelet_balanced_split_points([1, 8, 1], 2, 3, 10) == [0, 3, 7, 10]  # ours: smallest largest part
    assert _compute_tubelet_aware_split_points([4], 4, 2, 4) == [0, 4, 4]  # fewer units than ranks


def test_tubelet_split_points_tolerate_partial_tubelets():
    # a 6-frame video with tubelets of 4: Megatron's points stay monotonic (its last tubelet is short)
    assert _compute_tubelet_aware_split_points([4, 6], 4, 2, 10) == [0, 8, 10]
    for frames in ([3, 5, 7], [6], [1, 1, 9, 2]):
        for cp in (1, 2, 3, 5):
            pts = _compute_tubelet_aware_split_points(frames, 4, cp, sum(frames))
            assert len(pts) == cp + 1 and pts[0] == 0 and pts[-1] == sum(frames)
            assert all(a <= b for a, b in zip(pts, pts[1:])), (frames, cp, pts)
    # our balance rule cuts only whole tubelets, so it refuses them with the fix
    with pytest.raises(ValueError, match="medium 1 has 6 frames, not a multiple of temporal_patch_size=4"):
        tubelet_balanced_split_points([4, 6], 4, 2, 10)
    with pytest.raises(ValueError, match="total_frames=7 but num_frames"):
        tubelet_balanced_split_points([4, 2], 4, 2, 7)
    grid = torch.tensor([[6, 2, 2]])
    with pytest.raises(ValueError, match=r"video 0 \(grid_thw \(6, 2, 2\)\) has 6 frames.*Pad the video to 8"):
        split_to_context_parallel_ranks_dynamic_res(torch.zeros(24, 3), grid, temporal_patch_size=4)


def test_split_num_frames():
    assert _split_num_frames([4, 2], 2, 6) == [2, 2]
    assert _split_num_frames([16], 4, 8) == [4]
    assert _split_num_frames([4, 2], 4, 4) == []
    assert _split_num_frames([4, 2], 4, 9) == [2]  # clipped: a range past the end is no error
    assert _split_num_frames([4, 2], 7, 9) == []
    assert _split_num_frames([], 0, 3) == []


def test_balance_is_by_patches_not_images():
    # three small images and one big one: 2 ranks get [3 small | big], not 2 images each
    assert balanced_split_points([4, 4, 4, 12], 2) == [0, 12, 24]
    assert balanced_split_points([4, 4, 4, 16, 8], 3) == [0, 12, 28, 36]
    assert balanced_split_points([5], 3) == [0, 5, 5, 5]  # fewer units than ranks: later ranks empty


def test_pixel_values_inconsistent_with_grid():
    grid = torch.tensor([[1, 4, 4], [1, 2, 2]])
    with pytest.raises(ValueError, match="pixel_values has 19 patch rows but grid_thw describes 20 patches"):
        split_to_context_parallel_ranks_dynamic_res(torch.zeros(19, 3), grid, spatial_merge_size=2)
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(1, 2, 3\): h and w must be multiples of"):
        split_to_context_parallel_ranks_dynamic_res(torch.zeros(22, 3), torch.tensor([[1, 4, 4], [1, 2, 3]]),
                                                    spatial_merge_size=2)
    with pytest.raises(ValueError, match=r"grid_thw must be \[N, 3\]"):
        split_to_context_parallel_ranks_dynamic_res(torch.zeros(16, 3), torch.tensor([4, 4]))


def test_single_process_is_identity():
    x = torch.randn(3, 2)
    local, pad = split_to_context_parallel_ranks(x)
    assert pad == 0 and torch.equal(local, x)
    assert torch.equal(gather_from_context_parallel_ranks(local, 0), x)
    pv = torch.randn(20, 3)
    local, split = split_to_context_parallel_ranks_dynamic_res(pv, torch.tensor([[1, 4, 4], [1, 2, 2]]),
                                                               spatial_merge_size=2, fp8_enabled=True)
    assert split.split_points == [0, 20] and split.padded_patches_per_rank == [32]
    assert torch.equal(local[:20], pv) and not local[20:].any()
    assert split.local_cu_seqlens.tolist() == [0, 16, 20] and split.local_cu_seqlens_padded.tolist() == [0, 16, 32]


# ------------------------------------------------------------------------------------------------
# 2 gloo ranks


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed("tests.workers.multimodal_worker:run", world_size=2, timeout=300)


CASES = ["fixed_uneven", "fixed_fewer", "uneven", "fewer", "video_qwen", "video_tubelets", "video_whole",
         "fp8", "fp8_mx", "caller_split"]


@pytest.mark.dist
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("case", CASES)
def test_cp_matches_single_process(dist_results, case, dtype, tol):
    for rank in range(2):
        r = dist_results[rank][f"{case}_{dtype}"]
        assert r["value_rel"] <= tol, (rank, r)
        assert r["grad_rel"] <= (tol if dtype == "float64" else 1e-4), (rank, r)


@pytest.mark.dist
def test_split_decisions(dist_results):
    r0, r1 = dist_results[0], dist_results[1]
    # fixed-size: ceil(3/2) = 2 samples per rank, one padding sample at the end; 1 sample: rank 1 only pad
    assert r0["fixed_uneven_float32"]["local_shape"] == [2, 3, 2, 2] and r0["fixed_uneven_float32"]["global_pad"] == 1
    assert r1["fixed_fewer_float32"]["global_pad"] == 1
    # uneven images (16, 4, 24, 8 patches): [16+4 | 24+8] has the smallest maximum (32)
    u0, u1 = r0["uneven_float32"], r1["uneven_float32"]
    assert u0["split_points"] == [0, 20, 52] and u0["local_media"] == [(0, 0, 1), (1, 0, 1)]
    assert u1["local_media"] == [(2, 0, 1), (3, 0, 1)] and u1["local_grid_thw"] == [[1, 6, 4], [1, 2, 4]]
    # one image, two ranks: rank 1 encodes a dummy (1, 2, 2) image (one merged row), dropped by the gather
    f1 = r1["fewer_float32"]
    assert f1["has_dummy"] == [False, True] and f1["local_grid_thw"] == [[1, 2, 2]] and f1["local_media"] == []
    # Qwen2-VL layout: the 4-temporal-patch video is cut after its 2nd temporal patch
    assert r0["video_qwen_float32"]["local_media"] == [(0, 0, 2)]
    assert r1["video_qwen_float32"]["local_media"] == [(0, 2, 4), (1, 0, 1)]
    # frame layout, tubelets of 2: the 8-frame video is cut at frame 6 (a tubelet boundary)
    assert r0["video_tubelets_float32"]["local_grid_thw"] == [[1, 2, 2], [6, 2, 2]]
    assert r1["video_tubelets_float32"]["local_media"] == [(1, 6, 8), (2, 0, 4)]
    # split_videos=False keeps the video whole even though that is less balanced
    assert r0["video_whole_float32"]["split_points"] == [0, 32, 36]
    # FP8: 20 and 32 patches padded to multiples of 16 (and of m*m = 4)
    fp8 = r0["fp8_float32"]
    assert fp8["padded_patches_per_rank"] == [32, 32] and fp8["local_rows"] == 32
    assert fp8["cu_seqlens"] == [0, 16, 20] and fp8["cu_seqlens_padded"] == [0, 16, 32]
    assert r0["fp8_mx_float32"]["padded_patches_per_rank"] == [32, 32]  # mxfp8: multiples of 32


@pytest.mark.dist
def test_gather_autograd_function_along_dim1(dist_results):
    for rank in range(2):
        assert dist_results[rank]["gather_dim1"] == {"forward_ok": True, "grad": [3.0]}  # 1 + 2 summed


@pytest.mark.dist
def test_caller_split_that_cuts_an_image_is_rejected(dist_results):
    msg = dist_results[0]["bad_split"]
    assert msg is not None and "split point 8 cuts medium 0 (grid_thw (1, 4, 4), patches [0, 16))" in msg
    assert "Allowed split points: [0, 16, 24]" in msg


@pytest.mark.dist
def test_megatron_forms(dist_results):
    r0, r1 = dist_results[0]["megatron_forms"], dist_results[1]["megatron_forms"]
    assert r0["full_ok"] and r1["full_ok"]  # gathered along dim 1 by default, the padding sample dropped
    # backward: the group's sum (1 + 2) for the real samples, nothing for rank 1's padding sample
    assert r0["grad"] == [[[3.0] * 4, [3.0] * 4]] and r1["grad"] == [[[3.0] * 4, [0.0] * 4]]
    assert r0["both"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]] and r0["rows_grad"] == [[2.0, 2.0]]
    assert r1["rows_grad"] == [[2.0, 2.0], [2.0, 2.0]]
    assert r0["first"] == r1["first"] == [[0.0, 0.0]]  # rank 1's block dropped


def test_megatron_dynamic_res_split_single_process():
    cu = torch.tensor([0, 4, 10, 12], dtype=torch.int32)
    params = PackedSeqParams(cu, cu, None, None, 6, 6, "thd")
    g = torch.randn(1, 12, 768)
    local_t, sizes, p, has_pad, padded, frames = split_to_context_parallel_ranks_dynamic_res(
        g, torch.tensor([[16, 16]] * 3), params, fp8_enabled=True
    )
    assert torch.equal(local_t[:, :12], g) and not local_t[:, 12:].any() and local_t.shape == (1, 16, 768)
    assert p.cu_seqlens_q.tolist() == [0, 4, 10, 12, 16] and int(p.max_seqlen_q) == 6 and p.qkv_format == "thd"
    assert sizes.tolist() == [[16, 16]] * 3 + [[16, 64]] and has_pad and padded == 0 and frames is None
    with pytest.raises(ValueError, match="num_frames is required"):
        split_to_context_parallel_ranks_dynamic_res(g, torch.tensor([[16, 16]] * 3), params, temporal_patch_size=2)
    with pytest.raises(TypeError, match="belong to Megatron's form"):
        split_to_context_parallel_ranks_dynamic_res(torch.zeros(4, 3), torch.tensor([[1, 2, 2]]), num_frames=[1])


@pytest.mark.dist
def test_megatron_dynamic_res_split_two_ranks(dist_results):
    d0, d1 = dist_results[0]["megatron_forms"]["dyn"], dist_results[1]["megatron_forms"]["dyn"]
    tokens = lambda a, b: torch.arange(a * 8, b * 8, dtype=torch.float64).reshape(1, b - a, 8).tolist()  # noqa: E731
    # 3 images of 4, 6, 2 tokens: n // W = 1 image on rank 0, the rest on the last rank
    assert d0["images"]["local_t"] == tokens(0, 4) and d0["images"]["cu"] == [0, 4]
    assert d1["images"]["local_t"] == tokens(4, 12) and d1["images"]["cu"] == [0, 6, 8]
    # one image: rank 1 encodes a dummy of int(4*4*3/8) = 6 zero tokens, dropped by the gather
    assert d1["one_image"]["local_t"] == [[[0.0] * 8] * 6] and d1["one_image"]["padded"] == 1
    # tubelets of 2 frames: media of 4 and 2 frames cut at frame 2 (nearest tubelet boundary to 3)
    assert d0["tubelets"]["frames"] == [2] and d1["tubelets"]["frames"] == [2, 2]
    assert d0["tubelets"]["local_t"] == tokens(0, 4) and d1["tubelets"]["local_t"] == tokens(4, 12)
    for name, n in (("images", 12), ("one_image", 4), ("tubelets", 12)):
        g = torch.arange(n * 8, dtype=torch.float64).reshape(1, n, 8).requires_grad_(True)
        rows = g[0] * 2
        w = torch.linspace(-1, 1, rows.numel(), dtype=torch.float64).reshape(rows.shape)
        (rows * w).sum().backward()
        for d in (d0, d1):
            torch.testing.assert_close(d[name]["rows"], rows.detach())
        torch.testing.assert_close(d0[name]["grad"] + d1[name]["grad"], g.grad)  # SUM over ranks
