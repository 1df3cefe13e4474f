"""The docs state what the code computes (issue 30): each test fails if one of the contradictions it names comes back.

- linear mixers (docs/linear_mixers.md, docs/cp_layer_kinds.md) against ``linear_support`` and the registry;
- "Choosing ``cp_method``" (docs/recipe.md): every registered method, its packed rows and head limit from the
  method, its bytes from the method's own ``exchange_terms``, no rule of thumb the dry run contradicts;
- the lists of docs/recipe.md (methods that keep document boundaries, tested families) against the code;
- Ulysses' attention chunks on packed rows: the wording, and what one process computes.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from automodel.distributed.cp import LayerSpec, cp_methods
from automodel.distributed.cp.layers.linear_support import LINEAR_METHODS, STATE_MIXERS, linear_mixer_problem
from automodel.distributed.cp.profile import LINEAR
from tests.dist_harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"


def _table(text: str, header_start: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table whose header row starts with ``header_start``: (header cells, body rows' cells)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return [c.strip() for c in lines[start].strip().strip("|").split(" | ")], rows


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start : end if end > 0 else None]


# ------------------------------------------------------------------ B1: linear mixers


def test_linear_mixers_table_is_the_code_capability_table():
    header, rows = _table((DOCS / "linear_mixers.md").read_text(), "| mixer (transformers class) |")
    methods = header[3:]
    assert set(methods) == set(cp_methods()) == set(LINEAR_METHODS), methods
    listed: dict[str, str] = {}
    for row in rows:
        classes = re.findall(r"`(\w+)`", row[0].split("(")[0])
        if not classes:  # the closing row: any other mixer
            assert row[0].startswith("any mixer class without a registered kernel"), row
            unknown = LayerSpec(0, LINEAR, mixer="SomeNewMixer")
            for method, cell in zip(methods, row[3:]):
                assert cell == "refused" and linear_mixer_problem(method, unknown) is not None, (method, cell)
            continue
        for name in classes:
            listed[name] = row[1].strip("`")
            layer = LayerSpec(0, LINEAR, mixer=name)
            for method, cell in zip(methods, row[3:]):
                exact = linear_mixer_problem(method, layer) is None
                assert cell.startswith("exact" if exact else "refused"), (name, method, cell)
    assert listed == STATE_MIXERS  # every class with a kernel, with its kernel family, and no other


def test_layer_kinds_page_agrees_on_linear_mixers():
    """cp_layer_kinds.md once said linear mixers are refused under every method while linear_mixers.md and the
    support matrix said Gated DeltaNet is exact: its row now defers to linear_mixers.md and names no refusal."""
    header, rows = _table((DOCS / "cp_layer_kinds.md").read_text(), "| layer kind |")
    row = next(r for r in rows if r[0].startswith("linear / state-space mixers"))
    assert "[linear_mixers.md](linear_mixers.md)" in row[0] and "any other mixer is refused" in row[0]
    assert all("refused" not in cell for cell in row[1:]), row
    assert set(header[1:]) | {"usp"} == set(cp_methods()), header  # usp: said in the text to repeat thd
    for name in ("Qwen3NextGatedDeltaNet", "MambaMixer"):
        assert all(linear_mixer_problem(m, LayerSpec(0, LINEAR, mixer=name)) is None for m in cp_methods())


# ------------------------------------------------------------------ B2: choosing cp_method

LLAMA_8B = SimpleNamespace(heads=32, kv_heads=8, head_dim=128, hidden=4096)
SEQ_8B = 131072


def _bytes_per_layer(method, cp: int) -> float:
    shape = SimpleNamespace(cp=cp, tp=1, seq=SEQ_8B, local_tokens=SEQ_8B // cp, local_batch=1, compute_bytes=2)
    return sum(t.bytes for t in method.exchange_terms(LLAMA_8B, shape, False))


def test_choosing_cp_method_tabulates_every_method_from_the_code():
    from automodel.distributed.cp.usp import UspMethod

    section = _section((DOCS / "recipe.md").read_text(), "#### Choosing `cp_method`")
    assert section.split("\n", 2)[2].startswith("Leave it at **`auto`**")  # auto first
    assert "[choosing.md](choosing.md)" in section and "[support_matrix.md](support_matrix.md)" in section
    header, rows = _table(section, "| method |")
    assert header == ["method", "what one rank exchanges per attention layer", "packed rows", "heads",
                      "sent per rank per layer"]  # fmt: skip
    names = [r[0].strip("`") for r in rows]
    assert names == list(cp_methods()), names
    for row in rows:
        name = row[0].strip("`")
        method = UspMethod(4) if name == "usp" else cp_methods()[name]
        assert row[2] == ("yes" if method.supports_packed else "no"), row
        splits = (UspMethod(2) if name == "usp" else method).head_split_problem(3, 4) is not None
        assert (row[3] != "any") == splits, row
        stated = float(re.match(r"([\d.]+) GiB", row[4]).group(1))
        assert stated == round(_bytes_per_layer(method, 8) / 2**30, 2), (name, stated, _bytes_per_layer(method, 8))


def test_no_rule_of_thumb_the_exchange_terms_contradict():
    """The old section said "ring with strong GQA" moves fewer bytes; for Llama-8B at cp=8 the dry run has
    Ulysses sending 280 GiB per rank per step against ring's 672 (the same ratio per layer here)."""
    text = (DOCS / "recipe.md").read_text()
    ulysses_md = " ".join((DOCS / "ulysses.md").read_text().split())
    for page in (text, ulysses_md):
        assert "strong GQA" not in page and "little GQA" not in page
    assert "ring moves fewer bytes at `W` = 2 and 3 and Ulysses from `W` = 4 on" in ulysses_md
    ring, ulysses = cp_methods()["ring"], cp_methods()["ulysses"]
    assert _bytes_per_layer(ring, 8) / _bytes_per_layer(ulysses, 8) == pytest.approx(672 / 280)
    ring_cheaper = [cp for cp in range(2, 17) if _bytes_per_layer(ring, cp) < _bytes_per_layer(ulysses, cp)]
    assert ring_cheaper == [2, 3]
    assert "with these heads ring sends less only at\n`cp_size` 2 and 3" in _section(text, "#### Choosing `cp_method`")


# ------------------------------------------------------------------ B3: lists that come from the code


def test_packed_rows_list_is_the_methods_that_take_them():
    text = (DOCS / "recipe.md").read_text()
    match = re.search(r"keeps document boundaries \(([^;]+); (\w+) is rejected\)", text)
    assert match, "docs/recipe.md's rule on packed rows is missing"
    named = re.findall(r"`(\w+)`", match.group(1))
    assert named == [name for name, m in cp_methods().items() if m.supports_packed]
    assert [match.group(2)] == [name for name, m in cp_methods().items() if not m.supports_packed]


def test_tested_families_point_at_the_support_matrix():
    text = (DOCS / "recipe.md").read_text()
    assert "Llama, Qwen2, Qwen3, Mistral, Gemma" not in text
    assert "Tested families: every family of [support_matrix.md](support_matrix.md)" in text


# ------------------------------------------------------------------ B4: Ulysses' chunks on packed rows


def test_ulysses_chunk_wording():
    _, rows = _table((DOCS / "cp_layer_kinds.md").read_text(), "| layer kind |")
    cell = next(r for r in rows if r[0].startswith("attention chunk"))[-1]
    assert "per-document chunks" not in cell
    assert "chunks counted from each document's first token (as each document alone)" in cell
    assert "restarting `position_ids`" in cell and "installed transformers" in cell
    text = " ".join((DOCS / "ulysses.md").read_text().split())
    assert "the chunks are counted from each document's first token and never cross a document" in text
    from automodel.distributed.cp.ulysses.attention import UlyssesContext

    assert UlyssesContext.chunk_origin == "document"  # rows with seq_lens: what the docs say


def test_ulysses_chunks_on_a_seq_lens_row_are_each_document_alone():
    """What the wording claims, in one process (cp=1, the Ulysses mask on the whole row): Llama 4 with chunks
    of 4 on a row of documents 6 + 7 + 3 given by ``seq_lens`` equals each document run alone."""
    from dataclasses import replace

    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention
    from tests.family_matrix import family_by_name

    fam = family_by_name("llama4_text")
    fam = replace(fam, config_kwargs={**fam.config_kwargs, "attention_chunk_size": 4})
    ref, model = fam.build_model(), fam.build_model()
    set_ulysses_attention(model)
    lengths = [6, 7, 3]
    ids = torch.randint(0, 100, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = {"input_ids": ids, "position_ids": pos, "seq_lens": torch.tensor([lengths])}
    ctx_factory, local = make_ulysses_batch_and_ctx(None, batch, inner_attn="sdpa")
    with ctx_factory() as ctx:
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    assert ctx.chunk_origin == "document"
    start = 0
    for n in lengths:
        alone = ref(input_ids=ids[:, start : start + n], use_cache=False).logits
        torch.testing.assert_close(got[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
