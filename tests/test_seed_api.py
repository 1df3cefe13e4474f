"""Every public name of the four seed APIs is importable with the documented signature and defaults.

The table lists, per seed, where the name lives here and the reference's parameters in order, each
with its documented default (``REQ``: the reference has none). Ours must start with exactly those
parameter names; a documented default must be ours too; a required one may have a default here
(listed in docs/seed_api.md); parameters we add come after them and have defaults. Also the docstring
examples that need no processes.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch

REQ = object()
ROOT = Path(__file__).resolve().parents[1]

MS = "automodel.distributed.sp_communication"
VO = "automodel.distributed.sp_sharding"
MM = "automodel.distributed.multimodal_cp"
MP = "automodel.distributed.multimodule_pipeline"

# (module, qualified name, [(parameter, documented default)]); methods without self/ctx
TABLE = [
    # vllm-omni vllm_omni/diffusion/distributed/sp_sharding.py
    (VO, "sp_shard", [("tensor", REQ), ("dim", REQ), ("validate", True)]),
    (VO, "sp_gather", [("tensor", REQ), ("dim", REQ), ("validate", True)]),
    (VO, "sp_shard_with_padding", [("tensor", REQ), ("dim", REQ), ("pad_value", 0.0)]),
    (VO, "sp_gather_with_grad", [("tensor", REQ), ("dim", REQ)]),
    (VO, "get_sharding_validator", []),
    (VO, "AllGatherFunction.forward", [("tensor", REQ), ("dim", REQ)]),
    (VO, "ShardingValidator.reset", []),
    (VO, "ShardingValidator.track", []),
    (VO, "ShardingValidator.shard", [("tensor", REQ), ("name", REQ), ("dim", REQ), ("validate_divisible", True)]),
    (VO, "ShardingValidator.gather", [("tensor", REQ), ("name", REQ), ("dim", REQ)]),
    (VO, "ShardingValidator.validate", []),
    # MindSpeed-MM mindspeed_mm/fsdp/distributed/context_parallel/communication.py (+ utils)
    (MS, "cal_split_sizes", [("dim_size", REQ), ("world_size", REQ)]),
    (MS, "cal_split_sizes_multi", [("sizes", REQ), ("world_size", REQ)]),
    (MS, "adjust_tensor_dimensions", [("tensor", REQ), ("scatter_idx", REQ), ("gather_idx", REQ)]),
    (MS, "unadjust_tensor_dimensions", [("tensor", REQ), ("adjusted_dims", REQ)]),
    (MS, "all_to_all", [("input_", REQ), ("process_group", REQ), ("scatter_dim", 2), ("gather_dim", 1),
                        ("gather_size", None)]),
    (MS, "split_forward_gather_backward", [("input_", REQ), ("process_group", REQ), ("dim", REQ),
                                           ("split_sizes", None), ("grad_scale", "down")]),
    (MS, "gather_forward_split_backward", [("input_", REQ), ("process_group", REQ), ("dim", REQ),
                                           ("gather_sizes", None), ("grad_scale", "up")]),
    (MS, "load_balanced_split_forward_gather_backward", [("input_", REQ), ("process_group", REQ), ("dim", 0)]),
    (MS, "load_balanced_gather_forward_split_backward", [("input_", REQ), ("process_group", REQ), ("dim", 0)]),
    (MS, "split_forward_gather_backward_with_cp", [("input_", REQ), ("dim", REQ)]),
    (MS, "gather_forward_split_backward_with_cp", [("input_", REQ), ("dim", REQ), ("gather_size", REQ)]),
    (MS, "packed_data_split_forward_gather_backward", [("hidden_states", REQ), ("process_group", REQ),
                                                       ("sequence_lengths", REQ), ("dim", 0)]),
    (MS, "packed_data_gather_forward_split_backward", [("local_hidden_states", REQ), ("all_split_sizes", REQ),
                                                       ("process_group", REQ), ("dim", 0)]),
    (MS, "packed_data_split_forward_gather_backward_with_cp", [("x", REQ), ("dim", REQ), ("seq_lens", REQ)]),
    (MS, "packed_data_gather_forward_split_backward_with_cp", [("x", REQ), ("dim", REQ), ("seq_lens", REQ)]),
    # ... and the older mindspeed_mm/models/common/communications.py
    (MS, "all_to_all_SBH", [("input_", REQ), ("process_group", REQ), ("scatter_dim", 2), ("gather_dim", 1),
                            ("scatter_sizes", None), ("gather_sizes", None)]),
    (MS, "split_each_sequence_in_packed_tensor", [("hidden_states", REQ), ("process_group", REQ),
                                                  ("sequence_lengths", REQ), ("dim", 0)]),
    (MS, "gather_sequence_chunks_to_packed_tensor", [("local_hidden_states", REQ), ("all_split_sizes", REQ),
                                                     ("process_group", REQ), ("dim", 0)]),
    (MS, "collect_tensors_across_ranks", [("tensor", REQ), ("group", None), ("dynamic_shape", True)]),
    (MS, "split_tensor", [("tensor", REQ), ("group", REQ), ("rank", REQ), ("dim", 2), ("first_padding", 0)]),
    # Megatron megatron/core/models/multimodal/context_parallel.py
    (MM, "get_padding", [("seq_len", REQ), ("cp_size", REQ), ("tp_size", REQ), ("has_sp", REQ),
                         ("decoder_tp_comm_overlap", False), ("decoder_seq_len", None), ("fp8_enabled", False),
                         ("fp8_recipe", None)]),
    (MM, "get_packed_seq_params", [("tokens", REQ), ("img_seq_len", REQ), ("padding_needed", REQ), ("cp_size", REQ),
                                   ("use_packed_sequence", False)]),
    (MM, "split_to_context_parallel_ranks", [("global_t", REQ), ("pad_value", 0)]),
    (MM, "gather_from_context_parallel_ranks", [("local_t", REQ), ("global_pad", REQ)]),
    (MM, "GatherFromContextParallelRanks.forward", [("local_t", REQ)]),
    (MM, "gather_from_context_parallel_ranks_dynamic_res", [("local_t", REQ), ("num_padded_imgs", 0)]),
    (MM, "_compute_tubelet_aware_split_points", [("num_frames", REQ), ("temporal_patch_size", REQ), ("cp_size", REQ),
                                                 ("total_frames", REQ)]),
    (MM, "_split_num_frames", [("num_frames", REQ), ("lb", REQ), ("ub", REQ)]),
    (MM, "split_to_context_parallel_ranks_dynamic_res", [("global_t", REQ), ("global_imgs_sizes", REQ),
                                                         ("global_packed_seq_params", REQ), ("fp8_enabled", False),
                                                         ("patch_dim", 16), ("num_frames", None),
                                                         ("temporal_patch_size", 1)]),
    # Megatron megatron/core/pipeline_parallel/multimodule_communicator.py
    (MP, "RankModuleInfo", [("pp_rank", REQ), ("pp_size", REQ), ("p2p_communicator", REQ),
                            ("bridge_comms_as_src_module", REQ), ("bridge_comms_as_dest_module", REQ),
                            ("is_source_stage", True), ("is_terminal_stage", True)]),
    (MP, "_prepare_tensor_for_comm", [("tensor", REQ)]),
    (MP, "_restore_tensor_from_comm", [("tensor", REQ)]),
    (MP, "MultiModulePipelineCommunicator", [("module_to_grid_map", REQ), ("topology", REQ), ("config", REQ),
                                             ("dim_mapping", None), ("module_output_ndim", None)]),
    (MP, "MultiModulePipelineCommunicator.recv_forward", [("tensor_shape", None), ("is_first_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.send_forward", [("output_dict", REQ), ("is_last_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.send_forward_recv_backward", [("output_dict", REQ), ("tensor_shape", None),
                                                                        ("is_last_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.send_backward_recv_forward", [("grad_dict", REQ), ("tensor_shape", None),
                                                                        ("is_first_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.recv_backward", [("tensor_shape", None), ("is_last_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.send_backward", [("grad_dict", REQ), ("is_first_stage", False)]),
    (MP, "MultiModulePipelineCommunicator.compute_total_pipeline_stages", [("topology", REQ),
                                                                           ("module_to_grid_map", REQ),
                                                                           ("rank", None), ("module_name", None)]),
    (MP, "MultiModulePipelineCommunicator.is_current_rank_in_grid", [("grid", REQ)]),
]
#: attributes (properties) documented by the references
ATTRIBUTES = [
    (MP, "MultiModulePipelineCommunicator", ["total_stages", "current_stage", "is_pp_first_stage", "is_pp_last_stage",
                                             "rank_module_map", "bridge_comms"]),
    (MS, "HybridCPGroups", ["is_ring_enable", "is_ulysses_enable", "get_ring_group", "get_ulysses_group",
                            "get_ring_group_size", "get_ulysses_group_size", "get_ring_rank"]),
]


def _resolve(module: str, qualname: str):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _params(obj) -> list[inspect.Parameter]:
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name in ("self", "ctx", "cls"):
        params = params[1:]
    return params


@pytest.mark.parametrize("module,qualname,documented", TABLE, ids=[f"{m.rsplit('.', 1)[1]}.{q}" for m, q, _ in TABLE])
def test_documented_signature_and_defaults(module, qualname, documented):
    ours = _params(_resolve(module, qualname))
    names = [p.name for p in ours[: len(documented)]]
    assert names == [n for n, _ in documented], f"{qualname}: parameters {names}"
    for p, (name, default) in zip(ours, documented):
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY), f"{qualname}({name}) must be positional"
        if default is not REQ:
            assert p.default is not p.empty and p.default == default and type(p.default) is type(default), (
                f"{qualname}({name}) defaults to {p.default!r}, the reference to {default!r}"
            )
    for p in ours[len(documented) :]:
        assert p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD), (
            f"{qualname}: our extra parameter {p.name} needs a default"
        )


@pytest.mark.parametrize("module,cls,names", ATTRIBUTES)
def test_documented_attributes(module, cls, names):
    obj = _resolve(module, cls)
    assert [n for n in names if not hasattr(obj, n)] == []


def test_docs_table_lists_every_name():
    text = (ROOT / "docs" / "seed_api.md").read_text()
    listed = set(re.findall(r"^\| `([A-Za-z_][\w.]*)`", text, flags=re.M))
    missing = sorted({q for _, q, _ in TABLE if "." not in q or q.split(".")[0] in ("ShardingValidator",)} - listed)
    assert missing == [], f"docs/seed_api.md lacks rows for {missing}"


# ------------------------------------------------------------------------------------------------
# the docstring examples that need no processes


def test_mindspeed_docstring_examples():
    from automodel.distributed.sp_communication import (
        adjust_tensor_dimensions,
        cal_split_sizes,
        cal_split_sizes_multi,
        unadjust_tensor_dimensions,
    )

    assert cal_split_sizes_multi([10, 15], 3).tolist() == [[4, 5], [3, 5], [3, 5]]
    assert cal_split_sizes(10, 3) == [4, 3, 3]
    x = torch.arange(24).reshape(2, 3, 4, 1)
    for scatter, gather in [(2, 0), (1, 0), (3, 1), (0, 1), (0, 2), (1, 3), (2, 3)]:
        y, dims = adjust_tensor_dimensions(x, scatter, gather)
        assert (dims[0], dims[1]) == (scatter, gather) and y.shape[0] == x.shape[scatter]
        assert torch.equal(unadjust_tensor_dimensions(y, dims), x)
    assert adjust_tensor_dimensions(x, 2, 0)[1] == [2, 0, 1, 3]  # two transpositions, the rest in place


def test_megatron_docstring_examples():
    from automodel.distributed.multimodal_cp import _compute_tubelet_aware_split_points, _split_num_frames
    from automodel.distributed.multimodule_pipeline import (
        MultiModulePipelineCommunicator,
        _prepare_tensor_for_comm,
        _restore_tensor_from_comm,
    )

    # image_encoder ->\ -> llm -> generator, audio_encoder ->/ : max(pp(image), pp(audio)) + pp(llm) + pp(generator)
    topology = {"image_encoder": ["llm"], "audio_encoder": ["llm"], "llm": ["generator"], "generator": []}
    grids = {"image_encoder": 2, "audio_encoder": 1, "llm": 4, "generator": 1}
    assert MultiModulePipelineCommunicator.compute_total_pipeline_stages(topology, grids) == 7
    two = torch.ones(4, 3)
    assert _prepare_tensor_for_comm(two).shape == (4, 3, 1)
    assert torch.equal(_restore_tensor_from_comm(_prepare_tensor_for_comm(two)), two)
    assert [t.shape for t in _prepare_tensor_for_comm([two, torch.ones(2, 2, 2)])] == [(4, 3, 1), (2, 2, 2)]
    assert _prepare_tensor_for_comm(None) is None and _restore_tensor_from_comm(None) is None
    with pytest.raises(ValueError, match="cannot be told apart"):
        _prepare_tensor_for_comm(torch.ones(2, 3, 1))
    assert _split_num_frames([4, 2], 4, 9) == [2] and _split_num_frames([], 0, 5) == []
    assert _compute_tubelet_aware_split_points([16], 4, 4, 16) == [0, 4, 8, 12, 16]


def test_vllm_omni_chunk_sizes_and_world_one():
    from automodel.distributed.sp_sharding import chunk_sizes, sp_gather, sp_shard, sp_shard_with_padding

    assert chunk_sizes(17, 4) == [5, 5, 5, 2] and chunk_sizes(5, 4) == [2, 2, 1, 0]
    x = torch.randn(2, 5)
    assert sp_shard(x, 1, validate=False) is x and sp_gather(x, 1, validate=False) is x
    shard, pad = sp_shard_with_padding(x, dim=1)
    assert pad == 0 and shard is x


def test_mindspeed_refusals_name_the_difference():
    from automodel.distributed.sp_communication import split_forward_gather_backward

    with pytest.raises(ValueError, match="its gradient is wrong"):
        split_forward_gather_backward(torch.ones(4), None, 0, shift=True)
    with pytest.raises(TypeError, match="got grad_scale twice"):
        split_forward_gather_backward(torch.ones(4), None, 0, "up", grad_scale=None)
