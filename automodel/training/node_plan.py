"""Where the ranks of a multi-node run land: which node holds which ranks, and which groups cross nodes.

torchrun gives every node ``nproc_per_node`` consecutive global ranks (node ``n`` holds ranks
``n*nproc_per_node ... (n+1)*nproc_per_node - 1``), and the device mesh is row-major over
``(dp_replicate, dp_shard, cp, tp)`` (see :func:`automodel.training.dry_run.rank_layout`), so the
inner dims (tp, then cp) hold consecutive ranks. A cp or tp group that spans two nodes sends its
per-layer traffic (ring rotations, all-to-alls, TP collectives) over the network instead of
NVLink: the dry run warns about it. Pure arithmetic: no process group.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["MESH_DIMS", "mesh_groups", "cp_sub_group_ranks", "node_of", "NodePlan", "plan_nodes", "planned_nodes", "node_plan_lines"]

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def node_of(rank: int, nproc_per_node: int) -> int:
    """The node (0-based) that torchrun puts global ``rank`` on."""
    return rank // nproc_per_node


def mesh_groups(sizes: dict[str, int], dims: tuple[str, ...]) -> list[list[int]]:
    """The process groups of the mesh dims ``dims`` (e.g. ``("cp",)`` or ``("dp_shard", "cp")``).

    ``sizes`` holds ``dp_replicate, dp_shard, cp, tp``. Each group is the sorted global ranks that
    differ only in ``dims``; groups are listed in order of their smallest rank.
    """
    shape = tuple(sizes[d] for d in MESH_DIMS)
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    axes = [MESH_DIMS.index(d) for d in dims]
    rest = [i for i in range(len(MESH_DIMS)) if i not in axes]
    moved = np.transpose(grid, rest + axes).reshape(-1, int(np.prod([shape[a] for a in axes])))
    return sorted((sorted(int(r) for r in row) for row in moved), key=lambda g: g[0])


class NodePlan:
    """The ranks of each node and, per group kind, the groups that span more than one node."""

    def __init__(self, nodes: list[list[int]], spanning: dict[str, list[list[int]]], counts: dict[str, int]):
        self.nodes = nodes  # nodes[n] = the global ranks on node n
        self.spanning = spanning  # kind -> groups whose ranks sit on more than one node
        self.counts = counts  # kind -> number of groups of that kind


# (name shown, mesh dims) of the groups the report checks, innermost first
GROUP_KINDS = (("tp", ("tp",)), ("cp", ("cp",)), ("dp_shard_cp (FSDP)", ("dp_shard", "cp")))


def plan_nodes(sizes: dict[str, int], nnodes: int, nproc_per_node: int) -> NodePlan:
    """Place the mesh of ``sizes`` on ``nnodes`` nodes of ``nproc_per_node`` ranks each.

    Raises:
        ValueError: ``nnodes * nproc_per_node`` is not the mesh's world size.
    """
    world = int(np.prod([sizes[d] for d in MESH_DIMS]))
    if nnodes * nproc_per_node != world:
        raise ValueError(
            f"{nnodes} nodes x {nproc_per_node} processes per node = {nnodes * nproc_per_node} ranks, but the "
            f"mesh has {world}; set recipe.plan_nnodes / recipe.plan_nproc_per_node so that their product is the "
            f"world size"
        )
    nodes = [list(range(n * nproc_per_node, (n + 1) * nproc_per_node)) for n in range(nnodes)]
    spanning, counts = {}, {}
    for name, dims in GROUP_KINDS:
        groups = mesh_groups(sizes, dims)
        counts[name] = len(groups)
        spanning[name] = [g for g in groups if len({node_of(r, nproc_per_node) for r in g}) > 1]
    return NodePlan(nodes, spanning, counts)


def planned_nodes(nnodes: int | None, nproc_per_node: int | None, world: int) -> tuple[int, int] | None:
    """``(nnodes, nproc_per_node)`` from ``recipe.plan_nnodes`` / ``recipe.plan_nproc_per_node``.

    One of them is enough (the other is ``world`` divided by it; the config rules checked that it
    divides). None when neither is set: the dry run then plans one node.
    """
    if nnodes is None and nproc_per_node is None:
        return None
    if nnodes is None:
        nnodes = world // nproc_per_node
    elif nproc_per_node is None:
        nproc_per_node = world // nnodes
    return nnodes, nproc_per_node


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def cp_sub_group_ranks(sizes: dict[str, int], cp_sub_groups: list[tuple[str, int, bool]]) -> list[list[list[int]]]:
    """Per CP sub-group kind (innermost first, as :meth:`CPMethod.cp_sub_groups` lists them), its groups of
    global ranks: the innermost kind holds consecutive CP ranks, the next kind ranks that many apart, ...
    E.g. cp 4 = ulysses 2 x ring 2 on 4 ranks: ``[[[0, 1], [2, 3]], [[0, 2], [1, 3]]]``."""
    out: list[list[list[int]]] = [[] for _ in cp_sub_groups]
    shape = [size for _, size, _ in reversed(cp_sub_groups)]  # outermost first: CP rank = row-major index
    for group in mesh_groups(sizes, ("cp",)):
        grid = np.array(group).reshape(shape)
        for i in range(len(cp_sub_groups)):
            axis = len(shape) - 1 - i
            rows = np.moveaxis(grid, axis, -1).reshape(-1, shape[axis])
            out[i].extend(sorted(int(r) for r in row) for row in rows)
    return out


def _cp_sub_group_lines(
    sizes: dict[str, int], nproc_per_node: int, cp_sub_groups: list[tuple[str, int, bool]]
) -> list[str]:
    out = []
    for (name, size, warn), groups in zip(cp_sub_groups, cp_sub_group_ranks(sizes, cp_sub_groups), strict=True):
        if size == 1:
            continue
        bad = [g for g in groups if len({node_of(r, nproc_per_node) for r in g}) > 1]
        if not bad:
            out.append(f"{name}: {len(groups)} group(s) of {size} ranks, each within one node")
        elif warn:
            out.append(
                f"warning: {len(bad)} of {len(groups)} {name} group(s) of {size} ranks span nodes (e.g. ranks "
                f"{_ranks(bad[0])} on nodes {sorted({node_of(r, nproc_per_node) for r in bad[0]})}): their per-layer "
                f"traffic crosses the network. Keep {name} inside a node: make its size times tp_size (now "
                f"{size * sizes['tp']}) divide the processes per node ({nproc_per_node})"
            )
        else:
            out.append(f"{name}: {len(bad)} of {len(groups)} group(s) of {size} ranks cross nodes (by design)")
    return out


def node_plan_lines(
    sizes: dict[str, int], nnodes: int, nproc_per_node: int, cp_sub_groups: list[tuple[str, int, bool]] | None = None
) -> list[str]:
    """The dry run's "nodes" section: ranks per node, and per group kind whether it stays in a node.

    A cp or tp group that spans nodes gives a ``warning:`` line with the fix; FSDP spanning nodes
    is reported as a fact (it is the usual multi-node layout; HSDP keeps it inside a node). With
    ``cp_sub_groups`` (the CP method's factoring of the CP group, e.g. usp's ulysses x ring) each
    sub-group kind is reported instead of the whole CP group: a warning when one flagged to stay
    inside a node spans nodes.
    """
    plan = plan_nodes(sizes, nnodes, nproc_per_node)
    out = [f"--- nodes: {nnodes} x {nproc_per_node} processes (torchrun --nnodes {nnodes} "
           f"--nproc-per-node {nproc_per_node}) ---"]  # fmt: skip
    for n, ranks in enumerate(plan.nodes[:16]):
        out.append(f"node {n}: ranks {_ranks(ranks)}")
    if nnodes > 16:
        out.append(f"... ({nnodes - 16} more nodes, {nproc_per_node} consecutive ranks each)")
    for name, _ in GROUP_KINDS:
        size = {"tp": sizes["tp"], "cp": sizes["cp"]}.get(name, sizes["dp_shard"] * sizes["cp"])
        if size == 1:
            continue
        bad, total = plan.spanning[name], plan.counts[name]
        if name == "cp" and cp_sub_groups:
            out.extend(_cp_sub_group_lines(sizes, nproc_per_node, cp_sub_groups))
        elif not bad:
            out.append(f"{name}: {total} group(s) of {size} ranks, each within one node")
        elif name in ("tp", "cp"):
            block = sizes["tp"] if name == "tp" else sizes["cp"] * sizes["tp"]  # consecutive ranks it covers
            what = "tp_size" if name == "tp" else "cp_size * tp_size"
            fix = (
                f"{what}={block} is more than the {nproc_per_node} processes of a node: lower it to a divisor of "
                f"{nproc_per_node}, or use nodes with more devices"
                if block > nproc_per_node
                else f"make {what} (now {block}) divide the processes per node ({nproc_per_node})"
            )
            inner = math.gcd(sizes["cp"], max(1, nproc_per_node // sizes["tp"]))
            if name == "cp" and inner > 1:
                fix += (
                    f"; or distributed.cp_method=usp with distributed.ulysses_size={inner} (all-to-all inside each "
                    "node, only its ring crosses nodes)"
                )
            out.append(
                f"warning: {len(bad)} of {total} {name} group(s) of {size} ranks span nodes (e.g. ranks "
                f"{_ranks(bad[0])} on nodes {sorted({node_of(r, nproc_per_node) for r in bad[0]})}): their "
                f"per-layer traffic crosses the network. Keep {name} inside a node: {fix}"
            )
        else:
            inner = sizes["cp"] * sizes["tp"]
            hsdp = (
                f"; distributed.dp_replicate={nnodes} (HSDP) would shard inside each node and replicate across nodes"
                if sizes["dp_replicate"] == 1 and nproc_per_node % inner == 0
                else ""
            )
            out.append(
                f"{name}: {total} group(s) of {size} ranks span nodes (parameter all-gathers and gradient "
                f"reduce-scatters cross the network{hsdp})"
            )
    return out
