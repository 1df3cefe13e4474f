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

    for kernel in (bb.CUDNN, bb.FLASH, bb.EFFICIENT):  # the backward's RNG-state tensors, taken before the spy
        cuda_blocks._philox(kernel, q.device)
    monkeypatch.setattr(cuda_blocks, "_op", spy)
    for causal in (True, False):
        mk = n if causal else m  # causal: a square block (the diagonal); full: a rectangle (off-diagonal)
        ks, vs = k[:, :, :mk], v[:, :, :mk]
        o, l_ = cuda_blocks._sdpa_forward(bb.CUDNN, q, ks, vs, causal, 0.1, None)
        assert o.shape == (b, hq, n, d) and l_.shape == (b, hq, n)
        g = cuda_blocks._sdpa_backward(bb.CUDNN, torch.empty_like(o), q, ks, vs, o, l_, causal, 0.1, None)
        assert [tuple(x.shape) for x in g] == [tuple(q.shape), (b, hkv, mk, d), (b, hkv, mk, d)]
    assert seen and {h for _, h in seen} == {hkv}, seen
    seen.clear()  # the memory-efficient kernel keeps the repeat (flash: test_flash_takes_grouped_heads_...)
    cuda_blocks._sdpa_forward(bb.EFFICIENT, q, k[:, :, :n], v[:, :, :n], True, 0.1, None)
    assert seen == [("_scaled_dot_product_efficient_attention", hq)]


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


def _rect_attention(q, k, v, cu_q, cu_k, causal, scale):
    """Block ``i``: ``q[cu_q[i]:cu_q[i+1]]`` against ``k[cu_k[i]:cu_k[i+1]]`` (causal: square, top-left), fp64-exact
    math: ``out [Tq, H, D]``, ``lse [Tq, H]``, the probabilities per block."""
    outs, lses, probs = [], [], []
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        s = torch.einsum("nhd,mhd->hnm", q[a:b], k[c:e]) * scale
        if causal:
            s = s.masked_fill(~torch.ones(b - a, e - c, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None])
        outs.append(torch.einsum("hnm,mhd->nhd", p, v[c:e]))
        lses.append(lse.transpose(0, 1))
        probs.append(p)
    return torch.cat(outs), torch.cat(lses), probs


def _lse_of_op(lse_th: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` in the packed-row op's layout of the INSTALLED torch (aten_schemas.VARLEN_LSE_LAYOUT)."""
    layout = aten_schemas.varlen_lse_layout(aten_schemas.torch_release(torch.__version__)) or "HT"
    return lse_th.transpose(0, 1).contiguous() if layout == "HT" else lse_th[..., None].contiguous()


class _CudnnVarlenStandIn:
    """CPU stand-ins for ``_cudnn_attention_forward`` / ``_backward``: every call bound to the INSTALLED torch's
    schema (argument order, names, types), the packed-row contract of aten_schemas (q/k/v ``[T, H, D]`` with equal
    heads, ``cum_seq`` int32, causal only square with ONE offsets tensor for Q and K as torch 2.15 requires, the LSE
    fp32 in the installed release's layout: ``[H, T]`` on 2.14-2.15, ``[T, H, 1]`` before), per-block math inside."""

    calls: list = []
    #: the K/V head count each call received
    kv_heads: list = []

    def __call__(self, name):
        schema = getattr(torch.ops.aten, name).default._schema

        def call(*args, **kwargs):
            bound = _bind(schema, args, kwargs)
            self.calls.append((name, bool(bound["is_causal"])))
            return getattr(self, name)(bound)
        return call

    @staticmethod
    def _check(a):
        q, k, v, cq, ck = a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"]
        assert cq.dtype == ck.dtype == torch.int32 and a["attn_bias"] is None and a["dropout_p"] == 0.0
        assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1] and len(cq) == len(ck)
        if q.shape[1] != k.shape[1]:  # grouped K/V: only where the installed release's gate takes them (2.15)
            assert aten_schemas.cudnn_varlen_problem("2.15", 91900, causal=False, max_q=None, grouped=True) is None
        _CudnnVarlenStandIn.kv_heads.append(k.shape[1])
        if a["is_causal"]:
            assert ck is cq, "a causal packed call needs one offsets tensor for Q and K (torch 2.15's gate)"
        assert a["max_q"] == int((cq[1:] - cq[:-1]).max()) and a["max_k"] == int((ck[1:] - ck[:-1]).max())
        assert int(cq[-1]) == q.shape[0] and int(ck[-1]) == k.shape[0]
        return q, k, v, cq, ck

    @classmethod
    def _cudnn_attention_forward(cls, a):
        q, k, v, cq, ck = cls._check(a)
        assert a["compute_log_sumexp"]
        acc = torch.promote_types(q.dtype, torch.float32)  # the kernel accumulates in fp32 (fp64 stays fp64)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        out, lse, _ = _rect_attention(q.to(acc), k.to(acc), v.to(acc), cq, ck, a["is_causal"], a["scale"])
        return (out.to(q.dtype), _lse_of_op(lse.float()), cq, ck, a["max_q"], a["max_k"], torch.empty(()),
                torch.empty(()), None)

    @classmethod
    def _cudnn_attention_backward(cls, a):
        q, k, v, cq, ck = cls._check(a)
        lse = a["logsumexp"]
        assert lse.shape == _lse_of_op(torch.empty(q.shape[:2])).shape and lse.dtype == torch.float32
        dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
        g, hkv = q.shape[1] // k.shape[1], k.shape[1]
        q, k, v = q.to(acc), k.repeat_interleave(g, 1).to(acc), v.repeat_interleave(g, 1).to(acc)
        dout, out, scale = a["grad_out"].to(acc), a["out"].to(acc), a["scale"]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for s, e, c, f in zip(cq[:-1].tolist(), cq[1:].tolist(), ck[:-1].tolist(), ck[1:].tolist()):
            # the MERGED output's rowsum (what the kernel reads), and the probabilities of the merged LSE
            lse_rows = (lse.transpose(0, 1)[s:e] if lse.dim() == 2 else lse[s:e, :, 0]).to(acc)  # [n, H] -> p
            sc = torch.einsum("nhd,mhd->hnm", q[s:e], k[c:f]) * scale
            if a["is_causal"]:
                sc = sc.masked_fill(~torch.ones(e - s, f - c, dtype=torch.bool).tril(), float("-inf"))
            p = torch.exp(sc - lse_rows.transpose(0, 1)[..., None])
            do = dout[s:e]
            dv[c:f] += torch.einsum("hnm,nhd->mhd", p, do)
            dp = torch.einsum("nhd,mhd->hnm", do, v[c:f])
            ds = p * (dp - (do * out[s:e]).sum(-1).transpose(0, 1)[..., None]) * scale
            dq[s:e] += torch.einsum("hnm,mhd->nhd", ds, k[c:f])
            dk[c:f] += torch.einsum("hnm,nhd->mhd", ds, q[s:e])
        t = k.shape[0]  # grouped dK/dV: the query heads of a K/V head summed, as the op returns them
        dk, dv = dk.view(t, hkv, g, -1).sum(2), dv.view(t, hkv, g, -1).sum(2)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_the_cudnn_varlen_glue_against_the_installed_schema(monkeypatch, causal):
    """varlen_documents' cuDNN call (torch >= 2.14 with cuDNN >= 9.18 on Hopper: block_backend.varlen_choice): its
    arguments bind to the installed torch's ``_cudnn_attention_forward`` / ``_backward`` schemas, GQA K/V are repeated
    and their gradients summed back, and the result and the gradients equal per-document math (fp64)."""
    for op in aten_schemas.VARLEN_OPS:
        assert aten_schemas.installed_schema(op) is not None, op
    caps = bb.caps_for(bb.GpuInfo.named("h100"), "2.15.0", 91900)
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
        bb.CUDNN, "test", expand_kv=spec.grouped and not c.cudnn_varlen_gqa, varlen=True))
    _CudnnVarlenStandIn.kv_heads.clear()
    out = cuda_blocks.varlen_documents(q, k, v, cu, max(lens), causal, None, 0.25)
    assert _CudnnVarlenStandIn.kv_heads == [2]  # torch 2.15: grouped K/V reach the call as they are
    ref, _, _ = _doc_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, causal, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b_ in zip(got, want):
        assert a.shape == b_.shape
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)  # the LSE went through fp32, as on the GPU
    assert _CudnnVarlenStandIn.calls == [("_cudnn_attention_forward", causal), ("_cudnn_attention_backward", causal)]


def test_the_release_tables():
    """GROUPED_KV covers every supported release for cuDNN and flash; torch runs the packed-row cuDNN call from 2.14 with a
    cuDNN >= 9.18 on 9.x / 10.x; the positional part of the packed-row ops' schemas is the same in every release."""
    for r in aten_schemas.SUPPORTED_RELEASES:
        assert aten_schemas.takes_grouped_kv(bb.CUDNN, r) and aten_schemas.takes_grouped_kv(bb.FLASH, r)
        assert not aten_schemas.takes_grouped_kv(bb.EFFICIENT, r)
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


def test_the_packed_row_call_per_release():
    """Which packed-row cuDNN calls each torch release's own varlen_attn runs (aten_schemas.cudnn_varlen_problem, read
    from torch.nn.attention.varlen of 2.14.1 and 2.15.0): none before 2.14; full attention only on 2.14 (a causal call
    is window (-1, 0) there, which runs flash), past 128 query tokens; causal too from 2.15, and short query chunks
    with cuDNN >= 9.24. The LSE is [H, T] on 2.14-2.15 (VARLEN_LSE_LAYOUT)."""
    p = aten_schemas.cudnn_varlen_problem
    for r in ("2.11", "2.12", "2.13"):
        assert "never runs" in p(r, 92400, causal=False, max_q=None)
    assert p("2.14", 91900, causal=False, max_q=129) is None
    assert "full attention only" in p("2.14", 92400, causal=True, max_q=None)
    assert "not past 128" in p("2.14", 92400, causal=False, max_q=128)
    assert p("2.15", 91900, causal=True, max_q=129) is None
    assert "not past 128" in p("2.15", 91900, causal=True, max_q=128)
    assert p("2.15", 92400, causal=True, max_q=64) is None
    assert [aten_schemas.varlen_lse_layout(r) for r in aten_schemas.SUPPORTED_RELEASES] == ["TH1"] * 3 + ["HT"] * 2
    h100 = bb.GpuInfo.named("h100")
    full, causal = bb.BlockSpec(torch.bfloat16, 128, 128), bb.BlockSpec(torch.bfloat16, 128, 128, causal=True)
    c14, c15 = bb.caps_for(h100, "2.14.1", 91900), bb.caps_for(h100, "2.15.0", 91900)
    assert bb.packed_choice(full, c14, causal=False, max_q=200).kernel == bb.CUDNN
    assert bb.packed_choice(causal, c14, causal=True, max_q=200) is None
    assert "full attention only" in bb.packed_refusal(causal, c14, causal=True, max_q=200)
    assert bb.packed_choice(causal, c15, causal=True, max_q=200).kernel == bb.CUDNN
    assert bb.packed_choice(causal, c15, causal=True, max_q=100) is None
    assert bb.packed_choice(causal, bb.caps_for(h100, "2.15.0", 92400), causal=True, max_q=100).kernel == bb.CUDNN
    assert bb.packed_choice(causal, c15, bb.FLASH, causal=True, max_q=200) is None  # a flash pin: per-block flash
    assert "pins sdpa_flash" in bb.packed_refusal(causal, c15, bb.FLASH, causal=True, max_q=200)
    a100 = bb.caps_for(bb.GpuInfo.named("a100"), "2.15.0", 91900)
    assert bb.packed_choice(causal, a100, causal=True, max_q=200) is None  # auto: cuDNN not preferred on A100
    assert bb.packed_choice(bb.BlockSpec(torch.bfloat16, 128, 128, softcap=True), c15, causal=False, max_q=200) is None


def test_flash_takes_grouped_heads_on_the_meta_device(monkeypatch):
    """Flash with fewer K/V heads than Q heads (aten_schemas.GROUPED_KV, every release 2.11-2.15): the op's outputs are
    the query heads', its backward returns dK/dV at K/V's head count; the glue hands flash grouped K/V unrepeated
    (the memory-efficient kernel keeps the repeat)."""
    release = aten_schemas.torch_release(torch.__version__)
    if not aten_schemas.takes_grouped_kv(bb.FLASH, release):
        pytest.skip(f"torch {torch.__version__}: the table does not list grouped heads for flash")
    b, hq, hkv, n, m, d = 2, 8, 2, 48, 80, 64
    q, k, v = torch.empty(b, hq, n, d, **META), torch.empty(b, hkv, m, d, **META), torch.empty(b, hkv, m, d, **META)
    got = _raw(bb.FLASH, q, k, v, False)
    out, lse = got[:2]
    assert out.shape == (b, hq, n, d) and lse.shape == (b, hq, n)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        out, q, k, v, out, lse, got[2], got[3], n, m, 0.0, False, got[6], got[7], scale=0.1)
    assert [tuple(g.shape) for g in grads] == [(b, hq, n, d), (b, hkv, m, d), (b, hkv, m, d)]
    seen = []

    def spy(name):
        op = getattr(torch.ops.aten, name)

        def call(*args, **kwargs):
            seen.append((name, args[2].shape[1]))
            return op(*args, **kwargs)
        return call

    for kernel in (bb.CUDNN, bb.FLASH, bb.EFFICIENT):  # the backward's RNG-state tensors, taken before the spy
        cuda_blocks._philox(kernel, q.device)
    monkeypatch.setattr(cuda_blocks, "_op", spy)
    for causal in (True, False):
        mk = n if causal else m
        o, l_ = cuda_blocks._sdpa_forward(bb.FLASH, q, k[:, :, :mk], v[:, :, :mk], causal, 0.1, None)
        g = cuda_blocks._sdpa_backward(bb.FLASH, torch.empty_like(o), q, k[:, :, :mk], v[:, :, :mk], o, l_, causal, 0.1,
                                       None)
        assert [tuple(x.shape) for x in g] == [tuple(q.shape), (b, hkv, mk, d), (b, hkv, mk, d)]
    assert seen and {h for _, h in seen} == {hkv}, seen
    seen.clear()
    cuda_blocks._sdpa_forward(bb.EFFICIENT, q, k, v, False, 0.1, None)
    assert seen == [("_scaled_dot_product_efficient_attention", hq)]
    caps = bb.caps_for(bb.GpuInfo.named("a100"), torch.__version__.split("+")[0], 91900)
    assert caps.flash_gqa and not bb.expands_kv(bb.FLASH, bb.BlockSpec(torch.bfloat16, 64, 64, grouped=True), caps)


def _packed_caps(monkeypatch, version: str):
    """The CUDA slot made to see an H100 with ``version`` and cuDNN 9.19, the packed-row ops replaced by the stand-in
    bound to the installed schema, and the dtype gate lifted for fp64 (the gate's dtype rule is tested above; fp64
    makes the comparisons exact)."""
    import dataclasses

    caps = bb.caps_for(bb.GpuInfo.named("h100"), version, 91900)
    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: caps)
    monkeypatch.setattr(cuda_blocks, "_op", _CudnnVarlenStandIn())
    monkeypatch.setattr(cuda_blocks, "packed_choice", lambda spec, c, pinned=None, **kw: bb.packed_choice(
        dataclasses.replace(spec, dtype=torch.bfloat16), c, pinned, **kw))
    _CudnnVarlenStandIn.calls.clear()
    return caps


def _causal_docs(q, k, v, cu, scale):
    """Causal attention of every document alone, fp64 math on the global stream ``[T, H, D]`` (GQA by repeat)."""
    g = q.shape[1] // k.shape[1]
    return _rect_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), cu, cu, True, scale)[0]


@pytest.mark.parametrize("version, hkv", [("2.14.1", 4), ("2.15.0", 2)])
def test_thd_blocks_in_packed_calls_equal_each_document_alone(monkeypatch, version, hkv):
    """thd's gathered-K/V kernel with its prefix blocks (full) and diagonal blocks (causal) each in ONE packed-row cuDNN
    call where torch runs it (2.15: both, grouped K/V as they are; 2.14: the prefix blocks only, equal heads only, the
    diagonal blocks per block): every rank's output equals each document's causal attention alone, and its dQ / dK /
    dV (K/V gathered) equal that attention's gradients, fp64 (the LSE passes through fp32, as the op returns it)."""
    from automodel.distributed.cp import gathered_attention as ga
    from automodel.distributed.cp.layout import head_tail_indices

    _packed_caps(monkeypatch, version)
    world, lens = 2, [600, 520, 1040]  # chunks of 150, 130, 260 tokens: past 128
    cu_list = [0, *torch.tensor(lens).cumsum(0).tolist()]
    t, hq, d, scale = sum(lens), 4, 16, 0.25
    _CudnnVarlenStandIn.kv_heads.clear()
    gen = torch.Generator().manual_seed(0)
    qg, kg, vg = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv))
    cu = torch.tensor(cu_list, dtype=torch.int32)
    for rank in range(world):
        plan = ga.THDPlan(None, world, rank, cu_list, cu_list, max(lens))
        local = head_tail_indices(torch.tensor(cu_list), world, rank)
        q = qg[local].transpose(0, 1).unsqueeze(0)
        kh, vh = kg.transpose(0, 1).unsqueeze(0), vg.transpose(0, 1).unsqueeze(0)
        _CudnnVarlenStandIn.calls.clear()
        out, lse = ga._portable_forward(q, kh, vh, plan, scale)
        want_calls = [("_cudnn_attention_forward", False)] + ([("_cudnn_attention_forward", True)]
                                                              if version.startswith("2.15") else [])  # fmt: skip
        assert _CudnnVarlenStandIn.calls == want_calls, (rank, _CudnnVarlenStandIn.calls)
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (qg, kg, vg))
        ref = _causal_docs(qq, kk, vv, cu, scale)[local]
        torch.testing.assert_close(out[0].transpose(0, 1), ref.detach(), rtol=1e-6, atol=1e-6)
        dout = torch.randn(q.shape, dtype=torch.float64, generator=gen)
        dq, dkh, dvh = ga._portable_backward(dout, q, kh, vh, out, lse, plan, scale)
        want = torch.autograd.grad(ref, (qq, kk, vv), dout[0].transpose(0, 1))
        torch.testing.assert_close(dq[0].transpose(0, 1), want[0][local], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dkh[0].transpose(0, 1), want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dvh[0].transpose(0, 1), want[2], rtol=1e-5, atol=1e-6)
        assert [c for c in _CudnnVarlenStandIn.calls if c[0].endswith("backward")] == [
            ("_cudnn_attention_backward", c[1]) for c in want_calls]
    assert set(_CudnnVarlenStandIn.kv_heads) == {hkv}  # grouped K/V reach the call unrepeated
    with monkeypatch.context() as m:  # the same rank without the packed call: the per-block loop, the same numbers
        m.setattr(cuda_blocks, "cuda_caps", lambda device: None)
        out_blocks, lse_blocks = ga._portable_forward(q, kh, vh, plan, scale)
    torch.testing.assert_close(out, out_blocks, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), lse_blocks.double(), rtol=1e-6, atol=1e-6)


def test_thd_docs_blocks_in_packed_calls_equal_each_document_alone(monkeypatch):
    """thd_docs' document blocks with a split document (its prefix keys partly borrowed from the other rank) in two
    packed-row calls (torch 2.15): each rank's output equals each document's causal attention alone; the gradients
    (dQ, this rank's dK/dV, and the dK/dV given back for the borrowed chunks) equal the per-block loop's."""
    from automodel.distributed.cp.thd_docs import attention as da
    from automodel.distributed.cp.thd_docs.placement import CostModel, plan_documents

    _packed_caps(monkeypatch, "2.15.0")
    lens, world, hq, hkv, d, scale = [1400, 300, 260], 2, 4, 2, 16, 0.25
    placement = plan_documents(lens, world, CostModel())
    assert placement.spans, "the test needs a split document"
    t = sum(lens)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()[:-1]]
    gen = torch.Generator().manual_seed(1)
    qg, kg, vg = (torch.randn(t, h, d, dtype=torch.float64, generator=gen) for h in (hq, hkv, hkv))
    plans, local = [], []
    for r in range(world):
        plans.append(da.DocPlan(None, world, r, placement, max(lens)))
        local.append(torch.cat([torch.arange(starts[p.doc] + p.start, starts[p.doc] + p.end) for p in placement.ranks[r]]))
    kvs = [torch.cat([kg[i], vg[i]], -1).transpose(0, 1).unsqueeze(0) for i in local]  # [1, Hkv, T_r, 2D]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    ref = _causal_docs(qg, kg, vg, cu, scale)
    for r in range(world):
        plan = plans[r]
        got = {key: kvs[peer][:, :, plans[peer].offset(key) : plans[peer].offset(key) + plans[peer].size(key)]
               for peer in plan.peers() for key in plan.messages(peer, r)}  # what lend() brings
        q = qg[local[r]].transpose(0, 1).unsqueeze(0)
        _CudnnVarlenStandIn.calls.clear()
        out, lse = da._forward(q, kvs[r], d, plan, got, scale, None)
        assert sorted(_CudnnVarlenStandIn.calls) == [("_cudnn_attention_forward", False), ("_cudnn_attention_forward", True)]
        torch.testing.assert_close(out[0].transpose(0, 1), ref[local[r]], rtol=1e-6, atol=1e-6)
        dout = torch.randn(q.shape, dtype=torch.float64, generator=gen)
        results = []
        for packed in (True, False):
            lent_seen: dict = {}
            monkeypatch.setattr(da, "give_back", lambda plan_, lent, dkv, seen=lent_seen: seen.update(lent))
            with monkeypatch.context() as m:
                if not packed:
                    m.setattr(cuda_blocks, "cuda_caps", lambda device: None)
                dq, dkv = da._backward(dout, q, kvs[r], d, out, lse, plan, got, scale, None)
            results.append((dq, dkv, dict(lent_seen)))
        (dq, dkv, lent), (dq0, dkv0, lent0) = results
        torch.testing.assert_close(dq, dq0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dkv, dkv0, rtol=1e-5, atol=1e-6)
        assert sorted(lent) == sorted(lent0) == sorted(got)
        for key in lent:
            torch.testing.assert_close(lent[key], lent0[key], rtol=1e-5, atol=1e-6)


def test_torch_214_keeps_grouped_blocks_out_of_the_packed_call():
    """torch 2.14's varlen_attn hands the packed-row call equal head counts only: grouped blocks keep per-block cuDNN
    (K/V grouped there) instead of a repeat of the whole row's keys; 2.15 takes them grouped."""
    h100 = bb.GpuInfo.named("h100")
    gqa = bb.BlockSpec(torch.bfloat16, 128, 128, grouped=True)
    c14, c15 = bb.caps_for(h100, "2.14.1", 91900), bb.caps_for(h100, "2.15.0", 91900)
    assert bb.packed_choice(gqa, c14, causal=False, max_q=200) is None
    assert "equal head counts only" in bb.packed_refusal(gqa, c14, causal=False, max_q=200)
    assert bb.packed_choice(gqa, c15, causal=False, max_q=200).kernel == bb.CUDNN
    assert "not GQA" in aten_schemas.cudnn_varlen_problem("2.14", 91900, causal=False, max_q=None, grouped=True)


def test_cudnn_packed_blocks_off_runs_one_call_per_block(monkeypatch):
    """model.cudnn_packed_blocks=false (the train context's packed_blocks_context(False)): where the GPU and torch
    take a block set in one packed-row call, packed_takes says no (each block runs its own cuDNN call), on again
    outside the block; a value that is not a bool is refused."""
    from automodel.distributed.cp import attention_kernels as ak
    from automodel.distributed.cp import cuda_blocks

    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: bb.caps_for(bb.GpuInfo.named("h100"), "2.15.0", 91900))
    q = torch.empty(300, 8, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(300, 2, 128, dtype=torch.bfloat16, device="meta")
    assert cuda_blocks.packed_takes(q, k, k, [0, 150, 300], causal=True)
    with ak.packed_blocks_context(False):
        assert not ak.packed_blocks_enabled()
        assert not cuda_blocks.packed_takes(q, k, k, [0, 150, 300], causal=True)
        assert cuda_blocks.packed_forward(q, k, k, [0, 150, 300], [0, 150, 300], True, None) is None
    assert cuda_blocks.packed_takes(q, k, k, [0, 150, 300], causal=True)
    with pytest.raises(TypeError, match="cudnn_packed_blocks must be true or false"):
        with ak.packed_blocks_context("no"):
            pass


def test_the_plans_packed_call_term(monkeypatch):
    """The memory plan's term for the packed-row calls of thd / thd_docs / usp (block_sets.packed_call_bytes): the
    key stream's K/V copies and the calls' dK/dV (4 x Hkv D per key token), the diagonal set's (4 x Hkv D per query
    token) and the set in flight's q-sized copies (5 x Hq D per query token); only for cuDNN, and only on a torch
    whose varlen_attn runs the call for these heads (the plan's own torch: 2.15, or 2.14 with equal heads)."""
    from automodel.distributed.cp.block_sets import packed_call_bytes

    kv, q = 2 * 128, 8 * 128
    want = (4 * kv * 1000 + (4 * kv + 5 * q) * 100) * 2
    for version, grouped_bytes, equal_bytes in (("2.13.0", 0, 0), ("2.14.1", 0, (4 * q * 1000 + 9 * q * 100) * 2),
                                                ("2.15.0", want, (4 * q * 1000 + 9 * q * 100) * 2)):
        monkeypatch.setattr(torch, "__version__", version)
        assert packed_call_bytes(kv, q, 1000, 100, 2, bb.CUDNN) == grouped_bytes, version
        assert packed_call_bytes(q, q, 1000, 100, 2, bb.CUDNN) == equal_bytes, version
        assert packed_call_bytes(kv, q, 1000, 100, 2, bb.FLASH) == 0
        assert packed_call_bytes(q, q, 1000, 100, 2, bb.CUDNN, enabled=False) == 0  # model.cudnn_packed_blocks=false
