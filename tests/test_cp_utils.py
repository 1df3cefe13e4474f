"""In-process tests of the CP API: no-op paths, validation errors, helpers (no process group)."""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
import torch

from automodel.distributed import cp_utils, torch_internals
from automodel.distributed.cp.ring import causal_mask as hf_causal_mask
from automodel.distributed.cp.ring import cpu_ring
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

    def get_local_rank(self):
        return 0

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
def test_sequence_not_divisible_is_padded_exactly():
    """S=1004 at cp=4 -> 1008: every key gets its documented fill; the caller's batch is untouched."""
    ids = torch.arange(2 * 1004).view(2, 1004)
    batch = {
        "input_ids": ids,
        "labels": ids + 1,
        "position_ids": torch.arange(1004).unsqueeze(0) + 5,
        "loss_mask": torch.ones(2, 1004),
        "padding_mask": torch.zeros(2, 1004, dtype=torch.bool),
    }
    before = {k: v.clone() for k, v in batch.items()}
    _, out = make_cp_batch_and_ctx(StubMesh(size=4), batch, padding_token_id=7)
    assert cp_utils.cp_padded_seq_len(1004, 4) == 1008
    assert all(out[k].shape[-1] == 1008 for k in before)
    assert torch.equal(out["input_ids"][:, :1004], ids) and (out["input_ids"][:, 1004:] == 7).all()
    assert (out["labels"][:, 1004:] == -100).all()
    assert torch.equal(out["position_ids"], torch.arange(1008).unsqueeze(0) + 5)  # continuing
    assert (out["loss_mask"][:, 1004:] == 0).all() and out["loss_mask"].dtype == torch.float32
    assert out["padding_mask"][:, 1004:].all() and not out["padding_mask"][:, :1004].any()
    assert all(torch.equal(batch[k], before[k]) and batch[k].shape[-1] == 1004 for k in before)


def test_padding_continues_mrope_and_per_row_positions():
    batch = _batch(seq=6)
    batch["position_ids"] = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
    _, out = make_cp_batch_and_ctx(StubMesh(size=2), batch)
    assert torch.equal(out["position_ids"][:, 6:], torch.tensor([[6, 7], [9, 10]]))
    mrope = torch.arange(3 * 2 * 6).view(3, 2, 6)
    batch = {**_batch(seq=6), "position_ids": mrope}
    _, out = make_cp_batch_and_ctx(StubMesh(size=2), batch)
    assert out["position_ids"].shape == (3, 2, 8)
    assert torch.equal(out["position_ids"][..., 6:], mrope[..., 5:] + torch.tensor([1, 2]))


def test_divisible_sequence_is_copied_not_padded():
    batch = _batch(seq=16)
    _, out = make_cp_batch_and_ctx(StubMesh(size=2), batch)
    assert out is not batch and out["input_ids"].shape == (2, 16)
    assert out["input_ids"] is not batch["input_ids"] and torch.equal(out["input_ids"], batch["input_ids"])


def test_inputs_embeds_is_padded_with_zeros_and_keeps_its_graph():
    emb = torch.randn(2, 5, 3, requires_grad=True)
    out = make_cp_batch_and_ctx(StubMesh(size=2), {"inputs_embeds": emb, "labels": torch.zeros(2, 5).long()})[1]
    assert out["inputs_embeds"].shape == (2, 8, 3) and (out["inputs_embeds"][:, 5:] == 0).all()
    assert torch.equal(out["position_ids"], torch.arange(8).unsqueeze(0))
    out["inputs_embeds"].sum().backward()
    assert torch.equal(emb.grad, torch.ones_like(emb))


@pytest.mark.parametrize("mesh", [StubMesh(size=2), None])
def test_both_or_neither_input_ids_and_inputs_embeds_is_an_error(mesh):
    both = {**_batch(), "inputs_embeds": torch.zeros(2, 16, 4)}
    with pytest.raises(ValueError, match="both 'input_ids' and 'inputs_embeds'; give exactly one"):
        make_cp_batch_and_ctx(mesh, both)
    with pytest.raises(ValueError, match="neither 'input_ids' nor 'inputs_embeds'"):
        make_cp_batch_and_ctx(mesh, {"labels": torch.zeros(2, 16).long()})
    if mesh is not None:
        with pytest.raises(ValueError, match=r"inputs_embeds'\] must be a \[B, S, H\] tensor"):
            make_cp_batch_and_ctx(mesh, {"inputs_embeds": torch.zeros(2, 16), "labels": torch.zeros(2, 16)})


def test_mismatched_label_shape_is_rejected():
    batch = _batch()
    batch["labels"] = batch["labels"][:, :-1]
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(2, 15\); expected \[B, S\] = \(2, 16\)"):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_attention_mask_with_zeros_is_rejected():
    batch = _batch()
    batch["attention_mask"] = torch.ones(2, 16, dtype=torch.long)
    batch["attention_mask"][1, -3:] = 0
    with pytest.raises(
        ValueError, match=r"cp_method ring .*right padding.*methods that compute it: ulysses \| thd \| thd_docs \| usp"
    ):
        make_cp_batch_and_ctx(StubMesh(), batch)


def test_packed_rows_are_rejected():
    batch = _batch()
    batch["seq_lens"] = torch.tensor([[10, 6], [16, -1000]])
    with pytest.raises(ValueError, match=r"cp_method ring .*packed rows.*methods that compute it: ulysses"):
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
def test_build_position_ids_adds_arange_when_missing_and_returns_the_batch():
    batch = _batch(seq=6)
    assert _build_position_ids(batch, "cpu") is batch  # NeMo: batch = _build_position_ids(batch, device)
    pos = batch["position_ids"]
    assert pos.shape == (1, 6) and pos.dtype == torch.long
    assert torch.equal(pos, torch.arange(6).unsqueeze(0))
    given = torch.arange(12).view(2, 6)
    assert _build_position_ids({"input_ids": batch["input_ids"], "position_ids": given}, "cpu")["position_ids"] is given
    embeds_only = _build_position_ids({"inputs_embeds": torch.zeros(1, 4, 2)}, "cpu")
    assert torch.equal(embeds_only["position_ids"], torch.arange(4).unsqueeze(0))


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
    attn = torch_internals.cp_attention_module()
    monkeypatch.delattr(attn, "_templated_ring_attention_backward")
    assert not cpu_ring.cpu_ring_supported()
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)} .*_templated_ring_attention_backward"):
        cpu_ring.check_cpu_ring_support()
    with pytest.raises(RuntimeError, match=r"tested with torch 2\.11\.0, 2\.12\.1, 2\.13\.0, 2\.14\.1, 2\.15\.0"):
        create_context_parallel_ctx(StubMesh(), [torch.zeros(1, 8)], [1], set())


def test_cpu_ring_installs_and_restores_handlers():
    attn = torch_internals.cp_attention_module()
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


def test_ring_drops_only_a_mask_that_is_plain_causal_over_the_shard():
    # Falcon (transformers >= 5.25) hands SDPA the causal mask it materialised on the rank's shard: ring proves it
    # says nothing but causality and drops it; any other mask (a bias, padding, documents) is refused
    from automodel.errors import CPUnsupportedError

    check = hf_causal_mask.check_plain_causal_mask
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, 1, 6, 8)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    lowest = torch.finfo(torch.float32).min
    check(allowed[None, None].clone(), q, k, "FalconAttention")  # transformers' bool mask
    check(torch.zeros(1, 1, 6, 6).masked_fill(~allowed, lowest), q, k, "FalconAttention")  # its float form
    check(torch.zeros(2, 4, 6, 6).masked_fill(~allowed, float("-inf")), q, k, "FalconAttention")
    padded = allowed.clone()
    padded[:, 5] = False  # the last token is padding
    documents = allowed.clone()
    documents[3:, :3] = False  # two documents of 3 tokens
    alibi = torch.arange(6.0).expand(6, 6).masked_fill(~allowed, lowest)  # a position bias on the allowed scores
    wrong_shape = torch.ones(1, 1, 6, 12, dtype=torch.bool).tril(6)  # plain causal, but not over these keys
    for mask in (padded[None, None], documents[None, None], alibi[None, None], wrong_shape, allowed.long()):
        with pytest.raises(CPUnsupportedError, match=r"cp_method=ring: FalconAttention was given an attention mask "
                                                     r"of shape .* that is not plain causal"):  # fmt: skip
            check(mask, q, k, "FalconAttention")
    proven = allowed[None, None].clone()
    check(proven, q, k, "FalconAttention")  # remembered (weakly): the next layers pass the same object
    with pytest.raises(CPUnsupportedError):  # another object is read again
        check(padded[None, None].clone(), q, k, "FalconAttention")


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
