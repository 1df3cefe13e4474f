"""The dry run plans multi-node worlds: ranks per node, cp / tp groups inside or across nodes."""

from __future__ import annotations

import pytest

from automodel.config import ConfigError, load_config
from automodel.training.dry_run import rank_layout
from automodel.training.node_plan import mesh_groups, node_plan_lines, plan_nodes, planned_nodes


def _sizes(dp_replicate=1, dp_shard=1, cp=1, tp=1) -> dict[str, int]:
    return {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}


def test_mesh_groups_match_the_rank_layout():
    sizes = _sizes(dp_replicate=2, dp_shard=3, cp=2, tp=2)
    layout = rank_layout(sizes)
    for dims in [("tp",), ("cp",), ("dp_shard", "cp"), ("dp_replicate",)]:
        groups = mesh_groups(sizes, dims)
        key = [d for d in ("dp_replicate", "dp_shard", "cp", "tp") if d not in dims]
        expected: dict[tuple, list[int]] = {}
        for r in layout:  # the ranks that agree on every other coordinate form one group
            expected.setdefault(tuple(r[k] for k in key), []).append(r["rank"])
        assert sorted(groups) == sorted(expected.values()), dims
    assert mesh_groups(sizes, ("tp",))[:2] == [[0, 1], [2, 3]]
    assert mesh_groups(sizes, ("cp",))[:2] == [[0, 2], [1, 3]]


def test_groups_that_fit_stay_in_a_node():
    plan = plan_nodes(_sizes(dp_shard=4, cp=4, tp=2), nnodes=4, nproc_per_node=8)
    assert plan.nodes[1] == list(range(8, 16))
    assert plan.spanning["tp"] == [] and plan.spanning["cp"] == []
    assert plan.counts["cp"] == 8 and len(plan.spanning["dp_shard_cp (FSDP)"]) == 2  # 16 ranks: 2 nodes each


def test_cp_group_larger_than_a_node_spans_nodes():
    plan = plan_nodes(_sizes(dp_shard=2, cp=8), nnodes=4, nproc_per_node=4)
    assert plan.spanning["cp"] == [list(range(0, 8)), list(range(8, 16))]
    lines = node_plan_lines(_sizes(dp_shard=2, cp=8), 4, 4)
    assert "node 3: ranks 12-15" in lines
    (warning,) = [line for line in lines if line.startswith("warning:")]
    assert warning.startswith("warning: 2 of 2 cp group(s) of 8 ranks span nodes (e.g. ranks 0-7 on nodes [0, 1])")
    assert "cp_size * tp_size=8 is more than the 4 processes of a node" in warning


def test_misaligned_cp_groups_span_nodes():
    # cp*tp = 4 consecutive ranks on nodes of 6: the group of ranks 4-7 straddles nodes 0 and 1
    plan = plan_nodes(_sizes(dp_shard=3, cp=4), nnodes=2, nproc_per_node=6)
    assert plan.spanning["cp"] == [[4, 5, 6, 7]]
    (warning,) = [line for line in node_plan_lines(_sizes(dp_shard=3, cp=4), 2, 6) if "warning" in line]
    assert "1 of 3 cp group(s)" in warning and "make cp_size * tp_size (now 4) divide the processes per node (6)" in warning


def test_tp_warning_and_hsdp_hint():
    lines = node_plan_lines(_sizes(dp_shard=2, tp=4), 4, 2)
    assert any(line.startswith("warning: 2 of 2 tp group(s) of 4 ranks span nodes") for line in lines), lines
    lines = node_plan_lines(_sizes(dp_shard=8, cp=2), 2, 8)
    assert "cp: 8 group(s) of 2 ranks, each within one node" in lines
    assert any("distributed.dp_replicate=2 (HSDP)" in line for line in lines), lines
    assert not any(line.startswith("warning") for line in lines)


def test_planned_nodes_from_either_key():
    assert planned_nodes(None, None, 16) is None
    assert planned_nodes(2, None, 16) == (2, 8)
    assert planned_nodes(None, 4, 16) == (4, 4)
    assert planned_nodes(2, 8, 16) == (2, 8)
    with pytest.raises(ValueError, match="4 nodes x 2 processes per node = 8 ranks, but the mesh has 16"):
        plan_nodes(_sizes(dp_shard=16), 4, 2)


def test_dry_run_reports_nodes():
    from automodel.training.dry_run import dry_run_report

    base = ["--config", "configs/cp.yaml", "recipe.dry_run=true"]
    report = dry_run_report(load_config([*base, "recipe.plan_nnodes=2", "recipe.plan_nproc_per_node=2"]))
    assert "world size 4 = dp_replicate 1 x dp_shard 2 x cp 2 x tp 1" in report  # the product is the world
    assert "--- nodes: 2 x 2 processes (torchrun --nnodes 2 --nproc-per-node 2) ---" in report
    assert "node 1: ranks 2-3" in report and "cp: 2 group(s) of 2 ranks, each within one node" in report
    assert "warning" not in report
    report = dry_run_report(load_config([*base, "recipe.plan_nproc_per_node=1"]))
    assert "--- nodes: 2 x 1 processes" in report
    assert "warning: 1 of 1 cp group(s) of 2 ranks span nodes (e.g. ranks 0-1 on nodes [0, 1])" in report


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (["recipe.plan_nnodes=0"], "recipe.plan_nnodes=0 must be >= 1"),
        (["recipe.plan_nnodes=3", "recipe.dry_run_world_size=8"],
         "recipe.plan_nnodes=3 does not divide the planned world size 8"),
        (["recipe.plan_nnodes=2", "recipe.plan_nproc_per_node=2", "recipe.dry_run_world_size=8"],
         "recipe.plan_nnodes=2 x recipe.plan_nproc_per_node=2 = 4 ranks, but the dry run plans world size 8"),
    ],
)  # fmt: skip
def test_node_plan_rules(overrides, problem):
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        load_config(["--config", "configs/cp.yaml", "recipe.dry_run=true", *overrides])
