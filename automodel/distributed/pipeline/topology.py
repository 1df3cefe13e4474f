"""Module DAGs for multi-module pipelines: validation, rank grids and global stage arithmetic.

A multimodal model is a DAG of modules (image and audio encoders -> LLM -> generator). Each module
runs on its own group of ranks with its own pipeline (``pp``), data (``dp``), context (``cp``) and
tensor (``tp``) parallel sizes. This file knows nothing about communication: it validates the
graph, locates ranks in module grids, and counts global pipeline stages, so plans can be made on
a laptop without processes.

* ``topology``: ``{module: [downstream modules]}``; a sink may be absent as a key or map to ``[]``.
* a grid is one of: an ``int`` (the module's pipeline size, enough for counting stages), a
  :class:`ModuleGrid` (global ranks laid out ``[pp, dp, cp, tp]``, built without processes), or a
  ``torch.distributed.device_mesh.DeviceMesh`` over the module's ranks (converted with
  :meth:`ModuleGrid.from_mesh`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LOGICAL_DIMS",
    "ModuleGrid",
    "compute_total_pipeline_stages",
    "module_pp_sizes",
    "rank_modules",
    "topological_order",
    "upstream_modules",
    "validate_topology",
]

#: the logical dims of a module grid, outermost first
LOGICAL_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ModuleGrid:
    """The global ranks of one module laid out ``[pp, dp, cp, tp]`` (int64, every rank once).

    Build it without processes with :meth:`from_sizes` or from a ``DeviceMesh`` with :meth:`from_mesh`.
    """

    ranks: torch.Tensor

    def __post_init__(self) -> None:
        ranks = torch.as_tensor(self.ranks, dtype=torch.int64)
        if ranks.dim() != 4:
            raise ValueError(f"ModuleGrid.ranks must be 4-D [pp, dp, cp, tp], got shape {tuple(ranks.shape)}")
        flat = ranks.flatten().tolist()
        if len(set(flat)) != len(flat) or min(flat) < 0:
            raise ValueError(f"ModuleGrid.ranks must hold distinct non-negative ranks, got {flat}")
        object.__setattr__(self, "ranks", ranks)

    @classmethod
    def from_sizes(cls, first_rank: int = 0, *, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1) -> ModuleGrid:
        """Consecutive ranks from ``first_rank``, ``tp`` innermost (the usual launch order)."""
        for name, v in (("pp", pp), ("dp", dp), ("cp", cp), ("tp", tp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"ModuleGrid.from_sizes: {name}={v!r} must be a positive int")
        n = pp * dp * cp * tp
        return cls(torch.arange(first_rank, first_rank + n).reshape(pp, dp, cp, tp))

    @classmethod
    def from_mesh(cls, mesh: Any, dim_mapping: Mapping[str, str | Sequence[str]] | None = None) -> ModuleGrid:
        """Read a ``DeviceMesh``'s ranks into ``[pp, dp, cp, tp]``.

        Args:
            mesh: a ``DeviceMesh`` (or anything with ``.mesh`` (rank tensor) and ``.mesh_dim_names``).
            dim_mapping: logical dim -> mesh dim name, or a tuple of names flattened outer-first
                (e.g. ``{"dp": ("dp_replicate", "dp_shard")}``). Default: each logical dim maps to the
                mesh dim of the same name. A logical dim with no mesh dim has size 1.

        Raises:
            ValueError: a mapped name is not a mesh dim, a mesh dim is mapped twice, or a mesh dim of
                size > 1 is not mapped to any logical dim.
        """
        names = tuple(mesh.mesh_dim_names or ())
        ranks = torch.as_tensor(mesh.mesh, dtype=torch.int64)
        if len(names) != ranks.dim():
            raise ValueError(f"the mesh needs one name per dim, got names {names} for shape {tuple(ranks.shape)}")
        mapping = {d: d for d in LOGICAL_DIMS if d in names} if dim_mapping is None else dict(dim_mapping)
        unknown = set(mapping) - set(LOGICAL_DIMS)
        if unknown:
            raise ValueError(f"dim_mapping keys must be among {LOGICAL_DIMS}, got {sorted(unknown)}")
        order, sizes, used = [], [], set()
        for logical in LOGICAL_DIMS:
            targets = mapping.get(logical, ())
            targets = (targets,) if isinstance(targets, str) else tuple(targets)
            size = 1
            for t in targets:
                if t not in names:
                    raise ValueError(
                        f"dim_mapping maps {logical!r} to mesh dim {t!r}, but the mesh dims are {names}"
                    )
                if t in used:
                    raise ValueError(f"dim_mapping maps mesh dim {t!r} to more than one logical dim")
                used.add(t)
                order.append(names.index(t))
                size *= ranks.size(names.index(t))
            sizes.append(size)
        rest = [i for i, n in enumerate(names) if n not in used]
        big = [names[i] for i in rest if ranks.size(i) > 1]
        if big:
            raise ValueError(
                f"mesh dims {big} (size > 1) are not mapped to any of {LOGICAL_DIMS}; pass "
                f"dim_mapping, e.g. {{'dp': {tuple(big)!r}}}"
            )
        return cls(ranks.permute(*order, *rest).reshape(*sizes))

    @classmethod
    def from_hyper_comm_grid(cls, grid: Any) -> ModuleGrid:
        """Read a Megatron ``HyperCommGrid`` (``shape``, ``dim_names``, ``rank_offset``): the FIRST dim name
        varies fastest, ranks ``rank_offset .. rank_offset + prod(shape) - 1``.

        Raises ``ValueError`` for a dim of size > 1 that is not one of ``pp``, ``dp``, ``cp``, ``tp``.
        """
        names, shape = list(grid.dim_names), [int(v) for v in grid.shape]
        if len(names) != len(shape):
            raise ValueError(f"HyperCommGrid dim_names {names} and shape {shape} differ in length")
        big = [n for n, v in zip(names, shape) if n not in LOGICAL_DIMS and v > 1]
        if big:
            raise ValueError(f"HyperCommGrid dims {big} (size > 1) are not among {LOGICAL_DIMS}")
        size = 1
        for v in shape:
            size *= v
        ranks = torch.arange(int(grid.rank_offset), int(grid.rank_offset) + size).reshape(shape[::-1])
        rev = names[::-1]
        order = [rev.index(d) for d in LOGICAL_DIMS if d in rev]
        rest = [i for i, n in enumerate(rev) if n not in LOGICAL_DIMS]
        sizes = [shape[names.index(d)] if d in names else 1 for d in LOGICAL_DIMS]
        return cls(ranks.permute(*order, *rest).reshape(*sizes))

    @property
    def pp(self) -> int:
        return self.ranks.size(0)

    @property
    def dp(self) -> int:
        return self.ranks.size(1)

    @property
    def cp(self) -> int:
        return self.ranks.size(2)

    @property
    def tp(self) -> int:
        return self.ranks.size(3)

    def rank_list(self) -> list[int]:
        """Every global rank of the module, sorted."""
        return sorted(self.ranks.flatten().tolist())

    def coordinate(self, rank: int) -> tuple[int, int, int, int] | None:
        """``(pp, dp, cp, tp)`` of global ``rank`` in this grid, or ``None`` if it is not in the module."""
        hit = (self.ranks == rank).nonzero()
        return None if hit.numel() == 0 else tuple(int(v) for v in hit[0])  # type: ignore[return-value]

    def stage(self, pp_rank: int) -> torch.Tensor:
        """The ``[dp, cp, tp]`` global ranks of pipeline stage ``pp_rank``."""
        return self.ranks[pp_rank]


def _as_grid(name: str, grid: Any, dim_mapping=None) -> ModuleGrid | int:
    if isinstance(grid, ModuleGrid):
        return grid
    if isinstance(grid, int) and not isinstance(grid, bool):
        if grid < 1:
            raise ValueError(f"module {name!r}: pipeline size {grid} must be >= 1")
        return grid
    if hasattr(grid, "mesh") and hasattr(grid, "mesh_dim_names"):
        return ModuleGrid.from_mesh(grid, dim_mapping)
    if all(hasattr(grid, a) for a in ("shape", "dim_names", "rank_offset")):
        return ModuleGrid.from_hyper_comm_grid(grid)
    raise TypeError(
        f"module {name!r}: the grid must be an int (pipeline size), a ModuleGrid or a DeviceMesh, "
        f"got {type(grid).__name__}"
    )


def _grids(module_to_grid_map: Mapping[str, Any], dim_mapping=None) -> dict[str, ModuleGrid | int]:
    if not module_to_grid_map:
        raise ValueError("module_to_grid_map is empty: give every module a grid (mesh, ModuleGrid or pp size)")
    return {name: _as_grid(name, g, dim_mapping) for name, g in module_to_grid_map.items()}


def module_pp_sizes(module_to_grid_map: Mapping[str, Any], dim_mapping=None) -> dict[str, int]:
    """Module -> pipeline size, from ints, :class:`ModuleGrid` s or meshes."""
    return {n: g if isinstance(g, int) else g.pp for n, g in _grids(module_to_grid_map, dim_mapping).items()}


def validate_topology(topology: Mapping[str, Sequence[str]], modules: Sequence[str]) -> dict[str, list[str]]:
    """Check ``topology`` against the known ``modules``; return it with every module as a key.

    Raises:
        ValueError: an unknown module name (in keys or targets), a module with a grid that the
            topology never names, a repeated edge, no sink, or a cycle (the message names the modules).
    """
    known = set(modules)
    unknown = sorted({m for m in topology} - known | {d for ds in topology.values() for d in ds} - known)
    if unknown:
        raise ValueError(
            f"topology names unknown module(s) {unknown}; the modules with grids are {sorted(known)}: "
            "add a grid for each module or fix the name"
        )
    graph = {m: list(topology.get(m, ())) for m in modules}
    for m, ds in graph.items():
        if len(set(ds)) != len(ds):
            raise ValueError(f"topology: module {m!r} lists a downstream module twice: {ds}")
    if len(graph) > 1:
        # a module named in the topology with no edge ({"d": []}) runs on its own, as Megatron allows;
        # one with a grid that the topology never names is most likely a typo
        linked = {m for m, ds in graph.items() if ds} | {d for ds in graph.values() for d in ds} | set(topology)
        lonely = sorted(known - linked)
        if lonely:
            raise ValueError(
                f"module(s) {lonely} have grids but the topology never names them; connect them, list them as "
                "'name': [] to run them on their own, or remove their grids"
            )
    if not any(not ds for ds in graph.values()):
        raise ValueError(
            f"topology has no sink: every module has a downstream module ({graph}); the last module "
            "(e.g. the LLM or generator) must map to []"
        )
    topological_order(graph)  # raises on cycles
    return graph


def topological_order(graph: Mapping[str, Sequence[str]]) -> list[str]:
    """Modules in a dependency order (ties broken by name). ``ValueError`` naming the modules of a cycle."""
    indeg = {m: 0 for m in graph}
    for ds in graph.values():
        for d in ds:
            indeg[d] += 1
    ready = sorted(m for m, k in indeg.items() if k == 0)
    order = []
    while ready:
        m = ready.pop(0)
        order.append(m)
        for d in graph[m]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
                ready.sort()
    if len(order) != len(graph):
        cyc = {m for m in graph if m not in order}
        pruned = True
        while pruned:  # drop modules that only hang below a cycle: keep those on one
            keep = {m for m in cyc if any(d in cyc for d in graph[m])}
            pruned, cyc = keep != cyc, keep
        cyc = sorted(cyc)
        raise ValueError(f"topology has a cycle through module(s) {cyc}; a module pipeline must be a DAG")
    return order


def upstream_modules(graph: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Module -> the modules that feed it, in topology order of the keys."""
    ups: dict[str, list[str]] = {m: [] for m in graph}
    for m, ds in graph.items():
        for d in ds:
            ups[d].append(m)
    return ups


def compute_total_pipeline_stages(
    topology: Mapping[str, Sequence[str]],
    module_to_grid_map: Mapping[str, Any],
    rank: int | None = None,
    module_name: str | None = None,
    dim_mapping: Mapping[str, str | Sequence[str]] | None = None,
) -> int:
    """The number of global pipeline stages: the longest path through the DAG weighted by pp size.

    Args:
        topology: ``{module: [downstream modules]}``.
        module_to_grid_map: ``{module: grid}``; a grid is a pp size (``int``), a :class:`ModuleGrid` or
            a ``DeviceMesh``.
        rank: when given, count only up to this rank's stage: the longest path into its module plus
            ``pp_rank + 1``. Needs real grids (not ints) for the modules.
        module_name: chooses among modules colocated on ``rank`` (without it, the largest count of
            the modules holding ``rank``, as Megatron documents); without ``rank``, counts up to the
            end of this module's pipeline.
        dim_mapping: passed to :meth:`ModuleGrid.from_mesh` for meshes.

    Example (Megatron's topology: image and audio encoders -> LLM -> generator)::

        >>> compute_total_pipeline_stages(
        ...     {"image": ["llm"], "audio": ["llm"], "llm": ["generator"], "generator": []},
        ...     {"image": 2, "audio": 1, "llm": 4, "generator": 1})
        7

    Raises:
        ValueError: an invalid topology (see :func:`validate_topology`), an unknown ``module_name``,
            a ``rank`` in no module, or a ``module_name`` that does not hold ``rank``.
    """
    grids = _grids(module_to_grid_map, dim_mapping)
    graph = validate_topology(topology, list(grids))
    pp = {n: g if isinstance(g, int) else g.pp for n, g in grids.items()}
    ups = upstream_modules(graph)
    before: dict[str, int] = {}  # longest path ending just before the module's first stage
    for m in topological_order(graph):
        before[m] = max((before[u] + pp[u] for u in ups[m]), default=0)
    if module_name is not None and module_name not in grids:
        raise ValueError(f"unknown module_name {module_name!r}; the modules are {sorted(grids)}")
    if rank is None:
        if module_name is not None:
            return before[module_name] + pp[module_name]
        return max(before[m] + pp[m] for m in graph if not graph[m])
    holders = rank_modules(grids, rank)
    if not holders:
        raise ValueError(f"rank {rank} is in no module's grid ({_describe(grids)}); give it a module or launch fewer ranks")
    if module_name is None:
        return max(before[m] + p + 1 for m, p in holders.items())
    if module_name not in holders:
        raise ValueError(f"module {module_name!r} does not hold rank {rank}; rank {rank} holds {sorted(holders)}")
    return before[module_name] + holders[module_name] + 1


def rank_modules(grids: Mapping[str, ModuleGrid | int], rank: int) -> dict[str, int]:
    """Module -> ``pp_rank`` for every module whose grid holds global ``rank``.

    Raises ``ValueError`` if a grid is only a pp size (ranks unknown).
    """
    sizes_only = sorted(n for n, g in grids.items() if isinstance(g, int))
    if sizes_only:
        raise ValueError(
            f"a rank-aware count needs the ranks of every module, but {sizes_only} are given only as pp "
            "sizes; pass a DeviceMesh or ModuleGrid for each"
        )
    out = {}
    for name, g in grids.items():
        coord = g.coordinate(rank)  # type: ignore[union-attr]
        if coord is not None:
            out[name] = coord[0]
    return out


def _describe(grids: Mapping[str, ModuleGrid | int]) -> str:
    return ", ".join(
        f"{n}: ranks {g.rank_list()}" if isinstance(g, ModuleGrid) else f"{n}: pp={g}" for n, g in grids.items()
    )
