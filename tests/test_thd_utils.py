"""BSHD -> THD conversion, chunking, and the TE-compatible CP partition indices (all in-process)."""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from automodel.distributed.thd_utils import (
    get_thd_partitioned_indices,
    packed_padding_mask,
    process_input_for_thd,
    split_batch_into_thd_chunks,
    thd_partition_indices,
)
from tests.workers.thd_worker import make_packed_batch

S = -1000


def example_batch() -> dict:
    """Two rows of 6 tokens: row 0 packs sequences of padded length 4 (3 real) and 2; row 1 one of 6."""
    return {
        "input_ids": torch.tensor([[1, 2, 3, 0, 4, 5], [6, 7, 8, 9, 10, 11]]),
        "labels": torch.tensor([[2, 3, -100, -100, 5, -100], [7, 8, 9, 10, 11, -100]]),
        "loss_mask": torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 1, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]]),
        "seq_lens": torch.tensor([[3, 2], [6, S]]),
        "seq_lens_padded": torch.tensor([[4, 2], [6, S]]),
        "qkv_format": "thd",
        "note": 123,
    }


# ------------------------------------------------------------------------------------------------
# process_input_for_thd
# ------------------------------------------------------------------------------------------------


def test_process_example_exact_values():
    batch = example_batch()
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out = process_input_for_thd(batch)

    assert out["input_ids"].tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 10, 11]
    assert out["labels"].tolist() == [2, 3, -100, -100, 5, -100, 7, 8, 9, 10, 11, -100]
    assert out["loss_mask"].tolist() == [1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0]
    assert out["attention_mask"].tolist() == [1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1]
    assert out["cu_seqlens"].dtype == out["cu_seqlens_padded"].dtype == torch.int32
    assert out["cu_seqlens"].tolist() == [0, 3, 5, 11]  # real lengths 3, 2, 6
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]  # padded lengths 4, 2, 6
    assert out["max_seqlen"].dtype == torch.int32 and out["max_seqlen"].dim() == 0
    assert int(out["max_seqlen"]) == 6
    assert out["padding_mask"].dtype == torch.bool
    assert out["padding_mask"].tolist() == [False] * 3 + [True] + [False] * 8
    # generated positions restart at every packed sequence (from seq_lens_padded)
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]
    assert out["position_ids"].dtype == torch.int64
    # non-tensor keys copied, layout keys consumed
    assert out["qkv_format"] == "thd" and out["note"] == 123
    assert "seq_lens" not in out and "seq_lens_padded" not in out
    # the input is not mutated
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(batch[k], v)
    assert set(batch) == set(before)


def test_process_keeps_given_position_ids_and_padding_mask_ignores_token_ids():
    batch = example_batch()
    batch["position_ids"] = torch.arange(12).reshape(2, 6) * 10
    out = process_input_for_thd(batch, padding_token_id=9)
    assert out["position_ids"].tolist() == (torch.arange(12) * 10).tolist()
    # token 9 is a real token (row 1), token 0 sits in the pad slot: the layout decides, not the ids
    assert out["padding_mask"].nonzero().flatten().tolist() == [3]
    batch["input_ids"][0, 3] = 77  # a pad slot holding a non-pad id is still padding
    assert process_input_for_thd(batch)["padding_mask"].nonzero().flatten().tolist() == [3]


def test_process_mrope_position_ids():
    batch = example_batch()
    mrope = torch.arange(36).reshape(3, 2, 6)
    batch["position_ids"] = mrope
    out = process_input_for_thd(batch)
    assert out["position_ids"].shape == (3, 12)
    assert torch.equal(out["position_ids"], mrope.reshape(3, 12))
    batch["position_ids"] = torch.zeros(3, 2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mRoPE batch\['position_ids'\] must be \[n_rope, B, S\]"):
        process_input_for_thd(batch)


def test_process_position_ids_none_is_generated():
    batch = example_batch()
    batch["position_ids"] = None
    assert process_input_for_thd(batch)["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]


def test_process_custom_sentinel_and_zero_length_sequence():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3, 4]]),
        "labels": torch.tensor([[2, 3, 4, -100]]),
        "seq_lens": torch.tensor([[2, 0, 2, -1]]),
        "seq_lens_padded": torch.tensor([[2, 0, 2, -1]]),
    }
    out = process_input_for_thd(batch, seq_lens_padding_value=-1)
    assert out["cu_seqlens"].tolist() == out["cu_seqlens_padded"].tolist() == [0, 2, 2, 4]
    assert out["position_ids"].tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("key", ["input_ids", "inputs_embeds"])
def test_process_embeddings(key):
    batch = example_batch()
    ids = batch.pop("input_ids")
    emb = torch.randn(2, 6, 5)
    batch[key] = emb
    out = process_input_for_thd(batch)
    assert out[key].shape == (12, 5)
    assert torch.equal(out[key], emb.reshape(12, 5))
    # no token ids to compare: padding is the layout's slack (slot 3 of row 0 is past seq_lens=3)
    assert out["padding_mask"].tolist() == [False] * 3 + [True] + [False] * 8
    assert out["cu_seqlens_padded"].tolist() == [0, 4, 6, 12]
    if key == "inputs_embeds":  # ids next to embeddings: still the layout decides padding_mask
        batch["input_ids"] = ids
        both = process_input_for_thd(batch, padding_token_id=7)
        assert both["padding_mask"].nonzero().flatten().tolist() == [3]
        assert both["inputs_embeds"].shape == (12, 5) and both["input_ids"].shape == (12,)


def test_process_unknown_tensor_passes_through_unchanged():
    batch = example_batch()
    pixels = torch.randn(2, 3, 4, 4)
    batch["pixel_values"] = pixels
    out = process_input_for_thd(batch)
    assert out["pixel_values"] is pixels


def test_packed_padding_mask():
    mask = packed_padding_mask(torch.tensor([[3, 2], [1, S]]), torch.tensor([[4, 2], [6, S]]))
    assert mask.tolist() == [False, False, False, True, False, False, False] + [True] * 5


@pytest.mark.parametrize(
    "drop, match",
    [
        ("seq_lens", "missing 'seq_lens'"),
        ("seq_lens_padded", "missing 'seq_lens_padded'"),
        ("labels", "missing 'labels'"),
        ("input_ids", "neither 'input_ids' nor 'inputs_embeds'"),
    ],
)
def test_process_missing_keys(drop, match):
    batch = example_batch()
    del batch[drop]
    with pytest.raises(KeyError, match=match):
        process_input_for_thd(batch)


def _bad(**changes):
    batch = example_batch()
    batch.update(changes)
    return batch


@pytest.mark.parametrize(
    "batch, exc, match",
    [
        (
            _bad(seq_lens=torch.tensor([[3, 2], [4, S]]), seq_lens_padded=torch.tensor([[4, 2], [4, S]])),
            ValueError,
            r"row 1 of seq_lens_padded sums to 4 but each row holds S=6 tokens",
        ),
        (
            _bad(seq_lens_padded=torch.tensor([[4, 2], [8, S]])),
            ValueError,
            r"row 1 of seq_lens_padded sums to 8",
        ),
        (
            _bad(seq_lens=torch.tensor([[5, 2], [6, S]])),
            ValueError,
            r"invalid packed sequence at \[row, pack\]=\[0, 0\]: seq_lens=5, seq_lens_padded=4",
        ),
        (
            _bad(seq_lens=torch.tensor([[3, S], [6, S]])),
            ValueError,
            r"disagree on which entries are the padding sentinel -1000 \(first at \[row, pack\]=\[0, 1\]\)",
        ),
        (_bad(seq_lens=torch.tensor([3, 2, 6])), ValueError, r"seq_lens must be \[B, P\] with B=2"),
        (
            _bad(seq_lens=torch.tensor([[3, 2, S], [6, S, S]])),
            ValueError,
            r"seq_lens \(2, 3\) and seq_lens_padded \(2, 2\) must have the same shape",
        ),
        (
            _bad(seq_lens=torch.tensor([[3.0, 2.0], [6.0, S]])),
            TypeError,
            "seq_lens must be an integer tensor",
        ),
        (_bad(labels=torch.zeros(2, 5, dtype=torch.long)), ValueError, r"batch\['labels'\] must be \[B, S\]"),
        (
            _bad(position_ids=torch.zeros(12, dtype=torch.long)),
            ValueError,
            r"batch\['position_ids'\] must be \[B, S\] \(or mRoPE \[n_rope, B, S\]\)",
        ),
        (
            _bad(input_ids=torch.zeros(12, dtype=torch.long)),
            ValueError,
            r"input_ids must be \[B, S\] token ids",
        ),
        (_bad(inputs_embeds=torch.zeros(2, 6)), ValueError, r"batch\['inputs_embeds'\] must be \[B, S, H\]"),
        (_bad(loss_mask=[1, 0]), TypeError, r"batch\['loss_mask'\] must be a torch.Tensor"),
    ],
)
def test_process_bad_input(batch, exc, match):
    with pytest.raises(exc, match=match):
        process_input_for_thd(batch)


def test_process_inputs_embeds_must_be_3d_when_alone():
    batch = example_batch()
    del batch["input_ids"]
    batch["inputs_embeds"] = torch.zeros(2, 6)
    with pytest.raises(ValueError, match=r"inputs_embeds must be \[B, S, H\], got shape \(2, 6\)"):
        process_input_for_thd(batch)


# ------------------------------------------------------------------------------------------------
# split_batch_into_thd_chunks
# ------------------------------------------------------------------------------------------------


def _assert_same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_split_one_chunk_is_process_input_for_thd():
    batch = example_batch()
    _assert_same(split_batch_into_thd_chunks(batch, 1), process_input_for_thd(batch))


def test_split_chunks_match_per_chunk_conversion():
    batch = make_packed_batch(seed=3, batch_size=6, seq_len=12, multiple=2)
    batch["qkv_format"] = "thd"
    pixels = torch.randn(6, 2)
    batch["pixel_values"] = pixels
    out = split_batch_into_thd_chunks(batch, num_chunks=3)
    assert out["input_ids"].shape == (3, 24)
    assert out["qkv_format"] == "thd" and out["pixel_values"] is pixels  # copied, not split
    widths = []
    for i in range(3):
        rows = {
            k: batch[k][2 * i : 2 * i + 2]
            for k in ("input_ids", "labels", "loss_mask", "seq_lens", "seq_lens_padded")
        }
        ref = process_input_for_thd(rows)
        for k in ("input_ids", "labels", "loss_mask", "position_ids", "padding_mask"):
            assert torch.equal(out[k][i], ref[k]), (i, k)
        n = ref["cu_seqlens"].numel()
        widths.append(n)
        for name in ("cu_seqlens", "cu_seqlens_padded"):
            assert torch.equal(out[name][i, :n], ref[name])
            assert (out[name][i, n:] == S).all()
        assert out["max_seqlen"][i] == ref["max_seqlen"]
    assert out["cu_seqlens"].shape == (3, max(widths)) and out["cu_seqlens"].dtype == torch.int32
    assert len(set(widths)) > 1  # the seed gives chunks with different sequence counts: padding exercised
    assert out["max_seqlen"].shape == (3,) and out["max_seqlen"].dtype == torch.int32


def test_split_example_cu_seqlens_padded_with_sentinel():
    batch = {
        "input_ids": torch.arange(1, 25).reshape(4, 6),
        "labels": torch.arange(1, 25).reshape(4, 6),
        "seq_lens": torch.tensor([[3, 2, S], [6, S, S], [4, S, S], [2, 3, S]]),
        "seq_lens_padded": torch.tensor([[4, 2, S], [6, S, S], [6, S, S], [3, 3, S]]),
    }
    out = split_batch_into_thd_chunks(batch, num_chunks=4, seq_lens_padding_value=S)
    assert out["cu_seqlens_padded"].tolist() == [[0, 4, 6], [0, 6, S], [0, 6, S], [0, 3, 6]]
    assert out["cu_seqlens"].tolist() == [[0, 3, 5], [0, 6, S], [0, 4, S], [0, 2, 5]]
    assert out["max_seqlen"].tolist() == [4, 6, 6, 3]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1]


@pytest.mark.parametrize("batch_size, num_chunks", [(3, 2), (6, 4), (2, 3)])
def test_split_never_drops_rows(batch_size, num_chunks):
    batch = make_packed_batch(seed=1, batch_size=batch_size, seq_len=4, multiple=2)
    with pytest.raises(
        ValueError, match=rf"batch size {batch_size} is not divisible by num_chunks={num_chunks}"
    ):
        split_batch_into_thd_chunks(batch, num_chunks)


@pytest.mark.parametrize("num_chunks", [0, -1, 1.5, True])
def test_split_bad_num_chunks(num_chunks):
    with pytest.raises(ValueError, match="num_chunks must be a positive int"):
        split_batch_into_thd_chunks(example_batch(), num_chunks)


# ------------------------------------------------------------------------------------------------
# partition indices
# ------------------------------------------------------------------------------------------------


def brute_force_partition(cu: list[int], world_size: int, rank: int) -> list[int]:
    """The rule, one sequence at a time: chunks rank and 2W-1-rank of 2W equal chunks."""
    out = []
    for start, end in zip(cu[:-1], cu[1:]):
        c = (end - start) // (2 * world_size)
        out += list(range(start + rank * c, start + (rank + 1) * c))
        out += list(range(start + (2 * world_size - 1 - rank) * c, start + (2 * world_size - rank) * c))
    return out


def test_partition_example():
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    r0 = thd_partition_indices(cu, 24, 2, 0)
    r1 = thd_partition_indices(cu, 24, 2, 1)
    assert r0.tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert r1.tolist() == [2, 3, 4, 5] + list(range(12, 20))
    assert r0.dtype == torch.int32 and r0.device == cu.device


def test_partition_matches_brute_force_random():
    rng = random.Random(1234)
    cases = 0
    for _ in range(300):
        w = rng.randint(1, 8)
        n = rng.randint(1, 6)
        lengths = [2 * w * rng.randint(0, 5) for _ in range(n)]
        if sum(lengths) == 0:
            lengths[0] = 2 * w
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        total = cu[-1]
        cu_t = torch.tensor(cu, dtype=rng.choice([torch.int32, torch.int64]))
        seen = []
        for r in range(w):
            got = thd_partition_indices(cu_t, total, w, r)
            assert got.dtype == torch.int32
            assert got.tolist() == brute_force_partition(cu, w, r), (cu, w, r)
            assert got.numel() == total // w
            seen += got.tolist()
        assert sorted(seen) == list(range(total))  # a permutation of range(T)
        cases += 1
    assert cases == 300


def test_dispatcher_on_cpu_uses_pure_torch_and_never_touches_te(monkeypatch):
    def boom(*args):
        raise AssertionError("TE kernel must not be called for a CPU tensor")

    fake = types.ModuleType("transformer_engine_torch")
    fake.thd_get_partitioned_indices = boom
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", fake)
    cu = torch.tensor([0, 8, 24], dtype=torch.int32)
    for r in range(2):
        assert torch.equal(get_thd_partitioned_indices(cu, 24, 2, r), thd_partition_indices(cu, 24, 2, r))


def test_thd_utils_does_not_import_te_at_module_import():
    import automodel.distributed.thd_utils as mod

    src = open(mod.__file__).read()
    top_level = [line for line in src.splitlines() if line.startswith(("import ", "from "))]
    assert all("transformer_engine" not in line for line in top_level), top_level


@pytest.mark.parametrize(
    "cu, total, w, r, exc, match",
    [
        ([0, 8, 24], 24, 2, 2, ValueError, r"rank must satisfy 0 <= rank < world_size=2, got 2"),
        ([0, 8, 24], 24, 2, -1, ValueError, r"0 <= rank < world_size=2, got -1"),
        ([0, 8, 24], 24, 0, 0, ValueError, r"world_size must be >= 1, got 0"),
        ([0, 8, 24], 16, 2, 0, ValueError, r"total_tokens=16 must equal cu_seqlens_padded\[-1\]=24"),
        (
            [0, 6, 24],
            24,
            2,
            0,
            ValueError,
            r"sequence 0 has padded length 6 .* not divisible by 2\*world_size=4",
        ),
        ([0, 8, 4, 24], 24, 2, 0, ValueError, r"must be non-decreasing, but entry 2 \(4\) < entry 1 \(8\)"),
        ([4, 8, 24], 24, 2, 0, ValueError, r"must start at 0, got 4"),
        ([0], 4, 2, 0, ValueError, r"1-D with at least 2 entries"),
        ([[0, 8]], 8, 2, 0, ValueError, r"1-D with at least 2 entries"),
        ([0, 0], 0, 2, 0, ValueError, r"total_tokens must be > 0, got 0"),
        ([0.0, 8.0], 8, 2, 0, TypeError, r"must be an integer tensor"),
        ([0, 8], 8.0, 2, 0, TypeError, r"total_tokens must be a python int"),
    ],
)
def test_partition_bad_input(cu, total, w, r, exc, match):
    cu_t = torch.tensor(cu)
    with pytest.raises(exc, match=match):
        thd_partition_indices(cu_t, total, w, r)
    with pytest.raises(exc, match=match):
        get_thd_partitioned_indices(cu_t, total, w, r)


def test_partition_rejects_non_tensor():
    with pytest.raises(TypeError, match="cu_seqlens_padded must be a torch.Tensor"):
        thd_partition_indices([0, 8], 8, 2, 0)
