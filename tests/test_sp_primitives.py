"""Sequence-parallel primitives: all-to-all, split/gather, sharding helpers, validator, padding rule.

Single-process unit tests plus ONE launched group of 3 gloo ranks (tests/workers/sp_worker.py) whose
outputs and gradients are compared with single-process simulations computed here.
"""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.sp.all_to_all import all_to_all, cal_split_sizes_multi, even_split_sizes
from automodel.distributed.sp.hybrid import packed_split_indices
from automodel.distributed.sp.padding import get_padding, get_padding_lcm, get_padding_multiple
from automodel.distributed.sp.sharding import ShardingValidator, sp_gather, sp_shard, sp_shard_with_padding
from automodel.distributed.sp.split_gather import (
    gather_forward_split_backward,
    load_balanced_indices,
    per_sequence_indices,
    split_forward_gather_backward,
)
from tests.dist_harness import run_distributed
from tests.workers.sp_worker import A2A_CASES, PACKED_CU, PACKED_LENS, inputs

W = 3
TOL = dict(rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# single-process unit tests


def test_even_split_sizes():
    assert even_split_sizes(100, 3) == [34, 33, 33]
    assert even_split_sizes(8, 2) == [4, 4]
    assert even_split_sizes(5, 4) == [2, 1, 1, 1]
    assert even_split_sizes(2, 3) == [1, 1, 0]
    with pytest.raises(ValueError, match="world_size"):
        even_split_sizes(4, 0)


def test_world_size_one_is_pass_through():
    x = torch.randn(2, 6, 4, requires_grad=True)
    assert all_to_all(x, None, 1, 2) is x
    assert split_forward_gather_backward(x, None, 1) is x
    assert gather_forward_split_backward(x, None, 1) is x
    assert sp_gather(sp_shard(x, 1), 1) is x
    with pytest.raises(ValueError, match="scatter_dim and gather_dim must differ"):
        all_to_all(x, None, 1, 1)
    with pytest.raises(ValueError, match="out of range"):
        all_to_all(x, None, 3, 1)


def test_load_balanced_and_per_sequence_indices():
    # 2W = 4 chunks of 2 over W = 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    # TE's thd partition, written out by hand for W = 3, sequences of padded lengths 6, 12, 6
    assert per_sequence_indices(torch.tensor(PACKED_CU), 3, 1).tolist() == [1, 4, 8, 9, 14, 15, 19, 22]
    every = torch.cat([per_sequence_indices(torch.tensor(PACKED_CU), 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(
        ValueError, match=r"sequence 1 has padded length 10, not divisible by 2\*world_size=6"
    ):
        per_sequence_indices(torch.tensor([0, 6, 16]), 3, 0)


def test_per_sequence_indices_match_thd_partition():
    """The per-sequence split is the THD/TE partition used by the THD path (thd_utils)."""
    from automodel.distributed.thd_utils import thd_partition_indices

    for cu, world in [([0, 6, 18, 24], 3), ([0, 8, 24, 24, 32], 2), ([0, 16], 4)]:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        for r in range(world):
            ours = per_sequence_indices(cu_t, world, r)
            assert ours.tolist() == thd_partition_indices(cu_t, cu[-1], world, r).tolist()


def test_get_padding_examples():
    assert get_padding(99, cp_size=2, tp_size=2, has_sp=True) == 5  # 2*cp*tp = 8
    assert get_padding(99, cp_size=2, tp_size=1) == 1  # 2*cp = 4
    assert get_padding(99, cp_size=1, fp8_enabled=True) == 13  # 16
    assert get_padding(99, fp8_enabled=True, fp8_recipe="mxfp8") == 29  # 32
    assert get_padding(100, cp_size=2) == 0
    assert get_padding(99) == 0
    assert get_padding(99, tp_size=4, has_sp=True) == 1  # tp = 4
    assert get_padding(99, tp_size=4, has_sp=False) == 0  # TP without SP does not split the sequence
    # Megatron's single rule: FP8 alignment is dropped under CP; the lcm rule keeps it
    assert get_padding(99, 2, 1, False, fp8_enabled=True) == 1
    assert get_padding_lcm(99, 2, 1, False, fp8_enabled=True) == 29


def test_get_padding_combines_by_lcm():
    # FP8 alignment applies to each rank's tokens, so it is kept under CP (a single-rule choice would drop it)
    assert get_padding_multiple(cp_size=2, fp8_enabled=True) == 32  # lcm(4, 16*2)
    assert get_padding_multiple(cp_size=2, tp_size=2, has_sp=True, fp8_enabled=True) == 64  # lcm(4, 8, 16*4)
    assert get_padding_multiple(cp_size=3, tp_size=2, has_sp=True) == 12  # lcm(6, 12)
    for cp, tp, sp, fp8 in [(2, 2, True, True), (4, 1, False, True), (3, 4, True, False)]:
        m = get_padding_multiple(cp, tp, sp, fp8)
        for s in range(1, 200, 7):
            padded = s + get_padding_lcm(s, cp, tp, sp, fp8_enabled=fp8)
            assert padded % m == 0 and padded - s < m
            assert padded % (2 * cp) == 0


def test_get_padding_errors():
    with pytest.raises(ValueError, match="cp_size must be an int >= 1, got 0"):
        get_padding_lcm(10, cp_size=0)
    with pytest.raises(ValueError, match="fp8_recipe must be one of"):
        get_padding_lcm(10, fp8_enabled=True, fp8_recipe="fp4")
    with pytest.raises(ValueError, match="needs decoder_seq_len"):
        get_padding_lcm(10, cp_size=2, tp_size=2, has_sp=True, decoder_tp_comm_overlap=True)
    with pytest.raises(ValueError, match="decoder_seq_len=20 is not divisible by 8"):
        get_padding_lcm(10, cp_size=2, tp_size=2, has_sp=True, decoder_tp_comm_overlap=True, decoder_seq_len=20)
    assert (
        get_padding_lcm(10, cp_size=2, tp_size=2, has_sp=True, decoder_tp_comm_overlap=True, decoder_seq_len=24)
        == 14
    )


def test_validator_single_process():
    v = ShardingValidator()
    x = torch.zeros(2, 4)
    with v.track():
        a = sp_shard(x, 1, name="a")
        sp_shard(x, 1, name="b")
        sp_shard(x, 1, name="b")
        sp_gather(a, 1, name="a")
        sp_gather(a, 0, name="c_never_sharded")
        sp_shard(x, 1)  # unnamed: not recorded
    sp_shard(x, 1, name="outside")  # not tracked
    with pytest.raises(ValueError) as info:
        v.validate()
    msg = str(info.value)
    assert "'b' sharded 2x without a matching gather" in msg
    assert "'a'" not in msg and "outside" not in msg and "c_never_sharded" not in msg
    v.reset()
    with v.track():
        s, pad = sp_shard_with_padding(x, 1, name="p")
        sp_gather(s, 0, name="p")
    with pytest.raises(ValueError, match="'p' sharded along dim 1 but gathered along dim 0"):
        v.validate()


# ------------------------------------------------------------------------------------------------
# multi-process: single-process simulations as references


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.sp_worker:main", world_size=W, timeout=300)


def _sim_a2a(xs, scatter_dim, gather_dim):
    sizes = even_split_sizes(xs[0].size(scatter_dim), len(xs))
    pieces = [x.split(sizes, scatter_dim) for x in xs]
    return [torch.cat([pieces[i][r] for i in range(len(xs))], gather_dim) for r in range(len(xs))]


@pytest.mark.dist
@pytest.mark.parametrize("name", list(A2A_CASES))
def test_all_to_all_values_and_grads(results, name):
    shape_of, sd, gd, _ = A2A_CASES[name]
    xs = [inputs("a2a_" + name, r, shape_of(r)).requires_grad_(True) for r in range(W)]
    ys = _sim_a2a(xs, sd % xs[0].dim(), gd % xs[0].dim())
    loss = sum((y * inputs("a2a_g_" + name, r, tuple(y.shape))).sum() for r, y in enumerate(ys))
    loss.backward()
    for r in range(W):
        got = results[r][f"a2a/{name}"]
        torch.testing.assert_close(got["y"], ys[r].detach(), **TOL)
        torch.testing.assert_close(got["grad"], xs[r].grad, **TOL)


@pytest.mark.dist
def test_all_to_all_uneven_shapes_and_round_trip(results):
    # 100 tokens over 3 ranks: [34, 33, 33]; 6 heads -> 2 per rank
    for r in range(W):
        rt = results[r]["a2a/roundtrip"]
        assert rt["mid_shape"] == (2, 2, 100, 4)
        torch.testing.assert_close(rt["back"], rt["x"], rtol=0, atol=0)
    assert tuple(results[0]["a2a/both_uneven"]["y"].shape) == (3, 100, 2)
    assert tuple(results[2]["a2a/both_uneven"]["y"].shape) == (2, 100, 2)
    assert "(gather_size=100 split near-evenly, remainder first), which gives it 34" in results[0]["a2a/error"]


@pytest.mark.dist
@pytest.mark.parametrize("scale", [None, "up", "down"])
def test_split_and_gather_even(results, scale):
    factor = {None: 1.0, "up": float(W), "down": 1.0 / W}[scale]
    x = inputs("split", 0, (2, 12, 3), same_on_all_ranks=True)
    # split: rank r keeps x[:, 4r:4r+4]; the gradient of sum_r <y_r, g_r> is cat(g_r), scaled
    grad = torch.cat([inputs("split_g", r, (2, 4, 3)) for r in range(W)], dim=1) * factor
    for r in range(W):
        got = results[r][f"split/even/{scale}"]
        torch.testing.assert_close(got["y"], x[:, 4 * r : 4 * r + 4], **TOL)
        torch.testing.assert_close(got["grad"], grad, **TOL)
    # gather: every rank gets cat(x_r); a replicated loss <y, g> gives rank r the slice g[:, 4r:4r+4]
    full = torch.cat([inputs("gather", r, (2, 4, 3)) for r in range(W)], dim=1)
    g = inputs("gather_g", 0, (2, 12, 3), same_on_all_ranks=True)
    for r in range(W):
        got = results[r][f"gather/even/{scale}"]
        torch.testing.assert_close(got["y"], full, **TOL)
        torch.testing.assert_close(got["grad"], g[:, 4 * r : 4 * r + 4] * factor, **TOL)


@pytest.mark.dist
def test_split_and_gather_uneven(results):
    sizes, offs = [5, 3, 4], [0, 5, 8]
    x = inputs("split_uneven", 0, (2, 12, 3), same_on_all_ranks=True)
    grad = torch.cat([inputs("split_uneven_g", r, (2, sizes[r], 3)) for r in range(W)], dim=1)
    full = torch.cat([inputs("gather_uneven", r, (2, sizes[r], 3)) for r in range(W)], dim=1)
    g = inputs("gather_uneven_g", 0, (2, 12, 3), same_on_all_ranks=True)
    for r in range(W):
        torch.testing.assert_close(results[r]["split/uneven"]["y"], x[:, offs[r] : offs[r] + sizes[r]], **TOL)
        torch.testing.assert_close(results[r]["split/uneven"]["grad"], grad / W, **TOL)  # default "down"
        torch.testing.assert_close(results[r]["gather/uneven"]["y"], full, **TOL)
        torch.testing.assert_close(  # default "up"
            results[r]["gather/uneven"]["grad"], g[:, offs[r] : offs[r] + sizes[r]] * W, **TOL
        )
    assert "sizes [3, 3, 3] sum to 9, but the tensor has 7 along the split dim" in results[0]["split/error"]


@pytest.mark.dist
def test_load_balanced_split_gather(results):
    x = inputs("lb", 0, (2, 12, 3), same_on_all_ranks=True)
    chunks = x.split(2, dim=1)  # 2W = 6 chunks of 2
    grad = torch.zeros_like(x)
    for r in range(W):
        got = results[r]["lb/split"]
        torch.testing.assert_close(got["y"], torch.cat([chunks[r], chunks[2 * W - 1 - r]], dim=1), **TOL)
        torch.testing.assert_close(got["back"], x, **TOL)
        idx = load_balanced_indices(12, W, r)
        grad[:, idx] += inputs("lb_g", r, (2, 4, 3))
    for r in range(W):
        torch.testing.assert_close(results[r]["lb/split"]["grad"], grad, **TOL)
    # gather: rank r's 4 tokens are chunks r and 5-r of the result
    locals_ = [inputs("lb_gather", r, (2, 4, 3)) for r in range(W)]
    full = torch.zeros(2, 12, 3, dtype=torch.float64)
    for r in range(W):
        full[:, load_balanced_indices(12, W, r)] = locals_[r]
    g = inputs("lb_gather_g", 0, (2, 12, 3), same_on_all_ranks=True)
    for r in range(W):
        torch.testing.assert_close(results[r]["lb/gather"]["y"], full, **TOL)
        torch.testing.assert_close(
            results[r]["lb/gather"]["grad"], g[:, load_balanced_indices(12, W, r)], **TOL
        )


@pytest.mark.dist
def test_per_sequence_split_gather(results):
    x = inputs("ps", 0, (24, 2), same_on_all_ranks=True)
    grad = torch.zeros_like(x)
    for r in range(W):
        got = results[r]["ps/split"]
        idx = per_sequence_indices(torch.tensor(PACKED_CU), W, r)
        assert got["idx"].tolist() == idx.tolist()
        torch.testing.assert_close(got["y"], x[idx], **TOL)
        torch.testing.assert_close(got["back"], x, **TOL)
        grad[idx] += inputs("ps_g", r, (8, 2))
    assert results[1]["ps/split"]["idx"].tolist() == [1, 4, 8, 9, 14, 15, 19, 22]
    full = torch.zeros(24, 2, dtype=torch.float64)
    for r in range(W):
        torch.testing.assert_close(results[r]["ps/split"]["grad"], grad, **TOL)
        full[per_sequence_indices(torch.tensor(PACKED_CU), W, r)] = inputs("ps_gather", r, (8, 2))
    g = inputs("ps_gather_g", 0, (24, 2), same_on_all_ranks=True)
    for r in range(W):
        torch.testing.assert_close(results[r]["ps/gather"]["y"], full, **TOL)
        idx = per_sequence_indices(torch.tensor(PACKED_CU), W, r)
        torch.testing.assert_close(results[r]["ps/gather"]["grad"], g[idx], **TOL)


@pytest.mark.dist
def test_shard_gather_compose_to_single_process_gradients(results):
    x = inputs("shard", 0, (2, 9, 3), same_on_all_ranks=True).requires_grad_(True)
    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    g = inputs("shard_g", 0, (2, 9, 3), same_on_all_ranks=True)
    ((torch.sin(x) * w) * g).sum().backward()
    for r in range(W):
        got = results[r]["shard/compose"]
        assert got["shard_shape"] == (2, 3, 3)
        torch.testing.assert_close(got["y"], (torch.sin(x) * w).detach(), **TOL)
        torch.testing.assert_close(got["grad"], x.grad, **TOL)  # exact, with no reduction
        torch.testing.assert_close(got["w_grad_sum"], w.grad, **TOL)  # SUM over ranks


@pytest.mark.dist
def test_shard_with_padding_round_trip(results):
    x = inputs("shard_pad", 0, (2, 7, 3), same_on_all_ranks=True)
    g = inputs("shard_pad_g", 0, (2, 7, 3), same_on_all_ranks=True)
    padded = torch.cat([x, torch.full((2, 2, 3), -5.0, dtype=torch.float64)], dim=1)
    for r in range(W):
        got = results[r]["shard/padding"]
        assert got["pad"] == 2
        torch.testing.assert_close(got["shard"], padded[:, 3 * r : 3 * r + 3], **TOL)
        torch.testing.assert_close(got["y"], torch.cos(x), **TOL)
        torch.testing.assert_close(got["grad"], -torch.sin(x) * g, **TOL)


@pytest.mark.dist
def test_sharding_errors_and_validator(results):
    assert "size 7 along dim 1 is not divisible by the world size 3" in results[0]["shard/error_divisible"]
    assert "sp_shard_with_padding" in results[0]["shard/error_divisible"]
    assert "size 2 along dim 1 is shorter than the world size 3" in results[0]["shard/error_short"]
    msg = results[0]["validator/error"]
    assert "'kept_sharded' sharded 1x without a matching gather" in msg
    assert "'ok'" not in msg


# ------------------------------------------------------------------------------------------------
# the seeds' documented calls (tests/workers/sp_worker.py:seed_examples), against one process

SCALE = {"down": 1.0 / W, "up": float(W), None: 1.0, "positional": float(W)}


def _assemble(pieces, indices, total, dim=0):
    shape = list(pieces[0].shape)
    shape[dim] = total
    full = torch.zeros(shape, dtype=pieces[0].dtype)
    for p, i in zip(pieces, indices):
        full.index_copy_(dim, i, p)
    return full


@pytest.mark.dist
def test_mindspeed_all_to_all_defaults(results):
    xs = [inputs("ms_a2a", r, (2, 4, 6, 3)).requires_grad_(True) for r in range(W)]
    ys = _sim_a2a(xs, 2, 1)  # the documented defaults: scatter_dim=2, gather_dim=1
    sum((y * inputs("ms_a2a_g", r, tuple(y.shape))).sum() for r, y in enumerate(ys)).backward()
    for r in range(W):
        got = results[r]["ms/a2a_default"]
        assert tuple(got["y"].shape) == (2, 12, 2, 3)
        torch.testing.assert_close(got["y"], ys[r].detach(), **TOL)
        torch.testing.assert_close(got["grad"], xs[r].grad, **TOL)


@pytest.mark.dist
@pytest.mark.parametrize("scale", ["down", "up", None, "positional"])
def test_mindspeed_uneven_default_split_every_grad_scale(results, scale):
    x = inputs("ms_split", 0, (7, 2), same_on_all_ranks=True)
    sizes, offs = [3, 2, 2], [0, 3, 5]
    grad = torch.cat([inputs("ms_split_g", r, (sizes[r], 2)) for r in range(W)]) * SCALE[scale]
    for r in range(W):
        got = results[r][f"ms/split_uneven/{scale}"]
        torch.testing.assert_close(got["y"], x[offs[r] : offs[r] + sizes[r]], **TOL)
        torch.testing.assert_close(got["grad"], grad, **TOL)


@pytest.mark.dist
def test_mindspeed_load_balanced_names(results):
    idx = [load_balanced_indices(12, W, r) for r in range(W)]
    x = inputs("ms_lb", 0, (12, 2), same_on_all_ranks=True)
    grad = _assemble([inputs("ms_lb_g", r, (4, 2)) for r in range(W)], idx, 12) / W  # fixed "down"
    full = _assemble([inputs("ms_lbg", r, (4, 2)) for r in range(W)], idx, 12)
    gl = inputs("ms_lbg_g", 0, (12, 2), same_on_all_ranks=True)
    for r in range(W):
        got = results[r]["ms/lb"]
        torch.testing.assert_close(got["y"], x[idx[r]], **TOL)
        torch.testing.assert_close(got["grad"], grad, **TOL)
        torch.testing.assert_close(got["gy"], full, **TOL)
        torch.testing.assert_close(got["ggrad"], gl[idx[r]] * W, **TOL)  # fixed "up"


@pytest.mark.dist
@pytest.mark.parametrize("scale", ["down", "up", None])
def test_mindspeed_packed_data_every_grad_scale(results, scale):
    lens = PACKED_LENS
    split = cal_split_sizes_multi(lens, W)
    assert split.tolist() == [[2, 3, 1], [2, 2, 1], [1, 2, 0]]
    idx = packed_split_indices(split)
    assert idx[1].tolist() == [2, 3, 8, 9, 13]  # rank 1: the 2nd piece of every sequence, in order
    n = sum(lens)
    x = inputs("ms_packed", 0, (n, 2), same_on_all_ranks=True)
    grad = _assemble([inputs("ms_packed_g", r, (len(idx[r]), 2)) for r in range(W)], idx, n)
    full = _assemble([inputs("ms_packed_l", r, (len(idx[r]), 2)) for r in range(W)], idx, n)
    gl = inputs("ms_packed_lg", 0, (n, 2), same_on_all_ranks=True)
    for r in range(W):
        got = results[r][f"ms/packed/{scale}"]
        torch.testing.assert_close(got["y"], x[idx[r]], **TOL)
        torch.testing.assert_close(got["grad"], grad * SCALE[scale], **TOL)
        torch.testing.assert_close(got["gy"], full, **TOL)
        torch.testing.assert_close(got["ggrad"], gl[idx[r]] * SCALE[scale], **TOL)
    assert "sequence lengths [4, 4] (sum 8)" in results[0]["ms/packed_error"]


@pytest.mark.dist
def test_vllm_omni_documented_usage(results):
    x = inputs("vo_chunk", 0, (2, 17), same_on_all_ranks=True)
    g = inputs("vo_chunk_g", 0, (2, 17), same_on_all_ranks=True)
    offs, sizes = [0, 6, 12], [6, 6, 5]  # torch.chunk of 17 over 3
    for r in range(W):
        got = results[r]["vo/chunk"]
        torch.testing.assert_close(got["shard"], x[:, offs[r] : offs[r] + sizes[r]], **TOL)
        torch.testing.assert_close(got["y"], torch.sin(x), **TOL)
        torch.testing.assert_close(got["grad"], torch.cos(x) * g, **TOL)  # one process's gradient
        hs = inputs("vo_val", 0, (2, 6, 3), same_on_all_ranks=True)
        torch.testing.assert_close(results[r]["vo/validator"]["y"], hs * 2, **TOL)
        assert results[r]["vo/padding"]["pad"] == 2
        torch.testing.assert_close(results[r]["vo/padding"]["y"], inputs("vo_pad", 0, (2, 7), same_on_all_ranks=True))
        full = torch.cat([inputs("vo_grad", q, (2, 3)) for q in range(W)], dim=1)
        gg = inputs("vo_grad_g", 0, (2, 9), same_on_all_ranks=True)
        torch.testing.assert_close(results[r]["vo/with_grad"]["y"], full, **TOL)
        torch.testing.assert_close(results[r]["vo/with_grad"]["grad"], gg[:, 3 * r : 3 * r + 3], **TOL)
    assert "'leaked' sharded 1x without a matching gather" in results[0]["vo/validator_error"]
    hs = inputs("vo_doc", 0, (2, 6, 3), same_on_all_ranks=True)
    for r in range(W):
        torch.testing.assert_close(results[r]["vo/doc"]["shard"], hs[:, 2 * r : 2 * r + 2], **TOL)
        torch.testing.assert_close(results[r]["vo/doc"]["y"], hs + 1, **TOL)
