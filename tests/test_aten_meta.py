"""The aten attention ops of the CUDA block kernels, checked without a GPU: the installed torch's schemas against the
per-release table (automodel.distributed.cp.aten_schemas, torch 2.11-2.15), and every call the glue makes on the meta
device (argument order, output shapes, the log-sum-exp layout) for each block shape the CP methods use.

Needs torch only (no transformers): run it on another torch with
``PYTHONPATH=. <venv>/bin/python -m pytest -q tests/test_aten_meta.py`` (docs/gpu.md says which releases ran it)."""

from __future__ import annotations

import math

import pytest
import torch

from automodel.distributed.cp import aten_schemas, cuda_blocks
from automodel.distributed.cp import block_backend as bb

META = dict(device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize("op", sorted(aten_schemas.SCHEMAS))
def test_installed_schema_is_the_tables(op):
    release = aten_schemas.torch_release(torch.__version__)
    if release not in aten_schemas.SUPPORTED_RELEASES:
        pytest.skip(f"torch {torch.__version__} is outside the table")
    assert aten_schemas.schema_problem(op, torch.__version__) is None


def test_the_called_ops_have_one_schema_across_releases():
    """The glue makes one call per op: every release of the table agrees on the ops it calls (a new release that
    changes one must add a branch on aten_schemas.torch_release, and this test names it)."""
    for op in aten_schemas.CALLED_OPS:
        schemas = {aten_schemas.schema_for(op, r) for r in aten_schemas.SUPPORTED_RELEASES}
        assert len(schemas) == 1 and None not in schemas, op
    # the differences the table records are in ops the glue does not call, in keyword-only arguments
    assert "block_table" not in aten_schemas.schema_for("_flash_attention_forward", "2.11")
    assert "block_table" in aten_schemas.schema_for("_flash_attention_forward", "2.12")
    assert "seqused_k" not in aten_schemas.schema_for("_cudnn_attention_forward", "2.13")
    assert "seqused_k" in aten_schemas.schema_for("_cudnn_attention_forward", "2.14")
    assert aten_schemas.schema_for("_cudnn_attention_forward", "2.10") is None
    assert aten_schemas.torch_release("2.11.0+cu130") == "2.11"


def _raw(kernel, q, k, v, causal):
    """The op's own outputs (no glue), as cuda_blocks calls it."""
    if kernel == bb.FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=0.1)
    if kernel == bb.CUDNN:
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=0.1)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=0.1)


@pytest.mark.parametrize("kernel", [bb.FLASH, bb.EFFICIENT, bb.CUDNN])
def test_the_lse_layout_of_each_op(kernel):
    b, h, n, d = 2, 4, 40, 64
    q = torch.empty(b, h, n, d, **META)
    out, lse = _raw(kernel, q, q, q, True)[:2]
    assert out.shape == (b, h, n, d) and lse.dtype == torch.float32
    want = {bb.FLASH: (b, h, n), bb.CUDNN: (b, h, n, 1), bb.EFFICIENT: (b, h, math.ceil(n / 32) * 32)}[kernel]
    if kernel == bb.EFFICIENT and torch.version.hip:
        want = (b, h, n)
    assert tuple(lse.shape) == want, aten_schemas.LSE_LAYOUT[kernel]


# (q tokens, k tokens, causal): the block shapes the methods hand the kernels: ring's diagonal block (causal square),
# its off-diagonal blocks (full), head-tail chunks and halos (a causal rectangle, lower-right aligned)
_SHAPES = {"causal": (48, 48, True), "full": (48, 80, False), "rect": (48, 80, True)}


@pytest.mark.parametrize("kernel", [bb.FLASH, bb.EFFICIENT, bb.CUDNN])
@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("heads", ["gqa", "mla"])
def test_the_glue_on_the_meta_device(kernel, shape, heads):
    """cuda_blocks' forward and backward calls: every argument is one the op takes, the outputs come back as the
    block's shapes with an fp32 [B, H, n] LSE; a causal rectangle (a mask) goes to the memory-efficient kernel only."""
    n, m, causal = _SHAPES[shape]
    hq, hkv, d, dv = (8, 2, 64, 64) if heads == "gqa" else (4, 4, 72, 40)
    q, k, v = torch.empty(2, hq, n, d, **META), torch.empty(2, hkv, m, d, **META), torch.empty(2, hkv, m, dv, **META)
    if shape == "rect" and kernel != bb.EFFICIENT:
        with pytest.raises(ValueError, match="needs the memory-efficient kernel"):
            cuda_blocks._sdpa_forward(kernel, q, k, v, causal, 0.1, None)
        return
    out, lse = cuda_blocks._sdpa_forward(kernel, q, k, v, causal, 0.1, None)
    assert out.shape == (2, hq, n, dv) and lse.shape == (2, hq, n) and lse.dtype == torch.float32
    grads = cuda_blocks._sdpa_backward(kernel, torch.empty_like(out), q, k, v, out, lse, causal, 0.1, None)
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert all(g.dtype == torch.bfloat16 for g in grads)
