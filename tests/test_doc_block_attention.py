"""Attention one document block at a time (automodel.distributed.cp.ulysses.doc_blocks), as Ulysses
uses it for packed / padded rows: the layouts it accepts, exact equality with the dense-mask
attention (values and gradients), no [S, S] mask ever built, and memory without an S**2 term."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from automodel.distributed.cp.ulysses.attention import (
    UlyssesContext,
    make_ulysses_batch_and_ctx,
    set_ulysses_attention,
)
from automodel.distributed.cp.ulysses.doc_blocks import document_block_attention, document_segments
from automodel.training.cpu_memory import MMAP_ENV
from tests.dist_harness import REPO_ROOT
from tests.workers.ulysses_worker import make_batch, tiny_llama


def test_segments_of_packed_and_padded_rows():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 1, 1, 1, 1]])
    real = torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]).bool()
    assert document_segments(docs, real, 2, 8) == [[(0, 2, 3), (3, 5, 5), (5, 6, 8)], [(0, 4, 4), (4, 8, 8)]]
    assert document_segments(None, None, 1, 5) == [[(0, 5, 5)]]
    assert document_segments(None, real[:1, :3], 1, 3) == [[(0, 2, 3)]]
    # a pad before a real token of the same document (left padding, holes): only a dense mask can say it
    assert document_segments(None, torch.tensor([[0, 1, 1]]).bool(), 1, 3) is None
    assert document_segments(docs[:1], torch.tensor([[1, 0, 1, 1, 1, 1, 1, 1]]).bool(), 1, 8) is None


class _Module(torch.nn.Module):
    def __init__(self, groups: int, causal: bool = True):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, causal, False


@pytest.mark.parametrize("fn, needs_mask", [(sdpa_attention_forward, False), (eager_attention_forward, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_equals_dense_masked_attention(fn, needs_mask, causal):
    """Against the inner kernel on the whole row with the dense mask (causal within each document, no
    pad keys): real positions' outputs and every gradient of q/k/v, fp64 (sdpa exact; eager to fp32)."""
    torch.manual_seed(0)
    seq, docs = 12, torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])
    real = torch.tensor([[1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0]]).bool()
    q = torch.randn(1, 4, seq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, seq, 8, dtype=torch.float64, requires_grad=True)
    module = _Module(2, causal)
    allowed = (docs[0][:, None] == docs[0][None, :]) & real[0][None, :]
    if causal:
        allowed &= torch.ones(seq, seq, dtype=torch.bool).tril()
    dense = allowed[None, None]
    if needs_mask:
        dense = torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)[
            None, None
        ]
    ref, _ = fn(module, q, k, v, dense, scaling=8**-0.5, dropout=0.0)
    got = document_block_attention(
        fn, module, q, k, v, document_segments(docs, real, 1, seq), is_causal=causal, needs_mask=needs_mask,
        scaling=8**-0.5, dropout=0.0,
    )
    assert got.shape == ref.shape == (1, seq, 4, 8)
    keep = real[0]
    # transformers' eager kernel takes its softmax in fp32 even for fp64 inputs: blocks of another
    # length round differently there (~1e-7); sdpa is fp64 throughout. A leaked key would be >= 1e-2.
    tol = 1e-6 if fn is eager_attention_forward else 1e-12
    torch.testing.assert_close(got[:, keep], ref[:, keep], rtol=tol, atol=tol)
    grads_ref = torch.autograd.grad((ref[:, keep] ** 2).sum(), (q, k, v))
    grads = torch.autograd.grad((got[:, keep] ** 2).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["padding", "packed", "packed_seq_lens"])
def test_ulysses_never_builds_a_dense_mask_for_packed_or_padded_rows(monkeypatch, inner, kind):
    def no_dense_mask(self, *args, **kwargs):
        raise AssertionError("the dense [B, 1, S, S] mask was built")

    monkeypatch.setattr(UlyssesContext, "_build_mask", no_dense_mask)
    ref, model = tiny_llama(2, inner), tiny_llama(2, inner)
    set_ulysses_attention(model)
    batch = make_batch(kind)
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    expected = ref(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits
    ctx_factory, local = make_ulysses_batch_and_ctx(None, batch, inner_attn=inner)
    with ctx_factory():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_packed_attention_memory_has_no_s_squared_term():
    """Ulysses attention (world 1) on 4 packed documents: 4x the tokens (4K -> 16K) costs ~4x the memory
    (q/k/v, outputs and their gradients: ~4.5 MiB at 4K), where a dense bool mask alone would be 16 MiB
    at 4K and 256 MiB at 16K."""
    env = {**os.environ, **MMAP_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "tests.workers.attn_memory_probe", "4096", "16384"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    at_4k, at_16k = (float(v) for v in out.stdout.split())
    assert at_16k < 64, (at_4k, at_16k)  # the dense mask alone would be 256 MiB
    assert at_16k < 6 * max(at_4k, 4.0), (at_4k, at_16k)  # linear, not quadratic
