"""The document placement planner (automodel/distributed/cp/thd_docs/placement.py) on adversarial inputs."""

from __future__ import annotations

import pytest

from automodel.distributed.cp.thd_docs.placement import (
    CostModel,
    Piece,
    plan_documents,
    sample_lengths,
    split_chunks,
)


def _covers(plan) -> None:
    """Every token of every document is on exactly one rank, and split documents follow the head-tail rule."""
    seen = {d: [0] * n for d, n in enumerate(plan.lengths)}
    for pieces in plan.ranks:
        for p in pieces:
            for t in range(p.start, p.end):
                seen[p.doc][t] += 1
    assert all(c == 1 for counts in seen.values() for c in counts)
    for doc, span in plan.spans.items():
        k = len(span)
        chunks = split_chunks(plan.lengths[doc], k)
        for i, r in enumerate(span):
            mine = [(p.start, p.end) for p in plan.ranks[r] if p.doc == doc]
            assert mine == [c for c in (chunks[i], chunks[2 * k - 1 - i]) if c[1] > c[0]]
    for pieces in plan.ranks:
        for p in pieces:
            if p.doc not in plan.spans:
                assert (p.start, p.end) == (0, plan.lengths[p.doc])


def test_split_chunks_no_padding():
    assert split_chunks(10, 2) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_chunks(3, 2) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert sum(b - a for a, b in split_chunks(1001, 4)) == 1001


def test_one_huge_document_is_split_over_every_rank():
    plan = plan_documents([100_000], 4)
    _covers(plan)
    assert plan.spans == {0: (0, 1, 2, 3)}
    assert plan.imbalance < 1.001
    assert plan.tokens == [25_000] * 4


def test_huge_plus_tiny():
    plan = plan_documents([4000] + [3] * 50, 4)
    _covers(plan)
    assert list(plan.spans) == [0] and plan.imbalance <= 1.02


def test_all_equal():
    plan = plan_documents([512] * 8, 4)
    _covers(plan)
    assert not plan.spans and plan.imbalance == 1.0 and plan.tokens == [1024] * 4
    plan = plan_documents([512] * 3, 2)  # 3 equal documents on 2 ranks: one must be split
    _covers(plan)
    assert len(plan.spans) == 1 and plan.imbalance <= 1.02


def test_many_tiny_documents_stay_whole():
    plan = plan_documents([1, 2, 3] * 400, 8, CostModel(token=1.0))
    _covers(plan)
    assert not plan.spans and plan.imbalance <= 1.01
    assert sum(plan.step_tokens(r) for r in range(8)) == 0  # nothing to exchange


def test_more_ranks_than_documents_every_rank_gets_tokens():
    plan = plan_documents([1, 9], 4)
    _covers(plan)
    assert min(plan.tokens) >= 1 and sum(plan.tokens) == 10
    assert any(1 < len(s) < 4 for s in plan.spans.values()) or 0 in plan.spans or 1 in plan.spans
    plan = plan_documents([5, 5, 5], 8)
    _covers(plan)
    assert min(plan.tokens) >= 1
    with pytest.raises(ValueError, match="fewer than cp_size=4"):
        plan_documents([1, 2], 4)


def test_exchange_counts_head_to_all_tail_to_earlier():
    plan = plan_documents([8], 2)  # chunks of 2: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    assert plan.ranks == ((Piece(0, 0, 2), Piece(0, 6, 8)), (Piece(0, 2, 4), Piece(0, 4, 6)))
    assert plan.exchange_tokens(0) == [0, 2]  # its head only: rank 1's chunks precede rank 0's tail
    assert plan.exchange_tokens(1) == [4, 0]  # head and tail: rank 0's tail attends to both
    assert plan.step_tokens(0) == 2 * 2 + 4 and plan.step_tokens(1) == 2 * 4 + 2


def test_cost_model_windows_and_linear_layers():
    full = CostModel(pair=1.0)
    assert full.prefix(4) == 10
    window = CostModel(pair=1.0, full_layers=0, windows=(2,))
    assert window.prefix(4) == 1 + 2 + 2 + 2
    linear = CostModel(token=3.0, full_layers=0)
    assert linear.prefix(4) == 12
    # under a linear cost, balance is by tokens: a 3000-token document is no harder than 3000 tiny ones
    plan = plan_documents([3000] + [1] * 3000, 2, linear)
    assert not plan.spans and plan.tokens == [3000, 3000]


def test_pure_and_deterministic():
    lengths = sample_lengths(8192, 256, rows=2)
    assert sum(lengths) == 2 * 8192 and lengths == sample_lengths(8192, 256, rows=2)
    assert plan_documents(lengths, 4) == plan_documents(list(lengths), 4)
