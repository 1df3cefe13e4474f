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
    "automodel.distributed.all_to_all",
    "automodel.distributed.cp.doc_placement",
    "automodel.distributed.cp.gated_deltanet",
    "automodel.distributed.cp.kernels",
    "automodel.distributed.cp.kernels.halo",
    "automodel.distributed.cp.kernels.masked_attention",
    "automodel.distributed.cp.kernels.ring_layers",
    "automodel.distributed.cp.kernels.strategy",
    "automodel.distributed.cp.kernels.token_layout",
    "automodel.distributed.cp.linear_mixer",
    "automodel.distributed.cp.linear_support",
    "automodel.distributed.cp_subgroups",
    "automodel.distributed.cp_utils",
    "automodel.distributed.cpu_ring",
    "automodel.distributed.doc_attention",
    "automodel.distributed.doc_block_attention",
    "automodel.distributed.hf_causal_mask",
    "automodel.distributed.multimodal_comm",
    "automodel.distributed.multimodal_cp",
    "automodel.distributed.multimodal_dynamic_res",
    "automodel.distributed.multimodal_megatron_split",
    "automodel.distributed.multimodule_pipeline",
    "automodel.distributed.padding",
    "automodel.distributed.sp_communication",
    "automodel.distributed.sp_hybrid",
    "automodel.distributed.sp_sharding",
    "automodel.distributed.sp_split_gather",
    "automodel.distributed.te_batch",
    "automodel.distributed.thd_attention",
    "automodel.distributed.thd_utils",
    "automodel.distributed.ulysses",
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


def _imported_modules(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in ``tree`` (``from a import b``: ``a`` and ``a.b``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_the_library_imports_new_homes_not_reexport_modules() -> None:
    """The stable paths are for users: the library and the recipes import a moved module from its home."""
    stale = set(REEXPORT_MODULES)
    bad = []
    for pkg in ("automodel", "recipes"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if module in stale:
                continue
            tree = ast.parse(path.read_text(), str(path))
            bad += [f"{path.relative_to(ROOT)}:{line} imports {m}" for line, m in _imported_modules(tree) if m in stale]
    assert not bad, "import these from their new home instead:\n  " + "\n  ".join(bad)


def test_the_import_scan_sees_every_form() -> None:
    src = "import a.b\nfrom c import d\ndef f():\n    from e.f import g\n"
    assert {m for _, m in _imported_modules(ast.parse(src))} == {"a.b", "c", "c.d", "e.f", "e.f.g"}
