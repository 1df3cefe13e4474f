"""docs/choosing.md cannot go stale: its table is regenerated from ``choose_cp_method`` and the registry's checks
on meta-device profiles (scripts/choosing_table.py, no launch), checked against docs/support_matrix.md's parity
results, and compared with the file; the page's rules of thumb are checked against the same cells."""

from __future__ import annotations

import pytest

from scripts.choosing_table import (
    CELLS,
    DOC_PATH,
    END,
    REGENERATE,
    START,
    compute,
    render_section,
    replace_section,
)


@pytest.fixture(scope="module")
def chooser():
    from tests.family_matrix import skip_unless_pinned_transformers

    skip_unless_pinned_transformers("docs/choosing.md (from docs/support_matrix.md)")
    return compute()  # raises when a cell calls exact what the matrix does not, or a family fits no row


def _rows(chooser):
    return {row.family: cells for row, _, cells in chooser.rows}


def test_the_page_holds_the_generated_table(chooser):
    doc = DOC_PATH.read_text()
    assert doc.count(START) == 1 and doc.count(END) == 1
    assert replace_section(doc, render_section(chooser)) == doc, f"docs/choosing.md is stale: run {REGENERATE}"


def test_every_family_of_the_matrix_is_in_one_row_or_refused(chooser):
    from tests.family_matrix import FAMILIES

    covered = [f for names in chooser.members.values() for f in names] + [f for f, _, _ in chooser.refused]
    assert sorted(covered) == sorted(fam.name for fam in FAMILIES)
    refused = {f for f, _, _ in chooser.refused}
    # issue 43: only Inkling's convolved K/V with a relative-position bias and CPM-Ant's non-causal attention
    assert refused == {"inkling_text", "inkling2_text", "inkling2_loop_text", "cpmant"}
    assert not refused & {"rwkv", "xlstm", "doge", "gpt_neox_japanese", "openai-gpt", "xglm", "moshi", "hrm_text",
                          "deepseek_v4", "axk2", "qwen4_exp_text", "kolibri1_1", "zaya"}
    assert not refused & {"falcon", "bloom", "mpt", "gpt_neo", "hy_v4"}  # gpt_neo: its own masks handed to the method
    assert {"rwkv", "xlstm"} <= set(chooser.members["mamba2"])  # recurrent layers alone (issue 43)
    assert sorted(chooser.members["bloom"]) == ["bloom", "falcon@flagship", "mpt"]  # ALiBi (issue 43)
    assert not {"lfm3", "longcat_flash", "lara_mini", "bailing_hybrid"} & refused
    assert not refused & {"deepseek_v32", "glm_moe_dsa", "dots3_note_text", "hy_v4"}  # DSA: the latent KV gathered


def test_the_rules_of_thumb_on_the_page_hold(chooser):
    rows = _rows(chooser)
    titles = [t for t, _, _ in CELLS]
    assert titles[0].startswith("unpacked") and "cp 16" in titles[2] and titles[1].startswith("packed")
    every = ["ring", "ulysses", "thd", "thd_docs", "usp"]
    for family, cells in rows.items():
        for (_, _, packed), cell in zip(CELLS, cells):
            assert not (packed and "ring" in cell.exact), family  # ring never takes packed rows
        if family in ("qwen2_vl", "mamba2", "deepseek_v32", "doge"):
            continue
        # inside a node unpacked: Ulysses; packed: thd_docs; across nodes: usp with ulysses_size = GPUs per node
        assert [c.pick for c in cells] == ["ulysses", "thd_docs", "usp (ulysses_size=8)", "thd_docs"], family
        assert cells[0].exact == every, family  # layer kinds do not change the exact set (heads may)
    gemma = rows["gemma3_text"]  # 8 heads at cp 16: Ulysses only is ruled out
    assert "ulysses" not in gemma[2].exact and gemma[2].exact == ["ring", "thd", "thd_docs", "usp"]
    vlm = rows["qwen2_vl"]
    assert [c.exact for c in vlm] == [["ring", "ulysses"], ["ulysses"]] * 2
    dsa = rows["deepseek_v32"]  # every method gathers the same latent KV and indexer keys: inside a node a tie
    assert all(cell.exact == every for cell in dsa[::2]), [c.exact for c in dsa]
    assert dsa[0].pick == "ring" and dsa[2].pick == "usp (ulysses_size=8)"  # across nodes: the big gather inside
    doge = rows["doge"]  # K and V gathered whatever the method (as DSA's latents): the same picks
    assert doge[0].exact == every and doge[0].pick == "ring" and doge[2].pick == "usp (ulysses_size=8)"


def test_the_column_that_proves_a_method_does_not_depend_on_the_order_of_the_titles():
    from scripts.choosing_table import _matrix_column

    titles = ["ring", "ulysses", "usp (cp=4)", "ulysses (cp=4)", "ulysses packed", "usp packed (cp=4)"]
    for order in (titles, titles[::-1], sorted(titles)):
        assert _matrix_column("ulysses", False, order) == "ulysses"  # cp 2 proves it; cp 4 may refuse tiny heads
        assert _matrix_column("usp", False, order) == "usp (cp=4)"
        assert _matrix_column("usp", True, order) == "usp packed (cp=4)"
        assert _matrix_column("ulysses", True, order) == "ulysses packed"
        assert _matrix_column("thd", False, order) is None
