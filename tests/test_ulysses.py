"""Ulysses CP for HF models: single-process checks and ONE launched 2-rank parity group.

Parity (tests/workers/ulysses_worker.py): a tiny fp32 Llama with Ulysses CP at cp=2 gives the loss and
every parameter's gradient of the single-process run, with GQA (2 kv heads, and 1 kv head < cp), a
padding mask, packed rows (boundaries from position_ids and from seq_lens_padded), the eager and sdpa
inner kernels, and an odd sequence length (uneven shards).
"""

from __future__ import annotations

import copy

import pytest
import torch

from automodel.distributed.cp.ulysses.attention import (
    UlyssesContext,
    document_ids_from_cu_seqlens,
    document_ids_from_seq_lens,
    make_ulysses_batch_and_ctx,
    set_ulysses_attention,
)
from tests.dist_harness import run_distributed
from tests.workers.headwise_worker import CP2_CASES as HEADWISE_CP2
from tests.workers.headwise_worker import assert_case
from tests.workers.ulysses_worker import CASES, make_batch, tiny_llama

REL = 1e-5


# ------------------------------------------------------------------------------------------------
# single-process


def test_document_ids():
    ids = document_ids_from_seq_lens(torch.tensor([[3, 2, -1000], [6, -1000, -1000]]), 7)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 1]]
    assert document_ids_from_cu_seqlens(torch.tensor([0, 2, 5]), 5).tolist() == [[0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="more than the row length 4"):
        document_ids_from_seq_lens(torch.tensor([[3, 2]]), 4)


def test_batch_sharding_without_cp_keeps_everything_and_consumes_masks():
    batch = make_batch("padding")
    batch["loss_mask"] = torch.ones(2, 16)
    batch["meta"] = "kept"
    ctx_factory, local = make_ulysses_batch_and_ctx(None, batch)
    assert sorted(local) == ["input_ids", "labels", "loss_mask", "meta", "position_ids"]
    assert torch.equal(local["input_ids"], batch["input_ids"])
    assert local["position_ids"].tolist() == [list(range(16))] * 2
    assert "attention_mask" in batch  # the input batch is not mutated


def test_context_validation_errors():
    with pytest.raises(ValueError, match="inner_attn='flash_attention_2' is not supported"):
        make_ulysses_batch_and_ctx(None, make_batch("plain"), inner_attn="flash_attention_2")
    with pytest.raises(ValueError, match="cu_seqlens describes one packed row but the batch has B=2"):
        make_ulysses_batch_and_ctx(None, {**make_batch("plain"), "cu_seqlens": torch.tensor([0, 16])})
    with pytest.raises(ValueError, match=r"batch\['labels'\] has shape \(2, 15\)"):
        make_ulysses_batch_and_ctx(None, {**make_batch("plain"), "labels": torch.zeros(2, 15)})
    with pytest.raises(ValueError, match="shorter than the CP size 4"):
        UlyssesContext(group=None, world_size=4, rank=0, inner_attn="sdpa", position_ids=torch.zeros(1, 3))


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["plain", "padding", "packed"])
def test_cp1_matches_the_model_exactly(inner, kind):
    """Without CP the wrapper must be the identity around the inner kernel (same global mask as HF)."""
    ref = tiny_llama(2, inner)
    model = tiny_llama(2, inner)
    prev = set_ulysses_attention(model)
    assert prev == inner and model.config._attn_implementation == "ulysses"
    batch = make_batch(kind)
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    expected = ref(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits
    ctx_factory, local = make_ulysses_batch_and_ctx(None, batch, inner_attn=inner)
    with ctx_factory():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_whole_row_masks_are_freed_with_the_context(inner):
    """The whole-row masks a Ulysses context builds (a sliding window's ``[B, 1, S, S]``, one per layer kind) are
    dropped when its block exits, so a loop that keeps the context factory through its optimizer step does not hold
    them there; the same factory entered again builds the same masks (identical logits), and a backward after the
    block still gets the exact gradients (autograd keeps what it saved)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=64, sliding_window=5,
                               max_position_embeddings=128, attn_implementation=inner)  # fmt: skip
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32)  # its own config: switched
    model.load_state_dict(ref.state_dict())
    set_ulysses_attention(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = ref(input_ids=ids, use_cache=False).logits
    expected.square().sum().backward()
    ctx_factory, local = make_ulysses_batch_and_ctx(None, {"input_ids": ids}, inner_attn=inner)
    runs = []
    for _ in range(2):
        with ctx_factory() as ctx:
            runs.append(model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits)
            assert any(isinstance(m, torch.Tensor) and m.shape[-2:] == (16, 16) for m in ctx._masks.values())
        assert ctx._masks == {}
    torch.testing.assert_close(runs[0], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(runs[0], runs[1])
    runs[0].square().sum().backward()  # after the block: the saved tensors, not the dropped cache
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad - q.grad).norm() <= REL * q.grad.norm(), name


@pytest.mark.parametrize("second_start", [0, 7])
@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_chunks_of_a_row_packed_by_restarts_match_the_installed_transformers_cp1(inner, second_start):
    """Llama 4's attention chunks in a row packed by restarting position_ids: transformers 5.23+ cuts
    them at multiples of the chunk in each document's position_ids (its second document may start at 7),
    5.17 .. 5.22 at multiples of the chunk from the row start; Ulysses builds the same mask as the
    installed transformers (torch_internals.transformers_chunks_per_document)."""
    from dataclasses import replace

    from automodel.distributed.torch_internals import transformers_chunks_per_document
    from tests.family_matrix import family_by_name

    fam = family_by_name("llama4_text")
    fam = replace(fam, attn=inner, config_kwargs={**fam.config_kwargs, "attention_chunk_size": 4})
    ref, model = fam.build_model(), fam.build_model()
    set_ulysses_attention(model)
    ids = make_batch("plain")["input_ids"][:1]
    # 3 documents; the two rules cut the second differently
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, *range(second_start, second_start + 7), 0, 1, 2]])
    expected = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    ctx_factory, local = make_ulysses_batch_and_ctx(None, {"input_ids": ids, "position_ids": pos}, inner_attn=inner)
    with ctx_factory() as ctx:
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    assert ctx.chunk_origin == ("position" if transformers_chunks_per_document() else "row")
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    ctx_factory, local = make_ulysses_batch_and_ctx(None, {"input_ids": ids, "position_ids": pos}, inner_attn=inner)
    with ctx_factory() as ctx:
        ctx.chunk_origin = "row" if ctx.chunk_origin == "position" else "position"  # the other transformers' rule
        other = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    assert (other - expected).abs().max() > 1e-4  # the two rules differ on this row


@pytest.mark.parametrize("blocks", [1, 16])
@pytest.mark.parametrize("origin", ["document", "row", "position"])
@pytest.mark.parametrize("docs", [False, True])
def test_chunk_masks_are_the_chunk_rule_without_whole_mask_integers(docs, origin, blocks, monkeypatch):
    """The whole row's attention-chunk mask (Llama 4's chunked layers) is, for every origin of the chunks (each
    document's start, the row's, the position ids' restarts) and with or without documents, exactly the rule
    ``(kv - s) // c == (q - s) // c`` (``s``: the query's origin) with the causal and document masks; building it
    makes no ``[B, 1, S, S]`` integer tensor (the key offsets' division made int64 copies of the whole mask, 16 to 17
    bytes per score at once: -57% of a Llama 4 step's peak at 2048 tokens under Ulysses at cp 4), and in blocks of
    query rows (``MASK_BLOCK_SCORES``) little more than the mask itself."""
    from automodel.distributed.cp.ulysses import attention
    from scripts.live_tensors import AllocationTracker

    b, s, c = 2, 256, 24
    monkeypatch.setattr(attention, "MASK_BLOCK_SCORES", b * s * s // blocks)
    pos = torch.cat([torch.arange(100), torch.arange(13, 13 + 90), torch.arange(66)]).expand(b, -1).clone()
    ids = torch.tensor([0] * 100 + [1] * 90 + [2] * 66).expand(b, -1).clone()
    ids[1] = torch.tensor([0] * 37 + [1] * 219)
    ctx = UlyssesContext(group=None, world_size=1, rank=0, inner_attn="sdpa", position_ids=pos,
                         document_ids=ids if docs else None)  # fmt: skip
    ctx.chunk_origin = origin
    with AllocationTracker() as tracker:
        mask = ctx.global_mask(is_causal=True, sliding_window=None, dtype=torch.float32, device=torch.device("cpu"),
                               chunk=c)  # fmt: skip
    # one call: a few bools per score at once; 16 blocks: the mask and one block's (one bool per score)
    assert tracker.peak < (5 if blocks == 1 else 1.5) * b * s * s, tracker.peak
    index = torch.arange(s)
    start = {"document": index - ctx.document_positions(), "row": torch.zeros(b, s, dtype=torch.long),
             "position": index - pos}[origin]  # fmt: skip
    q, k = index[:, None], index[None, :]
    for row in range(b):
        first = start[row][:, None]
        want = ((k - first) // c == (q - first) // c) & (k <= q)
        if docs:
            want &= ids[row][:, None] == ids[row][None, :]
        assert torch.equal(mask[row, 0], want), (origin, docs, row)


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_masks_built_in_blocks_of_query_rows_are_the_whole_builds(inner, monkeypatch):
    """A sliding window's and a chunk's whole-row masks, with and without documents and padding, built in blocks of
    query rows equal the one-call build exactly (eager's float masks too); a mask the same for every row stays one
    ``[1, 1, S, S]`` storage expanded over the batch."""
    from automodel.distributed.cp.ulysses import attention

    b, s = 3, 96
    pos = torch.arange(s).expand(b, -1)
    ids = torch.tensor([0] * 40 + [1] * 56).expand(b, -1).clone()
    ids[2] = 0
    pad = torch.ones(b, s, dtype=torch.bool)
    pad[1, 90:] = False
    for docs, padding in ((None, None), (ids, None), (None, pad), (ids, pad)):
        for window, chunk in ((7, None), (None, 10), (9, 16)):
            masks = []
            for scores in (b * s * s, b * s * 5):  # one block, then blocks of 5 rows (the last one short)
                monkeypatch.setattr(attention, "MASK_BLOCK_SCORES", scores)
                ctx = UlyssesContext(group=None, world_size=1, rank=0, inner_attn=inner, position_ids=pos,
                                     document_ids=docs, padding_mask=padding)  # fmt: skip
                masks.append(ctx.global_mask(is_causal=True, sliding_window=window, dtype=torch.float32,
                                             device=torch.device("cpu"), chunk=chunk))  # fmt: skip
            assert masks[0].shape == (b, 1, s, s) and torch.equal(masks[0], masks[1]), (docs, padding, window, chunk)
            if inner == "sdpa" and docs is None and padding is None and chunk is None:  # chunks index [B, S] starts
                assert masks[1].stride(0) == 0 and masks[1].untyped_storage().nbytes() == s * s


def test_cu_seqlens_boundaries_cp1():
    """cu_seqlens alone (positions left as arange) gives block-diagonal causal attention."""
    ref = tiny_llama(2, "sdpa")
    model = tiny_llama(2, "sdpa")
    set_ulysses_attention(model)
    ids = make_batch("plain")["input_ids"][:1]
    doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    mask4d = (causal & (doc[:, None] == doc[None, :]))[None, None]
    expected = ref(input_ids=ids, attention_mask=mask4d, use_cache=False).logits
    plain = ref(input_ids=ids, use_cache=False).logits
    ctx_factory, local = make_ulysses_batch_and_ctx(
        None, {"input_ids": ids, "cu_seqlens": torch.tensor([0, 5, 12, 16])}
    )
    with ctx_factory():
        got = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (got - plain).abs().max() > 1e-4  # the boundaries matter


def test_outside_context_is_an_error():
    model = tiny_llama(2, "sdpa")
    set_ulysses_attention(model)
    with pytest.raises(RuntimeError, match="outside a Ulysses context"):
        model(input_ids=make_batch("plain")["input_ids"], use_cache=False)


def test_local_mask_is_rejected():
    model = tiny_llama(2, "sdpa")
    set_ulysses_attention(model)
    batch = make_batch("plain")
    ctx_factory, local = make_ulysses_batch_and_ctx(None, batch)
    bad = torch.ones(2, 1, 8, 16, dtype=torch.bool)  # a mask for 8 query tokens of a 16-token sequence
    with pytest.raises(ValueError, match="a mask built from the local slice"), ctx_factory():
        model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            attention_mask=bad,
            use_cache=False,
        )


# ------------------------------------------------------------------------------------------------
# multi-process parity


@pytest.fixture(scope="module")
def results():
    return run_distributed("tests.workers.ulysses_worker:main", world_size=2, timeout=300)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_ulysses_parity(results, case):
    for r in range(2):
        got = results[r][case]
        assert got["cp_loss"] == pytest.approx(got["ref_loss"], rel=REL)
        assert len(got["grad_rel"]) == 2 + 2 * 9 + 1  # embed, lm_head, 2 layers x 9, final norm
        worst = max(got["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= REL, f"{case}: rank {r} worst gradient {worst}"
    # both ranks hold the same reduced numbers
    assert results[0][case]["cp_loss"] == results[1][case]["cp_loss"]


@pytest.mark.dist
def test_shards_are_contiguous_and_uneven_on_first_rank(results):
    assert [results[r]["gqa_sdpa"]["local_len"] for r in range(2)] == [8, 8]
    assert [results[r]["uneven_seq"]["local_len"] for r in range(2)] == [8, 7]
    assert results[0]["padding_sdpa"]["local_keys"] == ["input_ids", "labels", "position_ids"]
    assert results[0]["packed_seq_lens_eager"]["local_keys"] == ["input_ids", "labels", "position_ids"]


@pytest.mark.dist
def test_negative_control_local_attention_differs(results):
    """Attention within each slice only (what happens without Ulysses) is detectably wrong on rank 1,
    by orders of magnitude more than the Ulysses logits differ from the reference."""
    assert results[1]["naive_logit_rel"] > 1e-3
    for r in range(2):
        assert results[r]["gqa_sdpa"]["logit_rel"] < 1e-6


@pytest.mark.dist
def test_clear_errors(results):
    errs = results[0]["errors"]
    assert "num_attention_heads=3 is not divisible by cp_size=2" in errs["heads_set"]
    assert "3 query heads are not divisible by cp_size=2" in errs["heads_call"]
    assert "no Ulysses attention ran inside the Ulysses context" in errs["not_switched"]
    assert "the device mesh has dims ('dp',) and none is named 'cp'" in errs["no_cp_dim"]


@pytest.mark.dist
@pytest.mark.parametrize("name", list(HEADWISE_CP2))
def test_headwise_ulysses_is_exact_cp2(results, name):
    """distributed.ulysses_head_chunks at cp=2: GQA, windows (Mistral), sinks (gpt-oss, eager), softcapping (Gemma 2,
    eager), plain and packed rows, checkpointing with activation offload, compiled blocks: the same loss and every
    gradient as the unchunked run and as one process (tests/workers/headwise_worker.py)."""
    for r in range(2):
        assert_case(name, HEADWISE_CP2[name], results[r]["headwise"][name])


@pytest.mark.dist
def test_headwise_refuses_a_count_that_splits_a_kv_group(results):
    msg = results[0]["headwise"]["refusal"]
    assert "distributed.ulysses_head_chunks=3 does not divide the 2 KV head(s) each rank holds" in msg
    assert "set distributed.ulysses_head_chunks to one of [1, 2]" in msg
