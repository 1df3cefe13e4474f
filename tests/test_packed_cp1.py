"""Packed rows at CP size 1 are computed per document, for every family (issue 37).

transformers' gpt-oss (eager attention with sinks; sliding and full layers) does not pass ``position_ids`` to its
mask builders, so on a packed row its documents attend to each other (Llama and Mistral keep them apart). The
library probes the model's own forward (:func:`automodel.distributed.cp.separation.document_separation`) and,
where it mixes documents, runs a CP method's document-aware attention on the one rank: the recipe
(:func:`~automodel.distributed.cp.bind.bind_cp_method`), the own loop's ``context_parallel`` at a CP group of 1,
and ring's ``make_cp_batch_and_ctx`` at a CP mesh of size 1 (which refuses instead: it never switches the
model). Every check here is against each document run alone (fp32 and fp64), in one process.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.distributed.cp import context_parallel
from automodel.distributed.cp.bind import bind_cp_method, no_cp_batch_and_ctx
from automodel.distributed.cp.ring.batch import make_cp_batch_and_ctx
from automodel.distributed.cp.separation import document_separation
from automodel.errors import CPUnsupportedError

VOCAB = 128
LENGTHS = (9, 14, 6)  # three documents of a packed row (real tokens)
BARS = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-12, 1e-10)}


def _model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    attn = "sdpa"
    if family == "gpt_oss":  # default layer_types: sliding then full; window 4 < every document
        kw.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
        attn = "eager"
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **kw)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    if family == "gpt_oss" and dtype == torch.float64:
        model.set_experts_implementation("eager")  # torch's grouped GEMM takes no fp64
    return model.to(dtype).eval()


def _documents(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in LENGTHS]  # +1: the last token's label


def _packed(docs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    lens = torch.tensor([[len(d) - 1 for d in docs]])
    return {
        "input_ids": torch.cat([d[:-1] for d in docs])[None],
        "labels": torch.cat([d[1:] for d in docs])[None],
        "position_ids": torch.cat([torch.arange(len(d) - 1) for d in docs])[None],
        "seq_lens": lens,
        "seq_lens_padded": lens.clone(),
    }


def _alone(model: torch.nn.Module, docs: list[torch.Tensor]) -> float:
    """Each document run alone: the CE sum over all labels / their count, backward into ``model``'s grads."""
    total = sum(len(d) - 1 for d in docs)
    loss = 0.0
    for d in docs:
        logits = model(input_ids=d[:-1][None], use_cache=False).logits[0]
        part = F.cross_entropy(logits, d[1:], reduction="sum") / total
        part.backward()
        loss += float(part.detach())
    return loss


def _rel_errors(model, ref, loss: float, ref_loss: float) -> tuple[float, float]:
    grad = max(
        float((p.grad - r.grad).abs().max() / r.grad.abs().max().clamp_min(1e-30))
        for p, r in zip(model.parameters(), ref.parameters())
        if r.grad is not None
    )
    return abs(loss - ref_loss) / abs(ref_loss), grad


def test_the_probe_finds_gptoss_mixing_documents_and_llama_keeping_them_apart():
    gptoss = document_separation(_model("gpt_oss"))
    assert not gptoss.separates and "attend to each other" in gptoss.reason
    assert document_separation(_model("llama")).separates
    assert document_separation(_model("mistral")).separates
    # DeepSeek sparse attention through transformers' indexer (its top-k over the whole packed row, which the family
    # matrix's cp=1 packed cell caught) is not vouched for; with the CP DSA kernel installed it is probed
    config = AutoConfig.for_model(
        "deepseek_v32", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=32, index_n_heads=2, index_head_dim=16, index_topk=4,
    )  # fmt: skip
    dsa = AutoModelForCausalLM.from_config(config)
    found = document_separation(dsa)
    assert not found.separates and "over the whole packed row" in found.reason
    from automodel.distributed.cp import profile_model
    from automodel.distributed.cp.layers.sparse_attention import install_sparse_attention

    dsa = AutoModelForCausalLM.from_config(config)  # a fresh model: the probe's answer is kept per model
    install_sparse_attention(dsa, profile_model(dsa))  # the CP kernel takes the top-k per document: probed
    assert document_separation(dsa).separates
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=VOCAB, num_hidden_layers=1))
    found = document_separation(meta)
    assert not found.separates and "meta device" in found.reason


def test_the_probe_reaches_past_the_longest_window_or_chunk(monkeypatch):
    """A window or chunk boundary placed at the row's index instead of the document's positions only shows once the
    probe's document crosses one (transformers 5.17's Llama 4 chunks did, and its own forward trained packed rows
    wrong at cp 1 until the probe reached across its chunk): the probe's second document is longer than the model's
    longest window or chunk, and a model whose windows are longer than the probe affords is not trusted."""
    from automodel.distributed.cp import separation

    lengths = []
    real = separation._logits
    monkeypatch.setattr(separation, "_logits", lambda m, ids, pos: lengths.append(ids.shape[-1]) or real(m, ids, pos))
    mistral = _model("mistral")
    mistral.config.sliding_window = 24
    separation._CACHE.pop(mistral, None)
    assert separation._longest_window(mistral) == 24
    assert separation.document_separation(mistral).separates
    assert min(lengths) > 24, lengths  # the document alone: 24 + 3 tokens
    monkeypatch.setattr(separation, "PROBE_MAX_WINDOW", 16)
    far = _model("mistral")
    far.config.sliding_window = 24
    found = separation.document_separation(far)
    assert not found.separates and "longer than the probe runs (16)" in found.reason


def test_gptoss_own_forward_really_mixes_the_documents():
    # what the probe stands for: the packed row's logits are not those of the documents alone
    model, docs = _model("gpt_oss"), _documents()
    batch = _packed(docs)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[:-1][None], use_cache=False).logits[0] for d in docs])
    assert float((packed - alone).abs().max()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("method", ["ring", "thd_docs", "thd", "ulysses"])
def test_recipe_binding_at_cp1_equals_documents_alone(method, dtype):
    # the recipe's cp_size=1 path on packed rows (bind_cp_method packed=True): whatever method the config names
    # (ring attends across the row: another method's document-aware attention runs), each document alone
    ref, docs = _model("gpt_oss", dtype), _documents()
    model = copy.deepcopy(ref)
    ref_loss = _alone(ref, docs)
    fn, prepared = bind_cp_method(method, model, None, 1, packed=True)
    assert fn is not no_cp_batch_and_ctx and prepared.switched and "attend to each other" in prepared.single_rank
    batch = _packed(docs)
    n_labels = int((batch["labels"] != -100).sum())
    ctx, local = fn(None, batch)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0]
        loss = F.cross_entropy(logits, local["labels"][0], ignore_index=-100, reduction="sum") / n_labels
        loss.backward()
    e_loss, e_grad = _rel_errors(model, ref, float(loss.detach()), ref_loss)
    assert e_loss <= BARS[dtype][0] and e_grad <= BARS[dtype][1], (e_loss, e_grad)
    prepared.undo()
    assert model.config._attn_implementation == "eager"


def test_recipe_binding_keeps_the_own_forward_where_it_separates_documents():
    fn, prepared = bind_cp_method("ring", _model("llama"), None, 1, packed=True)
    assert fn is no_cp_batch_and_ctx and not prepared.switched and "as if alone" in prepared.single_rank
    # the self-check's reference never trusts the own forward on packed rows
    fn, prepared = bind_cp_method("thd_docs", _model("llama"), None, 1, packed=True, trust_own_forward=False)
    assert prepared.switched and "not trusted" in prepared.single_rank
    # one document per row: nothing to separate, nothing probed
    fn, prepared = bind_cp_method("thd_docs", _model("gpt_oss"), None, 1, packed=False)
    assert fn is no_cp_batch_and_ctx and not prepared.switched


def test_recipe_binding_refuses_packing_when_nothing_computes_the_documents(monkeypatch):
    import automodel.distributed.cp.separation as separation

    monkeypatch.setattr(separation, "alternatives", lambda *a, **k: [])
    monkeypatch.setattr(separation, "run_problems", lambda *a, **k: ["not exact"])
    with pytest.raises(CPUnsupportedError, match=r"packed rows .* at CP size 1: GptOssForCausalLM .*data.dataset.pack"):
        bind_cp_method("thd_docs", _model("gpt_oss"), None, 1, packed=True)


@pytest.mark.parametrize("family", ["gpt_oss", "llama"])
def test_context_parallel_at_a_group_of_one_equals_documents_alone(family):
    # the own loop at CP size 1 (mesh None): gpt-oss runs thd_docs' document-aware attention, Llama its own
    # forward; Llama's config keeps use_cache=True, which context_parallel turns off (a cache mixes documents)
    ref, docs = _model(family), _documents()
    model = copy.deepcopy(ref)
    assert model.config.use_cache
    ref_loss = _alone(ref, docs)
    cp = context_parallel(model, None, method="thd_docs")
    assert cp._prepared.switched == (family == "gpt_oss")
    assert not model.config.use_cache
    batch = _packed(docs)
    del batch["seq_lens"], batch["seq_lens_padded"]  # documents from the restarting position_ids alone
    ctx, local = cp.shard(batch)
    with ctx():
        loss = model(**local).loss
        loss.backward()
    e_loss, e_grad = _rel_errors(model, ref, float(cp.reduce_loss(loss)), ref_loss)
    assert e_loss <= 1e-5 and e_grad <= 1e-4, (e_loss, e_grad)
    cp.restore()
    assert model.config.use_cache and model.config._attn_implementation == ref.config._attn_implementation


def test_context_parallel_at_a_group_of_one_refuses_packed_rows_a_method_cannot_keep_apart():
    model = _model("gpt_oss")
    cp = context_parallel(model, None, method="ring")  # ring attends across the row
    assert not cp._prepared.switched
    with pytest.raises(ValueError, match=r"attend to each other.*context_parallel|attend to each other"):
        cp.shard(_packed(_documents()))
    ctx, local = cp.shard({"input_ids": torch.ones(1, 8, dtype=torch.long), "labels": torch.ones(1, 8, dtype=torch.long)})
    with ctx():
        model(**local)  # one document per row runs


def test_make_cp_batch_and_ctx_at_size_one_refuses_a_model_that_mixes_documents():
    batch = _packed(_documents())
    ctx, same = make_cp_batch_and_ctx(None, batch)
    assert same is batch
    model = _model("gpt_oss")
    with pytest.raises(CPUnsupportedError, match=r"make_cp_batch_and_ctx at CP size 1 .*attend to each other.*thd_docs"):
        with ctx():
            model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    # Llama keeps the documents apart: runs, with its cache off inside the block (on again after it)
    llama = _model("llama")
    docs = _documents()
    ref = copy.deepcopy(llama)
    ref_loss = _alone(ref, docs)
    ctx, batch = make_cp_batch_and_ctx(None, _packed(docs))
    with ctx():
        logits = llama(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        assert not llama.config.use_cache
    loss = F.cross_entropy(logits, batch["labels"][0], reduction="sum") / int(batch["labels"].numel())
    loss.backward()
    assert llama.config.use_cache
    e_loss, e_grad = _rel_errors(llama, ref, float(loss.detach()), ref_loss)
    assert e_loss <= 1e-5 and e_grad <= 1e-4
    # one document per row: the plain no-op
    plain = {"input_ids": torch.ones(1, 8, dtype=torch.long), "labels": torch.ones(1, 8, dtype=torch.long)}
    assert make_cp_batch_and_ctx(None, plain) == (contextlib.nullcontext, plain)
