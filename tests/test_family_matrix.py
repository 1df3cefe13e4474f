"""Every CP method on every family of tests/family_matrix.py: exact, or refused with a clear error.

A launched group of 4 gloo ranks runs the matrix (tests/workers/family_matrix_worker.py): two
pairs share out the families for the methods at cp=2 (unpacked and packed rows) and the ``auto`` columns,
then all 4 run usp (2 x 2, unpacked and packed) and Ulysses again (``ulysses@4``); the tests below assert on rank 0's result. CI runs the
families of :data:`CI_FAMILIES` (every layer kind, both attention implementations, every column: unpacked,
packed and cp=1 packed rows, ``auto``; test_ci_subset_covers_every_layer_kind holds it) in one launch; the
whole matrix is a second launch behind the ``slow`` marker (``bash scripts/test.sh -m slow``: the other
families' cells, every cross-family check again and the published table) and scripts/support_table.py. DESIGN.md "Exact or refused": a cell that runs
with different numbers (wrong) or dies with anything but ``automodel.errors.UserInputError`` (crash) fails;
``auto`` must pick an exact method whenever one column of the same rows is exact. The published table,
docs/support_matrix.md, is generated from the same run by scripts/support_table.py.
"""

from __future__ import annotations

import time

import pytest

from tests.dist_harness import REPO_ROOT, run_distributed
from tests.family_matrix import (
    ABSENT,
    AT_CP4,
    AUTO_COLUMNS,
    CP1_PACKED,
    DOC_PATH,
    FAMILIES,
    OUT_OF_SCOPE,
    PACKED,
    REGENERATE,
    UNBUILDABLE,
    absent_reason,
    column_method,
    render_markdown,
    table_columns,
    table_section,
)

pytestmark = pytest.mark.dist

LAUNCH_TIMEOUT_S = 300
WORKER = "tests.workers.family_matrix_worker:main"


#: the families CI runs (every column each): every layer kind of FAMILIES and both attention implementations at least
#: once (test_ci_subset_covers_every_layer_kind), and the rows the cross-family tests name (llama, gpt_oss); the
#: other rows run in the slow launch of the whole matrix. Of transformers 5.25's new families: LFM3 (its short
#: convolutions beside full and sliding attention), ZAYA (cca) and CPM-Ant (relpos)
CI_FAMILIES = (
    "llama", "mistral", "gemma2", "gpt2", "bloom", "smollm3", "diffllama", "doge", "mixtral", "minicpm3",
    "deepseek_v32", "gpt_oss", "llama4_text", "qwen3_next", "falcon_h1", "nemotron_h", "recurrent_gemma", "rwkv",
    "xlstm", "lfm2@flagship", "mamba", "lfm3", "zaya", "cpmant", "deepseek_v4",
)  # fmt: skip


def _launch(families: tuple[str, ...] | None, **kwargs) -> list[dict]:
    t0 = time.perf_counter()
    ranks = run_distributed(WORKER, world_size=4, timeout=LAUNCH_TIMEOUT_S,
                            families=list(families) if families else None, **kwargs)  # fmt: skip
    print(f"family matrix ({len(ranks[0]['cells'])} families): worker {ranks[0]['seconds']:.1f} s (cp=2 pairs "
          f"{ranks[0]['pair_seconds']:.1f} s), launch {time.perf_counter() - t0:.1f} s")
    return ranks


@pytest.fixture(scope="module")
def matrix():
    """The CI launch: the families of CI_FAMILIES, after the one-rank-failing self-test."""
    return _launch(CI_FAMILIES, selftest_timeout_s=2.0)


@pytest.fixture(scope="module")
def full_matrix():
    """The slow launch: every family (what scripts/support_table.py runs)."""
    return _launch(None)


@pytest.fixture(params=["ci", pytest.param("full", marks=pytest.mark.slow)])
def any_matrix(request):
    """The cross-family checks, on the CI launch and (slow) on the whole matrix."""
    return request.getfixturevalue("matrix" if request.param == "ci" else "full_matrix")


def _families_of(result: dict) -> list[str]:
    ran = set(result["cells"])
    return [f.name for f in FAMILIES if f.name in ran]


def test_ci_subset_covers_every_layer_kind():
    """CI_FAMILIES holds every layer kind and attention implementation of FAMILIES; on an older transformers
    (scripts/compat.sh) the CI families it has hold every kind of the families it has."""
    by_name = {f.name: f for f in FAMILIES}
    ci = [name for name in CI_FAMILIES if absent_reason(name) is None]  # CI's release: all of them
    assert set(ci) <= set(by_name), set(ci) - set(by_name)
    every = {k for f in FAMILIES for k in f.kinds.split("+")}
    covered = {k for name in ci for k in by_name[name].kinds.split("+")}
    assert every == covered, f"add a family with layer kinds {sorted(every - covered)} to CI_FAMILIES"
    attns = {f.attn for f in FAMILIES}
    assert attns == {by_name[name].attn for name in ci}, attns


def test_the_release_ci_runs_has_every_family():
    """Only an older transformers leaves families out (their tests skip with "absent in transformers X"): from
    5.25, the release of constraints.txt, every row and every CI family builds, so no test skips one there."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.25"):
        pytest.skip(f"transformers {transformers.__version__} is older than CI's: it lacks {sorted(ABSENT)}")
    assert not ABSENT, ABSENT
    assert all(absent_reason(name) is None for name in CI_FAMILIES)


def test_every_causal_lm_type_of_transformers_is_a_row_or_listed_out():
    """Each ``model_type`` of the installed transformers' causal-LM mapping is a row of the matrix, a decoder family
    left out with the reason (UNBUILDABLE), or out of scope (OUT_OF_SCOPE: encoders, decoders of encoder-decoder
    models, multimodal wrappers), and in one of them only."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = {f.model_type for f in FAMILIES}
    groups = {"rows": rows, "UNBUILDABLE": set(UNBUILDABLE), "OUT_OF_SCOPE": set(OUT_OF_SCOPE)}
    for a, b in (("rows", "UNBUILDABLE"), ("rows", "OUT_OF_SCOPE"), ("UNBUILDABLE", "OUT_OF_SCOPE")):
        assert not groups[a] & groups[b], f"{sorted(groups[a] & groups[b])} are in both {a} and {b}"
    missing = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - rows - set(UNBUILDABLE) - set(OUT_OF_SCOPE))
    assert not missing, f"causal-LM types neither in tests/family_matrix.py nor listed out: {missing}"
    assert {"bert", "bart", "gemma3"} <= set(OUT_OF_SCOPE)
    assert ("lfm3" in rows) == (absent_reason("lfm3") is None)  # a row wherever the release has it (5.25)


def test_every_family_ran_every_method_on_every_rank(any_matrix, request):
    matrix = any_matrix
    result = matrix[0]
    assert len(FAMILIES) >= 30
    want = [f.name for f in FAMILIES if request.node.callspec.params["any_matrix"] == "full" or f.name in CI_FAMILIES]
    assert list(result["cells"]) == want
    for name, cells in result["cells"].items():
        assert tuple(cells) == table_columns(), name
    assert "usp" in table_columns() and "thd_docs packed" in table_columns() and "ring packed" not in table_columns()
    assert "ulysses@4" in table_columns() and column_method("ulysses@4") == column_method("ulysses packed") == "ulysses"
    statuses = [{(f, m): c["status"] for f, cs in r["cells"].items() for m, c in cs.items()} for r in matrix]
    assert all(s == statuses[0] for s in statuses), "the ranks recorded different outcomes"


def test_reference_is_deterministic_and_uses_the_attention_users_get(any_matrix):
    from automodel.distributed.torch_internals import sdpa_problem

    problems = []
    for fam in (f for f in FAMILIES if f.name in any_matrix[0]["meta"]):
        meta = any_matrix[0]["meta"][fam.name]
        if not meta.get("deterministic"):
            problems.append(f"{fam.name}: two single-process steps differ (dropout? a sampling router?)")
        if meta.get("attn_used") != fam.attn_implementation():
            problems.append(f"{fam.name}: built with attn {meta.get('attn_used')!r}, the entry says {fam.attn_implementation()!r}")
        # transformers 5.17 .. 5.24 let Gemma 2 pick SDPA, which drops its attention logit softcapping, and run Doge's
        # SDPA without its causal mask: the recipe refuses sdpa there (sdpa_problem; 5.25 marks Gemma 2 eager itself
        # and masks Doge), so users train eager
        claimed = type(meta["model_class"], (), {"_supports_sdpa": True})  # the class, taking its SDPA claim
        refused = sdpa_problem(claimed, fam.build_config())
        expected = "sdpa" if meta.get("supports_sdpa") and refused is None else "eager"
        if fam.attn_implementation() != expected:
            problems.append(f"{fam.name}: trains with {expected!r} by default, the entry says {fam.attn_implementation()!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("method", table_columns())
@pytest.mark.parametrize(
    "family", [pytest.param(f.name, marks=() if f.name in CI_FAMILIES else pytest.mark.slow) for f in FAMILIES]
)
def test_exact_or_refused(request, family, method):
    """Every cell: the CI families' from the CI launch, the others' (slow) from the whole matrix."""
    matrix = request.getfixturevalue("matrix" if family in CI_FAMILIES else "full_matrix")
    cell = matrix[0]["cells"][family][method]
    assert cell["status"] in ("exact", "refused"), f"{family} / {method}: {cell['status']}: {cell['detail']}"
    if cell["status"] == "refused" and method == CP1_PACKED:  # packing refused at cp_size=1, with the reason
        assert "at CP size 1" in cell["detail"] and "mixed together" in cell["detail"], cell["detail"]
    elif cell["status"] == "refused":
        message = cell["detail"]
        name = column_method(method)
        assert message and (name in message.lower() or "cp_method" in message), (
            f"{family} / {method}: the refusal does not name the method: {message!r}"
        )


def test_every_alternative_a_refusal_names_is_exact(any_matrix):
    """A refused cell's message names the methods that run the model instead (``err.alternatives``): each one's
    cell of the same rows is exact in this computed run (a usp alternative at cp=4: its own column; a method
    that takes no packed rows, named while the rows are not known yet: its unpacked column)."""
    from automodel.distributed.cp import get_cp_method

    problems, named = [], 0
    for family, cells in any_matrix[0]["cells"].items():
        for column, cell in cells.items():
            if column in AUTO_COLUMNS + (CP1_PACKED,) or cell["status"] != "refused":
                continue
            packed = column.endswith(PACKED)
            for alt in cell.get("alternatives", []):
                named += 1
                name = alt.partition(" (")[0]
                target = name + (PACKED if packed and get_cp_method(name).supports_packed else "")
                outcome = cells.get(target, {}).get("status")
                if outcome != "exact":
                    problems.append(f"{family} / {column}: names {alt}, whose cell {target} is {outcome}")
            if not cell.get("alternatives"):
                assert "no CP method runs this model exactly yet" in cell["detail"] or "cp_method" in cell["detail"]
    assert not problems, "\n".join(problems)
    print(f"refusals' alternatives checked against the computed cells: {named}")


@pytest.mark.parametrize("column", AUTO_COLUMNS)
def test_auto_picks_an_exact_method_whenever_one_exists(any_matrix, column):
    """``cp_method: auto`` never refuses a model that a method computes, never picks one that is not exact, and
    the methods it picks are the ones its chooser names (the worker marks a violation ``wrong``)."""
    packed = column.endswith(PACKED)
    problems, picked = [], set()
    for family, cells in any_matrix[0]["cells"].items():
        auto = cells[column]
        same_rows = [c for c, cell in cells.items() if c not in AUTO_COLUMNS + (CP1_PACKED,) and c.endswith(PACKED) == packed
                     and "usp" not in c and AT_CP4 not in c and cell["status"] == "exact"]  # fmt: skip (cp=4 columns: not candidates at cp=2)
        if same_rows and auto["status"] != "exact":
            problems.append(f"{family}: auto {auto.get('picked', 'refused')} is {auto['status']}; exact: {same_rows}")
        if not same_rows and auto["status"] != "refused":
            problems.append(f"{family}: no method is exact, yet auto is {auto['status']}")
        if "picked" in auto:
            picked.add(auto["picked"])
            assert auto["reason"].startswith(f"cp_method auto: {auto['picked']}"), auto["reason"]
        else:  # a refusal names every method's reasons
            assert all(m in auto["detail"] for m in ("ring", "ulysses", "thd", "thd_docs", "usp")), auto["detail"]
    assert not problems, "\n".join(problems)
    assert len(picked) >= 2, f"auto picked only {picked}: the matrix should exercise more than one choice"


def test_packed_rows_at_cp1_are_per_document_for_every_family(any_matrix):
    """The cp=1 packed column (the recipe's path at cp_size=1 against each document alone) is exact or refused for
    every family (test_exact_or_refused), and where a family's own forward mixes the documents of a packed row
    (gpt-oss) a method's document-aware attention computed them: cp=1 is never silently wrong."""
    cells = {family: cells[CP1_PACKED] for family, cells in any_matrix[0]["cells"].items()}
    paths = {family: cell.get("path") for family, cell in cells.items() if cell["status"] == "exact"}
    assert paths.get("gpt_oss") not in (None, "own forward"), cells.get("gpt_oss")
    assert paths.get("llama") == "own forward", cells.get("llama")
    print("cp=1 packed: " + ", ".join(f"{f}: {p}" for f, p in paths.items() if p != "own forward"))


def test_one_rank_failing_in_a_collective_neither_hangs_nor_poisons_the_next_cell(matrix):
    selftest = matrix[0]["selftest"]
    assert selftest["status"] == "crash" and selftest["disagreed"], selftest
    assert "rank 1" in selftest["detail"] and "self-test" in selftest["detail"], selftest["detail"]
    assert selftest["fresh_group"] and selftest["fresh_group_works"], selftest


@pytest.mark.slow
def test_docs_table_is_current(full_matrix):
    path = REPO_ROOT / DOC_PATH
    assert path.exists(), f"{DOC_PATH} is missing; generate it with: {REGENERATE}"
    assert table_section(path.read_text()) == table_section(render_markdown(full_matrix[0])), (
        f"{DOC_PATH} does not match this run's results; regenerate it with: {REGENERATE}"
    )


def test_docs_name_every_family_and_every_unbuildable_one():
    text = (REPO_ROOT / DOC_PATH).read_text()
    missing = [f.name for f in FAMILIES if f"| `{f.name}` |" not in text]
    missing += [name for name in UNBUILDABLE if f"`{name}`" not in text]
    assert not missing, f"{DOC_PATH} lacks {missing}; regenerate it with: {REGENERATE}"
