"""The CUDA slot of cp/blocks.py on CPU: the kernel-selection table case by case, FlexAttention's numerics
(forward, LSE, explicit merged backward, autograd) against the math blocks for every layer kind, and the
SDPA glue (padding, GQA, bias, LSE padding, merged backward) against stand-ins for the CUDA-only ops."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from automodel.distributed.cp import block_backend as bb
from automodel.distributed.cp import blocks, cuda_blocks

H100 = bb.CudaCaps(capability=(9, 0), flash_op=True, efficient_op=True, flex=True, varlen=True)
V100 = bb.CudaCaps(capability=(7, 0), flash_op=True, efficient_op=True, flex=True, varlen=False)
NO_FLEX = bb.CudaCaps(capability=(9, 0), flash_op=True, efficient_op=True, flex=False)
NO_OPS = bb.CudaCaps(capability=(9, 0), flash_op=False, efficient_op=False, flex=False)
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def _spec(dtype=BF16, d=64, dv=64, **kw):
    return bb.BlockSpec(dtype=dtype, head_dim=d, value_dim=dv, **kw)


@pytest.mark.parametrize(
    "device, spec, caps, kernel",
    [
        ("cpu", _spec(), H100, bb.MATH),  # not this slot's device
        ("cuda", _spec(), None, bb.MATH),  # unknown device
        ("cuda", _spec(), H100, bb.FLASH),  # causal / full square bf16
        ("cuda", _spec(causal=True), H100, bb.FLASH),
        ("cuda", _spec(torch.float16, causal=True, grouped=True), H100, bb.FLASH),  # GQA: K/V repeated
        ("cuda", _spec(d=192, dv=128, causal=True), H100, bb.FLASH),  # MLA: padded to 192
        ("cuda", _spec(d=320, dv=320), H100, bb.EFFICIENT),  # beyond flash's 256
        ("cuda", _spec(F32, causal=True), H100, bb.EFFICIENT),  # fp32: no flash
        ("cuda", _spec(causal=True, square=False), H100, bb.EFFICIENT),  # rectangular causal: a bias
        ("cuda", _spec(masked=True), H100, bb.EFFICIENT),  # window / chunk / document mask
        ("cuda", _spec(F32, masked=True), H100, bb.EFFICIENT),
        ("cuda", _spec(masked=True), bb.CudaCaps((9, 0), efficient_op=False), bb.FLEX),
        ("cuda", _spec(softcap=True, causal=True), H100, bb.FLEX),
        ("cuda", _spec(sinks=True, masked=True), H100, bb.FLEX),
        ("cuda", _spec(F32, sinks=True), H100, bb.FLEX),
        ("cuda", _spec(softcap=True), NO_FLEX, bb.MATH),  # no FlexAttention: exact math with a warning
        ("cuda", _spec(sinks=True), NO_FLEX, bb.MATH),
        ("cuda", _spec(F64), H100, bb.MATH),  # fp64: no fused kernel
        ("cuda", _spec(), V100, bb.MATH),  # bf16 below sm80
        ("cuda", _spec(torch.float16), V100, bb.EFFICIENT),  # fp16 below sm80: no flash
        ("cuda", _spec(), NO_OPS, bb.MATH),
        ("cuda", _spec(masked=True), NO_OPS, bb.MATH),
        ("cuda", _spec(), bb.CudaCaps((9, 0), flash_op=False, efficient_op=False, flex=True), bb.FLEX),
    ],
)
def test_selection_table(device, spec, caps, kernel):
    choice = bb.select_backend(device, spec, caps)
    assert choice.kernel == kernel, choice
    assert choice.reason


H100_CUDNN = bb.CudaCaps(capability=(9, 0), flash_op=True, efficient_op=True, flex=True, varlen=True, cudnn_op=True)


@pytest.mark.parametrize(
    "spec, pinned, caps, problem",
    [
        (_spec(causal=True, grouped=True), bb.CUDNN, H100_CUDNN, None),
        (_spec(causal=True), bb.CUDNN, H100, "no sdpa_cudnn op"),
        (_spec(d=192, dv=192), bb.CUDNN, H100_CUDNN, "up to 128"),
        (_spec(masked=True), bb.CUDNN, H100_CUDNN, "no mask"),
        (_spec(causal=True, square=False), bb.FLASH, H100, "no mask"),
        (_spec(F32), bb.FLASH, H100, "fp16/bf16"),
        (_spec(softcap=True), bb.EFFICIENT, H100, "FlexAttention"),
        (_spec(masked=True), bb.EFFICIENT, H100, None),
        (_spec(sinks=True), bb.FLEX, NO_FLEX, "not available"),
        (_spec(F64, sinks=True), bb.MATH, NO_OPS, None),
    ],
)
def test_a_pinned_kernel_runs_every_block_or_raises(spec, pinned, caps, problem):
    """model.attention_backend pins a kernel: the selection returns it for every block it takes, and a block it
    cannot take is a ValueError naming the pin and the reason (never another kernel)."""
    if problem is None:
        assert bb.select_backend("cuda", spec, caps, pinned).kernel == pinned
        return
    with pytest.raises(ValueError, match=rf"pins '{pinned}'.*{problem}"):
        bb.select_backend("cuda", spec, caps, pinned)


def test_the_pin_reaches_the_cuda_slot(monkeypatch):
    """attention_backend_context pins the block kernel the CUDA slot runs (stand-in ops on CPU); auto and a CPU
    device change nothing."""
    from automodel.distributed.cp import attention_kernels as ak

    seen = []
    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: H100_CUDNN)
    monkeypatch.setattr(cuda_blocks, "_op", _Ops())
    monkeypatch.setattr(cuda_blocks, "_philox", lambda kernel, device: (torch.empty(()), torch.empty(())))
    real = bb.select_backend
    monkeypatch.setattr(cuda_blocks, "select_backend",
                        lambda dev, spec, caps, pinned=None: seen.append(pinned) or real("cuda", spec, caps, pinned))
    q, k, v = _inputs(d=8, dv=8)
    q, k, v = (t.to(BF16) for t in (q, k, v))
    with ak.attention_backend_context("auto"):
        cuda_blocks.cuda_block_forward(q, k, v, True, None, None, None, None)
    with ak.attention_backend_context("cudnn", device_type="cpu"):
        cuda_blocks.cuda_block_forward(q, k, v, True, None, None, None, None)
    ak._PINNED.append(bb.CUDNN)  # what the context pushes on CUDA (its sdpa_kernel part needs no GPU to test)
    try:
        cuda_blocks.cuda_block_forward(q, k, v, True, None, None, None, None)
        with pytest.raises(ValueError, match="pins 'sdpa_cudnn'"):
            cuda_blocks.cuda_block_forward(q, k, v, True, None, torch.ones(12, 12, dtype=torch.bool), None, None)
    finally:
        ak._PINNED.pop()
    assert seen[:3] == [None, None, bb.CUDNN]
    with pytest.raises(ValueError, match="not one of"):
        with ak.attention_backend_context("fa3"):
            pass


def test_varlen_padding_and_layer_kind():
    assert bb.varlen_applies(_spec(causal=True), H100)
    assert not bb.varlen_applies(_spec(causal=True), V100)  # no varlen / sm70
    assert not bb.varlen_applies(_spec(F32), H100)
    assert not bb.varlen_applies(_spec(d=192, dv=128), H100)
    assert not bb.varlen_applies(_spec(masked=True), H100)
    assert not bb.varlen_applies(_spec(softcap=True), H100)
    assert bb.padded_head_dim(_spec(d=192, dv=128)) == 192
    assert bb.padded_head_dim(_spec(d=60, dv=60)) == 64
    assert bb.layer_kind(_spec(sinks=True, masked=True, causal=True)) == "sinks masked (window/chunk/document) causal"
    assert bb.layer_kind(_spec(d=192, dv=128, grouped=True)) == "MLA GQA full"


def test_math_fallback_warns_once_per_layer_kind(caplog, monkeypatch):
    monkeypatch.setattr(cuda_blocks, "_WARNED", set())
    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: NO_FLEX)
    monkeypatch.setattr(cuda_blocks, "select_backend", lambda dev, spec, caps, pinned=None: bb.select_backend("cuda", spec, caps))
    q = torch.randn(1, 2, 4, 8)
    with caplog.at_level(logging.WARNING, logger="automodel.distributed.cp.blocks"):
        for _ in range(3):
            assert cuda_blocks.cuda_block_forward(q, q, q, False, None, None, None, 5.0) is None  # math on CPU too
        assert cuda_blocks.cuda_block_forward(q.double(), q.double(), q.double(), False, None, None, None, None) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "softcap full" in lines[0] and "FlexAttention" in lines[0]
    assert "full" in lines[1] and "float64" in lines[1]


# ---------------------------------------------------------------------------------------------------------
# numerics against the math blocks (fp64 on CPU)


def _inputs(hq=4, hkv=2, n=12, m=12, d=8, dv=8, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = dict(dtype=torch.float64, generator=g)
    return torch.randn(b, hq, n, d, **f), torch.randn(b, hkv, m, d, **f), torch.randn(b, hkv, m, dv, **f)


def _kinds(n=12, m=12, hq=4):
    doc = torch.zeros(n, m, dtype=torch.bool)
    doc[:5, :5] = True
    doc[5:, 5:] = True
    i = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None]
    window = (j <= i) & (j > i - 4)
    chunk = (j <= i) & (i // 5 == j // 5)
    sinks = torch.randn(hq, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    return {
        "causal": dict(causal=True),
        "per-document": dict(causal=True, allowed=doc),
        "window": dict(allowed=window),
        "chunk": dict(allowed=chunk),
        "softcap": dict(causal=True, softcap=3.0),
        "sinks": dict(causal=True, sinks=sinks),
        "full": dict(),
    }


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """FlexAttention refuses a backward on CPU; its eager form computes one fine (it is the reference
    implementation), so the check is lifted for these tests."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(flex, "_validate_device", lambda *a, **k: None)


@pytest.mark.parametrize(
    "kind, shape",
    [("causal", "gqa"), ("per-document", "gqa"), ("window", "mla"), ("chunk", "gqa"), ("softcap", "gqa"),
     ("sinks", "mla"), ("sinks", "gqa"), ("full", "mla")],
)
def test_flex_matches_the_math_blocks(flex_on_cpu, kind, shape):
    dims = dict(d=8, dv=8) if shape == "gqa" else dict(hq=2, hkv=2, d=12, dv=8)
    q, k, v = _inputs(**dims)
    kw = _kinds(hq=q.shape[1])[kind]
    ref_out, ref_lse = blocks.block_forward(q, k, v, scale=0.4, backend="math", **kw)
    out, lse = blocks.block_forward(q, k, v, scale=0.4, kernel="flex", **kw)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    # the explicit backward with merged out / lse (as the blocked kernels call it): merge a second block
    q2, k2, v2 = _inputs(**dims, seed=1)
    o2, l2 = blocks.block_forward(q, k2, v2, scale=0.4, backend="math")
    mo, ml = blocks.merge(ref_out, ref_lse, o2, l2)
    dout = torch.randn_like(mo)
    bw = {key: val for key, val in kw.items() if key != "sinks"}
    ref = blocks.block_backward(dout, q, k, v, mo, ml, scale=0.4, backend="math", **bw)
    got = blocks.block_backward(dout, q, k, v, mo, ml, scale=0.4, kernel="flex", **bw)
    for a, b_ in zip(got, ref):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)
    # autograd through the forward (the halo kernel's use), sinks' gradient included
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sinks = kw.get("sinks")
    extra = [sinks.clone().requires_grad_(True)] if sinks is not None else []
    akw = dict(kw, **({"sinks": extra[0]} if extra else {}))
    o, _ = blocks.block_forward(*leaves, scale=0.4, kernel="flex", **akw)
    got = torch.autograd.grad(o, leaves + extra, dout)
    leaves_r = [t.clone().requires_grad_(True) for t in (q, k, v)]
    extra_r = [sinks.clone().requires_grad_(True)] if sinks is not None else []
    rkw = dict(kw, **({"sinks": extra_r[0]} if extra_r else {}))
    o_r, _ = blocks.block_forward(*leaves_r, scale=0.4, backend="math", **rkw)
    ref = torch.autograd.grad(o_r, leaves_r + extra_r, dout)
    for a, b_ in zip(got, ref):
        torch.testing.assert_close(a, b_, rtol=0, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# the SDPA glue against CPU stand-ins for the CUDA-only ops (their documented contracts)


def _ref_attn(q, k, v, bias, causal, scale):
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse, s


def _ref_bwd(dout, q, k, v, bias, out, lse, causal, scale):
    assert q.shape[1] == k.shape[1] == v.shape[1], "the stand-in takes repeated K/V only"
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0, "padded head sizes"
    _, _, s = _ref_attn(q, k, v, bias, causal, scale)
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.transpose(-1, -2) @ q, dv


class _Ops:
    """CPU stand-ins with the CUDA ops' signatures and output layouts (efficient: LSE padded to 32)."""

    def __call__(self, name):
        return getattr(self, name)

    #: the K/V head counts the flash stand-in received (grouped heads go to flash as they are)
    flash_kv_heads: list = []

    @staticmethod
    def _scaled_dot_product_flash_attention(q, k, v, p, causal, debug, *, scale):
        assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
        _Ops.flash_kv_heads.append(k.shape[1])
        g = q.shape[1] // k.shape[1]  # flash takes grouped heads (aten_schemas.GROUPED_KV)
        out, lse, _ = _ref_attn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, causal, scale)
        return out, lse.float(), None, None, q.shape[2], k.shape[2], torch.empty(2), torch.empty(()), None

    @staticmethod
    def _scaled_dot_product_efficient_attention(q, k, v, bias, want_lse, p, causal, *, scale):
        out, lse, _ = _ref_attn(q, k, v, bias, causal, scale)
        n = q.shape[2]
        padded = lse.new_full((*lse.shape[:-1], -(-n // 32) * 32), float("nan"))
        padded[..., :n] = lse
        return out, padded.float(), torch.empty(()), torch.empty(())

    #: the K/V head counts the cuDNN stand-in received (grouped heads go to cuDNN as they are)
    cudnn_kv_heads: list = []

    @staticmethod
    def _scaled_dot_product_cudnn_attention(q, k, v, bias, want_lse, p, causal, debug, *, scale):
        assert bias is None and want_lse and q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
        _Ops.cudnn_kv_heads.append(k.shape[1])
        g = q.shape[1] // k.shape[1]  # cuDNN takes grouped heads (aten_schemas.GROUPED_KV)
        out, lse, _ = _ref_attn(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, causal, scale)
        return out, lse.float()[..., None], None, None, q.shape[2], k.shape[2], torch.empty(()), torch.empty(()), None

    @staticmethod
    def _scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, s1, s2, bias, cq, ck, n, m, p, causal,
                                                     *, scale):  # fmt: skip
        assert lse.shape == (*q.shape[:3], 1) and bias is None and (n, m) == (q.shape[2], k.shape[2])
        _Ops.cudnn_kv_heads.append(k.shape[1])
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = _ref_bwd(dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, out,
                              lse[..., 0].to(q.dtype), causal, scale)  # fmt: skip
        b, _, m_, d = dk.shape
        # grouped dK/dV, in K/V's own head count, as the op returns them
        return dq, dk.view(b, k.shape[1], g, m_, d).sum(2), dv.view(b, v.shape[1], g, m_, dv.shape[-1]).sum(2)

    @staticmethod
    def _scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, cq, ck, n, m, p, causal, s1, s2, *, scale):
        assert lse.shape == q.shape[:3]
        _Ops.flash_kv_heads.append(k.shape[1])
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = _ref_bwd(dout, q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), None, out,
                              lse.to(q.dtype), causal, scale)  # fmt: skip
        b, _, m_, d = dk.shape
        # grouped dK/dV, in K/V's own head count, as mha_bwd returns them (after summing its dk_expanded)
        return dq, dk.view(b, k.shape[1], g, m_, d).sum(2), dv.view(b, v.shape[1], g, m_, dv.shape[-1]).sum(2)

    @staticmethod
    def _scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, s1, s2, p, mask, causal, *, scale
    ):
        n = q.shape[2]
        assert lse.shape[-1] == -(-n // 32) * 32 and mask == [True, True, True, False]
        if bias is not None:
            assert bias.shape == (q.shape[0], q.shape[1], n, k.shape[2]) and bias.stride(-2) % 16 == 0
        return (*_ref_bwd(dout, q, k, v, bias, out, lse[..., :n].to(q.dtype), causal, scale), None)


_SDPA_CASES = [(bb.EFFICIENT, kind) for kind in ("causal", "per-document", "window", "chunk", "full", "rect")]
_SDPA_CASES += [(k, kind) for k in (bb.FLASH, bb.CUDNN) for kind in ("causal", "full")]  # no mask to flash / cuDNN


@pytest.mark.parametrize("kernel, kind", _SDPA_CASES)
@pytest.mark.parametrize("shape", ["gqa", "mla"])
def test_sdpa_glue_matches_the_math_blocks(monkeypatch, kernel, kind, shape):
    monkeypatch.setattr(cuda_blocks, "_op", _Ops())
    monkeypatch.setattr(cuda_blocks, "_philox", lambda kernel, device: (torch.empty(()), torch.empty(())))
    _Ops.cudnn_kv_heads.clear()
    _Ops.flash_kv_heads.clear()
    dims = dict(d=8, dv=8) if shape == "gqa" else dict(hq=2, hkv=2, d=12, dv=6)
    kw = dict(causal=True) if kind == "rect" else _kinds()[kind]
    q, k, v = _inputs(**dims, m=16 if kind == "rect" else 12)
    ref_out, ref_lse = blocks.block_forward(q, k, v, scale=0.4, backend="math", **kw)
    out, lse = blocks.block_forward(q, k, v, scale=0.4, kernel=kernel, **kw)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(out)
    ref = blocks.block_backward(dout, q, k, v, ref_out, ref_lse, scale=0.4, backend="math", **kw)
    got = blocks.block_backward(dout, q, k, v, ref_out, ref_lse, scale=0.4, kernel=kernel, **kw)
    for a, b_ in zip(got, ref):
        assert a.shape == b_.shape
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)  # the LSE went through fp32
    # autograd: the fused block's backward is the fused backward op; a gradient into its LSE is refused
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, l_ = blocks.block_forward(*leaves, scale=0.4, kernel=kernel, **kw)
    got = torch.autograd.grad(o, leaves, dout)
    for a, b_ in zip(got, ref):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-6)
    o, l_ = blocks.block_forward(*leaves, scale=0.4, kernel=kernel, **kw)
    with pytest.raises(RuntimeError, match="log-sum-exp got a gradient"):
        torch.autograd.grad((o * dout).sum() + l_.sum(), leaves)
    if kernel in (bb.CUDNN, bb.FLASH):  # grouped K/V reached the op unrepeated (forward and backward), every call
        heads = _Ops.cudnn_kv_heads if kernel == bb.CUDNN else _Ops.flash_kv_heads
        assert heads and set(heads) == {k.shape[1]}


def test_cpu_keeps_its_backends():
    q, k, v = _inputs()
    assert blocks.resolve_backend(q.device) == "flash"
    assert blocks.resolve_backend(q.device, "cuda") == "math"
    assert cuda_blocks.cuda_caps(q.device) is None
    assert cuda_blocks.varlen_documents(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                        torch.tensor([0, 12]), 12, True, None, None) is None


def test_ulysses_documents_in_one_call_assemble_like_the_blocks(monkeypatch):
    """doc_blocks' one-call path (CUDA: one varlen_attn call) against its per-document blocks, with a CPU
    stand-in for the call that runs each document of the flat stream as its own block: values and gradients."""
    from automodel.distributed.cp.ulysses import doc_blocks

    def per_document(q, k, v, cu, max_len, *, causal, window=None, scale=None, backend=None):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            x = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            outs.append(blocks.block_forward(*x, causal=causal, scale=scale)[0][0].transpose(0, 1))
        return torch.cat(outs)

    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 7 + [1] * 5])
    real = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0], [1] * 7 + [1, 1, 0, 0, 0]]).bool()
    segments = doc_blocks.document_segments(docs, real, 2, 12)
    q, k, v = (t.requires_grad_(True) for t in _inputs(b=2, n=12, m=12))
    for causal in (True, False):
        ref = doc_blocks.document_block_attention(None, None, q, k, v, segments, is_causal=causal, needs_mask=False,
                                                  scaling=0.4)
        monkeypatch.setattr(doc_blocks, "documents_forward", per_document)
        monkeypatch.setattr(doc_blocks, "resolve_backend", lambda *a, **k: "cuda")
        got = doc_blocks.document_block_attention(None, None, q, k, v, segments, is_causal=causal, needs_mask=False,
                                                  scaling=0.4)
        monkeypatch.undo()
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
        dout = torch.randn_like(ref)
        for a, b_ in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(a, b_, rtol=0, atol=1e-12)
    assert doc_blocks._one_call(q, k, v, segments, True, 0.4) is None  # CPU: no one-call kernel


@pytest.mark.parametrize("kernel", [bb.FLASH, bb.EFFICIENT, bb.CUDNN])
def test_sdpa_calls_match_the_real_op_schemas(kernel):
    """The real aten ops on the meta device (their registered shapes): every argument the glue passes is one
    the installed torch's schema takes, and the outputs come back in the block's shapes."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k, v = torch.empty(2, 4, 40, 12, **meta), torch.empty(2, 2, 56, 12, **meta), torch.empty(2, 2, 56, 6, **meta)
    allowed = torch.ones(40, 56, dtype=torch.bool, device="meta") if kernel == bb.EFFICIENT else None
    out, lse = cuda_blocks._sdpa_forward(kernel, q, k, v, False, 0.3, allowed)
    assert out.shape == (2, 4, 40, 6) and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
    grads = cuda_blocks._sdpa_backward(kernel, torch.empty_like(out), q, k, v, out, lse, False, 0.3, allowed)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_varlen_call_matches_the_real_op_schema(monkeypatch):
    """``varlen_documents`` against the installed ``varlen_attn`` (its fake kernels on the meta device): grouped K/V
    as they are where the caps say so (``CudaCaps.varlen_gqa``), with ``enable_gqa`` where the signature has it
    (torch >= 2.12, which raises for unequal heads without it), repeated per query head otherwise; the window as
    ``window_size``; the output in the queries' shape and dK/dV at the KV heads."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    real = varlen.varlen_attn
    meta = dict(device="meta", dtype=torch.bfloat16)
    q, k = torch.empty(100, 8, 64, **meta), torch.empty(100, 2, 64, **meta)
    cu = torch.tensor([0, 30, 100], dtype=torch.int32, device="meta")
    seen = []
    keyword = cuda_blocks.varlen_has_enable_gqa()  # read from the real signature (the spy keeps it: functools.wraps)

    @functools.wraps(real)
    def spy(q_, k_, v_, *args, **kw):
        seen.append((k_.shape[1], v_.shape[1], kw.get("enable_gqa", False)))
        return real(q_, k_, v_, *args, **kw)

    monkeypatch.setattr(varlen, "varlen_attn", spy)
    for caps in (H100, bb.CudaCaps(capability=(9, 0), flash_op=True, efficient_op=True, flex=True, varlen=True,
                                   varlen_gqa=True)):  # fmt: skip
        monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device, c=caps: c)
        for window in (None, 16):
            seen.clear()
            qg = q.detach().requires_grad_()
            kg, vg = k.detach().requires_grad_(), k.detach().requires_grad_()
            out = cuda_blocks.varlen_documents(qg, kg, vg, cu, 70, True, window, 0.1)
            assert out.shape == q.shape
            assert seen == ([(2, 2, keyword)] if caps.varlen_gqa else [(8, 8, False)]), (caps, seen)
            out.sum().backward()
            assert (qg.grad.shape, kg.grad.shape, vg.grad.shape) == (q.shape, k.shape, k.shape)
    assert cuda_blocks.varlen_documents(q, k, k, cu, 70, False, 16, None) is None  # a window is causal
    from automodel.distributed.cp import attention_kernels as ak

    ak._PINNED.append(bb.CUDNN)  # a pinned non-flash kernel: the per-document blocks run it, not varlen (flash)
    try:
        assert cuda_blocks.varlen_documents(q, k, k, cu, 70, True, None, 0.1) is None
    finally:
        ak._PINNED.pop()
