"""Stable import paths that moved are re-export modules: they hold no logic.

Every documented import path (README, docs/, examples/, the seed names) keeps working after the code
moved into packages (``automodel/distributed/cp/<method>/``, ``sp/``, ``multimodal/``, ``pipeline/``).
The old modules re-export the names from their new home and define nothing themselves: no function,
no class, no statement but imports, ``__all__``, a docstring and plain name aliases.

Pure ``ast`` (nothing is imported), plus an import of each module to show the names resolve.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each entry: a stable path that now only re-exports. Add a module here when its code moves.
REEXPORT_MODULES: tuple[str, ...] = (
    "automodel.distributed.cp_subgroups",
    "automodel.distributed.doc_attention",
    "automodel.distributed.te_batch",
    "automodel.distributed.thd_attention",
    "automodel.distributed.thd_utils",
    "automodel.distributed.usp_attention",
)


def _path(module: str) -> Path:
    p = ROOT.joinpath(*module.split("."))
    return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")


def _logic(tree: ast.Module) -> list[str]:
    """The statements of a module that are more than imports, ``__all__``, a docstring and aliases."""
    bad = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            if isinstance(node.value, (ast.Name, ast.Attribute)):
                continue  # an alias: old_name = new_name
            if [t.id for t in node.targets] == ["__all__"] and isinstance(node.value, (ast.List, ast.Tuple)):
                continue
        bad.append(f"line {node.lineno}: {ast.dump(node)[:80]}")
    return bad


@pytest.mark.parametrize("module", list(REEXPORT_MODULES))
def test_reexport_module_holds_no_logic(module: str) -> None:
    path = _path(module)
    assert path.is_file(), f"{module}: no file at {path}"
    tree = ast.parse(path.read_text(), str(path))
    assert not _logic(tree), f"{module} must only re-export; it holds: {_logic(tree)}"
    mod = importlib.import_module(module)
    for name in getattr(mod, "__all__", []):
        assert hasattr(mod, name), f"{module}.__all__ names {name!r}, which it does not define"


def test_the_check_finds_logic() -> None:
    """The checker is not vacuous: a function, a class or a computed value is logic."""
    for src in ("def f():\n    pass\n", "class A:\n    pass\n", "X = 1 + 2\n", "if True:\n    import os\n"):
        assert _logic(ast.parse(src)), src
    assert not _logic(ast.parse('"""doc."""\nfrom a import b\nc = b\n__all__ = ["b", "c"]\n'))
