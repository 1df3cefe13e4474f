"""The chunked linear cross-entropy equals the plain loss (values and gradients) and its memory does not
grow with the number of local tokens (automodel.training.chunked_loss)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from automodel.training.chunked_loss import chunked_linear_cross_entropy_sum
from automodel.training.cpu_memory import MMAP_ENV
from automodel.training.logit_transform import LogitTransform, chunkable_transform
from automodel.training.loss import token_cross_entropy_sum
from tests.dist_harness import REPO_ROOT


def _inputs(dtype, tokens=(2, 37), hidden=16, vocab=50, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*tokens, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) * 0.3
    b = torch.randn(vocab, generator=g, dtype=dtype) if bias else None
    y = torch.randint(0, vocab, tokens, generator=g)
    y[0, :20] = -100  # a prompt: with chunk 8, two whole chunks have no label token
    y[1, -3:] = -100
    return h, w, b, y


def _grads(fn, h, w, b, y):
    leaves = [t.clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    loss = fn(*leaves, y)
    (loss * 0.37).backward()  # a non-unit incoming gradient, like loss / num_label_tokens
    return loss.detach(), [t.grad for t in leaves]


def _plain(h, w, *rest):
    *b, y = rest
    return token_cross_entropy_sum(F.linear(h, w, b[0] if b else None), y)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [1, 8, 13, 1000])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_plain_loss_and_gradients(dtype, tol, chunk, bias):
    h, w, b, y = _inputs(dtype, bias=bias)
    ref_loss, ref_grads = _grads(_plain, h, w, b, y)

    def chunked(h, w, *rest):
        *bb, y = rest
        return chunked_linear_cross_entropy_sum(h, w, y, chunk, bias=bb[0] if bb else None)

    loss, grads = _grads(chunked, h, w, b, y)
    assert loss.dtype == torch.float32 or dtype == torch.float64
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    for got, ref in zip(grads, ref_grads):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol


TRANSFORMS = [
    LogitTransform(softcap=30.0),  # Gemma 2
    LogitTransform(softcap=2.0),  # a cap the logits reach: tanh far from linear
    LogitTransform(scale=0.0625),  # Cohere
    LogitTransform(divisor=8.0),  # Granite
    LogitTransform(scale=3.0, divisor=0.5, softcap=4.0),
]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk", [8, 1000])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("transform", TRANSFORMS, ids=[t.describe() for t in TRANSFORMS])
def test_a_final_logit_transform_equals_the_plain_loss_of_the_transformed_logits(dtype, tol, chunk, bias, transform):
    """With a model's final transform (a soft-cap, a scale, a divisor) the chunked loss and every gradient equal the
    plain loss of ``transform(F.linear(h, w, b))`` differentiated by autograd, and differ from the untransformed loss
    (what using the plain head would train)."""
    h, w, b, y = _inputs(dtype, bias=bias)
    h = h * 4.0  # logits of a few units: a cap of 2 bends them

    def plain(h, w, *rest):
        *bb, y = rest
        return token_cross_entropy_sum(transform.reference(F.linear(h, w, bb[0] if bb else None)), y)

    def chunked(h, w, *rest):
        *bb, y = rest
        return chunked_linear_cross_entropy_sum(h, w, y, chunk, bias=bb[0] if bb else None, transform=transform)

    ref_loss, ref_grads = _grads(plain, h, w, b, y)
    loss, grads = _grads(chunked, h, w, b, y)
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    for got, ref in zip(grads, ref_grads):
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= tol
    untransformed, _ = _grads(_plain, h, w, b, y)
    assert abs(untransformed.item() - ref_loss.item()) > 1e-3 * abs(ref_loss.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_soft_cap_costs_the_chunked_loss_no_more_memory(dtype):
    """The soft-cap's backward keeps its ``tanh`` ``[n, V]`` while the softmax is made in place of the transformed
    logits: the tracked peak of a forward and backward (1024 tokens, chunks of 256, vocabulary 4096) is the
    untransformed one's (9.25 MiB fp32, 9.13 bf16: what the plan's chunked term counts)."""
    from scripts.live_tensors import AllocationTracker

    peaks = []
    for transform in (LogitTransform(), LogitTransform(softcap=30.0)):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(1024, 64, generator=g).to(dtype).requires_grad_()
        w = torch.randn(4096, 64, generator=g).to(dtype).requires_grad_()
        y = torch.randint(0, 4096, (1024,), generator=g)
        tracker = AllocationTracker()
        with tracker:
            chunked_linear_cross_entropy_sum(h, w, y, 256, transform=transform).backward()
        peaks.append(tracker.peak)
    assert peaks[1] <= peaks[0] * 1.01, [p / 2**20 for p in peaks]


def test_logit_transforms_describe_and_refuse_what_they_cannot_compute():
    from types import SimpleNamespace

    from torch import nn

    assert LogitTransform(softcap=30.0).describe() == "30 * tanh(z / 30)"
    assert LogitTransform(scale=0.0625).describe() == "z * 0.0625" and LogitTransform().identity

    def model(bias=False, **config):  # noqa: ANN202
        head = nn.Linear(4, 8, bias=bias)
        return SimpleNamespace(config=SimpleNamespace(**config), get_output_embeddings=lambda: head,
                               get_decoder=lambda: None)  # fmt: skip

    assert chunkable_transform(model(final_logit_softcapping=30.0)) == (LogitTransform(softcap=30.0), "")
    assert chunkable_transform(model(logits_soft_cap=15)) == (LogitTransform(softcap=15.0), "")
    assert chunkable_transform(model(logit_scale=0.5, logits_scaling=2)) == (LogitTransform(0.5, 2.0), "")
    # MiniCPM3: its width scale states the divisor (logits_scaling); without it the width keys are refused
    assert chunkable_transform(model(logits_scaling=0.25, dim_model_base=256)) == (LogitTransform(divisor=0.25), "")
    assert chunkable_transform(model(dim_model_base=256))[1] == "dim_model_base=256"
    assert chunkable_transform(model(logits_scaling=1.0, dim_model_base=64)) == (LogitTransform(), "")
    assert "with a biased LM head" in chunkable_transform(model(bias=True, logit_scale=0.5))[1]
    assert chunkable_transform(model(bias=True)) == (LogitTransform(), "")
    assert chunkable_transform(model(final_logit_softcapping=0.0))[1] == "softcap=0.0"


def test_tied_weight_gets_both_gradients():
    """The LM-head weight doubling as the embedding (tie_word_embeddings) accumulates both terms."""
    h0, w, _, y = _inputs(torch.float64, bias=False)
    ids = torch.randint(0, w.shape[0], y.shape)

    def run(loss_fn):
        wt = w.clone().requires_grad_()
        hidden = F.embedding(ids, wt) + h0
        loss_fn(hidden, wt).backward()
        return wt.grad

    ref = run(lambda hidden, wt: token_cross_entropy_sum(F.linear(hidden, wt), y))
    got = run(lambda hidden, wt: chunked_linear_cross_entropy_sum(hidden, wt, y, 7))
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-12


def test_all_ignored_gives_zero_loss_and_zero_gradients():
    h, w, _, y = _inputs(torch.float64, bias=False)
    y.fill_(-100)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_linear_cross_entropy_sum(hh, ww, y, 8)
    loss.backward()
    assert loss.item() == 0.0 and not hh.grad.any() and not ww.grad.any()


def test_bad_arguments_name_the_value():
    h, w, _, y = _inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match=r"chunk_tokens=0 must be a positive integer"):
        chunked_linear_cross_entropy_sum(h, w, y, 0)
    with pytest.raises(ValueError, match=r"hidden \(2, 37, 16\) and labels \(2, 36\) disagree"):
        chunked_linear_cross_entropy_sum(h, w, y[:, :-1], 8)
    with pytest.raises(ValueError, match=r"weight \(50, 8\) must be \[V, H\] with H=16"):
        chunked_linear_cross_entropy_sum(h, w[:, :8], y, 8)


def _peak_mib(pairs: list[tuple[int, int]], vocab: int = 4096, hidden: int = 32) -> list[float]:
    env = {**os.environ, **MMAP_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    args = [f"{t}:{c}" for t, c in pairs]
    out = subprocess.run(
        [sys.executable, "-m", "tests.workers.loss_memory_probe", str(vocab), str(hidden), *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )
    return [float(line) for line in out.stdout.split()]


def test_peak_extra_memory_does_not_grow_with_local_tokens():
    """At chunk 128 and vocab 4096, 4x the tokens (2048 -> 8192) adds only the O(tokens x hidden) terms
    (a few copies of the [tokens, hidden] states and their gradient: 0.75 MiB each), while the plain loss's [tokens, vocab] logits and
    gradient grow by ~96 MiB each (which also shows the probe measures what it should)."""
    small, large, plain_small, plain_large = _peak_mib([(2048, 128), (8192, 128), (2048, 0), (8192, 0)])
    assert large - small < 8, (small, large)
    assert plain_large - plain_small > 150, (plain_small, plain_large)
    assert large < plain_large / 10, (large, plain_large)
