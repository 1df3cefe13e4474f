"""In-process tests of the CP API: no-op paths, validation errors, helpers (no process group)."""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
import torch

from automodel.distributed import cp_utils, cpu_ring, hf_causal_mask
from automodel.distributed.cp_utils import (
    _build_position_ids,
    create_context_parallel_ctx,
    get_cp_mesh,
    get_train_context,
    make_cp_batch_and_ctx,
)
from automodel.distributed.mesh import ParallelDims


class StubMesh:
    """Enough of a DeviceMesh for the validation paths, which run before any collective."""

    def __init__(self, names=("cp",), size=2, device_type="cpu"):
        self.mesh_dim_names = names
        self._size = size
        self.device_type = device_type

    def size(self, dim=None):
        return self._size

    def __getitem__(self, name):
        assert name in self.mesh_dim_names
        return StubMesh(("cp",), self._size, self.device_type)


def _batch(seq=16, bsz=2):
    ids = torch.arange(bsz * seq).view(bsz, seq)
    return {"input_ids": ids, "labels": ids + 1}


# ------------------------------------------------------------------ no-op paths
@pytest.mark.parametrize("mesh", [None, StubMesh(names=("dp",)), StubMesh(size=1)])
def test_no_cp_is_a_true_no_op(mesh):
    batch = _batch()
    before = {k: v.clone() for k, v in batch.items()}
    ctx, out = make_cp_batch_and_ctx(mesh, batch)
    assert ctx is contextlib.nullcontext
    assert out is batch
    assert set(out) == {"input_ids", "labels"}  # no position_ids added
    assert all(torch.equal(out[k], before[k]) for k in before)


def test_get_cp_mesh():
    assert get_cp_mesh(None) is None
    assert get_cp_mesh(StubMesh(names=("dp", "tp"))) is None
    one_d = StubMesh(names=("cp",))
    assert get_cp_mesh(one_d) is one_d
    assert get_cp_mesh(StubMesh(names=("dp_shard", "cp"), size=4)).size() == 4


# ------------------------------------------------------------------ validation errors
def test_sequence_not_divisible_names_the_fix():
    with pytest.raises(
        ValueError,
        match=r"sequence length 1004 is not divisible by 2\*cp_size=8; set data.pad_to_multiple_of=8",
    ):
        make_cp_batch_and_ctx(StubMesh(size=4), _batch(seq=1004))


def test_attention_mask_with_zeros_is_rejected():
    batch = _batch()
    batch["attention_mask"] = torch.ones(2, 16, dtype=torch.long)
    batch["attention_mask"][1, -3:] = 0
    with pytest.raises(
        ValueError, match="causal attention and cannot take an attention_mask with zeros.*Ulysses"
    ):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_packed_rows_are_rejected():
    batch = _batch()
    batch["seq_lens"] = torch.tensor([[10, 6], [16, -1000]])
    with pytest.raises(ValueError, match="packed rows.*use_te=True"):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_unknown_sequence_tensor_is_rejected():
    batch = _batch()
    batch["token_type_ids"] = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="'token_type_ids'.*only shards"):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"must be a \[B, S\] tensor"):
        make_cp_batch_and_ctx(StubMesh(), {"input_ids": torch.zeros(16, dtype=torch.long), "labels": None})
    with pytest.raises(ValueError, match="has no 'labels'"):
        make_cp_batch_and_ctx(StubMesh(), {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    batch = _batch()
    batch["position_ids"] = torch.arange(8).unsqueeze(0)
    with pytest.raises(ValueError, match=r"position_ids'\] has shape \(1, 8\)"):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_create_context_parallel_ctx_errors():
    buf = torch.zeros(1, 12)
    with pytest.raises(ValueError, match="cp_rotate_method='ring' is not one of"):
        create_context_parallel_ctx(StubMesh(), [buf], [1], set(), cp_rotate_method="ring")
    with pytest.raises(ValueError, match="1 cp_buffers but 2 cp_seq_dims"):
        create_context_parallel_ctx(StubMesh(), [buf], [1, 1], set())
    with pytest.raises(ValueError, match=r"sequence length 12 \(dim 1\), not divisible by 2\*cp_size=8"):
        create_context_parallel_ctx(StubMesh(size=4), [buf], [1], set())


# ------------------------------------------------------------------ helpers
def test_build_position_ids_adds_arange_when_missing():
    batch = _batch(seq=6)
    pos = _build_position_ids(batch, "cpu")
    assert pos.shape == (1, 6) and pos.dtype == torch.long
    assert torch.equal(pos, torch.arange(6).unsqueeze(0))
    assert batch["position_ids"] is pos
    given = torch.arange(12).view(2, 6)
    assert _build_position_ids({"input_ids": batch["input_ids"], "position_ids": given}, "cpu") is given


def test_get_train_context_enters_cp_context_once():
    events = []

    @contextlib.contextmanager
    def cp():
        events.append("enter")
        yield
        events.append("exit")

    ctx = get_train_context(False, False, cp())
    with ctx():
        events.append("body")
    assert events == ["enter", "body", "exit"]
    with get_train_context(False, False)():  # no cp context: plain no-op
        pass


def test_cpu_ring_missing_private_symbol_is_a_clear_error(monkeypatch):
    attn = importlib.import_module(cpu_ring._ATTN_MODULE)
    monkeypatch.delattr(attn, "_templated_ring_attention_backward")
    assert not cpu_ring.cpu_ring_supported()
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)} .*_templated_ring_attention_backward"):
        cpu_ring.check_cpu_ring_support()
    with pytest.raises(RuntimeError, match="install torch==2.13.0"):
        create_context_parallel_ctx(StubMesh(), [torch.zeros(1, 8)], [1], set())


def test_cpu_ring_installs_and_restores_handlers():
    attn = importlib.import_module(cpu_ring._ATTN_MODULE)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert op not in attn.custom_ops
    with cpu_ring.cpu_ring_attention():
        assert op in attn.custom_ops
        with cpu_ring.cpu_ring_attention():  # re-entrant
            assert op in attn.custom_ops
        assert op in attn.custom_ops
    assert op not in attn.custom_ops


def test_packed_sequence_detection_is_off_only_inside():
    masking_utils = importlib.import_module("transformers.masking_utils")
    jumpy = torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]])
    assert masking_utils.find_packed_sequence_indices(jumpy) is not None
    with hf_causal_mask.no_packed_sequence_detection():
        assert masking_utils.find_packed_sequence_indices(jumpy) is None
    assert masking_utils.find_packed_sequence_indices(jumpy) is not None


def test_reference_names_are_exported():
    for name in (
        "make_cp_batch_and_ctx",
        "make_cp_batch_for_te",
        "create_context_parallel_ctx",
        "get_train_context",
        "_build_position_ids",
        "_shard_thd_chunk_for_te",
    ):
        assert callable(getattr(cp_utils, name))


# ------------------------------------------------------------------ ParallelDims
def test_parallel_dims_infers_dp_shard():
    dims = ParallelDims(dp_replicate=2, cp=2, world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.dp) == (2, 2, 2, 1, 4)
    assert dims.cp_enabled and not dims.tp_enabled


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(cp=3, world_size=8), r"world size 8 is not divisible by dp_replicate\*cp\*tp = 1\*3\*1 = 3"),
        (dict(dp_shard=2, cp=2, world_size=8), r"= 4 must equal the world size 8; set dp_shard=-1"),
        (dict(cp=0, world_size=8), r"cp=0 must be a positive integer"),
        (dict(dp_shard=-2, world_size=8), r"dp_shard=-2 must be a positive integer, or -1"),
        (dict(tp=True, world_size=8), r"tp=True must be a positive integer"),
    ],
)
def test_parallel_dims_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_build_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ParallelDims(world_size=1).build_mesh("cpu")
