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


def test_cudnn_takes_grouped_heads_on_the_meta_device(monkeypatch):
    """cuDNN with fewer K/V heads than Q heads (GQA, aten_schemas.GROUPED_KV): the op's own outputs are the query
    heads' ([B, Hq, n, Dv], LSE [B, Hq, n, 1]); its backward returns dK/dV in K/V's head count; the glue hands the op
    grouped K/V (no repeat) and returns grouped gradients."""
    release = aten_schemas.torch_release(torch.__version__)
    if not aten_schemas.takes_grouped_kv(bb.CUDNN, release):
        pytest.skip(f"torch {torch.__version__}: the table does not list grouped heads for cuDNN")
    b, hq, hkv, n, m, d = 2, 8, 2, 48, 80, 64
    q, k, v = torch.empty(b, hq, n, d, **META), torch.empty(b, hkv, m, d, **META), torch.empty(b, hkv, m, d, **META)
    out, lse, _, _, max_q, max_k, seed, offset, _ = _raw(bb.CUDNN, q, k, v, False)
    assert out.shape == (b, hq, n, d) and lse.shape == (b, hq, n, 1) and (max_q, max_k) == (n, m)
    grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        out, q, k, v, out, lse, seed, offset, None, None, None, n, m, 0.0, False, scale=0.1)
    assert [tuple(g.shape) for g in grads] == [(b, hq, n, d), (b, hkv, m, d), (b, hkv, m, d)]
    seen = []

    def spy(name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            seen.append((name, args[2].shape[1]))  # the key's head count the op received
            return op(*args, **kwargs)
        return call

    monkeypatch.setattr(cuda_blocks, "_op", spy)
    for causal in (True, False):
        mk = n if causal else m  # causal: a square block (the diagonal); full: a rectangle (off-diagonal)
        ks, vs = k[:, :, :mk], v[:, :, :mk]
        o, l_ = cuda_blocks._sdpa_forward(bb.CUDNN, q, ks, vs, causal, 0.1, None)
        assert o.shape == (b, hq, n, d) and l_.shape == (b, hq, n)
        g = cuda_blocks._sdpa_backward(bb.CUDNN, torch.empty_like(o), q, ks, vs, o, l_, causal, 0.1, None)
        assert [tuple(x.shape) for x in g] == [tuple(q.shape), (b, hkv, mk, d), (b, hkv, mk, d)]
    assert seen and {h for _, h in seen} == {hkv}, seen
    seen.clear()  # flash keeps the repeat
    cuda_blocks._sdpa_forward(bb.FLASH, q, k[:, :, :n], v[:, :, :n], True, 0.1, None)
    assert seen == [("_scaled_dot_product_flash_attention", hq)]


def _bind(schema, args, kwargs) -> dict:
    """``args`` / ``kwargs`` bound to ``schema``'s arguments by name, each checked against its declared type (what
    the dispatcher would accept), defaults filled in; raises AssertionError naming the argument otherwise."""
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    assert len(args) <= len(positional), f"{len(args)} positional arguments, the schema takes {len(positional)}"
    bound = {a.name: v for a, v in zip(positional, args)}
    for name, value in kwargs.items():
        arg = next((a for a in params if a.name == name), None)
        assert arg is not None and name not in bound, f"unknown or repeated argument {name!r}"
        bound[name] = value
    for a in params:
        if a.name not in bound:
            assert a.has_default_value(), f"argument {a.name!r} missing"
            bound[a.name] = a.default_value
        value, kind = bound[a.name], str(a.type)
        if kind.endswith("?") and value is None:
            continue
        want = {"Tensor": (torch.Tensor, type(None)), "SymInt": int, "int": int, "bool": bool, "float": float}
        base = kind.rstrip("?")
        if base in want:
            assert isinstance(value, want[base]), f"argument {a.name!r} ({kind}) got {type(value).__name__}"
    return bound


def _doc_attention(q, k, v, cu, causal, scale):
    """Per-document attention of a packed stream (fp64 math): ``out [T, H, D]``, ``lse [T, H]``, probabilities."""
    outs, lses, probs = [], [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        s = torch.einsum("nhd,mhd->hnm", q[a:b], k[a:b]) * scale
        if causal:
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None])
        outs.append(torch.einsum("hnm,mhd->nhd", p, v[a:b]))
        lses.append(lse.transpose(0, 1))
        probs.append(p)
    return torch.cat(outs), torch.cat(lses), probs


class _CudnnVarlenStandIn:
    """CPU stand-ins for ``_cudnn_attention_forward`` / ``_backward``: every call bound to the INSTALLED torch's
    schema (argument order, names, types), the packed-row contract of aten_schemas (q/k/v ``[T, H, D]`` with equal
    heads, ``cum_seq`` int32, LSE ``[T, H, 1]`` fp32 handed back unchanged), per-document math inside."""

    calls: list = []

    def __call__(self, name):
        schema = getattr(torch.ops.aten, name).default._schema

        def call(*args, **kwargs):
            bound = _bind(schema, args, kwargs)
            self.calls.append(name)
            return getattr(self, name)(bound)
        return call

    @staticmethod
    def _cudnn_attention_forward(a):
        q, k, v, cu = a["query"], a["key"], a["value"], a["cum_seq_q"]
        assert a["cum_seq_k"] is cu and cu.dtype == torch.int32 and a["attn_bias"] is None
        assert q.shape[1] == k.shape[1] == v.shape[1] and a["compute_log_sumexp"] and a["dropout_p"] == 0.0
        assert a["max_q"] == a["max_k"] == int((cu[1:] - cu[:-1]).max())
        acc = torch.promote_types(q.dtype, torch.float32)  # the kernel accumulates in fp32 (fp64 stays fp64)
        out, lse, _ = _doc_attention(q.to(acc), k.to(acc), v.to(acc), cu, a["is_causal"], a["scale"])
        return (out.to(q.dtype), lse.float()[..., None], cu, cu, a["max_q"], a["max_k"], torch.empty(()),
                torch.empty(()), None)

    @staticmethod
    def _cudnn_attention_backward(a):
        q, k, v, cu, lse = a["query"], a["key"], a["value"], a["cum_seq_q"], a["logsumexp"]
        assert lse.shape == (*q.shape[:2], 1) and lse.dtype == torch.float32 and a["attn_bias"] is None
        dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        _, _, probs = _doc_attention(q, k, v, cu, a["is_causal"], a["scale"])
        dout, out, scale = a["grad_out"].to(acc), a["out"].to(acc), a["scale"]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (s, e), p in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), probs):
            do = dout[s:e]
            dv[s:e] = torch.einsum("hnm,nhd->mhd", p, do)
            dp = torch.einsum("nhd,mhd->hnm", do, v[s:e])
            ds = p * (dp - (do * out[s:e]).sum(-1).transpose(0, 1)[..., None]) * scale
            dq[s:e] = torch.einsum("hnm,mhd->nhd", ds, k[s:e])
            dk[s:e] = torch.einsum("hnm,nhd->mhd", ds, q[s:e])
        return dq.to(dtype), dk.to(dtype), dv.to(dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_the_cudnn_varlen_glue_against_the_installed_schema(monkeypatch, causal):
    """varlen_documents' cuDNN call (torch >= 2.14 with cuDNN >= 9.18 on Hopper: block_backend.varlen_choice): its
    arguments bind to the installed torch's ``_cudnn_attention_forward`` / ``_backward`` schemas, GQA K/V are repeated
    and their gradients summed back, and the result and the gradients equal per-document math (fp64)."""
    for op in aten_schemas.VARLEN_OPS:
        assert aten_schemas.installed_schema(op) is not None, op
    caps = bb.caps_for(bb.GpuInfo.named("h100"), "2.14.1", 91900)
    assert caps.cudnn_varlen and caps.cudnn_preferred
    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: caps)
    monkeypatch.setattr(cuda_blocks, "_op", _CudnnVarlenStandIn())
    _CudnnVarlenStandIn.calls.clear()
    lens = [150, 200, 140]
    g = torch.Generator().manual_seed(0)
    t = sum(lens)
    q = torch.randn(t, 4, 16, dtype=torch.float64, generator=g).requires_grad_(True)
    k, v = (torch.randn(t, 2, 16, dtype=torch.float64, generator=g).requires_grad_(True) for _ in range(2))
    cu = torch.tensor([0, 150, 350, 490], dtype=torch.int32)
    spec_caps = cuda_blocks.varlen_choice  # the selection the glue follows: cuDNN for these documents
    assert spec_caps(bb.BlockSpec(torch.bfloat16, 16, 16, causal=causal, grouped=True), caps, max_len=200).kernel == bb.CUDNN
    # fp64 stands in for bf16 so the check is exact: the dtype gate is the selection's, tested above
    monkeypatch.setattr(cuda_blocks, "varlen_choice", lambda spec, c, pinned=None, **kw: bb.Choice(
        bb.CUDNN, "test", expand_kv=spec.grouped, varlen=True))
    out = cuda_blocks.varlen_documents(q, k, v, cu, max(lens), causal, None, 0.25)
    ref, _, _ = _doc_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, causal, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b_ in zip(got, want):
        assert a.shape == b_.shape
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)  # the LSE went through fp32, as on the GPU
    assert _CudnnVarlenStandIn.calls == ["_cudnn_attention_forward", "_cudnn_attention_backward"]


def test_the_release_tables():
    """GROUPED_KV covers every supported release for cuDNN; torch runs the packed-row cuDNN call from 2.14 with a
    cuDNN >= 9.18 on 9.x / 10.x; the positional part of the packed-row ops' schemas is the same in every release."""
    for r in aten_schemas.SUPPORTED_RELEASES:
        assert aten_schemas.takes_grouped_kv(bb.CUDNN, r) and not aten_schemas.takes_grouped_kv(bb.FLASH, r)
        runs = aten_schemas.cudnn_varlen_runs(r, 91900, (9, 0))
        assert runs == (r in ("2.14", "2.15")), r
    assert not aten_schemas.cudnn_varlen_runs("2.15", 91700, (9, 0))
    assert not aten_schemas.cudnn_varlen_runs("2.15", 91900, (8, 0))
    assert aten_schemas.cudnn_varlen_runs("2.15", 91900, (10, 3))
    assert not aten_schemas.takes_grouped_kv(bb.CUDNN, "2.10")
    assert [aten_schemas.varlen_follows_sdpa(r) for r in aten_schemas.SUPPORTED_RELEASES] == [False] * 4 + [True]
    for op in aten_schemas.VARLEN_OPS:
        firsts = {aten_schemas.schema_for(op, r).split(", *")[0] for r in aten_schemas.SUPPORTED_RELEASES}
        assert len(firsts) == 1, op
