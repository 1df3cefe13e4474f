"""The package's layering holds: imports point down, and no modules import each other.

Layers, lowest first (the design's "Layout": dependencies point downward):

    errors < distributed < data < config < models < training < recipes < cli

``automodel/errors.py`` is ``errors``; ``automodel/cli.py`` (the console command, which launches the
recipes) is ``cli``; ``automodel/<layer>/**`` is ``<layer>``; ``recipes/**`` is
``recipes``; the root ``automodel/__init__.py`` sits with ``errors`` at the bottom (it may import
nothing above it). A module outside these is itself a failure: place it in a layer first.

What counts as an import (pure ``ast``, nothing is imported, so this test needs no torch):

* every ``import`` / ``from ... import`` statement anywhere in the file: at module level, inside
  functions and methods (lazy imports), inside ``try``, and inside ``if TYPE_CHECKING:``. The rule is
  "no import upward, not even a lazy one", and a type-checking-only import still ties the lower
  layer to the higher one's names (and is one edit away from a runtime import), so it counts;
* relative imports, resolved against the importing module's package;
* ``from pkg import name`` is an import of the submodule ``pkg.name`` when that file exists, else an
  import of ``pkg`` itself (its ``__init__``);
* ``importlib.import_module(X)`` / ``import_module(X)`` / ``__import__(X)`` where ``X`` is a string
  literal or a module-level string constant (``package=`` honoured for relative names);
* any string literal of the form ``"automodel.x.y:fn"`` (or ``"recipes.x:fn"``): the library's
  lazy "module:function" dispatch, i.e. a lazy import in disguise.

Not counted: plain dotted strings that are not passed to an import function (logger names,
``importlib.resources.files("automodel.data")``) and the values of ``_target_`` config nodes (e.g.
the schema's default ``lr_scheduler._target_``): those are user configuration, the same text a YAML
file holds, resolved by Hydra for whatever target the user names.

Package ``__init__`` rule. Python runs a package's ``__init__`` before any of its submodules, but a
partially initialised package in ``sys.modules`` never breaks ``import pkg.sub`` or
``from pkg import sub``; only ``from pkg import name`` (a name the ``__init__`` defines or
re-exports) reads the half-built package. So the implicit "importing ``pkg.sub`` runs ``pkg``" is
*not* an edge, while each explicit import is an edge to the module it names (see the submodule rule
above). Hence an ``__init__`` may re-export its submodules (edge ``pkg -> pkg.sub``), and a submodule
importing a *name* from its own package's ``__init__`` (edge ``pkg.sub -> pkg``) forms a cycle and
fails: import the name from the submodule that defines it.

Checks: (a) no edge goes to a higher layer; (b) the module graph has no cycle (strongly connected
components of size > 1; a module naming itself is ignored); (c) every in-project import resolves to
a file, so a stale lazy import or dispatch string fails here instead of at run time.

Inside ``distributed`` (issue 31, "One CP engine"), the CP method packages
``automodel.distributed.cp.{ring,ulysses,thd,thd_docs,usp}`` (a package or, until it moves, a module of
that name) are leaves that the shared machinery never reaches:

* (d) no method package imports another one;
* (e) ``automodel.distributed.sp``, ``.multimodal`` and ``.pipeline`` import no method package;
* (f) no shared CP module (anything under ``automodel/distributed/cp/`` outside the five method
  packages) imports a method package, except the modules that register the built-in methods
  (``cp/__init__.py``, ``cp/registry.py``) and the own-loop entry point ``cp/context.py``.

An edge to a re-export module (``tests/test_reexports.py``'s ``REEXPORT_MODULES``) counts as an edge to
what it re-exports, so a stable old path (``cp_utils``, ``ulysses``, ...) is no back door.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("automodel", "recipes")
LAYERS = ("errors", "distributed", "data", "config", "models", "training", "recipes", "cli")
RANK = {name: i for i, name in enumerate(LAYERS)}

_DISPATCH_STRING = re.compile(r"((?:automodel|recipes)(?:\.\w+)*):\w+(?:\.\w+)*")
_IMPORT_FUNCS = {"import_module", "__import__"}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    where: str  # "path:line"
    how: str  # "import", "lazy import", "TYPE_CHECKING import", "import_module", "dispatch string"

    def describe(self) -> str:
        return f"{self.src} -> {self.dst}  [{self.how} at {self.where}]"


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py under the project's packages (``__init__`` -> package)."""
    modules: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "recipes":
        return "recipes"
    if parts == ["automodel"]:
        return "errors"  # the root package: the bottom, it may import nothing above errors
    if len(parts) >= 2 and parts[1] in RANK and parts[1] != "recipes":
        return parts[1]
    return None


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_relative(name: str, level: int, package: str) -> str:
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _raw_imports(tree: ast.Module, module: str, package: str) -> Iterator[tuple[str, str | None, int, str]]:
    """(imported module, imported name or None, line, how) for every import in ``tree``."""
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def string_of(node: ast.expr | None) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    def walk(node: ast.AST, how: str) -> Iterator[tuple[str, str | None, int, str]]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno, how
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(node.module or "", node.level, package) if node.level else node.module
            for alias in node.names:
                yield base or "", (None if alias.name == "*" else alias.name), node.lineno, how
        elif isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if fname in _IMPORT_FUNCS and node.args:
                target = string_of(node.args[0])
                if target:
                    pkg_kw = next((k.value for k in node.keywords if k.arg == "package"), None)
                    if target.startswith("."):
                        level = len(target) - len(target.lstrip("."))
                        target = _resolve_relative(target.lstrip("."), level, string_of(pkg_kw) or package)
                    yield target, None, node.lineno, "import_module"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _DISPATCH_STRING.fullmatch(node.value)
            if m:
                yield m.group(1), None, node.lineno, "dispatch string"

        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and how == "import":
            how = "lazy import"
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from walk(node.test, how)
            for child in node.body:
                yield from walk(child, "TYPE_CHECKING import")
            for child in node.orelse:
                yield from walk(child, how)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, how)

    yield from walk(tree, "import")


def import_graph(root: Path = ROOT) -> tuple[dict[str, Path], list[Edge], list[Edge]]:
    """(modules, edges between project modules, in-project imports that resolve to no file)."""
    modules = find_modules(root)
    edges: list[Edge] = []
    unresolved: list[Edge] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for target, name, line, how in _raw_imports(tree, module, _package_of(module, path)):
            if target.split(".")[0] not in PACKAGES:
                continue
            where = f"{rel}:{line}"
            if name is not None and f"{target}.{name}" in modules:
                target = f"{target}.{name}"  # from pkg import submodule
            if target not in modules:
                unresolved.append(Edge(module, target, where, how))
                continue
            if target != module:
                edges.append(Edge(module, target, where, how))
    # one edge per (importer, imported, line): ``from m import a, b`` is one import of m
    return modules, list(dict.fromkeys(edges)), list(dict.fromkeys(unresolved))


def upward_imports(edges: list[Edge]) -> list[str]:
    out = []
    for e in edges:
        a, b = layer_of(e.src), layer_of(e.dst)
        if a is not None and b is not None and RANK[b] > RANK[a]:
            out.append(f"{e.src} -> {e.dst} (layer {a} < layer {b})  [{e.how} at {e.where}]")
    return out


def strongly_connected(nodes: list[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); components in discovery order, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(succ.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    components.append(sorted(comp))
    return components


def _shortest_cycle(start: str, members: set[str], succ: dict[str, list[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in succ.get(node, ()):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt in members and nxt not in seen:
                    seen.add(nxt)
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return [start]


def import_cycles(modules: dict[str, Path], edges: list[Edge]) -> list[str]:
    succ: dict[str, list[str]] = {}
    by_pair: dict[tuple[str, str], Edge] = {}
    for e in edges:
        if (e.src, e.dst) not in by_pair:
            by_pair[(e.src, e.dst)] = e
            succ.setdefault(e.src, []).append(e.dst)
    out = []
    for comp in strongly_connected(sorted(modules), succ):
        if len(comp) < 2:
            continue
        members = set(comp)
        cycle = _shortest_cycle(comp[0], members, succ)
        lines = [f"cycle among {len(comp)} modules: {', '.join(comp)}", "  e.g. " + " -> ".join(cycle)]
        lines += ["    " + by_pair[(a, b)].describe() for a in comp for b in succ.get(a, ()) if b in members]
        out.append("\n".join(lines))
    return out


# ---------------------------------------------------------------------------------------------
# CP method packages (issue 31): leaves that the shared machinery never reaches

CP = "automodel.distributed.cp"
METHOD_PACKAGES = ("ring", "ulysses", "thd", "thd_docs", "usp")
#: packages outside cp/ that must not import a method package
METHOD_FREE_PACKAGES = ("automodel.distributed.sp", "automodel.distributed.multimodal", "automodel.distributed.pipeline")
#: shared cp modules that may import the method packages: the registration of the built-ins and the
#: own-loop entry point (``context_parallel(model, mesh, method=...)``)
REGISTRATION_MODULES = (CP, f"{CP}.registry", f"{CP}.context")

# Edges between method packages that are tolerated, (importer, imported): none since issue 31 (usp
# composes the shared pieces instead of subclassing thd's method).
ALLOWED_METHOD_EDGES: frozenset[tuple[str, str]] = frozenset()


def method_of(module: str) -> str | None:
    """The method package ``module`` belongs to (``cp.ring`` or ``cp.ring.batch`` -> ``"ring"``), else None."""
    for name in METHOD_PACKAGES:
        base = f"{CP}.{name}"
        if module == base or module.startswith(base + "."):
            return name
    return None


def _in_package(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _reexport_modules() -> tuple[str, ...]:
    from tests.test_reexports import REEXPORT_MODULES

    return REEXPORT_MODULES


def methods_reached(module: str, edges: list[Edge], reexports: tuple[str, ...]) -> set[str]:
    """The method packages an import of ``module`` reaches: its own, or through re-export modules."""
    succ: dict[str, set[str]] = {}
    for e in edges:
        succ.setdefault(e.src, set()).add(e.dst)
    found, seen, todo = set(), {module}, [module]
    while todo:
        m = todo.pop()
        if method_of(m):
            found.add(method_of(m))
        elif m in reexports:
            todo.extend(n for n in succ.get(m, ()) if n not in seen)
            seen.update(succ.get(m, ()))
    return found


def method_cross_imports(
    edges: list[Edge], allowed: frozenset[tuple[str, str]] = ALLOWED_METHOD_EDGES
) -> list[str]:
    """Edges from one method package into another (rule d), except the allow-listed ones."""
    return [
        f"{e.describe()}: method package {method_of(e.src)!r} imports method package {method_of(e.dst)!r}"
        for e in edges
        if method_of(e.src) and method_of(e.dst) and method_of(e.src) != method_of(e.dst)
        and (e.src, e.dst) not in allowed
    ]


def shared_imports_of_methods(edges: list[Edge], reexports: tuple[str, ...]) -> list[str]:
    """Edges from sp/, multimodal/, pipeline/ (rule e) or a shared cp module (rule f) to a method package."""
    out = []
    for e in edges:
        if e.src in reexports:
            continue  # a stable old path that only re-exports a method package's names (no logic)
        if _in_package(e.src, METHOD_FREE_PACKAGES):
            what = "sp/multimodal/pipeline"
        elif _in_package(e.src, (CP,)) and not method_of(e.src) and e.src not in REGISTRATION_MODULES:
            what = "shared cp module"
        else:
            continue
        reached = methods_reached(e.dst, edges, reexports)
        if reached:
            out.append(f"{e.describe()}: {what} {e.src} reaches method package(s) {sorted(reached)}")
    return out


# ---------------------------------------------------------------------------------------------
# the checks on this repository


def test_every_module_has_a_layer():
    orphans = sorted(m for m in find_modules() if layer_of(m) is None)
    if orphans:
        pytest.fail("modules outside every layer (move them into one): " + ", ".join(orphans), pytrace=False)


def test_no_upward_imports():
    _, edges, _ = import_graph()
    bad = upward_imports(edges)
    if bad:
        pytest.fail(
            f"{len(bad)} import(s) point to a higher layer ({' < '.join(LAYERS)}); move the code down or "
            "invert the call:\n  " + "\n  ".join(bad),
            pytrace=False,
        )


def test_no_import_cycles():
    modules, edges, _ = import_graph()
    cycles = import_cycles(modules, edges)
    if cycles:
        pytest.fail(f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles), pytrace=False)


def test_project_imports_resolve():
    _, _, unresolved = import_graph()
    if unresolved:
        pytest.fail(
            "imports of project modules that do not exist:\n  "
            + "\n  ".join(e.describe() for e in unresolved),
            pytrace=False,
        )


def test_method_packages_do_not_import_each_other():
    _, edges, _ = import_graph()
    bad = method_cross_imports(edges)
    if bad:
        pytest.fail(
            "CP method packages import each other; put the shared piece in cp/ (outside the method "
            "packages) and import it from there:\n  " + "\n  ".join(bad),
            pytrace=False,
        )


def test_shared_machinery_imports_no_method_package():
    _, edges, _ = import_graph()
    bad = shared_imports_of_methods(edges, _reexport_modules())
    if bad:
        pytest.fail(
            "the shared machinery (sp/, multimodal/, pipeline/, cp/ outside the method packages) imports "
            "a CP method package; move what it needs into the shared part:\n  " + "\n  ".join(bad),
            pytrace=False,
        )


# ---------------------------------------------------------------------------------------------
# the checker itself, on a synthetic tree


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checker_sees_every_kind_of_import(tmp_path):
    _write(
        tmp_path,
        {
            "automodel/__init__.py": "",
            "automodel/errors.py": "",
            "automodel/distributed/__init__.py": "from automodel.distributed.a import f\n",
            "automodel/distributed/a.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from automodel.models.m import M\n"
                "def f():\n    import automodel.training.t\n"
                "X = 'automodel.recipes_not_a_layer'\n"
            ),
            "automodel/distributed/b.py": (
                "import importlib\n"
                "_MOD = 'automodel.data.d'\n"
                "def g():\n    return importlib.import_module(_MOD)\n"
                "FN = 'automodel.config.c:build'\n"
            ),
            "automodel/distributed/c.py": "from . import a\nfrom .b import g\nfrom automodel.distributed import f\n",
            "automodel/data/d.py": "from ..distributed import missing_mod\n",
            "automodel/config/c.py": "from automodel.nowhere import x\n",
            "automodel/models/m.py": "",
            "automodel/training/t.py": "",
            "recipes/r.py": "from automodel.training import t\n",
        },
    )
    modules, edges, unresolved = import_graph(tmp_path)
    got = {(e.src, e.dst, e.how) for e in edges}
    assert ("automodel.distributed.a", "automodel.models.m", "TYPE_CHECKING import") in got
    assert ("automodel.distributed.a", "automodel.training.t", "lazy import") in got
    assert ("automodel.distributed.b", "automodel.data.d", "import_module") in got
    assert ("automodel.distributed.b", "automodel.config.c", "dispatch string") in got
    assert ("automodel.distributed.c", "automodel.distributed.a", "import") in got  # from . import a
    assert ("automodel.distributed.c", "automodel.distributed.b", "import") in got  # from .b import g
    assert ("automodel.distributed.c", "automodel.distributed", "import") in got  # a name, not a module
    assert ("automodel.data.d", "automodel.distributed", "import") in got  # relative, up two levels
    assert ("recipes.r", "automodel.training.t", "import") in got  # from pkg import submodule
    assert {e.dst for e in unresolved} == {"automodel.nowhere"}

    up = upward_imports(edges)
    assert len(up) == 4, up  # a -> models, a -> training, b -> data, b -> config
    assert any(
        "automodel.distributed.a -> automodel.models.m (layer distributed < layer models)" in u for u in up
    )

    # the package __init__ re-exports a.f (edge init -> a), c imports f from the package (c -> init)
    # and a from the submodule: no cycle. Make a import the package's name back: a cycle.
    assert import_cycles(modules, edges) == []
    (tmp_path / "automodel/distributed/a.py").write_text("from automodel.distributed import f\n")
    modules, edges, _ = import_graph(tmp_path)
    (cycle,) = import_cycles(modules, edges)
    assert "automodel.distributed, automodel.distributed.a" in cycle, cycle



def test_cp_package_rules_fire(tmp_path):
    """Each CP package rule finds its violation in a synthetic tree, and passes the allowed imports."""
    _write(
        tmp_path,
        {
            "automodel/__init__.py": "",
            "automodel/distributed/__init__.py": "",
            # registration may import every method package
            "automodel/distributed/cp/__init__.py": "from automodel.distributed.cp.ring import RingMethod\n",
            "automodel/distributed/cp/registry.py": "from automodel.distributed.cp.usp import method\n",
            "automodel/distributed/cp/context.py": "import automodel.distributed.cp.thd\n",
            "automodel/distributed/cp/layout.py": "",
            "automodel/distributed/cp/ring/__init__.py": "from automodel.distributed.cp.ring.method import RingMethod\n",
            # (d) a package imports a not-yet-package module, and a module imports a package
            "automodel/distributed/cp/ring/method.py": (
                "from automodel.distributed.cp.layout import x\nfrom automodel.distributed.cp import ulysses\n"
                "RingMethod = 1\n"
            ),
            "automodel/distributed/cp/ulysses.py": "from automodel.distributed.cp.ring.method import RingMethod\n",
            "automodel/distributed/cp/thd.py": "",
            "automodel/distributed/cp/thd_docs/__init__.py": "",
            "automodel/distributed/cp/usp/__init__.py": "",
            "automodel/distributed/cp/usp/method.py": "from automodel.distributed.cp import thd\n",
            # (f) a shared cp module imports a method package, lazily
            "automodel/distributed/cp/group.py": "def f():\n    from automodel.distributed.cp.thd_docs import p\n",
            # (e) sp imports a method package directly, multimodal through a re-export module
            "automodel/distributed/sp/__init__.py": "",
            "automodel/distributed/sp/split.py": "from automodel.distributed.cp.layout import x\n",
            "automodel/distributed/sp/bad.py": "from automodel.distributed.cp.ring.method import RingMethod\n",
            "automodel/distributed/old_ring.py": "from automodel.distributed.cp.ring.method import *\n",
            "automodel/distributed/multimodal/cp.py": "from automodel.distributed.old_ring import RingMethod\n",
            "automodel/distributed/pipeline/bridge.py": "from automodel.distributed.sp.split import y\n",
        },
    )
    _, edges, _ = import_graph(tmp_path)

    cross = method_cross_imports(edges, allowed=frozenset())
    assert len(cross) == 3, cross
    assert any("cp.ring.method -> automodel.distributed.cp.ulysses " in c for c in cross), cross
    assert any("cp.ulysses -> automodel.distributed.cp.ring.method " in c for c in cross), cross
    assert any("cp.usp.method -> automodel.distributed.cp.thd " in c for c in cross), cross
    allowed = frozenset({("automodel.distributed.cp.usp.method", "automodel.distributed.cp.thd")})
    assert len(method_cross_imports(edges, allowed=allowed)) == 2

    shared = shared_imports_of_methods(edges, reexports=("automodel.distributed.old_ring",))
    assert len(shared) == 3, shared
    assert any(s.startswith("automodel.distributed.sp.bad -> ") and "['ring']" in s for s in shared), shared
    assert any(s.startswith("automodel.distributed.multimodal.cp -> automodel.distributed.old_ring") for s in shared)
    assert any(s.startswith("automodel.distributed.cp.group -> ") and "['thd_docs']" in s for s in shared), shared
    # without the re-export list, the old path is a plain module: only the direct imports count
    assert len(shared_imports_of_methods(edges, reexports=())) == 2
