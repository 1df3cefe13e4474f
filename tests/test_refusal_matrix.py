"""Every refusal's suggested alternatives run, on the whole family matrix (issue 30).

For every family of tests/family_matrix.py (profiled on the meta device: no weights, no process launch) and
every CP method (each configuration ``auto`` may try: usp's ``ulysses_size``), at several conditions a refusal
site knows (``cp_size``, ``tp_size``, one document per row or packed rows): when the model check a run makes
(:func:`check_model_config_for_cp`, the recipe's and ``context_parallel``'s) refuses, each method its message
names as an alternative (``err.alternatives``) passes the same check under the same conditions and, on packed
rows, takes packed rows. At the matrix's own conditions (cp=2, rows of SEQ tokens) each named alternative's cell
of the support matrix is also ``exact``: here against docs/support_matrix.md (which tests/test_family_matrix.py
keeps equal to a computed run), and in tests/test_family_matrix.py against the computed cells themselves.
"""

from __future__ import annotations

import functools

import pytest

from automodel.distributed.cp import check_model_config_for_cp, cp_methods, profile_model
from automodel.errors import UserInputError
from tests.dist_harness import REPO_ROOT
from tests.family_matrix import (
    CP,
    DOC_PATH,
    FAMILIES,
    PACKED,
    SEQ,
    TABLE_END,
    TABLE_START,
    column_title,
    table_columns,
)

#: (cp_size, tp_size, packed): the matrix's own cp=2 (unpacked, packed), cp=4 (usp's factorings), and
#: tp=2 x cp=4, where 4 heads leave 2 per TP rank that Ulysses cannot split over 4
CONDITIONS = [(CP, 1, False), (CP, 1, True), (4, 1, False), (4, 2, False), (4, 2, True)]


@functools.cache
def _profile(family: str):
    import torch
    from transformers import AutoModelForCausalLM

    fam = next(f for f in FAMILIES if f.name == family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
    return profile_model(model)


def _configs(cp: int):
    """Every (label, method with its options bound) a user may name at ``cp``."""
    for name, method in cp_methods().items():
        configs = method.auto_configs(cp, None)
        for m, options in configs or [(method, {})]:
            label = name + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")
            yield label, m


def _method(label: str):
    """The method a refusal's label names (``usp (ulysses_size=2)`` -> usp with that option bound)."""
    name, _, rest = label.partition(" (")
    method = cp_methods()[name]
    if rest:
        options = {k: int(v) for k, v in (kv.split("=") for kv in rest.rstrip(")").split(", "))}
        method = type(method)(**options)
    return method


def _refusal(method, profile, cp: int, tp: int, packed: bool) -> UserInputError | None:
    try:
        check_model_config_for_cp(method, profile, cp, tp, seq_len=SEQ, packed=packed)
    except UserInputError as err:
        return err
    return None


def _published_cells() -> dict[str, dict[str, str]]:
    """family -> column -> "exact" / "refused: ..." from docs/support_matrix.md's table."""
    text = (REPO_ROOT / DOC_PATH).read_text()
    rows = text[text.index(TABLE_START) + len(TABLE_START) : text.index(TABLE_END)].strip().splitlines()[2:]
    titles = [column_title(c) for c in table_columns()]
    cells = {}
    for row in rows:
        parts = [p.strip() for p in row.strip("|").split(" | ")]
        cells[parts[0].strip("`")] = dict(zip(titles, parts[4:]))
    return cells


def _column(label: str, packed: bool) -> str:
    name = label.partition(" (")[0]
    return column_title(name + (PACKED if packed else ""))


def _check_family(family: str) -> tuple[int, int]:
    """Assert every alternative the refusals of ``family`` name runs; returns (alternatives checked, of them
    looked up in the published matrix)."""
    profile = _profile(family)
    published = _published_cells()[family]
    named = looked_up = 0
    for cp, tp, packed in CONDITIONS:
        for label, method in _configs(cp):
            err = _refusal(method, profile, cp, tp, packed)
            if err is None:
                continue
            text = str(err)
            if not err.alternatives:
                assert "CP method runs this model exactly" in text and "cp_size=1" in text, (family, label, text)
            for alt in err.alternatives:
                named += 1
                assert alt in text, (family, label, alt, text)  # the message names what the attribute holds
                other = _method(alt)
                assert other.name != method.name, (family, label, alt)
                assert _refusal(other, profile, cp, tp, packed) is None, (family, label, cp, tp, packed, alt)
                assert other.supports_packed or not packed, (family, label, alt)
                if (cp, tp) == (CP, 1) and other.name != "usp":  # the matrix's conditions (usp runs at cp=4 there)
                    looked_up += 1
                    cell = published[_column(alt, packed)]
                    assert cell == "exact", (family, label, alt, cell)
    return named, looked_up


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_every_alternative_a_refusal_names_runs(family):
    _check_family(family)


def test_the_sweep_reaches_refusals_that_name_alternatives():
    """The check above can fail: Llama's refusals name alternatives (ring on packed rows at cp=2, looked up in
    the matrix; Ulysses at tp=2 x cp=4), and a method that does not run it is never among them."""
    named, looked_up = _check_family("llama")
    assert named >= 4 and looked_up >= 3, (named, looked_up)
    err = _refusal(cp_methods()["ring"], _profile("llama"), CP, 1, True)
    assert set(err.alternatives) == {"ulysses", "thd", "thd_docs"}, err.alternatives  # usp: none at cp=2
    err = _refusal(cp_methods()["ulysses"], _profile("llama"), 4, 2, True)
    assert "ring" not in err.alternatives and "thd" in err.alternatives, err.alternatives
