"""make_cp_batch_for_te / _shard_thd_chunk_for_te: per-rank THD batches that gather back to the full batch.

In-process tests cover every rank through a fake 1-D mesh (``size()``, ``get_local_rank()``); one
2-rank gloo launch runs the same calls on a real ``init_device_mesh("cpu", (2,), ("cp",))``.
"""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.cp.te_batch import _shard_thd_chunk_for_te, make_cp_batch_for_te, shard_thd_chunk
from automodel.distributed.thd_utils import (
    process_input_for_thd,
    split_batch_into_thd_chunks,
    thd_partition_indices,
)
from tests.dist_harness import run_distributed
from tests.workers.thd_worker import make_packed_batch

SENTINEL = -1000
BASE_KEYS = {
    "input_ids",
    "labels",
    "position_ids",
    "cu_seqlens",
    "cu_seqlens_padded",
    "max_seqlen",
    "qkv_format",
    "padding_mask",
}
TOKEN_KEYS = ("input_ids", "labels", "position_ids", "padding_mask", "loss_mask")


class FakeMesh:
    """The slice of the DeviceMesh API make_cp_batch_for_te uses."""

    ndim = 1

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def unshard(shards: list[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Gather the ranks' shards of one chunk and undo the partition permutation."""
    cu = cu_seqlens[cu_seqlens != SENTINEL]
    total = int(cu[-1])
    perm = torch.cat([thd_partition_indices(cu, total, len(shards), r).long() for r in range(len(shards))])
    full = torch.empty((total, *shards[0].shape[1:]), dtype=shards[0].dtype)
    full[perm] = torch.cat(shards)
    return full


def assert_round_trip(per_rank: list[dict], thd: dict, num_chunks: int, keys=TOKEN_KEYS):
    """Every rank has the global cu_seqlens/max_seqlen; the gathered shards are the THD batch exactly."""
    cp = len(per_rank)
    for r, out in enumerate(per_rank):
        assert out["cp_size"] == cp and out["cp_rank"] == r and out["qkv_format"] == "thd"
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(out[name], thd[name]) and out[name].dtype == torch.int32
        assert torch.equal(out["max_seqlen"], thd["max_seqlen"]) and out["max_seqlen"].dtype == torch.int32
    for key in keys:
        if num_chunks == 1:
            got = unshard([o[key] for o in per_rank], thd["cu_seqlens_padded"])
            assert got.dtype == thd[key].dtype and torch.equal(got, thd[key]), key
        else:
            for i in range(num_chunks):
                got = unshard([o[key][i] for o in per_rank], thd["cu_seqlens_padded"][i])
                assert torch.equal(got, thd[key][i]), (key, i)


# ------------------------------------------------------------------------------------------------
# without CP
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mesh", [None, FakeMesh(1, 0)])
def test_no_cp_returns_the_thd_batch(mesh):
    batch = make_packed_batch(seed=0, batch_size=3, seq_len=10, multiple=1)
    out = make_cp_batch_for_te(mesh, batch)
    assert set(out) == BASE_KEYS | {"cp_size", "cp_rank", "loss_mask"}
    assert out["cp_size"] == 1 and out["cp_rank"] == 0
    thd = process_input_for_thd(batch)
    for key in (
        "input_ids",
        "labels",
        "position_ids",
        "padding_mask",
        "loss_mask",
        "cu_seqlens",
        "cu_seqlens_padded",
        "max_seqlen",
    ):
        assert torch.equal(out[key], thd[key]), key
    assert out["input_ids"].dtype == torch.int64 and out["padding_mask"].dtype == torch.bool


def test_no_loss_mask_in_no_loss_mask_out():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    del batch["loss_mask"]
    batch["qkv_format"] = "thd"  # non-tensor entries are not carried
    assert set(make_cp_batch_for_te(None, batch)) == BASE_KEYS | {"cp_size", "cp_rank"}
    assert set(make_cp_batch_for_te(FakeMesh(2, 1), batch)) == BASE_KEYS | {"cp_size", "cp_rank"}


def test_int32_ids_become_int64():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    for key in ("input_ids", "labels"):
        batch[key] = batch[key].to(torch.int32)
    for mesh in (None, FakeMesh(2, 0)):
        out = make_cp_batch_for_te(mesh, batch)
        assert out["input_ids"].dtype == out["labels"].dtype == out["position_ids"].dtype == torch.int64


def test_input_not_mutated():
    batch = make_packed_batch(seed=5, batch_size=2, seq_len=8, multiple=4)
    before = {k: v.clone() for k, v in batch.items()}
    make_cp_batch_for_te(FakeMesh(2, 1), batch, num_chunks=2)
    assert set(batch) == set(before) and all(torch.equal(batch[k], before[k]) for k in batch)


# ------------------------------------------------------------------------------------------------
# sharding, every rank in-process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("num_chunks", [1, 2])
def test_round_trip_fake_mesh(cp, num_chunks):
    batch = make_packed_batch(seed=10 + cp, batch_size=4, seq_len=8 * cp, multiple=2 * cp)
    per_rank = [make_cp_batch_for_te(FakeMesh(cp, r), batch, num_chunks=num_chunks) for r in range(cp)]
    thd = split_batch_into_thd_chunks(batch, num_chunks)
    assert_round_trip(per_rank, thd, num_chunks)
    tokens = batch["input_ids"].numel() // num_chunks
    shape = (tokens // cp,) if num_chunks == 1 else (num_chunks, tokens // cp)
    for out in per_rank:
        assert set(out) == BASE_KEYS | {"cp_size", "cp_rank", "loss_mask"}
        assert all(out[k].shape == shape for k in TOKEN_KEYS)


def test_shard_example_exact_tokens():
    # one row, sequences of padded length 8 and 16 -> the partition example cu=[0, 8, 24], W=2
    chunk = {
        "input_ids": torch.arange(100, 124),
        "labels": torch.arange(200, 224),
        "position_ids": torch.arange(24),
        "padding_mask": torch.zeros(24, dtype=torch.bool),
        "cu_seqlens": torch.tensor([0, 8, 24], dtype=torch.int32),
    }
    r0 = shard_thd_chunk(chunk, cp_size=2, cp_rank=0)
    r1 = shard_thd_chunk(chunk, cp_size=2, cp_rank=1)
    assert (r0["input_ids"] - 100).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert (r1["labels"] - 200).tolist() == [2, 3, 4, 5] + list(range(12, 20))
    assert r0["cu_seqlens"].tolist() == r1["cu_seqlens"].tolist() == [0, 8, 24]
    assert int(r0["max_seqlen"]) == 16


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_shard_embeddings_and_mesh_wrapper(rank):
    batch = make_packed_batch(seed=2, batch_size=2, seq_len=12, multiple=6)
    emb = torch.randn(2, 12, 4, dtype=torch.float64)
    batch["inputs_embeds"] = emb
    del batch["input_ids"]
    thd = process_input_for_thd(batch)
    core = shard_thd_chunk(thd, 3, rank)
    wrapped = _shard_thd_chunk_for_te(thd, FakeMesh(3, rank), "thd", SENTINEL, 0)
    assert set(core) == set(wrapped) and "input_ids" not in core
    assert all(
        torch.equal(core[k], wrapped[k]) if isinstance(core[k], torch.Tensor) else core[k] == wrapped[k]
        for k in core
    )
    assert core["inputs_embeds"].dtype == torch.float64 and core["inputs_embeds"].shape == (8, 4)
    idx = thd_partition_indices(thd["cu_seqlens_padded"], 24, 3, rank).long()
    assert torch.equal(core["inputs_embeds"], emb.reshape(24, 4)[idx])
    # padding from the layout: exactly the label-less slack slots of this rank
    assert torch.equal(core["padding_mask"], thd["padding_mask"][idx])


def test_make_with_embeddings_round_trip():
    batch = make_packed_batch(seed=4, batch_size=2, seq_len=8, multiple=4)
    batch["inputs_embeds"] = torch.randn(2, 8, 3)
    del batch["input_ids"]
    per_rank = [make_cp_batch_for_te(FakeMesh(2, r), batch) for r in range(2)]
    assert set(per_rank[0]) == BASE_KEYS - {"input_ids"} | {
        "inputs_embeds",
        "cp_size",
        "cp_rank",
        "loss_mask",
    }
    keys = ("inputs_embeds", "labels", "position_ids", "padding_mask", "loss_mask")
    assert_round_trip(per_rank, process_input_for_thd(batch), 1, keys=keys)


def test_attention_mask_on_padding_only_is_accepted_and_dropped():
    batch = make_packed_batch(seed=6, batch_size=2, seq_len=8, multiple=4)
    batch["attention_mask"] = (batch["input_ids"] != 0).long()  # 0 exactly on the slack
    out = make_cp_batch_for_te(FakeMesh(2, 0), batch)
    assert "attention_mask" not in out
    del batch["attention_mask"]
    ref = make_cp_batch_for_te(FakeMesh(2, 0), batch)
    assert all(torch.equal(out[k], ref[k]) for k in TOKEN_KEYS)


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------


def test_bad_qkv_format():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    with pytest.raises(
        ValueError, match="only qkv_format='thd' is supported by make_cp_batch_for_te, got 'bshd'"
    ):
        make_cp_batch_for_te(None, batch, qkv_format="bshd")
    with pytest.raises(ValueError, match="only qkv_format='thd' is supported, got 'sbhd'"):
        shard_thd_chunk(process_input_for_thd(batch), 2, 0, qkv_format="sbhd")


def test_sequence_not_divisible_by_2cp_names_the_fix():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=12, multiple=2)  # fine for cp=1, not cp=2
    make_cp_batch_for_te(None, batch)
    with pytest.raises(
        ValueError,
        match=r"packed sequence \d+ has padded length \d+, not divisible by 2\*cp_size=4.*"
        r"data.pad_to_multiple_of=4",
    ):
        make_cp_batch_for_te(FakeMesh(2, 0), batch)


def test_unknown_tensor_key_is_an_error_not_a_silent_drop():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    batch["pixel_values"] = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"cannot shard batch key\(s\) \['pixel_values'\]"):
        make_cp_batch_for_te(FakeMesh(2, 0), batch)


def test_attention_mask_hiding_real_tokens_is_an_error():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 0] = 0  # the first token of row 1 is always real
    batch["attention_mask"] = am
    with pytest.raises(
        ValueError, match=r"attention_mask hides real token\(s\) \(first at row 1, column 0\)"
    ):
        make_cp_batch_for_te(None, batch)


def test_batch_not_divisible_by_num_chunks():
    batch = make_packed_batch(seed=0, batch_size=3, seq_len=8, multiple=4)
    with pytest.raises(ValueError, match="batch size 3 is not divisible by num_chunks=2"):
        make_cp_batch_for_te(FakeMesh(2, 0), batch, num_chunks=2)


def test_missing_seq_lens():
    batch = make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4)
    del batch["seq_lens_padded"]
    with pytest.raises(KeyError, match="missing 'seq_lens_padded'"):
        make_cp_batch_for_te(FakeMesh(2, 0), batch)


def test_multi_dim_mesh_rejected():
    mesh = FakeMesh(4, 0)
    mesh.ndim = 2
    with pytest.raises(ValueError, match=r"cp_mesh must be a 1-D DeviceMesh \(e.g. device_mesh\['cp'\]\)"):
        make_cp_batch_for_te(mesh, make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4))


@pytest.mark.parametrize(
    "cp_size, cp_rank, match",
    [(0, 0, "cp_size must be a positive int"), (2, 2, r"0 <= cp_rank < cp_size=2, got 2")],
)
def test_shard_bad_size_rank(cp_size, cp_rank, match):
    thd = process_input_for_thd(make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4))
    with pytest.raises(ValueError, match=match):
        shard_thd_chunk(thd, cp_size, cp_rank)


def test_shard_bad_chunks():
    thd = process_input_for_thd(make_packed_batch(seed=0, batch_size=2, seq_len=8, multiple=4))
    bad = dict(thd, cu_seqlens_padded=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_padded must run from 0 to the chunk's token count 16"):
        shard_thd_chunk(bad, 2, 0)
    bad = dict(thd, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="describe the same number of sequences"):
        shard_thd_chunk(bad, 2, 0)
    bad = dict(thd, cu_seqlens=thd["cu_seqlens_padded"] + torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"packed sequence 0 has real length 5 > padded length 4"):
        shard_thd_chunk(bad, 2, 0)
    bad = dict(thd, labels=thd["labels"][:8])
    with pytest.raises(ValueError, match=r"chunk\['labels'\] has 8 tokens but input_ids has 16"):
        shard_thd_chunk(bad, 2, 0)
    bad = {k: v for k, v in thd.items() if k != "cu_seqlens"}
    with pytest.raises(KeyError, match="THD chunk is missing 'cu_seqlens'"):
        shard_thd_chunk(bad, 2, 0)


# ------------------------------------------------------------------------------------------------
# one real 2-rank launch
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_mesh_results():
    return run_distributed("tests.workers.thd_worker:main", world_size=2, timeout=300)


@pytest.mark.dist
def test_real_mesh_matches_fake_mesh_and_round_trips(real_mesh_results):
    batch = make_packed_batch(seed=7, batch_size=4, seq_len=16, multiple=4)
    assert [res["mesh_rank"] for res in real_mesh_results] == [0, 1]
    for name, num_chunks in (("one", 1), ("two", 2)):
        per_rank = [res[name] for res in real_mesh_results]
        for r, out in enumerate(per_rank):
            fake = make_cp_batch_for_te(FakeMesh(2, r), batch, num_chunks=num_chunks)
            assert set(out) == set(fake)
            for k, v in fake.items():
                assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, (name, r, k)
        assert_round_trip(per_rank, split_batch_into_thd_chunks(batch, num_chunks), num_chunks)


# ------------------------------------------------------------------------------------------------
# issue 12: real vs padded offsets, layout padding, loss_mask and mRoPE travel with the tokens
# ------------------------------------------------------------------------------------------------


def test_real_and_padded_offsets_and_layout_padding_example():
    # one row, two documents: 3 real tokens padded to 4, 5 real padded to 8 (cp=2: multiples of 4)
    batch = {
        "input_ids": torch.tensor([[5, 6, 0, 0, 0, 8, 9, 10, 11, 0, 0, 0]]),  # token 0 is a real token at slot 4
        "labels": torch.tensor([[6, 7, -100, -100, 8, 9, 10, 11, 12, -100, -100, -100]]),
        "loss_mask": torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0]]),
        "seq_lens": torch.tensor([[3, 5]]),
        "seq_lens_padded": torch.tensor([[4, 8]]),
    }
    outs = [make_cp_batch_for_te(FakeMesh(2, r), batch) for r in range(2)]
    for out in outs:
        assert out["cu_seqlens"].tolist() == [0, 3, 8] and out["cu_seqlens"].dtype == torch.int32
        assert out["cu_seqlens_padded"].tolist() == [0, 4, 12] and out["cu_seqlens_padded"].dtype == torch.int32
        assert int(out["max_seqlen"]) == 8
    # rank 0: doc 0 chunks 0,3 (slots 0, 3); doc 1 (c=2) chunks 0,3 (slots 4,5,10,11)
    assert outs[0]["padding_mask"].tolist() == [False, True, False, False, True, True]
    assert outs[0]["loss_mask"].tolist() == [1, 0, 1, 1, 0, 0]
    # the real token with id 0 at slot 4 is not padding; the pad slots are, whatever their ids
    assert outs[0]["input_ids"].tolist() == [5, 0, 0, 8, 0, 0]
    # rank 1: slots 1, 2 of doc 0; slots 6, 7, 8, 9 of doc 1
    assert outs[1]["padding_mask"].tolist() == [False, False, False, False, False, True]


def test_mrope_position_ids_sharded_on_the_token_dim():
    batch = make_packed_batch(seed=8, batch_size=2, seq_len=8, multiple=4)
    mrope = torch.stack([batch["position_ids"] if "position_ids" in batch else torch.arange(8).expand(2, 8)] * 3)
    mrope = mrope + torch.arange(3).view(3, 1, 1) * 100
    batch["position_ids"] = mrope
    thd = process_input_for_thd(batch)
    for num_chunks in (1, 2):
        per_rank = [make_cp_batch_for_te(FakeMesh(2, r), batch, num_chunks=num_chunks) for r in range(2)]
        for r, out in enumerate(per_rank):
            if num_chunks == 1:
                assert out["position_ids"].shape == (3, 8)
                idx = thd_partition_indices(thd["cu_seqlens_padded"], 16, 2, r).long()
                assert torch.equal(out["position_ids"], thd["position_ids"][:, idx])
            else:
                assert out["position_ids"].shape == (3, 2, 4)
                split = split_batch_into_thd_chunks(batch, 2)
                for i in range(2):
                    idx = thd_partition_indices(split["cu_seqlens_padded"][i], 8, 2, r).long()
                    assert torch.equal(out["position_ids"][:, i], split["position_ids"][:, i, idx])
