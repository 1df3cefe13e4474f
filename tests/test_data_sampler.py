"""Sampler and loader: dp sharding (not global rank), determinism, exact resume, drop_last, errors."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch

from automodel.data.dataloader import build_dataloader
from automodel.data.sampler import FILLER_INDEX, DistributedBatchSampler


class RowIds(torch.utils.data.Dataset):
    """Row i has input_ids [i, i, ...] of a varying length, so a batch says which rows it holds."""

    pad_token_id = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        length = 3 + i % 4
        return {"input_ids": torch.full((length,), i + 1), "labels": torch.full((length,), i + 1)}


def rows_of(batch) -> list[int]:
    """Row ids in a batch (filler rows, all padding with labels -100, are reported as -1)."""
    return [int(r[0]) - 1 for r in batch["input_ids"]]


def take(loader, n):
    return [rows_of(b) for b in itertools.islice(iter(loader), n)]


def loader(n=50, **kw):
    args = dict(local_batch_size=3, dp_rank=0, dp_size=2, seed=7, pad_to_multiple_of=4)
    args.update(kw)
    return build_dataloader(RowIds(n), **args)


def test_dp_ranks_get_disjoint_rows_and_cp_peers_identical_rows():
    # world of 8 = dp 2 x cp 4: the loader takes the dp coordinate, so the 4 cp ranks of a dp group match
    dp, cp = 2, 4
    per_rank = [take(loader(dp_rank=rank // cp, dp_size=dp), len(loader())) for rank in range(dp * cp)]
    for rank in range(dp * cp):
        assert per_rank[rank] == per_rank[(rank // cp) * cp]
    seen = []
    for step in range(len(loader())):
        a, b = per_rank[0][step], per_rank[cp][step]
        assert not set(a) & set(b)
        seen += a + b
    assert len(seen) == len(set(seen)) == (50 // 6) * 6  # every row at most once per epoch


def test_global_batch_does_not_depend_on_the_dp_split():
    one = take(loader(local_batch_size=6, dp_size=1), 8)
    two = [take(loader(local_batch_size=3, dp_size=2, dp_rank=r), 8) for r in range(2)]
    three = [take(loader(local_batch_size=2, dp_size=3, dp_rank=r), 8) for r in range(3)]
    for s in range(8):
        assert one[s] == two[0][s] + two[1][s] == three[0][s] + three[1][s] + three[2][s]


def test_deterministic_per_seed_and_reshuffled_per_epoch():
    a, b, c = loader(seed=7), loader(seed=7), loader(seed=8)
    ea, eb, ec = take(a, 8), take(b, 8), take(c, 8)
    assert ea == eb and ea != ec
    assert a.epoch == 1 and a.step_in_epoch == 0  # rolled over after the epoch's last batch
    assert take(a, 8) != ea  # epoch 1 has its own order
    ordered = take(loader(shuffle=False, dp_size=1, local_batch_size=5), 2)
    assert ordered == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_batches_are_padded_cpu_int64_and_len_is_steps_per_epoch():
    ld = loader(n=50)
    assert len(ld) == 50 // 6
    batch = next(iter(ld))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].device.type == "cpu" and batch["input_ids"].dtype == torch.int64
    assert batch["input_ids"].shape[1] % 4 == 0 and batch["input_ids"].shape == batch["labels"].shape
    assert bool((batch["labels"][batch["input_ids"] == 0] == -100).all())


@pytest.mark.parametrize("stop_at", [0, 3, 7, 8, 13, 16])
def test_resume_sees_exactly_the_rows_of_an_uninterrupted_run(stop_at):
    steps = 20  # crosses two epoch boundaries (8 steps per epoch)
    ref = loader()
    expected = []
    while len(expected) < steps:
        expected += [rows_of(b) for b in ref]
    expected = expected[:steps]

    first = loader()
    got = []
    while len(got) < stop_at:
        for b in first:
            got.append(rows_of(b))
            if len(got) == stop_at:
                break
    state = pickle.loads(pickle.dumps(copy.deepcopy(first.state_dict())))  # as a checkpoint would
    assert state["sampler"]["epoch"] * 8 + state["sampler"]["step"] == stop_at

    resumed = loader()
    resumed.load_state_dict(state)
    while len(got) < steps:
        got += [rows_of(b) for b in resumed]
    assert got[:steps] == expected


def test_resume_with_another_dp_split_of_the_same_global_batch():
    run = loader(dp_size=1, local_batch_size=6)
    take(run, 5)
    state = run.state_dict()
    parts = []
    for r in range(2):
        ld = loader(dp_size=2, local_batch_size=3, dp_rank=r)
        ld.load_state_dict(state)
        parts.append(take(ld, 3))
    assert [parts[0][s] + parts[1][s] for s in range(3)] == take(run, 3)


def test_drop_last_false_uses_every_row_once_with_empty_fillers():
    per_rank = [take(loader(n=50, drop_last=False, dp_rank=r), 100) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 9  # ceil(50 / 6): same step count on every rank
    rows = [i for rank in per_rank for batch in rank for i in batch]
    assert sorted(i for i in rows if i != -1) == list(range(50)) and rows.count(-1) == 4
    last = list(loader(n=50, drop_last=False, dp_rank=1))[-1]
    assert rows_of(last) == [-1, -1, -1]
    assert bool((last["labels"] == -100).all())  # fillers contribute nothing to a summed loss
    s = DistributedBatchSampler(
        5, local_batch_size=2, dp_rank=1, dp_size=2, seed=0, drop_last=False, shuffle=False
    )
    assert s.local_indices(0, 1) == [FILLER_INDEX, FILLER_INDEX] and s.local_indices(0, 0) == [2, 3]


def test_a_new_iterator_makes_the_old_one_stale():
    ld = loader()
    old = iter(ld)
    next(old)
    new = iter(ld)
    assert rows_of(next(new)) == take(loader(), 2)[1]
    with pytest.raises(RuntimeError, match="stale"):
        next(old)
    old = iter(ld)
    next(old)
    list(iter(ld))  # a newer iterator finishes the epoch: the old one must still not stop silently
    with pytest.raises(RuntimeError, match="stale"):
        next(old)


@pytest.mark.parametrize("stop_at", [2, 8, 10])
def test_resume_with_another_global_batch_maps_the_position_exactly(stop_at):
    # 48 rows: 8 batches of 6 or 12 batches of 4 per epoch (the same 48 rows); after an even number
    # of 6-row batches (a multiple of 12 rows) the 4-row loader continues where a 4-row run would be
    n, rows = 48, stop_at * 6
    ref = loader(n=n, local_batch_size=2, dp_size=2)
    expected = []
    while len(expected) < rows // 4 + 10:
        expected += take(ref, 99)
    first = loader(n=n, local_batch_size=3, dp_size=2)
    for _ in range(stop_at):
        take(first, 1)
    resumed = loader(n=n, local_batch_size=2, dp_size=2)
    resumed.load_state_dict(first.state_dict())
    got = []
    while len(got) < 10:
        got += take(resumed, 10 - len(got))
    assert got == expected[rows // 4 : rows // 4 + 10]


def test_errors_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match=r"dp_rank=2 must be < dp_size=2.*not its global rank"):
        loader(dp_rank=2)
    with pytest.raises(ValueError, match=r"5 rows, fewer than one global batch of 6 .*drop_last=False"):
        loader(n=5)
    with pytest.raises(ValueError, match=r"local_batch_size=0 must be an integer >= 1"):
        loader(local_batch_size=0)
    with pytest.raises(ValueError, match=r"seed=-1 must be an integer >= 0"):
        loader(seed=-1)
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=0 must be an integer >= 1"):
        loader(pad_to_multiple_of=0)
    state = loader(seed=7).state_dict()
    with pytest.raises(ValueError, match=r"seed: checkpoint 7 != now 8.*same data, seq_len, seed"):
        loader(seed=8).load_state_dict(state)
    # 50 rows: an epoch spans 48 rows in batches of 6 but 50 in batches of 10
    with pytest.raises(ValueError, match=r"global_batch_size: checkpoint 6 != now 10 .*spans 48 rows.*50"):
        loader(local_batch_size=5).load_state_dict(state)
    ld = loader()
    take(ld, 1)  # 6 rows consumed: not a whole number of batches of 4
    msg = r"6 rows of the epoch are consumed.*local_batch_size \* dp_size = 6"
    with pytest.raises(ValueError, match=msg):
        loader(local_batch_size=2).load_state_dict(ld.state_dict())
    with pytest.raises(ValueError, match=r"num_rows: checkpoint 50 != now 60"):
        loader(n=60).load_state_dict(state)


def test_packed_dataset_needs_a_compatible_multiple():
    class Packed(RowIds):
        packed, seq_pad_multiple = True, 8

    with pytest.raises(ValueError, match=r"pad_to_multiple_of=4 is not a multiple of .*seq_pad_multiple=8"):
        build_dataloader(Packed(10), local_batch_size=1, dp_rank=0, dp_size=1, seed=0, pad_to_multiple_of=4)
