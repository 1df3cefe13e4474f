#!/usr/bin/env python
"""Run the CP family x method matrix and write docs/support_matrix.md.

Launches tests/workers/family_matrix_worker.py on 4 local gloo ranks (CPU), the same run as
tests/test_family_matrix.py: every row of tests/family_matrix.py (transformers' default config of each family
scaled down in sizes only, keeping its layer pattern, plus a ``<family>@flagship`` row where the released
flagship's pattern differs), each CP method (ring, ulysses, thd,
thd_docs at cp=2; usp at cp=4 = 2 x 2, and Ulysses again at cp=4) against one process, on one document per row and on packed rows
(three documents against each alone, every method that takes them), and the method ``cp_method: auto``
picks. Writes the table with the counts per column and exits 1 when any cell is wrong or crashes
(printing those cells); 0 when every cell is exact or refused.

    PYTHONPATH=. python scripts/support_table.py                  # rewrite docs/support_matrix.md
    PYTHONPATH=. python scripts/support_table.py --check          # only compare the table with the file
    PYTHONPATH=. python scripts/support_table.py --families llama,mistral --out /tmp/m.md --traceback
    PYTHONPATH=. python scripts/support_table.py --json /tmp/m.json               # also keep the raw result
    PYTHONPATH=. python scripts/support_table.py --families hy_v4,lfm3 --merge /tmp/m.json  # rerun rows, keep the rest

``--merge`` reruns only ``--families`` and takes every other row from a result that ``--json`` saved (rows in the
order of tests/family_matrix.py; the saved result must have the same columns and must come from the same
transformers release, which is checked). The merged result is written back to that file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist_harness import run_distributed  # noqa: E402
from tests.family_matrix import (  # noqa: E402
    DOC_PATH,
    REGENERATE,
    TABLE_END,
    TABLE_START,
    column_counts,
    failures,
    render_markdown,
    table_section,
)

WORKER = "tests.workers.family_matrix_worker:main"


def run_matrix(families: list[str] | None = None, timeout: float = 600.0) -> dict:
    """Rank 0's result of one launch of the matrix worker (4 gloo ranks: pairs at cp=2, then usp and Ulysses at
    cp=4)."""
    return run_distributed(WORKER, world_size=4, timeout=timeout, families=families)[0]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def merge_results(old: dict, new: dict) -> dict:
    """``old`` with the rows of ``new`` replacing (or adding) theirs, in the row order of tests/family_matrix.py.

    Raises:
        ValueError: the two results have different columns or come from different transformers releases.
    """
    from tests.family_matrix import FAMILIES

    if old.get("methods") != new.get("methods"):
        raise ValueError(f"--merge: the saved result has columns {old.get('methods')}, this run {new.get('methods')}; "
                         "rerun the whole matrix")
    if old.get("transformers") != new.get("transformers"):
        raise ValueError(f"--merge: the saved result is from transformers {old.get('transformers')}, this run from "
                         f"{new.get('transformers')}; rerun the whole matrix")
    merged = dict(old)
    cells = {**old["cells"], **new["cells"]}
    meta = {**old["meta"], **new["meta"]}
    order = [f.name for f in FAMILIES if f.name in cells]
    merged["cells"] = {name: cells[name] for name in order}
    merged["meta"] = {name: meta[name] for name in order}
    merged["seconds"] = old.get("seconds", 0.0) + new.get("seconds", 0.0)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / DOC_PATH), help="where to write the markdown")
    parser.add_argument("--families", default=None, help="comma-separated family names (default: all)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the launch is killed")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file's table is stale")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of every crashed cell")
    parser.add_argument("--json", default=None, help="also write the raw result (cells, meta, columns) here")
    parser.add_argument("--merge", default=None,
                        help="a --json result: rerun only --families and keep its other rows; written back")
    args = parser.parse_args(argv)

    families = args.families.split(",") if args.families else None
    if args.merge and not families:
        parser.error("--merge needs --families (the rows to rerun)")
    t0 = time.perf_counter()
    result = run_matrix(families, args.timeout)
    result["transformers"] = _transformers_version()
    if args.merge:
        result = merge_results(json.loads(Path(args.merge).read_text()), result)
        Path(args.merge).write_text(json.dumps(result, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, default=str))
    print(f"matrix: {len(result['cells'])} families x {len(result['methods'])} methods, worker "
          f"{result['seconds']:.1f} s, launch {time.perf_counter() - t0:.1f} s")
    for column, counts in column_counts(result).items():
        print(f"  {column:22s} " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    markdown = render_markdown(result)
    out = Path(args.out)
    if args.check:
        current = out.read_text() if out.exists() else ""
        has_table = TABLE_START in current and TABLE_END in current
        if not has_table or table_section(current) != table_section(markdown):
            print(f"{out} is out of date; regenerate it with: {REGENERATE}")
            return 1
        print(f"{out} is up to date")
    else:
        out.write_text(markdown)
        print(f"wrote {out}")
    bad = failures(result)
    for family, method, cell in bad:
        print(f"{cell['status'].upper():6s} {family} / {method}: {cell['detail']}")
        if args.traceback and cell.get("traceback"):
            print(cell["traceback"])
    if bad:
        print(f"{len(bad)} cells are wrong or crash (must be exact or refused)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
