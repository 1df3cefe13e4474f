"""``row_multiple``: the padding a row needs for each CP method, with and without TP sequence parallelism.

For the head-tail methods (ring, thd) it must be exactly ``get_padding_multiple(cp, tp, has_sp)``;
Ulysses gives each CP rank one contiguous slice; TP without sequence parallelism adds no constraint.
"""

from __future__ import annotations

import itertools

import pytest

from automodel.distributed.cp import get_cp_method
from automodel.distributed.sp.padding import get_padding_multiple


def row_multiple(method: str, cp: int, tp: int, sp: bool) -> tuple[int, str]:
    return get_cp_method(method).row_multiple(cp, tp, sp)


@pytest.mark.parametrize(("cp", "tp", "sp"), list(itertools.product((1, 2, 4), (1, 2, 8), (False, True))))
def test_head_tail_methods_follow_get_padding(cp, tp, sp):
    for method in ("ring", "thd"):
        assert row_multiple(method, cp, tp, sp)[0] == get_padding_multiple(cp, tp, has_sp=sp)


def test_ulysses_and_descriptions():
    assert row_multiple("ulysses", 4, 2, False) == (4, "cp_size = 4")
    assert row_multiple("ulysses", 4, 2, True) == (8, "cp_size*tp_size = 4*2 = 8 (sequence parallel)")
    assert row_multiple("ring", 2, 2, False) == (4, "2*cp_size = 2*2 = 4")
    assert row_multiple("ring", 2, 2, True) == (8, "2*cp_size*tp_size = 2*2*2 = 8 (sequence parallel)")
    assert row_multiple("ring", 1, 2, True) == (2, "tp_size = 2 (sequence parallel)")
    assert row_multiple("ring", 1, 4, False) == (1, "1")  # TP alone: every TP rank holds all the tokens
