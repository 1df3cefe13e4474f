"""Multi-module pipeline planning without processes: stage arithmetic, rank grids, bridge plans."""

from __future__ import annotations

import itertools

import pytest
import torch

from automodel.distributed.pipeline.bridge import StageLayout, cp_sequence_indices, peer_pairs, plan_transfers
from automodel.distributed.pipeline.multimodule import MultiModulePipelineCommunicator
from automodel.distributed.pipeline.topology import ModuleGrid, compute_total_pipeline_stages

# Megatron's documented example: image and audio encoders -> LLM -> generator
MEGATRON = {"image": ["llm"], "audio": ["llm"], "llm": ["generator"], "generator": []}


@pytest.mark.parametrize(
    "pp, total",
    [
        ({"image": 1, "audio": 1, "llm": 1, "generator": 1}, 3),
        ({"image": 2, "audio": 1, "llm": 4, "generator": 1}, 7),
        ({"image": 1, "audio": 3, "llm": 2, "generator": 2}, 7),
        ({"image": 4, "audio": 4, "llm": 8, "generator": 2}, 14),
    ],
)
def test_megatron_topology_total_stages(pp, total):
    assert compute_total_pipeline_stages(MEGATRON, pp) == total


def _megatron_grids():
    # image pp=2 on ranks 0-1, audio pp=1 dp=2 on ranks 2-3, llm pp=4 on 4-7, generator pp=1 on 8
    return {
        "image": ModuleGrid.from_sizes(0, pp=2),
        "audio": ModuleGrid.from_sizes(2, dp=2),
        "llm": ModuleGrid.from_sizes(4, pp=4),
        "generator": ModuleGrid.from_sizes(8),
    }


def test_rank_aware_count():
    grids = _megatron_grids()
    assert compute_total_pipeline_stages(MEGATRON, grids) == 7
    # counts up to pp_rank + 1 of the rank's module, after the longest path into it
    expected = {0: 1, 1: 2, 2: 1, 3: 1, 4: 3, 5: 4, 6: 5, 7: 6, 8: 7}
    assert {r: compute_total_pipeline_stages(MEGATRON, grids, rank=r) for r in range(9)} == expected
    assert compute_total_pipeline_stages(MEGATRON, grids, module_name="llm") == 6  # end of the llm
    with pytest.raises(ValueError, match=r"rank 9 is in no module's grid"):
        compute_total_pipeline_stages(MEGATRON, grids, rank=9)
    with pytest.raises(ValueError, match=r"only as pp sizes"):
        compute_total_pipeline_stages(MEGATRON, {"image": 1, "audio": 1, "llm": 1, "generator": 1}, rank=0)


def test_colocated_modules_count_the_largest_without_module_name():
    grids = _megatron_grids()
    grids["audio"] = ModuleGrid(torch.tensor([0, 1]).reshape(1, 2, 1, 1))  # audio on the image's ranks, dp=2
    assert compute_total_pipeline_stages(MEGATRON, grids, rank=1) == 2  # max over image (2) and audio (1)
    assert compute_total_pipeline_stages(MEGATRON, grids, rank=1, module_name="image") == 2
    assert compute_total_pipeline_stages(MEGATRON, grids, rank=1, module_name="audio") == 1
    with pytest.raises(ValueError, match=r"module 'llm' does not hold rank 1"):
        compute_total_pipeline_stages(MEGATRON, grids, rank=1, module_name="llm")
    with pytest.raises(ValueError, match=r"unknown module_name 'vision'"):
        compute_total_pipeline_stages(MEGATRON, grids, rank=1, module_name="vision")
    comm = MultiModulePipelineCommunicator(grids, MEGATRON, rank=1)
    assert list(comm.modules) == ["image", "audio"]  # the map's order
    assert comm.current_stage == 1 and comm.is_pp_first_stage and not comm.is_pp_last_stage  # image's, 0-based
    with pytest.raises(ValueError, match="pass module_name"):
        comm.stage_of()


def test_cycles_missing_sinks_and_unknown_modules():
    sizes = {"a": 1, "b": 2, "c": 1, "d": 1}
    with pytest.raises(ValueError, match=r"cycle through module\(s\) \['b', 'c'\]"):
        compute_total_pipeline_stages({"a": ["b"], "b": ["c"], "c": ["b", "d"], "d": []}, sizes)
    with pytest.raises(ValueError, match=r"no sink"):
        compute_total_pipeline_stages({"a": ["b"], "b": ["a"]}, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match=r"unknown module\(s\) \['x'\]"):
        compute_total_pipeline_stages({"a": ["x"]}, {"a": 1})
    with pytest.raises(ValueError, match=r"\['d'\] have grids but the topology never names them"):
        compute_total_pipeline_stages({"a": ["b"], "b": ["c"]}, sizes)
    assert compute_total_pipeline_stages({"a": ["b"], "b": ["c"], "d": []}, sizes) == 4  # d on its own, as Megatron
    with pytest.raises(ValueError, match="pipeline size 0"):
        compute_total_pipeline_stages({"a": []}, {"a": 0})


def test_module_grid_from_mesh_like():
    class FakeMesh:  # DeviceMesh's two attributes, so no process group is needed
        mesh = torch.arange(3, 11).reshape(2, 2, 2)  # dp_shard=2, pp=2, cp=2 in an unusual order
        mesh_dim_names = ("dp_shard", "pp", "cp")

    grid = ModuleGrid.from_mesh(FakeMesh(), {"dp": "dp_shard", "pp": "pp", "cp": "cp"})
    assert (grid.pp, grid.dp, grid.cp, grid.tp) == (2, 2, 2, 1)
    assert grid.coordinate(6) == (1, 0, 1, 0)  # mesh index [0, 1, 1]
    with pytest.raises(ValueError, match=r"mesh dims \['dp_shard'\] \(size > 1\) are not mapped"):
        ModuleGrid.from_mesh(FakeMesh())
    with pytest.raises(ValueError, match="maps 'tp' to mesh dim 'tensor'"):
        ModuleGrid.from_mesh(FakeMesh(), {"tp": "tensor"})


def test_communicator_plan_without_processes():
    grids = {"vision": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, cp=2)}
    topo = {"vision": ["llm"], "llm": []}
    comm = MultiModulePipelineCommunicator(grids, topo, rank=2)
    info = comm.modules["llm"]
    assert (info.pp_rank, info.cp_rank, info.upstream, info.is_terminal_stage) == (0, 1, ("vision",), True)
    assert comm.total_stages == 2 and comm.current_stage == 1 and comm.is_pp_last_stage
    idle = MultiModulePipelineCommunicator(grids, topo, rank=3)  # in no module: idles, as in Megatron
    assert idle.modules == {} and idle.current_stage == 0 and not idle.is_pp_first_stage
    assert idle.recv_forward() == {} and idle.send_forward({"llm": torch.ones(1)}) is None
    with pytest.raises(ValueError, match=r"module_output_ndim: unknown module 'audio'"):
        MultiModulePipelineCommunicator(grids, topo, module_output_ndim={"audio": 2}, rank=0)
    with pytest.raises(ValueError, match=r"module_output_ndim\['llm'\]=4"):
        MultiModulePipelineCommunicator(grids, topo, module_output_ndim={"llm": 4}, rank=0)
    with pytest.raises(ValueError, match=r"cp_layout\['llm'\]='zigzag'"):
        MultiModulePipelineCommunicator(grids, topo, cp_layout={"llm": "zigzag"}, rank=0)
    with pytest.raises(ValueError, match=r"unknown module 'audio'"):
        comm.recv_forward("audio")
    with pytest.raises(ValueError, match=r"rank 2 does not hold module 'vision'"):
        comm.recv_forward("vision")


# ------------------------------------------------------------------------------------------------
# bridge plans


def _layout(first, dp=1, cp=1, tp=1, lay="head_tail"):
    return StageLayout(torch.arange(first, first + dp * cp * tp).reshape(dp, cp, tp), lay)


def test_plan_cp1_to_head_tail_cp2_exact_indices():
    plan = plan_transfers(_layout(0), _layout(1, cp=2), rows=2, seq_len=8)
    assert [(t.src, t.dst, t.src_rows, t.dst_rows) for t in plan] == [(0, 1, (0, 2), (0, 2)), (0, 2, (0, 2), (0, 2))]
    assert plan[0].src_pos.tolist() == [0, 1, 6, 7] and plan[0].dst_pos.tolist() == [0, 1, 2, 3]
    assert plan[1].src_pos.tolist() == [2, 3, 4, 5]
    # contiguous cp=2 (Ulysses) -> head_tail cp=2 (ring): rank 3 wants chunks 0 and 3 of 4
    plan = plan_transfers(_layout(0, cp=2, lay="contiguous"), _layout(2, cp=2), rows=1, seq_len=8)
    to3 = [(t.src, t.src_pos.tolist(), t.dst_pos.tolist()) for t in plan if t.dst == 2]
    assert to3 == [(0, [0, 1], [0, 1]), (1, [2, 3], [2, 3])]
    assert peer_pairs(_layout(0), _layout(1, cp=2, tp=2)) == [(0, 1), (0, 2), (0, 3), (0, 4)]
    with pytest.raises(ValueError, match=r"destination stage: sequence length 6 is not divisible by 4"):
        plan_transfers(_layout(0), _layout(1, cp=2), rows=1, seq_len=6)
    with pytest.raises(ValueError, match=r"3 rows are not divisible by dp=2"):
        plan_transfers(_layout(0), _layout(1, dp=2), rows=3, seq_len=4)


def _shard(x, lay: StageLayout, d, c):
    rows = x.size(0) // lay.dp
    idx = cp_sequence_indices(x.size(1), lay.cp, c, lay.cp_layout)
    return x[d * rows : (d + 1) * rows].index_select(1, idx)


LAYOUTS = [
    dict(dp=1, cp=1), dict(dp=2, cp=1), dict(dp=1, cp=2), dict(dp=1, cp=2, lay="contiguous"),
    dict(dp=2, cp=2, tp=2), dict(dp=1, cp=3, lay="contiguous"), dict(dp=3, cp=2, tp=1),
]  # fmt: skip


@pytest.mark.parametrize("a, b", list(itertools.combinations(range(len(LAYOUTS)), 2)))
def test_plan_moves_every_element_exactly(a, b):
    """Simulate every message of a plan in one process: each destination rank gets exactly its shard."""
    for src_kw, dst_kw in ((LAYOUTS[a], LAYOUTS[b]), (LAYOUTS[b], LAYOUTS[a])):
        src, dst = _layout(0, **src_kw), _layout(20, **dst_kw)
        x = torch.randn(6, 24, 3)
        plan = plan_transfers(src, dst, 6, 24)
        assert {(t.src, t.dst) for t in plan} == set(peer_pairs(src, dst))
        held = {int(src.ranks[d, c, t]): _shard(x, src, d, c) for d in range(src.dp) for c in range(src.cp) for t in range(src.tp)}  # fmt: skip
        got = {int(r): torch.full((6 // dst.dp, 24 // dst.cp, 3), float("nan")) for r in dst.ranks.flatten()}
        for t in plan:
            assert int(src.ranks.flatten().tolist().index(t.src)) % src.tp == 0  # only tp rank 0 sends
            piece = held[t.src][t.src_rows[0] : t.src_rows[1]].index_select(1, t.src_pos)
            target = got[t.dst][t.dst_rows[0] : t.dst_rows[1]]
            assert torch.isnan(target[:, t.dst_pos]).all()  # written once
            target[:, t.dst_pos] = piece
        for d, c, tt in itertools.product(range(dst.dp), range(dst.cp), range(dst.tp)):
            assert torch.equal(got[int(dst.ranks[d, c, tt])], _shard(x, dst, d, c))
