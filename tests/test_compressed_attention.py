"""DeepSeek-V4's compressed attention under CP: the profile, the kernel against transformers' own compressor and
indexer, and each failure mode, in one process.

The multi-process parity (ring, thd, Ulysses at cp 2 and 4: tests/test_layer_kinds.py; thd_docs at cp 2 and 4:
tests/test_doc_layer_kinds.py; usp 2 x 2: tests/test_usp.py; every column of the support matrix:
tests/test_family_matrix.py) runs in launches that already exist. Here, without a launch:

- the profile reads every DeepSeek-V4 layer (window only, HCA, CSA) as ``sparse_attention`` of
  ``DeepseekV4Attention`` with its gathered widths, from the modules and from the config alone; every built-in method
  runs it, a method without the kernel is refused;
- the pooled entries equal transformers' compressor's (HCA: blocks of ``m``; CSA: overlapping pools of ``2m``), and
  the CSA picks equal transformers' indexer's block mask, on one document;
- top-k larger than the visible entries: early queries get ``-1`` slots (and the entries they may not see yet are
  never picked);
- packed rows: no pick crosses a document, and each document's picks equal the document's alone;
- a packed row at cp=1 through the installed forward equals each document alone, loss and every gradient in fp64,
  with queries in blocks of 8 too (the recomputed block path);
- ``auto`` costs the gathered state.
"""

from __future__ import annotations

import copy

import pytest
import torch

from automodel.distributed.cp import get_cp_method, profile_model
from automodel.distributed.cp.layers import compressed_attention as ca
from automodel.distributed.cp.layers.sparse_attention import Placement, Stage
from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention, installed_on
from automodel.distributed.cp.method import profile_problems
from automodel.distributed.cp.profile import SPARSE, profile_line
from tests.workers.exact_norms import norms_in_input_dtype
from tests.workers.layer_kinds_worker import V4_CONFIG, V4_RANDOM, build_case_model, randomize


def _model(dtype=torch.float64):
    model = build_case_model({"family": "deepseek_v4", "config": V4_CONFIG})
    randomize(model, V4_RANDOM)
    model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return model.to(dtype)


def _one_rank(doc_lengths: list[int]) -> Placement:
    total = sum(doc_lengths)
    ids = torch.arange(total)
    starts = torch.tensor([sum(doc_lengths[:i]) for i in range(len(doc_lengths))])
    start = torch.repeat_interleave(starts, torch.tensor(doc_lengths))
    end = start + torch.repeat_interleave(torch.tensor(doc_lengths), torch.tensor(doc_lengths))
    return Placement([Stage.of(None, [ids])], ids, start[None], end[None])


# ------------------------------------------------------------------ the profile and the refusals


def test_profile_reads_every_deepseek_v4_layer_as_its_compressed_attention():
    from tests.toy_cp_method import ToyGather

    with torch.device("meta"):
        model = build_case_model({"family": "deepseek_v4", "config": V4_CONFIG})
    for profile in (profile_model(model), profile_model(model.config)):
        assert {layer.kind for layer in profile.layers} == {SPARSE}
        assert {layer.mixer for layer in profile.layers} == {"DeepseekV4Attention"}
        assert all(layer.sinks and layer.window == 8 for layer in profile.layers)
        # window K = V (16); + HCA's kv and gate (2 x 16); + CSA's (2 x 32) and its indexer's (2 x 32, no gradient)
        assert [layer.sparse_widths for layer in profile.layers] == [(16, 0), (48, 0), (80, 64), (80, 64)]
        for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
            assert profile_problems(get_cp_method(method), profile, 64) == [], method
    assert "compressed attention (DeepSeek-V4) x4" in profile_line(profile_model(model))
    problems = profile_problems(ToyGather(), profile_model(model), 64)
    assert problems and "ring, thd, thd_docs, ulysses, usp" in problems[0], problems
    assert "sliding-window attention with sinks and compressed KV entries (DeepseekV4Attention)" in problems[0]


# ------------------------------------------------------------------ the kernel against transformers


def _compress(compressor, hidden, place, positions):
    step = ca.CompressedStep(place, 8)
    q_residual = torch.randn(hidden.shape[0], hidden.shape[1], 48, generator=torch.Generator().manual_seed(4),
                             dtype=hidden.dtype)  # fmt: skip
    out, _ = step.compress(compressor, hidden, q_residual, positions)
    return step, out, q_residual


@pytest.mark.parametrize("layer", [1, 2])  # HCA (blocks of 8), CSA (overlapping pools of 8, stride 4, top-3)
def test_entries_and_picks_equal_transformers_on_one_document(layer):
    model = _model()
    compressor = model.model.layers[layer].self_attn.compressor
    n = 37  # 4 HCA blocks, 9 CSA blocks (the last tokens pool nothing)
    hidden = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = torch.arange(n)[None]
    with torch.no_grad():
        step, mine, q_residual = _compress(compressor, hidden, _one_rank([n]), positions)
        ref, bias = type(compressor).forward(compressor, hidden, q_residual, positions, None, layer)
    assert mine.shape == ref.shape == (1, 1, n // compressor.compress_rate, 16)
    assert torch.equal(mine, ref)  # the same operations in the same order
    entries = torch.arange(mine.shape[2])
    seen = (entries >= step.entry_lo[0, :, None]) & (entries < step.entry_hi[0, :, None])
    if step.picks is not None:  # CSA: the indexer's picks
        picked = torch.zeros_like(seen)
        for i, row in enumerate(step.picks[0]):
            picked[i, row[row >= 0]] = True
        seen &= picked
    assert torch.equal(seen, bias[0, 0] == 0)  # transformers' block mask: 0 where a query attends the entry


def test_early_queries_get_minus_one_slots_and_never_a_future_entry():
    model = _model()
    compressor = model.model.layers[2].self_attn.compressor  # CSA, top-3 of blocks of 4
    n = 30
    hidden = torch.randn(1, n, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        step, _, _ = _compress(compressor, hidden, _one_rank([n]), torch.arange(n)[None])
    picks = step.picks[0]
    assert picks.shape == (n, 3)
    for p in range(n):
        visible = (p + 1) // 4
        row = picks[p]
        assert int((row >= 0).sum()) == min(3, visible), (p, row)  # top-k larger than the visible prefix: -1 slots
        assert ((row == -1) | (row < visible)).all(), (p, row)  # never an entry that pools a later token
    assert (picks[:3] == -1).all()  # no block is complete before the 4th token


def test_packed_picks_stay_in_each_document_and_equal_the_document_alone():
    with norms_in_input_dtype(True):  # fp64 throughout: the batched pooling then differs by fp64's round-off only
        _packed_picks()


def _packed_picks() -> None:
    model = _model()
    compressor = model.model.layers[3].self_attn.compressor
    lengths = [13, 30, 6, 21]  # the third pools nothing
    hidden = torch.randn(1, sum(lengths), 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        step, out, q_residual = _compress(compressor, hidden, _one_rank(lengths), positions)
    at, first = 0, 0
    for n in lengths:
        count = n // 4
        rows = step.picks[0, at : at + n]
        assert ((rows == -1) | ((rows >= first) & (rows < first + count))).all()  # nothing from another document
        alone = ca.CompressedStep(_one_rank([n]), 8)
        with torch.no_grad():
            entries, _ = alone.compress(compressor, hidden[:, at : at + n], q_residual[:, at : at + n],
                                        torch.arange(n)[None])  # fmt: skip
        # the same entries (pooled in one batch with the other documents' blocks: fp64's round-off apart)
        torch.testing.assert_close(out[0, 0, first : first + count], entries[0, 0], rtol=1e-14, atol=1e-15)
        if count:
            assert torch.equal(rows, torch.where(alone.picks[0] >= 0, alone.picks[0] + first, alone.picks[0]))
        at, first = at + n, first + count


@pytest.mark.parametrize("block", [None, 8])  # 8: the queries in blocks (recomputed in the backward)
def test_packed_row_in_one_process_equals_each_document_alone_fp64(monkeypatch, block):
    from tests.family_matrix import VOCAB

    if block:
        monkeypatch.setattr(ca, "QUERY_BLOCK", block)
    with norms_in_input_dtype(True):  # its fp32 casts (norms, RoPE, hyper-connections, pooling) in fp64
        model = _model()
        lengths = [9, 30, 21]
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(3, VOCAB, (sum(lengths),), generator=g)
        labels = torch.randint(3, VOCAB, (sum(lengths),), generator=g)
        reference = copy.deepcopy(model)
        ref_loss, at = 0.0, 0
        for n in lengths:  # each document alone, transformers' own forward
            out = reference(input_ids=ids[None, at : at + n], position_ids=torch.arange(n)[None], use_cache=False)
            loss = torch.nn.functional.cross_entropy(out.logits[0], labels[at : at + n], reduction="sum")
            loss.backward()
            ref_loss += float(loss.detach())
            at += n
        assert install_sparse_attention(model, profile_model(model)) == 4 == installed_on(model)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        out = model(input_ids=ids[None], position_ids=positions, use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits[0], labels, reduction="sum")
        loss.backward()
    assert abs(float(loss.detach()) - ref_loss) / abs(ref_loss) < 1e-14
    grads = dict(reference.named_parameters())
    top = max(float(p.grad.abs().max()) for p in reference.parameters() if p.grad is not None)
    for name, p in model.named_parameters():
        ref = grads[name].grad
        if ref is None:
            assert p.grad is None, name  # the indexer trains without gradient, as in transformers
            continue
        assert float((p.grad - ref).abs().max()) / max(float(ref.abs().max()), 1e-3 * top) < 1e-13, name


def test_the_model_on_a_packed_row_without_the_kernel_pools_across_documents():
    """The negative control of the test above: transformers' own forward on the packed row pools blocks over the
    document boundary (and its indexer picks from every document), so it differs from the documents alone."""
    from tests.family_matrix import VOCAB

    model = _model()
    lengths = [9, 30, 21]
    ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(6))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        own = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        install_sparse_attention(model, profile_model(model))
        kernel = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert float((own - kernel).abs().max()) > 1e-3


# ------------------------------------------------------------------ cp_method: auto


def test_auto_costs_the_gathered_window_and_compressor_state():
    from automodel.distributed.cp.choose import choose_cp_method
    from automodel.distributed.cp.cost import exchange_cost

    profile = profile_model(build_case_model({"family": "deepseek_v4", "config": V4_CONFIG}).config)
    n = 4096 // 4
    with_grad, without = (16 + 48 + 80 + 80) / 4, (0 + 0 + 64 + 64) / 4  # the layers' mean widths
    for method in ("ring", "ulysses", "thd", "thd_docs"):
        (term,) = exchange_cost(get_cp_method(method), profile, seq_len=4096, cp_size=4).terms
        assert (term.forward_bytes, term.backward_bytes) == (3 * n * (with_grad + without) * 2, 3 * n * with_grad * 2)
    choice = choose_cp_method(profile, cp_size=4, seq_len=4096)
    assert choice.method.name in ("ring", "ulysses", "thd", "thd_docs", "usp")
