#!/usr/bin/env python
"""Write the method chooser's table into docs/choosing.md (between its markers).

No cell is typed by hand. Each row is a model kind with a representative family of the support matrix
(tests/family_matrix.py; the VLM row: the tiny Qwen2-VL of automodel/models/vlm_tiny.py), built on the
meta device (no weights) and profiled (``profile_model``: its layer kinds, sinks, MLA, attention
implementation); its heads are set to a released model's (``Row.shape``: transformers' default config of
the type unless the row names one). Each cell asks ``choose_cp_method`` (what ``distributed.cp_method: auto``
runs) for the pick and takes the exact set from the same call's candidates: every method whose own checks
accept the model there (the registry's static checks: layer kinds, heads over cp, packed rows, VLM).

The claims are tied to the parity runs: every method a cell calls exact must be **exact** in
docs/support_matrix.md's row of that family (the matching unpacked or packed column), and the refused
families are the rows whose auto cells the matrix shows refused, each of which ``choose_cp_method`` must
refuse here too. A mismatch stops the script (exit 1). ``tests/test_choosing_doc.py`` regenerates the table
and compares it with the file.

    PYTHONPATH=. python scripts/choosing_table.py           # rewrite the table in docs/choosing.md
    PYTHONPATH=. python scripts/choosing_table.py --check   # write nothing; exit 1 if the table is stale
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DOC_PATH = ROOT / "docs" / "choosing.md"
MATRIX_PATH = ROOT / "docs" / "support_matrix.md"
REGENERATE = "PYTHONPATH=. python scripts/choosing_table.py"
START, END = "<!-- chooser:start -->", "<!-- chooser:end -->"
SEQ = 32768  # tokens per row the cells are computed for
GPUS_PER_NODE = 8
#: (title, cp_size, packed): the four cells of a row; every cell has GPUS_PER_NODE ranks per node
CELLS = (
    ("unpacked rows, cp 8 in one node", 8, False),
    ("packed documents, cp 8 in one node", 8, True),
    ("unpacked rows, cp 16 over 2 nodes", 16, False),
    ("packed documents, cp 16 over 2 nodes", 16, True),
)


def _tags(kinds: str) -> set[str]:
    return set(kinds.split("+"))


@dataclass(frozen=True)
class Row:
    """One model kind: the families it covers (a predicate on the matrix's layer-kind tags), its representative."""

    kind: str
    family: str  # a family name of tests/family_matrix.py, or "qwen2_vl" (the VLM row)
    covers: Callable[[set[str]], bool]
    shape: dict[str, int] = field(default_factory=dict)  # heads, kv, head_dim, hidden overriding the defaults
    shape_from: str = ""  # what ``shape`` copies (empty: transformers' default config of the type)


_STATE = {"mamba", "conv", "rglru"}
_RECURRENT = {"mamba", "rwkv", "xlstm"}  # models of recurrent layers alone (no attention layer)
ROWS: tuple[Row, ...] = (
    Row("full attention (MHA or GQA; MoE or dense)", "llama",
        lambda t: t <= {"full", "moe", "abspos", "differential", "nope"},
        dict(heads=32, kv=8, head_dim=128, hidden=4096), "Llama-3.1-8B"),
    Row("sliding-window or chunked hybrids (NoPE layers, softcapping)", "gemma3_text",
        lambda t: bool(t & {"sliding", "chunked"}) and not t & ({"sinks", "linear", "dsa"} | _STATE)),
    Row("attention sinks (gpt-oss)", "gpt_oss", lambda t: "sinks" in t),
    Row("MLA (DeepSeek-V2/V3 style latent attention)", "deepseek_v3",
        lambda t: "mla" in t and not t & {"linear", "sinks", "dsa"}),
    Row("DeepSeek sparse and compressed attention (DSA: DeepSeek-V3.2, GLM-5, dots3; DeepSeek-V4)", "deepseek_v32",
        lambda t: bool(t & {"dsa", "hca", "csa"}) and "linear" not in t),  # Qwen4-Exp (Gated DeltaNet + QSA): linear
    Row("dynamic mask attention (Doge: K and V gathered, top-k per document)", "doge", lambda t: "dynamic-mask" in t),
    Row("linear-attention hybrids (Gated DeltaNet, lightning attention)", "qwen3_next", lambda t: "linear" in t),
    Row("state-space / convolution hybrids (Mamba, Mamba-2, short conv, RG-LRU + attention)", "jamba",
        lambda t: "cca" in t or (bool(t & _STATE) and bool(t & {"full", "sliding"}))),  # ZAYA: convolved q/k
    Row("state-space only (Mamba, Mamba-2, RWKV, xLSTM; MoE or MLP layers between)", "mamba2",
        lambda t: bool(t & _RECURRENT) and t <= _RECURRENT | {"moe", "mlp"}),
    Row("ALiBi in the layer's own code (BLOOM, MPT)", "bloom", lambda t: "alibi" in t,
        dict(heads=32, kv=32, head_dim=128, hidden=4096), "BLOOM-7B1"),
    Row("VLMs (image + text)", "qwen2_vl", lambda t: False),
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- the matrix


def read_matrix(text: str) -> dict[str, dict[str, str]]:
    """docs/support_matrix.md's table: family -> column title -> cell text."""
    from tests.family_matrix import TABLE_END, TABLE_START

    body = text[text.index(TABLE_START) + len(TABLE_START) : text.index(TABLE_END)].strip().splitlines()
    header = [c.strip() for c in body[0].strip("|").split("|")]
    out = {}
    for line in body[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        out[cells[0].strip("`")] = dict(zip(header, cells))
    return out


def _matrix_column(method: str, packed: bool, titles: Iterable[str]) -> str | None:
    """The matrix column that proves ``method``: the one titled with its name alone (``ulysses``, ``thd packed``),
    else the first in sorted order of those that add a size (``usp (cp=4)``). ``ulysses`` has both: its cp 2 column
    proves the method, while ``ulysses (cp=4)`` also refuses the tiny rows whose heads 4 ranks cannot split. The
    order of ``titles`` does not matter (a set's order changes with the process's string hash seed)."""
    name = method + (" packed" if packed else "")
    titles = sorted(titles)
    if name in titles:
        return name
    return next((t for t in titles if t.startswith(name + " (")), None)


# ---------------------------------------------------------------------------------------------- profiles


def _meta_profile(family: str) -> Any:
    """The representative's profile, from its model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from automodel.distributed.cp import profile_model

    if family == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        from automodel.models.vlm_tiny import tiny_qwen2_vl_config

        with torch.device("meta"):
            model = Qwen2VLForConditionalGeneration._from_config(tiny_qwen2_vl_config())
        return profile_model(model, "sdpa")
    from tests.family_matrix import family_by_name

    fam = family_by_name(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
    return profile_model(model, fam.attn_implementation())


def _model_type(family: str) -> str:
    if family == "qwen2_vl":
        return "qwen2_vl"
    from tests.family_matrix import family_by_name

    return family_by_name(family).model_type


def row_profile(row: Row) -> tuple[Any, str]:
    """The row's profile with a released model's heads, and the shape in words."""
    from transformers import AutoConfig

    from automodel.distributed.cp.profile import text_config

    profile = _meta_profile(row.family)
    text = text_config(AutoConfig.for_model(_model_type(row.family)))
    heads = row.shape.get("heads", getattr(text, "num_attention_heads", None))
    kv = row.shape.get("kv", getattr(text, "num_key_value_heads", None) or heads)
    hidden = row.shape.get("hidden", getattr(text, "hidden_size", None))
    head_dim = row.shape.get("head_dim", getattr(text, "head_dim", None) or (hidden // heads if heads else None))
    profile = dataclasses.replace(profile, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                                  hidden_size=hidden)  # fmt: skip
    attends = any(layer.is_attention or layer.hybrid_attention for layer in profile.layers)
    source = f"as {row.shape_from}" if row.shape_from else f"`{type(text).__name__}` defaults"
    heads_text = f"{heads} heads, {kv} KV heads of {head_dim}, {source}" if attends else "no attention layers"
    shape = f"{profile.attn_implementation}; {heads_text}"
    return profile, shape


# ---------------------------------------------------------------------------------------------- cells


@dataclass
class Cell:
    pick: str  # the pick's label, "usp (ulysses_size=8)"
    exact: list[str]  # method names whose checks accept the model here, registry order
    costs: list[tuple[str, float]]  # (label, weighted bytes) of every configuration that computes, cheapest first
    what: str  # what the pick sends
    refused: dict[str, str]  # method -> its first reason, for methods with no configuration that computes


def compute_cell(profile: Any, cp: int, packed: bool) -> Cell:
    from automodel.distributed.cp import choose_cp_method, cp_methods
    from automodel.distributed.cp.choose import _short

    choice = choose_cp_method(profile, cp, seq_len=SEQ, packed=packed, ranks_per_node=GPUS_PER_NODE)
    exact = [n for n in cp_methods() if any(c.name == n and c.computes for c in choice.candidates)]
    costs = sorted(((c.label, c.cost) for c in choice.candidates if c.computes), key=lambda lc: lc[1])
    pick = next(c for c in choice.candidates if c.method is choice.method)
    refused = {}
    for c in choice.candidates:
        if c.name not in exact and c.name not in refused:
            reason = re.sub(r"^distributed\.cp_method=\S+ ", "", c.problems[0])  # the method is named before it
            refused[c.name] = _short(re.sub(r"; set distributed\..*$", "", reason), 150)
    what = ", ".join(t.what for t in pick.terms) or "nothing"
    return Cell(pick.label, exact, costs, what, refused)


def _which_cells(titles: list[str]) -> str:
    """``"every cell"``, ``"packed documents"``, ``"cp 16"``, or the titles."""
    for words, group in (
        ("every cell", [t for t, _, _ in CELLS]),
        ("packed documents", [t for t, _, packed in CELLS if packed]),
        ("unpacked rows", [t for t, _, packed in CELLS if not packed]),
        *((f"cp {cp}", [t for t, c, _ in CELLS if c == cp]) for cp in sorted({c for _, c, _ in CELLS})),
    ):
        if titles == group:
            return words
    return "; ".join(titles)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def check_against_matrix(row: Row, cells: list[Cell], matrix: dict[str, dict[str, str]]) -> list[str]:
    """Every method a cell calls exact must be exact in the matrix's row of the family (the parity runs)."""
    if row.family not in matrix:
        return []  # the VLM row: its parity lives in tests/test_vlm_cp.py and tests/test_vlm_recipe.py
    cols = matrix[row.family]
    bad = []
    for (title, _, packed), cell in zip(CELLS, cells):
        for method in cell.exact:
            column = _matrix_column(method, packed, set(cols))
            if column is None or cols[column] != "exact":
                bad.append(f"{row.family}, {title}: {method} is called exact, the matrix says {cols.get(column)!r}")
    return bad


def refused_families(matrix: dict[str, dict[str, str]]) -> list[tuple[str, str, str]]:
    """(family, layer-kind tags, reason) of every family whose auto cells the matrix shows refused; each must
    be refused by ``choose_cp_method`` on its meta-device profile too (else ``ValueError``)."""
    from automodel.distributed.cp import choose_cp_method, get_cp_method
    from automodel.distributed.cp.method import profile_problems
    from automodel.errors import CPUnsupportedError
    from tests.family_matrix import SEQ as MATRIX_SEQ
    from tests.family_matrix import short_reason

    out = []
    for family, cols in matrix.items():
        if not cols["auto"].startswith("refused"):
            continue
        profile = _meta_profile(family)
        try:
            choice = choose_cp_method(profile, 2, seq_len=MATRIX_SEQ)
        except CPUnsupportedError:
            pass
        else:
            raise ValueError(f"{family}: the matrix shows auto refused, choose_cp_method picks {choice.name}")
        problems = profile_problems(get_cp_method("ring"), profile, MATRIX_SEQ)
        reason = re.sub(r" is not known to be exact.*$", "", problems[0])
        reason = re.sub(r", which ring splits over the ranks without passing the state on.*$",
                        ", with no CP kernel that passes the state between ranks", reason)
        reason = re.sub(r",? and ring builds its own mask.*$", ", which every CP method's own mask would miss", reason)
        out.append((family, cols["layer kinds"], short_reason(reason, 170)))
    return out


# ---------------------------------------------------------------------------------------------- rendering


@dataclass
class Chooser:
    """Everything the section shows: per row its shape and cells, the families it covers; the refused families."""

    rows: list[tuple[Row, str, list[Cell]]]
    members: dict[str, list[str]]
    refused: list[tuple[str, str, str]]
    matrix_size: int


def compute(matrix_text: str | None = None) -> Chooser:
    """Every cell, checked against the support matrix.

    Raises:
        ValueError: a cell calls a method exact that the matrix does not show exact, a family fits no row
            or several, or a family the matrix shows refused is not refused here.
    """
    from tests.family_matrix import FAMILIES

    matrix = read_matrix(matrix_text if matrix_text is not None else MATRIX_PATH.read_text())
    refused = refused_families(matrix)
    refused_names = {f for f, _, _ in refused}
    members: dict[str, list[str]] = {row.family: [] for row in ROWS}
    problems = []
    for fam in FAMILIES:
        if fam.name in refused_names:
            continue
        rows = [row for row in ROWS if row.covers(_tags(fam.kinds))]
        if len(rows) != 1:
            problems.append(f"{fam.name} ({fam.kinds}) fits {len(rows)} rows of the chooser: {[r.kind for r in rows]}")
        else:
            members[rows[0].family].append(fam.name)
    rows = []
    for row in ROWS:
        profile, shape = row_profile(row)
        cells = [compute_cell(profile, cp, packed) for _, cp, packed in CELLS]
        problems += check_against_matrix(row, cells, matrix)
        rows.append((row, shape, cells))
    if problems:
        raise ValueError("the chooser disagrees with the support matrix or its rows:\n  " + "\n  ".join(problems))
    return Chooser(rows, members, refused, len(matrix))


def render_section(chooser: Chooser | None = None) -> str:
    """The text between the markers of docs/choosing.md (``chooser``: :func:`compute`'s, else computed now)."""
    c = chooser if chooser is not None else compute()
    members, refused = c.members, c.refused
    head = "| model kind | representative (attention, heads) | " + " | ".join(t for t, _, _ in CELLS) + " |"
    lines = [head, "|---|---|" + "---|" * len(CELLS)]
    why = []
    for row, shape, cells in c.rows:
        texts = [f"**{cell.pick}**<br>exact: {', '.join(cell.exact)}" for cell in cells]
        lines.append(f"| {row.kind} | `{_model_type(row.family)}` ({shape}) | " + " | ".join(texts) + " |")
        covered = members[row.family]
        why.append(f"- **{row.kind}**, `{_model_type(row.family)}`"
                   + (f" (this row covers {len(covered)} families: {', '.join(covered)})" if covered else ""))  # fmt: skip
        not_exact: dict[tuple[str, str], list[str]] = {}
        for (title, _, _), cell in zip(CELLS, cells):
            others = ", ".join(f"{label} {_mib(cost)}" for label, cost in cell.costs[1:4])
            why.append(f"  - {title}: **{cell.pick}** sends {_mib(cell.costs[0][1])} ({cell.what})"
                       + (f"; next: {others}" if others else ""))  # fmt: skip
            for method, reason in cell.refused.items():
                not_exact.setdefault((method, reason), []).append(title)
        for (method, reason), where in not_exact.items():
            cells_text = _which_cells(where)
            why.append(f"  - not exact: **{method}** ({cells_text}): {reason}")
    out = [
        f"<!-- generated by {REGENERATE}; do not edit by hand -->",
        "",
        f"Rows of {SEQ} tokens, {GPUS_PER_NODE} GPUs per node, `tp_size` 1. Each cell: **what `auto` picks**, then "
        "every method that computes the model exactly there.",
        "",
        *lines,
        "",
        "Why each cell (bytes one rank sends per attention layer, bf16, a byte across nodes counted "
        "8 times; the cheapest exact method wins):",
        "",
        *why,
        "",
        f"**Refused families** ({len(refused)} of the support matrix's {c.matrix_size}): every method refuses "
        "them, `auto` too; train them with `distributed.cp_size=1`.",
        "",
        "| family | layer kinds | why no method computes it |",
        "|---|---|---|",
        *[f"| `{f}` | {kinds} | {reason} |" for f, kinds, reason in refused],
    ]
    return "\n".join(out)


def replace_section(doc: str, section: str) -> str:
    start, end = doc.index(START) + len(START), doc.index(END)
    return doc[:start] + "\n" + section + "\n" + doc[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file's table is stale")
    args = parser.parse_args(argv)
    try:
        section = render_section(compute())
    except ValueError as err:
        print(err)
        return 1
    doc = DOC_PATH.read_text()
    new = replace_section(doc, section)
    if args.check:
        if new != doc:
            print(f"{DOC_PATH} is out of date; regenerate it with: {REGENERATE}")
            return 1
        print(f"{DOC_PATH} is up to date")
        return 0
    DOC_PATH.write_text(new)
    print(f"wrote {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
