"""The stable public import paths are re-export modules, and they are the only ones.

docs/seed_api.md holds one table of the import paths that stay where they are (NeMo AutoModel's
``cp_utils`` / ``thd_utils`` and the four seed APIs); everything else is imported from the module where
its code lives. Each listed module re-exports its home's ``__all__`` and defines nothing itself: no
function, no class, no statement but imports, ``__all__``, a docstring and plain name aliases. No
other module of ``automodel/distributed/`` is a re-export (a package ``__init__`` may re-export its own
submodules: that is the package's face, not a second room), and the library imports none of them.

Pure ``ast`` for the structure, plus an import of each module to show the names resolve.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SEED_API = ROOT / "docs" / "seed_api.md"
_ROW = re.compile(r"^\| `(automodel(?:\.\w+)+)` \|[^|]*\| `(automodel(?:\.\w+)+)` \|([^|]*)\|\s*$")


def stable_paths(text: str) -> list[tuple[str, str, list[str]]]:
    """``(import path, home module, [names])`` for every row of the "Stable import paths" table."""
    section = text.split("## Stable import paths", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = _ROW.match(line)
        if m:
            rows.append((m.group(1), m.group(2), re.findall(r"`(\w+)`", m.group(3))))
    return rows


STABLE = stable_paths(SEED_API.read_text(encoding="utf-8"))
REEXPORT_MODULES: tuple[str, ...] = tuple(path for path, _, _ in STABLE)


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


def test_the_table_is_read() -> None:
    """The table parser is not vacuous: the mission's ``cp_utils`` and the four seed APIs are rows."""
    assert set(REEXPORT_MODULES) >= {
        "automodel.distributed.cp_utils",
        "automodel.distributed.sp_sharding",
        "automodel.distributed.sp_communication",
        "automodel.distributed.multimodal_cp",
        "automodel.distributed.multimodule_pipeline",
    }, REEXPORT_MODULES
    assert len(set(REEXPORT_MODULES)) == len(REEXPORT_MODULES), REEXPORT_MODULES
    assert "make_cp_batch_and_ctx" in {p: n for p, _, n in STABLE}["automodel.distributed.cp_utils"]
    assert all(names for _, _, names in STABLE), STABLE


@pytest.mark.parametrize(("module", "home", "names"), STABLE, ids=[p for p, _, _ in STABLE])
def test_stable_path_exposes_the_listed_names_of_its_home(module: str, home: str, names: list[str]) -> None:
    mod, src = importlib.import_module(module), importlib.import_module(home)
    assert set(mod.__all__) == set(src.__all__), f"{module} must re-export every name of {home}.__all__"
    for name in names:
        assert name in mod.__all__, f"docs/seed_api.md lists {module}.{name}, which is not in its __all__"
        assert getattr(mod, name) is getattr(src, name), f"{module}.{name} is not {home}.{name}"


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


def _reexports_only(tree: ast.Module) -> bool:
    """True for a module that imports something and holds nothing but imports, ``__all__`` and aliases."""
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body) and not _logic(tree)


def _imports_only_its_own_package(package: str, tree: ast.Module) -> bool:
    """True when every import of a package's ``__init__`` is of that package's own submodules."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            continue  # from .x import y
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(package + "."):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return False
    return True


def reexport_modules_found(root: Path, package_dir: str = "automodel/distributed") -> list[str]:
    """Every re-export module under ``package_dir`` (a package ``__init__`` of its own submodules is not one)."""
    found = []
    for path in sorted((root / package_dir).rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(), str(path))
        if not _reexports_only(tree):
            continue
        if path.name == "__init__.py" and _imports_only_its_own_package(module, tree):
            continue
        found.append(module)
    return found


def test_no_reexport_module_but_the_listed_ones() -> None:
    """A module that only re-exports code living elsewhere is a room without code: only the table's stay."""
    found = reexport_modules_found(ROOT)
    extra = sorted(set(found) - set(REEXPORT_MODULES))
    assert not extra, (
        "re-export modules that docs/seed_api.md's table of stable import paths does not list (import the "
        f"names from their home instead and remove the module): {extra}"
    )
    assert sorted(found) == sorted(REEXPORT_MODULES), (found, REEXPORT_MODULES)


def test_the_reexport_scan_finds_one(tmp_path: Path) -> None:
    """The scan is not vacuous: a flat re-export and a package ``__init__`` re-exporting another package are
    found; a package ``__init__`` of its own submodules, a docstring-only one and a module with code are not."""
    pkg = tmp_path / "automodel" / "distributed"
    (pkg / "own").mkdir(parents=True)
    (pkg / "other").mkdir()
    (pkg / "flat.py").write_text('"""Moved."""\nfrom automodel.distributed.own.a import f\n__all__ = ["f"]\n')
    (pkg / "code.py").write_text("from automodel.distributed.own.a import f\n\ndef g():\n    return f\n")
    (pkg / "__init__.py").write_text('"""Docstring only."""\n')
    (pkg / "own" / "__init__.py").write_text("from automodel.distributed.own.a import f\nfrom .b import g\n")
    (pkg / "other" / "__init__.py").write_text("from automodel.distributed.own.a import f\n")
    assert reexport_modules_found(tmp_path) == ["automodel.distributed.flat", "automodel.distributed.other"]
