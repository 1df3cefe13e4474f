"""DeepSeek Sparse Attention (DSA) under CP: the profile, the refusals and each known failure mode, in one process.

The multi-process parity (ring, thd, Ulysses at cp 2 and 4: tests/test_layer_kinds.py; thd_docs at cp 2 and 4:
tests/test_doc_layer_kinds.py; usp 2 x 2: tests/test_usp.py; every column of the support matrix:
tests/test_family_matrix.py) runs in launches that already exist. Here, without a launch:

- the profile names DSA layers ``sparse_attention`` with their class; every built-in method runs them, a method
  without a DSA kernel (the toy method) and an unknown indexed attention class are refused with the reason;
- the indexer's RoPE layout: the CP indexer selects exactly what transformers' indexer selects for DeepSeek-V3.2
  (rotary halves) and GLM-5 (interleaved pairs), and the other layout selects differently (the check can fail);
- top-k larger than the visible prefix: early queries get ``-1`` slots, which select nothing and are never read
  as an index (the attention equals a dense reference over the selected keys);
- packed rows: no selection crosses a document, and each document's selection equals the document's alone;
- a packed row at cp=1 through the installed forward (GLM-5 and HY-V4 with a ``shared`` layer reusing the previous
  layer's top-k; HY-V4's sinks, gate and hyper-connections) equals each document alone, loss and every gradient in
  fp64; HY-V4's indexer rotates its last dimensions (rotating the first selects differently).
"""

from __future__ import annotations

import copy

import pytest
import torch

from automodel.distributed.cp import get_cp_method, profile_model
from automodel.distributed.cp.layers.sparse_attention import (
    DsaStep,
    Placement,
    Stage,
    dsa_attention,
    install_sparse_attention,
    select_topk,
)
from automodel.distributed.cp.method import profile_problems
from automodel.distributed.cp.profile import SPARSE, UNKNOWN
from tests.family_matrix import family_by_name

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2")


def _one_rank(doc_lengths: list[int]) -> Placement:
    """The placement of one rank holding a row of packed documents (no padding)."""
    total = sum(doc_lengths)
    ids = torch.arange(total)
    start = torch.repeat_interleave(
        torch.tensor([sum(doc_lengths[:i]) for i in range(len(doc_lengths))]), torch.tensor(doc_lengths)
    )
    end = start + torch.repeat_interleave(torch.tensor(doc_lengths), torch.tensor(doc_lengths))
    return Placement([Stage.of(None, [ids])], ids, start[None], end[None])


def _model(family: str, dtype=torch.float32, **overrides):
    from transformers import AutoModelForCausalLM

    fam = family_by_name(family)
    config = fam.build_config()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation(), dtype=torch.float32)
    return model.to(dtype).train()


# ------------------------------------------------------------------ the profile and the refusals


@pytest.mark.parametrize("family", DSA_FAMILIES)
def test_profile_names_dsa_layers_and_every_builtin_method_runs_them(family):
    fam = family_by_name(family)
    config = fam.build_config()
    assert config.index_topk < 64  # top-k really selects
    assert set(config.layer_types) <= {"indexed_attention", "deepseek_sparse_attention"}  # (transformers < 5.25)
    with torch.device("meta"):
        model = fam.build_model(0)
    profile = profile_model(model)
    assert {layer.kind for layer in profile.layers} == {SPARSE}
    assert {layer.mixer for layer in profile.layers} == {type(model.model.layers[0].self_attn).__name__}
    assert "sparse attention (DSA)" in __import__("automodel.distributed.cp.profile", fromlist=["x"]).profile_line(profile)
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        assert profile_problems(get_cp_method(method), profile, 64) == [], method


def test_a_method_without_a_dsa_kernel_and_an_unknown_indexed_class_are_refused():
    from automodel.distributed.cp.profile import LayerSpec, _layer_from_modules
    from tests.toy_cp_method import ToyGather

    with torch.device("meta"):
        model = family_by_name("deepseek_v32").build_model(0)
    problems = profile_problems(ToyGather(), profile_model(model), 64)
    assert problems and "selects each query's keys from the whole document" in problems[0], problems
    assert "ring, thd, thd_docs, ulysses, usp" in problems[0]

    class OtherSparseAttention(torch.nn.Module):  # an indexed attention of a family without a CP kernel
        def forward(self, hidden_states, attention_interface=None):
            return hidden_states

    layer = torch.nn.Module()
    layer.self_attn = OtherSparseAttention()
    spec = _layer_from_modules(layer, LayerSpec(0, SPARSE), "model.layers.0")
    assert spec.kind == UNKNOWN and "OtherSparseAttention" in spec.mixer and "without a CP kernel" in spec.mixer


def test_dots3_runs_the_kernel_on_its_indexed_layers_only():
    from automodel.distributed.cp.profile import SLIDING
    from tests.family_matrix import skip_if_absent

    skip_if_absent("dots3_note_text")
    fam = family_by_name("dots3_note_text")
    model = fam.build_model(0)
    profile = profile_model(model)
    assert [layer.kind for layer in profile.layers] == [SPARSE, SPARSE, SLIDING]  # its default pattern, cut to 3
    assert install_sparse_attention(model, profile) == 2
    assert [layer.self_attn.__dict__.get("forward") is not None for layer in model.model.layers] == [True, True, False]
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        assert profile_problems(get_cp_method(method), profile, 64) == [], method


# ------------------------------------------------------------------ the indexer's RoPE layout


def _indexer_inputs(model, seq: int, seed: int = 1):
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, seq, model.config.hidden_size, generator=g)
    q_resid = torch.randn(1, seq, model.config.q_lora_rank, generator=g)
    positions = torch.arange(seq)[None]
    return attn, hidden, q_resid, model.model.rotary_emb(hidden, positions)


@pytest.mark.parametrize("family, attr, other", [
    ("deepseek_v32", "_automodel_dsa_rope", "interleaved"),
    ("glm_moe_dsa", "_automodel_dsa_rope", "half"),
    ("hy_v4", "_automodel_dsa_rope_last", False),  # HY-V4 rotates the last dimensions: the first ones differ
    ("axk2", "_automodel_dsa_rope", "interleaved"),  # DeepSeek-V3.2's indexer
])  # fmt: skip
def test_indexer_selects_what_transformers_selects_with_the_family_rope_layout(family, attr, other):
    model = _model(family)
    seq = 40
    attn, hidden, q_resid, pe = _indexer_inputs(model, seq)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None]
    reference = attn.indexer(hidden, q_resid, pe, causal, None).long()[0]  # transformers' indexer, one process
    install_sparse_attention(model, profile_model(model))
    place = _one_rank([seq])
    ours = DsaStep(place, "sdpa").select(attn.indexer, hidden, q_resid, pe)[0]

    def visible_sets(idx):
        return [sorted(i for i in row.tolist() if 0 <= i <= q) for q, row in enumerate(idx)]

    assert visible_sets(ours) == visible_sets(reference)
    assert ours.shape == (seq, model.config.index_topk)
    setattr(attn.indexer, attr, other)  # the other family's layout: the selection must change
    wrong = DsaStep(place, "sdpa").select(attn.indexer, hidden, q_resid, pe)[0]
    assert visible_sets(wrong) != visible_sets(reference)


# ------------------------------------------------------------------ top-k larger than the prefix, -1 slots


def _select_inputs(lengths: list[int], topk: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, total, 3, 8, generator=g)
    weights = torch.randn(1, total, 3, generator=g)
    keys = torch.randn(1, total, 8, generator=g)
    return q, weights, keys


def test_early_queries_get_minus_one_slots_that_select_nothing_and_are_never_read():
    topk, seq = 8, 24
    place = _one_rank([seq])
    q, w, k = _select_inputs([seq], topk)
    idx = select_topk(q, w, k, place, topk, 0.3)
    for pos in range(seq):  # a query sees pos + 1 keys: all of them while that is fewer than top-k
        row = idx[0, pos]
        chosen = sorted(i for i in row.tolist() if i >= 0)
        assert (row == -1).sum() == max(0, topk - (pos + 1))
        assert all(i <= pos for i in chosen)
        if pos < topk:
            assert chosen == list(range(pos + 1))
    # the attention: -1 slots at the end of the row would index past it; they select nothing
    g = torch.Generator().manual_seed(4)
    query = torch.randn(1, 2, seq, 6, generator=g, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, 2, seq, 6, generator=g, dtype=torch.float64, requires_grad=True)
    value = torch.randn(1, 2, seq, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = place.mask(1, torch.device("cpu"))
    module = torch.nn.Module()
    out, _ = dsa_attention(module, query, key, value, mask, scaling=0.4, indices=idx)
    selected = torch.zeros(seq, seq, dtype=torch.bool)
    for pos in range(seq):
        selected[pos, [i for i in idx[0, pos].tolist() if i >= 0]] = True
    scores = (query @ key.transpose(-1, -2) * 0.4).masked_fill(~selected, float("-inf"))
    reference = (scores.softmax(-1) @ value).transpose(1, 2)
    assert torch.allclose(out, reference, rtol=0, atol=1e-14)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (query, key, value))


# ------------------------------------------------------------------ packed rows


def test_packed_selection_stays_in_each_document_and_equals_the_document_alone():
    lengths, topk = [5, 20, 7, 12], 6
    place = _one_rank(lengths)
    q, w, k = _select_inputs(lengths, topk)
    idx = select_topk(q, w, k, place, topk, 0.5)[0]
    at = 0
    for n in lengths:
        rows = idx[at : at + n]
        assert ((rows == -1) | ((rows >= at) & (rows < at + n))).all()  # nothing from another document
        alone = select_topk(q[:, at : at + n], w[:, at : at + n], k[:, at : at + n], _one_rank([n]), topk, 0.5)[0]
        shifted = torch.where(alone >= 0, alone + at, alone)
        assert torch.equal(rows[:, : alone.shape[1]], shifted)
        assert (rows[:, alone.shape[1] :] == -1).all()
        at += n


@pytest.mark.parametrize("family, overrides", [
    ("deepseek_v32", {}),
    ("glm_moe_dsa", {"indexer_types": ["full", "shared"]}),  # layer 1 reuses layer 0's top-k
    ("hy_v4", {"indexer_types": ["full", "shared"]}),  # and per-head sinks, an output gate, hyper-connections
    ("axk2", {}),  # DeepSeek-V3.2's DSA with a fused q/gate projection, an output gate and gated norms
])  # fmt: skip
def test_packed_row_in_one_process_equals_each_document_alone_fp64(family, overrides):
    from tests.workers.exact_norms import norms_in_input_dtype

    with norms_in_input_dtype(family == "hy_v4"):  # HY-V4's hyper-connections in fp64 (transformers: fp32)
        _packed_row_equals_documents_alone(family, overrides)


def _packed_row_equals_documents_alone(family: str, overrides: dict) -> None:
    from tests.family_matrix import VOCAB

    n_layers = family_by_name(family).build_config().num_hidden_layers
    model = _model(family, torch.float64, first_k_dense_replace=n_layers, mlp_layer_types=["dense"] * n_layers,
                   **overrides)  # fmt: skip
    if overrides:
        assert model.model.layers[1].self_attn.indexer is None
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
    assert install_sparse_attention(model, profile_model(model)) == n_layers
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(input_ids=ids[None], position_ids=positions, use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits[0], labels, reduction="sum")
    loss.backward()
    assert abs(float(loss.detach()) - ref_loss) / abs(ref_loss) < 1e-14
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref = grads[name].grad
        if ref is None:
            assert p.grad is None, name  # the indexer trains without gradient, as in transformers
            continue
        assert float((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) < 1e-12, name


# ------------------------------------------------------------------ cp_method: auto


def test_auto_costs_the_gathered_latent_kv_and_indexer_keys():
    from automodel.distributed.cp.choose import choose_cp_method
    from automodel.distributed.cp.cost import exchange_cost

    profile = profile_model(family_by_name("deepseek_v32").build_config())
    assert {layer.sparse_widths for layer in profile.layers} == {(32 + 8, 16)}  # kv_lora + rope, index_head_dim
    n = 4096 // 4
    for method in ("ring", "ulysses", "thd", "thd_docs"):
        (term,) = exchange_cost(get_cp_method(method), profile, seq_len=4096, cp_size=4).terms
        assert "latent KV and indexer keys" in term.what, (method, term)
        assert (term.forward_bytes, term.backward_bytes) == (3 * n * 56 * 2, 3 * n * 40 * 2)  # bf16; no indexer grad
    usp = exchange_cost(get_cp_method("usp").with_options(ulysses_size=2), profile, seq_len=4096, cp_size=4).terms
    assert [(t.group, t.forward_bytes) for t in usp] == [(2, n * 56 * 2), (2, 2 * n * 56 * 2)]
    choice = choose_cp_method(profile, cp_size=4, seq_len=4096)
    assert choice.method.name in ("ring", "ulysses", "thd", "thd_docs", "usp")
    assert all("DSA" in t.what for t in choice.candidates[0].terms)


@pytest.mark.parametrize("sinks", [False, True])  # HY-V4's per-head sinks ride along into the recomputed blocks
def test_query_blocks_select_and_attend_as_one_block(monkeypatch, sinks):
    import automodel.distributed.cp.layers.sparse_attention as dsa

    lengths, topk = [13, 30, 21], 6
    place = _one_rank(lengths)
    q, w, k = _select_inputs(lengths, topk)
    g = torch.Generator().manual_seed(8)
    total = sum(lengths)
    qkv = [torch.randn(1, 2, total, d, generator=g, dtype=torch.float64) for d in (6, 6, 5)]
    mask = place.mask(1, torch.device("cpu"))

    sink = torch.tensor([0.3, -1.2], dtype=torch.float64) if sinks else None

    def run():
        idx = select_topk(q, w, k, place, topk, 0.5)
        leaves = [x.clone().requires_grad_(True) for x in qkv]
        extra = [] if sink is None else [sink.clone().requires_grad_(True)]
        out, _ = dsa_attention(torch.nn.Module(), *leaves, mask, scaling=0.4, indices=idx,
                               **({"s_aux": extra[0]} if extra else {}))  # fmt: skip
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        return idx, out.detach(), [x.grad for x in leaves + extra]

    whole = run()
    monkeypatch.setattr(dsa, "QUERY_BLOCK", 5)  # blocks of 5 queries, recomputed in the backward
    blocked = run()
    assert torch.equal(whole[0], blocked[0])
    assert torch.allclose(whole[1], blocked[1], rtol=0, atol=1e-14)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-13) for a, b in zip(whole[2], blocked[2]))


# ------------------------------------------------------------------ Doge's dynamic mask attention (issue 43)


@pytest.mark.parametrize("random_a", [True, False])  # A = 0 (its initialisation): every key's bias 1, all ties
def test_doge_packed_row_in_one_process_equals_each_document_alone_fp64(random_a):
    """Doge's kernel (cp/layers/dynamic_mask.py) on one rank: a packed row of documents longer than keep_window_size
    (8) equals each document alone, loss and every gradient in fp64 (its RMSNorms in fp64); transformers' own forward
    on the packed row does not (its top-k row is the whole row, so ties among equal biases, as equal token ids give
    in the first layer, resolve otherwise than in the document alone). Eager Doge (transformers < 5.25, whose SDPA is
    refused) runs its reference softmax in fp64 too (exact_norms.DOGE_EAGER)."""
    from tests.family_matrix import VOCAB
    from tests.workers.exact_norms import norms_in_input_dtype
    from tests.workers.layer_kinds_worker import build_case_model

    with norms_in_input_dtype(True):
        model = build_case_model({"family": "doge", "random_A": random_a}).to(torch.float64)
        lengths = [21, 30, 9]
        g = torch.Generator().manual_seed(6)
        ids = torch.randint(3, VOCAB, (sum(lengths),), generator=g)
        labels = torch.randint(3, VOCAB, (sum(lengths),), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        own = copy.deepcopy(model)
        reference = copy.deepcopy(model)
        ref_loss, ref_logits, at = 0.0, [], 0
        for n in lengths:
            out = reference(input_ids=ids[None, at : at + n], position_ids=torch.arange(n)[None], use_cache=False)
            ref_logits.append(out.logits[0].detach())
            loss = torch.nn.functional.cross_entropy(out.logits[0], labels[at : at + n], reduction="sum")
            loss.backward()
            ref_loss += float(loss.detach())
            at += n
        n_layers = model.config.num_hidden_layers
        assert install_sparse_attention(model, profile_model(model)) == n_layers
        out = model(input_ids=ids[None], position_ids=positions, use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits[0], labels, reduction="sum")
        loss.backward()
        assert abs(float(loss.detach()) - ref_loss) / abs(ref_loss) < 1e-14
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            ref = grads[name].grad
            assert float((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) < 1e-12, name
        with torch.no_grad():
            theirs = own(input_ids=ids[None], position_ids=positions, use_cache=False).logits[0]
        assert float((theirs - torch.cat(ref_logits)).abs().max()) > 1e-3  # the negative control


def test_doge_top_k_keeps_the_largest_biases_of_the_document_only():
    from automodel.distributed.cp.layers.dynamic_mask import drop_beyond_top_k

    lengths, keep = [5, 12], 4
    place = _one_rank(lengths)
    T = sum(lengths)
    bias = torch.arange(T, dtype=torch.float64).flip(0)[None, None]  # earlier keys larger
    visible = place.mask(1, torch.device("cpu"))
    mask = bias[:, :, None, :].expand(1, 1, T, T).masked_fill(~visible, torch.finfo(torch.float64).min)
    kept = visible[0, 0] & ~drop_beyond_top_k(mask, place, keep)[0, 0]
    for q in range(T):  # each query keeps its document's first min(keep, seen) keys (the largest biases it sees)
        d = 0 if q < 5 else 5
        assert kept[q].nonzero().flatten().tolist() == list(range(d, d + min(keep, q - d + 1))), q
    assert not drop_beyond_top_k(mask, place, 12).any()  # no document longer than keep: no top-k


# ------------------------------------------------------------------ Qwen4-Exp's QSA (query-sparse attention)

def _needs(family: str) -> None:
    """Skip, naming the release, where the installed transformers has no ``family`` or calls its sparse layers
    otherwise (Qwen4-Exp's are ``qwen_sparse_attention`` in 5.17: refused, see the test below; Kolibri-1.1: >= 5.25)."""
    from tests.family_matrix import skip_if_absent

    skip_if_absent(family if family != "qwen4_exp_text" else "qwen4_exp_text@qsa")


def test_qwen4_exp_sparse_layers_of_an_earlier_form_are_refused_by_every_method():
    """Where the installed Qwen4-Exp's sparse layers are not ``indexed_attention`` (5.17: ``qwen_sparse_attention``,
    whose class hands its indexer another cache argument and adds its selection as a float mask), no CP kernel
    reproduces them: every method refuses the layer as unrecognised, naming the layer type and the release to
    report; on the releases with ``indexed_attention`` the tests above run the kernel instead."""
    from automodel.distributed.cp import check_model_for_cp, cp_methods, methods_that_run
    from automodel.distributed.cp.profile import REPORT_HINT
    from automodel.errors import CPUnsupportedError
    from tests.family_matrix import absent_reason, skip_if_absent

    skip_if_absent("qwen4_exp_text")
    if absent_reason("qwen4_exp_text@qsa") is None:
        pytest.skip("the installed Qwen4-Exp has indexed_attention layers: the kernel runs them (tests above)")
    fam = family_by_name("qwen4_exp_text")
    with torch.device("meta"):
        model = fam.build_model(0)
    profile = profile_model(model)
    types = model.config.layer_types
    sparse = [t for t in types if t != "linear_attention"]
    assert sparse and all(layer.kind == UNKNOWN for layer, t in zip(profile.layers, types) if t in sparse)
    assert methods_that_run(profile, 64) == []
    for method in cp_methods():
        with pytest.raises(CPUnsupportedError) as err:
            check_model_for_cp(method, profile, seq_len=64)
        message = str(err.value)
        assert f"Qwen4ExpTextAttention (config layer type {sparse[0]}" in message and REPORT_HINT in message, message


def test_profile_names_qsa_and_gated_deltanet_layers_and_every_builtin_method_runs_them():
    _needs("qwen4_exp_text")
    from automodel.distributed.cp.profile import LINEAR

    config = family_by_name("qwen4_exp_text").build_config()
    assert config.indexer_budget < 64 and config.ple_layer_ids == []  # the indexer really selects; no PLE layers
    with torch.device("meta"):
        model = family_by_name("qwen4_exp_text").build_model(0)
    profile = profile_model(model)
    assert [(layer.kind, layer.mixer) for layer in profile.layers] == [
        (LINEAR, "Qwen4ExpTextGatedDeltaNet")] * 3 + [(SPARSE, "Qwen4ExpTextAttention")]  # fmt: skip
    assert profile.layers[3].sparse_widths == (2 * config.num_key_value_heads * config.head_dim, config.indexer_head_dim)
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        assert profile_problems(get_cp_method(method), profile, 64) == [], method


def test_qsa_kernel_on_one_rank_equals_each_document_alone_and_selects():
    """The installed forward on a one-rank placement of three packed documents (K, V, the raw indexer keys and the
    RoPE of every position gathered, the class's own selection over them) against the class's forward on each
    document alone, fp64 (the q / k RMSNorms in fp64: transformers computes them in fp32): outputs and every
    gradient; the selection really drops keys (budget 16 of up to 30)."""
    _needs("qwen4_exp_text")
    from tests.workers.exact_norms import norms_in_input_dtype

    with norms_in_input_dtype():
        _qsa_one_rank_equals_documents_alone()


def _qsa_one_rank_equals_documents_alone() -> None:
    from automodel.distributed.cp.layers import sparse_attention as sa

    lengths = [9, 30, 21]
    model = _model("qwen4_exp_text", torch.float64, num_hidden_layers=1, layer_types=["indexed_attention"])
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, sum(lengths), model.config.hidden_size, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    pe = model.model.rotary_emb(hidden, positions)
    reference, at = [], 0
    for n in lengths:  # each document alone: the class's forward with its causal mask
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        part = tuple(x[:, at : at + n] for x in pe)
        reference.append(type(attn).forward(attn, hidden[:, at : at + n], part, mask)[0])
        at += n
    reference = torch.cat(reference, dim=1)
    ref_grads = torch.autograd.grad(reference.square().sum(), list(attn.parameters()), allow_unused=True)

    install_sparse_attention(model, profile_model(model))
    call = {"hidden_states": hidden, "position_embeddings": pe, "attention_mask": None}
    seen = {}
    original = type(attn.indexer)._select_tokens

    def spy(self, *args, **kwargs):
        seen["mask"] = out = original(self, *args, **kwargs)
        return out

    sa._bound(attn, (), call)  # caches the signature _run reads
    type(attn.indexer)._select_tokens = spy
    try:
        out = sa._run(attn, dict(call), _one_rank(lengths))[0]
    finally:
        type(attn.indexer)._select_tokens = original
    grads = torch.autograd.grad(out.square().sum(), list(attn.parameters()), allow_unused=True)
    assert (out - reference).abs().max() <= 1e-13 * reference.abs().max()
    for got, want in zip(grads, ref_grads):
        assert (got is None) == (want is None)
        if want is not None:
            assert (got - want).abs().max() <= 1e-12 * want.abs().max().clamp_min(1e-30)
    visible = _one_rank(lengths).mask(1, hidden.device)
    assert (seen["mask"] & ~visible).sum() == 0 and (seen["mask"].sum(-1) < visible.sum(-1)).any()


def test_a_qsa_indexer_that_changed_is_refused(monkeypatch):
    _needs("qwen4_exp_text")
    from automodel.errors import CPUnsupportedError

    model = _model("qwen4_exp_text", num_hidden_layers=1, layer_types=["indexed_attention"])
    indexer = type(model.model.layers[0].self_attn.indexer)

    def _select_tokens(self, hidden_states, q, raw_keys, full_cos, full_sin, attention_mask, **kwargs):
        return attention_mask  # every visible key: not the block selection the kernel expects

    monkeypatch.setattr(indexer, "_select_tokens", _select_tokens)
    with pytest.raises(CPUnsupportedError, match="does not compute what the CP QSA kernel expects"):
        install_sparse_attention(model, profile_model(model))


def test_qwen4_exp_ple_layers_are_refused_by_every_method():
    """Qwen4-Exp's per-layer n-gram embeddings (``ple_layer_ids``; none in the default config) read earlier tokens
    outside the mixers the kernels compute: a dilated depthwise conv along the sequence and hashed n-grams of the
    previous token ids. Refused, never run with a state that does not travel."""
    _needs("qwen4_exp_text")
    from transformers import AutoModelForCausalLM

    from automodel.distributed.cp.profile import LINEAR

    config = family_by_name("qwen4_exp_text").build_config()
    config.ple_layer_ids, config.eos_token_id = [1, 4], 1  # layers 0 (Gated DeltaNet) and 3 (QSA) get one
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = profile_model(model).layers
    assert layers[0].kind == UNKNOWN and layers[0].module_path == "model.layers.0.ple.conv1d", layers[0]
    assert "outside the mixer its CP kernel computes" in layers[0].mixer
    assert layers[3].kind == LINEAR and layers[3].mixer.startswith("Conv1d"), layers[3]  # no kernel: refused
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        problems = profile_problems(get_cp_method(method), profile_model(model), 64)
        assert any("layer 0" in p or "layers 0" in p for p in problems), (method, problems)
        assert any("3" in p and "Conv1d" in p for p in problems), (method, problems)


# ------------------------------------------------------------------ Kolibri-1.1's indexed attention


def test_kolibri_indexed_layers_get_the_kv_gathering_forward_and_a_changed_class_is_refused(monkeypatch):
    _needs("kolibri1_1")
    from automodel.distributed.cp.layers.kolibri_sparse import check_kolibri_attention
    from automodel.distributed.cp.profile import SLIDING
    from automodel.errors import CPUnsupportedError
    from tests.workers.layer_kinds_worker import KOLIBRI_CONFIG

    model = _model("kolibri1_1", **{k: v for k, v in KOLIBRI_CONFIG.items() if k != "kv_source_layers"})
    profile = profile_model(model)
    assert [layer.kind for layer in profile.layers] == [SLIDING, SPARSE] * 2
    assert install_sparse_attention(model, profile) == 2  # the indexed layers only (the class runs the sliding ones)
    assert [layer.self_attn.__dict__.get("forward") is not None for layer in model.model.layers] == [False, True] * 2
    for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
        assert profile_problems(get_cp_method(method), profile, 64) == [], method
    # a K/V share with a layer that is not indexed (transformers' config refuses it today): refused
    shared = _model("kolibri1_1", **KOLIBRI_CONFIG)
    with pytest.raises(CPUnsupportedError, match=r"shares its K/V with layer\(s\) 3, which are not indexed"):
        check_kolibri_attention(shared.model.layers[1].self_attn, {1: "Kolibri1_1Attention"})
    # a release whose forward no longer hands the indexer the keys through the cache: refused
    cls = type(model.model.layers[1].self_attn)
    monkeypatch.setattr(cls, "forward", lambda self, hidden_states, *a, **k: (hidden_states, None, None))
    fresh = _model("kolibri1_1", **{k: v for k, v in KOLIBRI_CONFIG.items() if k != "kv_source_layers"})
    with pytest.raises(CPUnsupportedError, match="does not compute what the CP kernel for Kolibri-1.1"):
        install_sparse_attention(fresh, profile_model(fresh))
