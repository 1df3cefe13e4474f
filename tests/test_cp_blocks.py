"""Block attention (cp/blocks.py): every backend and feature against a dense softmax, and the LSE merge."""

from __future__ import annotations

import pytest
import torch

from automodel.distributed.cp import blocks


def _dense(q, k, v, scale, causal=False, allowed=None, sinks=None, softcap=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    n, m = s.shape[-2:]
    mask = torch.ones(n, m, dtype=torch.bool)
    if causal:
        mask = mask.tril(m - n)
    if allowed is not None:
        mask = mask & allowed
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    p = s.softmax(-1)
    return (p[..., :-1] if sinks is not None else p) @ v


def _qkv(b=2, hq=4, hkv=2, n=6, m=6, d=8, dv=8):
    torch.manual_seed(0)
    f = dict(dtype=torch.float64, requires_grad=True)
    return torch.randn(b, hq, n, d, **f), torch.randn(b, hkv, m, d, **f), torch.randn(b, hkv, m, dv, **f)


@pytest.mark.parametrize("backend", ["flash", "math", "cuda"])
@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_and_explicit_backward_match_a_dense_softmax(backend, causal):
    q, k, v = _qkv()
    with blocks.force_backend(backend):
        out, lse = blocks.block_forward(q, k, v, causal=causal, scale=0.3)
        dout = torch.randn_like(out)
        grads = blocks.block_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)
    ref = _dense(q, k, v, 0.3, causal)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_mask_softcap_unequal_value_heads_and_a_rectangular_causal_block():
    q, k, v = _qkv(b=1, n=5, m=7, dv=3)
    allowed = torch.rand(5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[:, 0] = True
    out, lse = blocks.block_forward(q, k, v, causal=True, scale=0.5, allowed=allowed, softcap=2.0)
    ref = _dense(q, k, v, 0.5, True, allowed, softcap=2.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    dout = torch.randn_like(out)
    grads = blocks.block_backward(dout, q, k, v, out, lse, causal=True, scale=0.5, allowed=allowed, softcap=2.0)
    for a, b in zip(grads, torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_sinks_are_one_extra_lse_column_and_merging_blocks_is_exact():
    q, k, v = _qkv(b=1, n=5, m=7)
    sinks = torch.randn(4, dtype=torch.float64)
    ref = _dense(q, k, v, 0.5, sinks=sinks)
    out, lse = blocks.block_forward(q, k, v, scale=0.5, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    whole, whole_lse = blocks.block_forward(q, k, v, scale=0.5)
    merged, merged_lse = blocks.merge_sinks(whole, whole_lse, sinks)
    torch.testing.assert_close(merged, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-12)
    a = blocks.block_forward(q, k[:, :, :3], v[:, :, :3], scale=0.5)
    b = blocks.block_forward(q, k[:, :, 3:], v[:, :, 3:], scale=0.5)
    torch.testing.assert_close(blocks.merge(*a, *b)[0], whole, rtol=0, atol=1e-12)


def test_backend_slots():
    cpu = torch.device("cpu")
    assert blocks.resolve_backend(cpu) == "flash"
    assert blocks.resolve_backend(cpu, sinks=True) == "math"  # the flash kernel takes no sinks
    assert blocks.resolve_backend(cpu, "cuda") == "math"  # the CUDA slot takes CUDA tensors only
    assert blocks.resolve_backend(torch.device("meta")) == "math"
    with blocks.force_backend("math"):
        assert blocks.resolve_backend(cpu) == "math"
        assert blocks.resolve_backend(cpu, "flash") == "flash"  # an explicit argument wins
    assert blocks.resolve_backend(cpu) == "flash"
    with pytest.raises(ValueError, match="'tpu' is not one of"):
        blocks.resolve_backend(cpu, "tpu")
