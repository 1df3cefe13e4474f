"""Every documented import path keeps working (issue 31: code moved into packages, old paths re-export).

The import statements of README.md, docs/*.md and examples/*.py (``from automodel... import ...`` and
``import automodel...``, parenthesised ones over several lines included) are run, one after the other,
in this one process; each must import and bind every name it lists. The dotted ``automodel.x.y``
paths the prose names in backticks, alone or called (``automodel.distributed.sp.all_to_all``,
``automodel.distributed.multimodule_pipeline.MultiModulePipelineCommunicator``) must resolve too.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_START = re.compile(r"^\s*(?:>>> |\.\.\. )?((?:from|import)\s+automodel\b.*)$")
_BACKTICKED_PATH = re.compile(r"`(automodel(?:\.\w+)+)[`(]")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _examples() -> list[Path]:
    return sorted((ROOT / "examples").glob("*.py"))


def markdown_imports(text: str) -> list[tuple[int, str]]:
    """``(line, statement)`` for every import of ``automodel`` in a markdown text (code or prose).

    A parenthesised import continues until its parentheses close; inline code stops at its backtick.
    """
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = _IMPORT_START.match(lines[i]) or re.search(r"`((?:from|import)\s+automodel\b[^`]*)`", lines[i])
        if not m:
            i += 1
            continue
        stmt, start = m.group(1).split("#")[0].rstrip(), i + 1
        while stmt.count("(") > stmt.count(")") and i + 1 < len(lines):
            i += 1
            stmt += "\n" + lines[i].split("#")[0].rstrip()
        out.append((start, stmt))
        i += 1
    return out


def python_imports(text: str) -> list[tuple[int, str]]:
    """``(line, statement)`` for every import of ``automodel`` in a Python file, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "automodel":
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "automodel" for a in node.names):
            out.append((node.lineno, ast.unparse(node)))
    return out


def documented_imports() -> list[tuple[str, str]]:
    """``(where, statement)`` for every import of ``automodel`` the README, docs and examples show."""
    found = []
    for path in _documents():
        for line, stmt in markdown_imports(path.read_text(encoding="utf-8")):
            found.append((f"{path.relative_to(ROOT)}:{line}", stmt))
    for path in _examples():
        for line, stmt in python_imports(path.read_text(encoding="utf-8")):
            found.append((f"{path.relative_to(ROOT)}:{line}", stmt))
    return found


def documented_paths() -> list[tuple[str, str]]:
    """``(where, dotted path)`` for every backticked ``automodel.x.y`` path in the README and docs."""
    found = []
    for path in _documents():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found += [(f"{path.relative_to(ROOT)}:{n}", p) for p in _BACKTICKED_PATH.findall(line)]
    return found


def resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted`` and read the rest as attributes (AttributeError,
    ImportError otherwise)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is None or not ".".join(parts[:cut]).startswith(e.name):
                raise  # the module exists but imports something missing: a real failure
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module on the path {dotted}")


def test_documented_imports_work():
    statements = documented_imports()
    assert len(statements) >= 20, statements  # the README alone shows a dozen
    failures = []
    for where, stmt in statements:
        try:
            exec(compile(stmt, where, "exec"), {})  # the documented statement, as a user runs it
        except Exception as e:  # report every failure at once
            failures.append(f"{where}: {stmt!r}: {type(e).__name__}: {e}")
    assert not failures, "documented imports that fail:\n  " + "\n  ".join(failures)


def test_documented_paths_resolve():
    paths = documented_paths()
    assert any(p == "automodel.distributed.sp.all_to_all" for _, p in paths), paths
    failures = []
    for where, dotted in paths:
        try:
            resolve(dotted)
        except Exception as e:  # report every failure at once
            failures.append(f"{where}: {dotted}: {type(e).__name__}: {e}")
    assert not failures, "documented paths that do not resolve:\n  " + "\n  ".join(failures)


def test_extraction_finds_every_form():
    """The extractor is not vacuous: code lines, doctest prompts, inline code, several lines, lazy imports."""
    md = (
        "```python\n"
        "from automodel.a import b, c  # comment\n"
        "import automodel.x.y\n"
        ">>> from automodel.d import e\n"
        "from automodel.f import (\n"
        "    g,\n"
        "    h,\n"
        ")\n"
        "```\n"
        "Prose with `from automodel.i import j` inline, and not from automodelx import k.\n"
    )
    assert markdown_imports(md) == [
        (2, "from automodel.a import b, c"),
        (3, "import automodel.x.y"),
        (4, "from automodel.d import e"),
        (5, "from automodel.f import (\n    g,\n    h,\n)"),
        (10, "from automodel.i import j"),
    ]
    py = "import os\nfrom automodel.a import b\n\ndef f():\n    import automodel.c as d\n    from . import x\n"
    assert python_imports(py) == [(2, "from automodel.a import b"), (5, "import automodel.c as d")]
    with pytest.raises(ImportError):
        exec("from automodel.distributed import no_such_module_here", {})
    with pytest.raises(AttributeError):
        resolve("automodel.distributed.mesh.no_such_name")
