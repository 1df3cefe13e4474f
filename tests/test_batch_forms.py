"""Every own-loop batch function honours or refuses every batch key that changes the numbers (issue 27, item 1).

- the classifier (:func:`automodel.distributed.cp.batch_forms.classify_batch`) on each form, the packing slack,
  mRoPE and malformed input (single process);
- the user's case: ring's ``make_cp_batch_and_ctx`` on rows packed transformers-style (restarting
  ``position_ids``, no ``seq_lens``) is refused, naming the methods that compute it (single process);
- THE matrix (one launched group of 2 gloo ranks, tests/workers/batch_forms_worker.py): method x batch form
  -> exact against transformers in one process (fp32: loss rel <= 1e-5, gradients rel <= 1e-4) or refused.
  No cell runs with different numbers; the table :data:`~automodel.distributed.cp.batch_forms.COMPUTES` agrees
  with every cell; every refusal names exactly the methods the matrix shows computing its form; the methods'
  ``supports_packed`` and docs/support_matrix.md's claims agree with it; docs/batch_forms.md shows the table.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from automodel.distributed.cp import cp_methods, get_cp_method
from automodel.distributed.cp.batch_forms import (
    BATCH_FORMS,
    COMPUTES,
    METHOD_ORDER,
    BatchFormError,
    batch_form_problem,
    check_batch_forms,
    classify_batch,
    methods_computing,
)
from automodel.errors import UserInputError
from tests.dist_harness import run_distributed
from tests.workers.batch_forms_worker import FORMS, METHODS, MROPE_FORMS, batches, mrope_batches

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "batch_forms.md"
TABLE_START, TABLE_END = "<!-- batch-forms:start -->", "<!-- batch-forms:end -->"


# ------------------------------------------------------------------ the table (no launch)


def render_table() -> str:
    """docs/batch_forms.md's table: one line per form, one column per method (from :data:`COMPUTES`)."""
    head = "| batch form | " + " | ".join(METHOD_ORDER) + " |"
    rule = "|---|" + "---|" * len(METHOD_ORDER)
    lines = [head, rule]
    for form in BATCH_FORMS:
        cells = ["exact" if form in COMPUTES[m] else "refused" for m in METHOD_ORDER]
        lines.append(f"| `{form}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_table_covers_the_registered_methods_and_forms():
    assert set(COMPUTES) == set(METHOD_ORDER) == set(cp_methods()) == set(METHODS)
    for method, forms in COMPUTES.items():
        assert "plain" in forms and forms <= set(BATCH_FORMS), method
    assert set(FORMS) | set(MROPE_FORMS) == set(BATCH_FORMS)


def test_doc_shows_the_table():
    text = DOC.read_text()
    assert TABLE_START in text and TABLE_END in text, f"{DOC} lacks the table markers"
    shown = text.split(TABLE_START)[1].split(TABLE_END)[0].strip()
    assert shown == render_table(), f"{DOC} is stale; its table must read:\n{render_table()}"
    example = text.split("```\n", 2)[1].split("\n```")[0]  # the user's case, as ring refuses it
    assert " ".join(example.split()) == batch_form_problem("ring", "restarts")


# ------------------------------------------------------------------ the classifier


def test_each_matrix_batch_is_its_form():
    for form, batch in {**batches(), **mrope_batches()}.items():
        assert classify_batch(batch) == [form], form


def test_classifier_details():
    ids = torch.zeros(2, 16, dtype=torch.long)
    assert classify_batch({"input_ids": ids, "position_ids": torch.arange(16)[None]}) == ["plain"]
    # restarts at seq_lens boundaries are the documents themselves; one elsewhere is not
    lens, padded = torch.tensor([[5, 7, -1000], [3, 2, 7]]), torch.tensor([[8, 8, -1000], [4, 4, 8]])
    packed = batches()["seq_lens"]
    assert classify_batch(packed) == ["seq_lens"]
    assert classify_batch({**packed, "position_ids": torch.arange(16).expand(2, 16)}) == ["seq_lens"]
    off = torch.cat([torch.arange(5), torch.arange(11)]).expand(2, 16)
    assert classify_batch({**packed, "position_ids": off}) == ["restarts", "seq_lens"]
    # zeros of the mask on a packed document's own padding are right padding; elsewhere they hide a token
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 5:8] = 0
    assert classify_batch({**packed, "attention_mask": mask}) == ["seq_lens", "right_padding"]
    mask[0, 2] = 0
    assert classify_batch({**packed, "attention_mask": mask}) == ["seq_lens", "right_padding", "masked_token"]
    # both sides, an empty row
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :2], mask[0, -2:], mask[1] = 0, 0, 0
    assert classify_batch({"input_ids": ids, "attention_mask": mask}) == ["right_padding", "left_padding"]
    assert classify_batch({"input_ids": ids, "attention_mask": torch.ones(2, 16, dtype=torch.bool)}) == ["plain"]
    # mRoPE: 3 rows never mark documents, 4 rows carry text positions in row 0
    assert classify_batch({"input_ids": ids, "position_ids": torch.zeros(3, 2, 16, dtype=torch.long)}) == ["mrope"]
    text = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
    four = torch.stack([text, *(torch.arange(16).expand(2, 16),) * 3])
    assert classify_batch({"input_ids": ids, "position_ids": four}) == ["restarts", "mrope_text"]
    four[0] = torch.arange(16)
    assert classify_batch({"input_ids": ids, "position_ids": four}) == ["mrope_text"]
    assert classify_batch({"input_ids": ids, "seq_lens": lens, "seq_lens_padded": padded}) == ["seq_lens"]
    # malformed entries are left to the method's own validation
    assert classify_batch({"input_ids": ids, "position_ids": torch.arange(8)[None], "seq_lens": lens}) == ["seq_lens_only"]
    assert classify_batch({"input_ids": ids, "seq_lens_padded": padded}) == ["seq_lens"]
    one = {"input_ids": ids[:1], "cu_seqlens": torch.tensor([0, 6, 16])}
    assert classify_batch(one) == ["seq_lens_only"]
    assert classify_batch({**one, "position_ids": batches()["restarts"]["position_ids"][:1]}) == ["seq_lens_only"]
    assert classify_batch({"attention_mask": torch.ones(16), "seq_lens": torch.tensor([5, 3])}) == ["plain"]


def test_refusal_text(monkeypatch):
    msg = batch_form_problem("ring", "restarts")
    assert msg.startswith("cp_method ring (make_cp_batch_and_ctx) does not compute this batch exactly: the batch has "
                          "position_ids that restart inside a row")  # fmt: skip
    assert "methods that compute it: ulysses (distributed.cp_method=...; own loop: make_ulysses_batch_and_ctx)" in msg
    assert "or pass seq_lens / seq_lens_padded [B, P]" in msg
    with pytest.raises(BatchFormError, match="cp_method thd .*left padding"):
        check_batch_forms("thd", batches()["left_padding"])
    assert check_batch_forms("ulysses", batches()["left_padding"]) == ["left_padding"]
    assert isinstance(BatchFormError("x"), UserInputError) and isinstance(BatchFormError("x"), ValueError)
    import automodel.distributed.cp.batch_forms as batch_forms

    monkeypatch.setattr(batch_forms, "COMPUTES", {"ring": frozenset({"plain"})})
    assert "no CP method computes it" in batch_form_problem("ulysses", "left_padding")


def test_users_case_ring_refuses_rows_packed_transformers_style():
    """The user's case: ring's make_cp_batch_and_ctx, restarting position_ids and no seq_lens (no collective
    runs before the refusal: a stub mesh is enough)."""
    from automodel.distributed.cp_utils import make_cp_batch_and_ctx
    from tests.test_cp_utils import StubMesh

    batch = batches()["restarts"]
    with pytest.raises(ValueError) as info:
        make_cp_batch_and_ctx(StubMesh(), batch)
    assert str(info.value) == batch_form_problem("ring", "restarts")
    assert "methods that compute it: ulysses " in str(info.value)
    # without CP the batch goes back untouched (one process: transformers takes the restarts itself)
    ctx, same = make_cp_batch_and_ctx(StubMesh(size=1), batch)
    assert same is batch


# ------------------------------------------------------------------ the matrix (one launch)


@pytest.fixture(scope="module")
def matrix() -> dict:
    result = run_distributed("tests.workers.batch_forms_worker:main", world_size=2, timeout=240)[0]
    print(f"\nbatch-form matrix (worker {result['seconds']:.1f} s):")
    for (method, form), cell in result["cells"].items():
        detail = (
            f"loss rel {cell['loss_rel']:.1e}, grad rel {cell['grad_rel']:.1e}"
            if "loss_rel" in cell
            else cell["message"][:100]
        )
        print(f"  {method:8s} {form:18s} {cell['status']:8s} {detail}")
    return result


def _exact(result: dict, form: str) -> list[str]:
    return [m for m in METHOD_ORDER if result["cells"].get((m, form), {}).get("status") == "exact"]


def test_no_cell_runs_with_different_numbers(matrix):
    bad = {k: c for k, c in matrix["cells"].items() if c["status"] not in ("exact", "refused")}
    assert not bad, bad
    assert set(matrix["cells"]) == {(m, f) for m in METHODS for f in BATCH_FORMS}


def test_the_table_agrees_with_every_cell(matrix):
    for (method, form), cell in matrix["cells"].items():
        assert cell["status"] == ("exact" if form in COMPUTES[method] else "refused"), (method, form, cell)


def test_each_refusal_names_the_methods_that_compute_its_form(matrix):
    for (method, form), cell in matrix["cells"].items():
        if cell["status"] != "refused":
            continue
        assert cell["type"] == "BatchFormError", (method, form, cell)
        assert cell["message"] == batch_form_problem(method, form)
        named = re.search(r"methods that compute it: ([\w| ]+?) \(", cell["message"])
        listed = named.group(1).split(" | ") if named else []
        assert listed == [m for m in _exact(matrix, form) if m != method], (method, form, listed)
        assert listed == [m for m in methods_computing(form) if m != method]


def test_packed_claims_agree_with_the_matrix(matrix):
    """``supports_packed`` (read by the config rules and docs/cp_methods.md) is the matrix's ``seq_lens`` column."""
    for name in METHODS:
        assert get_cp_method(name).supports_packed == (name in _exact(matrix, "seq_lens")), name


def test_support_table_claims_agree_with_the_matrix(matrix):
    """docs/support_matrix.md runs one plain row (one document) per family and method: a method column with an
    ``exact`` cell claims the plain form, which the matrix must show exact; no column names an unknown method."""
    text = (ROOT / "docs" / "support_matrix.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| family |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    methods = [c for c in columns if c in METHODS]
    assert methods, columns
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for method in methods:
        i = columns.index(method)
        claims = any(line.strip("|").split("|")[i].strip() == "exact" for line in rows)
        if claims:
            assert method in _exact(matrix, "plain"), method
