"""State-space mixers under every CP method (tests/test_state_mixers.py), against one process.

:data:`FAMILIES` lists the model families (tiny configs) and, per family, the functions of its transformers
module that compute in fp32 whatever the dtype, with a dtype-keeping replacement (``fp64_rules``): the fp64
cases swap them in BOTH runs, so that the CP kernels are proven to fp64 round-off; the fp32 cases run
transformers' own kernels. A rule may also name a class attribute (``"Class.forward"``): Nemotron-H's router
keeps its fp32 arithmetic but runs one token row per call (:func:`one_row_at_a_time`). A new mixer family is
one more entry.

On every rank, per family and case: the single-process reference (each document of a packed row ALONE
through the unmodified model; two unpacked rows as one batch for ring), then, on the packed row, thd,
thd_docs and Ulysses (and usp at cp=4: 2 x 2), and ring on the unpacked rows; loss and every gradient
SUM-all-reduced over the CP group. The packed row's documents cross every rank boundary under thd, and
under thd_docs one document spans all ranks, one a subset, one (at cp=4) has empty chunks, the rest stay
whole on one rank.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tests.family_matrix import absent_reason
from tests.workers.cp_steps import (
    documents_reference,
    packed_documents,
    reduce_flat,
    rows_reference,
    sum_ce,
    take_grads,
    unpacked_rows,
)

VOCAB = 96
DOCS = (29, 3, 13, 2, 6)  # real lengths; each is padded to a multiple of 2*cp for thd / usp
DOC_TOLERANCE = 1.02  # thd_docs' placement: see the module docstring for what it gives at cp=2 and cp=4


def _mamba2_rules(modeling) -> dict[str, Callable]:
    from automodel.distributed.cp.layers.mamba2 import recurrent_mamba2_scan

    return {"mamba2_chunk_scan": recurrent_mamba2_scan}


def one_row_at_a_time(forward: Callable) -> Callable:
    """``forward(self, hidden [..., D])`` called on one token row at a time, its outputs (a tuple of ``[rows,
    ...]`` tensors) concatenated over the rows: the result for a token no longer depends on how many rows the
    call holds. Nemotron-H's router computes its logits with an fp32 matmul even in an fp64 model, and that
    matmul's result for a row depends on the row count (CPU-dependent blocking; measured on AVX-512: one
    routing weight differs by 6e-8 between the 13 rows one rank holds and the same token in its document run
    alone, which moves every later gradient by 2e-8 at cp=4 under thd_docs). Per row, both runs compute the
    same fp32 numbers, and the fp64 cases prove the CP kernels, not the matmul's blocking."""

    @functools.wraps(forward)
    def per_row(self, hidden_states: torch.Tensor):
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if rows.shape[0] == 0:
            return forward(self, hidden_states)
        parts = [forward(self, rows[i : i + 1]) for i in range(rows.shape[0])]
        return tuple(torch.cat(outs) for outs in zip(*parts))

    return per_row


def _nemotron_h_rules(modeling) -> dict[str, Callable]:
    return {**_mamba2_rules(modeling),
            "NemotronHTopkRouter.forward": one_row_at_a_time(modeling.NemotronHTopkRouter.forward)}


#: the fp64 rules of the Mamba2 families (tests/test_state_mixers.py runs its single-process Mamba2 checks on them)
MAMBA2_RULES = (_mamba2_rules, _nemotron_h_rules)


@contextlib.contextmanager
def swapped(modeling, rules: dict[str, Callable]) -> Iterator[None]:
    """``rules`` (``{name: replacement}``, a name a module attribute or ``"Class.attribute"``) swapped into the
    ``modeling`` module for the block; the originals are restored after (mutates ``modeling``)."""
    targets = []
    for name, fn in rules.items():
        owner, attr = (getattr(modeling, name.split(".")[0]), name.split(".")[1]) if "." in name else (modeling, name)
        targets.append((owner, attr, vars(owner).get(attr), attr in vars(owner), fn))
    try:
        for owner, attr, _, _, fn in targets:
            setattr(owner, attr, fn)
        yield
    finally:
        for owner, attr, old, had, _ in reversed(targets):
            if had:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)


def _gdn_rules(modeling) -> dict[str, Callable]:
    from automodel.distributed.cp.layers.gated_deltanet import recurrent_gated_delta_rule

    return {"torch_chunk_gated_delta_rule": recurrent_gated_delta_rule}


def _gdn_chunk(modeling, size: int) -> dict[str, Callable]:
    import functools

    return {"torch_chunk_gated_delta_rule": functools.partial(modeling.torch_chunk_gated_delta_rule, chunk_size=size)}


_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
_MAMBA = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1,
              mamba_chunk_size=8)


@dataclass
class Family:
    """A tiny model family: ``AutoConfig.for_model(model_type, **config)``; ``fp64_rules(modeling module)`` ->
    ``{function name: dtype-keeping replacement}``; ``chunk_rules(modeling module, size)``: the module functions
    to replace so that the scan runs at chunk ``size`` (``None``: the mixers' ``chunk_attr`` attribute);
    ``methods``: the methods this test runs it under (``None``: all)."""

    model_type: str
    config: dict
    fp64_rules: Callable[[object], dict[str, Callable]]
    chunk_attr: str = "chunk_size"
    chunk_rules: Callable[[object, int], dict[str, Callable]] | None = None
    methods: tuple[str, ...] | None = None
    attn: str | None = "sdpa"  # None: a model without attention layers
    extra: dict = field(default_factory=dict)
    row: str | None = None  # the family-matrix row (or variant) the config needs (None: ``model_type``)


#: every family this test proves (helpers add theirs)
FAMILIES: dict[str, Family] = {
    # transformers' default kinds M E * - (Mamba-2, MoE, attention, MLP: issue 36), the MoE layer first and a
    # second Mamba-2 layer last: its router computes in fp32 whatever the dtype, so a Mamba-2 layer before it
    # would get fp32-level gradients in the fp64 reference too (the family matrix runs the default order, fp32);
    # the fp64 cases run the router one token row per call (one_row_at_a_time: its fp32 matmul's rows depend
    # on the row count)
    "nemotron_h": Family("nemotron_h", dict(
        hidden_size=32, hybrid_override_pattern="EM*-M", head_dim=8, mamba_num_heads=4,
        mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4, expand=1, intermediate_size=48,
        chunk_size=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, **_ATTN), _nemotron_h_rules),
    "falcon_h1": Family("falcon_h1", dict(
        hidden_size=32, num_hidden_layers=2, head_dim=8, mamba_d_ssm=32, intermediate_size=48, **_ATTN, **_MAMBA),
        _mamba2_rules),
    "granitemoehybrid": Family("granitemoehybrid", dict(
        hidden_size=32, num_hidden_layers=2, layer_types=["mamba", "attention"], intermediate_size=48,
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=48, **_ATTN,
        **{**_MAMBA, "mamba_n_groups": 2}), _mamba2_rules),
    "bamba": Family("bamba", dict(
        hidden_size=32, num_hidden_layers=2, attn_layer_indices=[1], intermediate_size=48, **_ATTN, **_MAMBA),
        _mamba2_rules),
    "zamba2": Family("zamba2", dict(
        hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], num_attention_heads=4,
        num_key_value_heads=4, attention_head_dim=16, n_mamba_heads=4, mamba_headdim=8, mamba_d_state=8,
        mamba_ngroups=1, mamba_d_conv=4, mamba_expand=1, intermediate_size=48, chunk_size=8, use_mem_rope=True),
        _mamba2_rules),
    "mamba2": Family("mamba2", dict(
        hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4,
        expand=1, chunk_size=8), _mamba2_rules, attn=None,
        # ring refuses a model whose attn_implementation is not sdpa, and Mamba-2 has no attention to set
        methods=("thd", "thd_docs", "ulysses", "usp")),
    # Gated DeltaNet: thd, Ulysses and ring are proven by tests/test_linear_mixer.py; thd_docs and usp here
    "qwen3_5_text": Family("qwen3_5_text", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8, **_ATTN),
        _gdn_rules, chunk_rules=_gdn_chunk, methods=("thd_docs", "usp")),
    # transformers 5.25's LaraMini: Qwen3.5's Gated DeltaNet class under its own name (linear_support.py), beside a
    # sliding-window layer; every method. Its MoE blocks keep one routed expert (and the shared one): the router
    # computes in fp32 whatever the dtype, and a softmax over one logit is exactly 1 with a zero gradient, so the
    # fp64 proof is not blurred by it (with 4 experts the mixer's conv gradient moves 2e-12 in fp64)
    "lara_mini": Family("lara_mini", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
        layer_types=["linear_attention", "sliding_attention"], sliding_window=6, linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
        num_experts=1, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16, **_ATTN),
        _gdn_rules, chunk_rules=_gdn_chunk),
    # transformers 5.25's Qwen4-Exp: Qwen3.5's Gated DeltaNet (its gated norm's activation from the config) beside a
    # QSA layer (query-sparse attention: K, V and the indexer's raw keys gathered, cp/layers/qsa.py), behind
    # hyper-connections; every method. One routed expert, as LaraMini (the router's softmax is fp32)
    "qwen4_exp_text": Family("qwen4_exp_text", dict(
        hidden_size=32, num_hidden_layers=2, head_dim=8, layer_types=["linear_attention", "indexed_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
        linear_num_value_heads=8, num_experts=1, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
        indexer_budget=8, indexer_compress_ratio=2, hc_lowrank=8, ple_layer_ids=[], **_ATTN),
        _gdn_rules, chunk_rules=_gdn_chunk, row="qwen4_exp_text@qsa"),  # 5.17's sparse layers: another type
}
#: the families the installed transformers builds (all from 5.25; the tests of the others skip, naming the release)
INSTALLED: dict[str, Family] = {
    name: fam for name, fam in FAMILIES.items() if absent_reason(fam.row or fam.model_type) is None
}


def build_model(family: Family, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family.model_type, vocab_size=VOCAB, tie_word_embeddings=False, pad_token_id=0,
                                  **family.config)
    torch.manual_seed(0)
    kwargs = {"experts_implementation": "eager"} if family.model_type in ("granitemoehybrid", "nemotron_h",
                                                                          "lara_mini", "qwen4_exp_text") else {}
    if family.attn is not None:
        kwargs["attn_implementation"] = family.attn
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    with torch.no_grad():  # non-trivial decays, skips and norms (the inits are constants)
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "dt_bias":
                p.uniform_(-1.0, 1.0)
            elif leaf == "A_log":
                p.uniform_(-1.0, 1.0)
            elif leaf == "D":
                p.uniform_(0.5, 1.5)
            elif "norm" in name and leaf == "weight":
                p.uniform_(0.5, 1.5)
            elif "conv1d" in name and leaf == "bias":
                p.uniform_(-0.5, 0.5)
    return model.train()


def set_chunk(model, family: Family, size: int) -> dict[str, Callable]:
    """Set the scan's chunk size of every mixer (the one-process kernel-movement measurement); returns the
    module functions the caller must swap in for that (``Family.chunk_rules``), else ``{}``."""
    if family.chunk_rules is not None:
        return family.chunk_rules(sys.modules[type(model).__module__], size)
    for m in model.modules():
        if hasattr(m, family.chunk_attr) and hasattr(m, "A_log"):
            setattr(m, family.chunk_attr, size)
    return {}


def documents(world: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The documents (ids of length L+1, the last is the next-token label) and the packed row."""
    return packed_documents(DOCS, VOCAB, world)


def ring_rows() -> dict[str, torch.Tensor]:
    """Two unpacked rows of 24 tokens: 2*cp chunks of 6 (cp=2) or 3 (cp=4)."""
    return unpacked_rows(VOCAB)


_ce, _grads, _reduce = sum_ce, take_grads, reduce_flat
reference, ring_reference = documents_reference, rows_reference


def cp_step(method: str, model, row, group) -> tuple[float, dict, dict]:
    """One forward/backward under ``method`` on ``group``; returns (loss, grads, facts about the split)."""
    count = int((row["labels"] != -100).sum())
    batch = {k: v.clone() for k, v in row.items()}
    facts: dict = {}
    if method == "ring":
        from torch.distributed.device_mesh import DeviceMesh

        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
        ctx, local = make_cp_batch_and_ctx(mesh, batch)
    elif method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, group)
        ctx, local = make_ulysses_batch_and_ctx(group, batch, inner_attn=inner)
    elif method == "thd":
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        set_thd_attention(model, group)
        ctx, local = make_thd_batch_and_ctx(group, batch)
    elif method == "thd_docs":
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention
        from automodel.distributed.cp.thd_docs.placement import CostModel

        set_doc_attention(model)
        ctx, local = make_doc_batch_and_ctx(group, batch, cost=CostModel(token=4.0), tolerance=DOC_TOLERANCE)
        placement = local["placement"]
        facts["spans"] = {d: tuple(s) for d, s in placement.spans.items()}
        facts["whole"] = sorted({p.doc for r in placement.ranks for p in r} - set(placement.spans))
    else:
        from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention

        set_usp_attention(model)
        ctx, local = make_usp_batch_and_ctx(group, batch, ulysses_size=2)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = _ce(logits, local["labels"]) / count
        loss.backward()
    return (*_reduce(model, loss, group), facts)


def compare(ref_loss, ref_grads, loss, grads) -> dict:
    rel = {name: ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
           for name, ref in ref_grads.items()}
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": rel,
            "missing": sorted(n for n, r in ref_grads.items() if r.abs().max() > 0 and grads[n].abs().max() == 0)}


def exact_reference(base, family: Family, data, run) -> tuple[float, dict]:
    """The exact answer for ``base``'s parameters: ``base`` converted to fp64 with the dtype-keeping rules swapped
    in (``run``: :func:`reference` or :func:`ring_reference`)."""
    model = copy.deepcopy(base).double()
    modeling = sys.modules[type(model).__module__]
    with swapped(modeling, family.fp64_rules(modeling)):
        return run(model, data)


def run_family(family: Family, group, cp: int, methods: tuple[str, ...]) -> dict:
    """Every case of one family at CP size ``cp``: ``{(dtype, rule, method): comparison, ...}``; fp32 cases
    also hold ``"raw"``: the CP ``(loss, grads)``, for the test to hold against :func:`exact_reference` (the
    same for every CP size: computed once, in the test's process)."""
    out: dict = {}
    for dtype_name, rule in (("float64", "fp64"), ("float32", "hf")):
        base = build_model(family, getattr(torch, dtype_name))
        modeling = sys.modules[type(base).__module__]
        patches = family.fp64_rules(modeling) if rule == "fp64" else {}
        docs, row = documents(cp)
        rows = ring_rows()
        with swapped(modeling, patches):
            ref = reference(copy.deepcopy(base), docs)
            for method in methods:
                if family.methods is not None and method not in family.methods:
                    continue
                if method == "ring":
                    ring_ref = ring_reference(copy.deepcopy(base), rows)
                    loss, grads, facts = cp_step("ring", copy.deepcopy(base), rows, group)
                    result = compare(*ring_ref, loss, grads)
                else:
                    loss, grads, facts = cp_step(method, copy.deepcopy(base), row, group)
                    result = {**compare(*ref, loss, grads), **facts}
                if rule == "hf":
                    result["raw"] = (loss, grads)
                out[(dtype_name, rule, method)] = result
            if rule == "fp64" and cp == 2 and family.model_type == "bamba":  # left padding under Ulysses
                rows = ring_rows()
                mask = torch.ones_like(rows["input_ids"])
                mask[0, :5] = 0
                rows["labels"][0, :5] = -100
                rows["attention_mask"] = mask
                count = int((rows["labels"] != -100).sum())
                model = copy.deepcopy(base)
                logits = model(input_ids=rows["input_ids"], attention_mask=mask, use_cache=False).logits
                (_ce(logits, rows["labels"]) / count).backward()
                ref_loss = (_ce(logits.detach(), rows["labels"]) / count).item()
                loss, grads, _ = cp_step("ulysses", copy.deepcopy(base), rows, group)
                out[(dtype_name, rule, "ulysses+left_padding")] = compare(ref_loss, _grads(model), loss, grads)
    return out


#: families run at cp=4 in CI (every family runs at cp=2; ``cp4="all"`` runs every family at cp=4 too). The
#: kernels are shared per mixer kind (the families differ only in token-local parts, proven at cp=2), so
#: cp=4 runs one family per kernel: Nemotron-H for Mamba2 (2 B/C groups: replicated over 4 Ulysses ranks),
#: Qwen3.5 for Gated DeltaNet
CP4_FAMILIES: list[str] = ["nemotron_h", "qwen3_5_text"]


def run_all(group, cp: int, methods: tuple[str, ...], families: dict[str, Family]) -> dict:
    return {name: run_family(fam, group, cp, methods) for name, fam in families.items()}


def chain_bytes(family: Family, group, rank: int, world: int) -> dict:
    """Bytes this rank's state hand-off sends in one ring step (two rows) at 24 and 48 tokens per row, and what
    :func:`~automodel.distributed.cp.layers.state_chain.chain_bytes_per_rank` says for the model's mixers."""
    import automodel.distributed.cp.layers.state_chain as chain_module
    from automodel.distributed.cp.layers.mixer_kernel import kernel_for

    base = build_model(family, torch.float32)
    mixers = [m for m in base.modules() if kernel_for(m) is not None]
    out = {"expected": sum(chain_module.chain_bytes_per_rank(kernel_for(m), m, world, rank, n_docs=1, batch=2)
                           for m in mixers)}
    original = chain_module.send_state
    for length in (24, 48):
        sent = [0]

        def counting(g, tensors, peer, _box=sent):
            _box[0] += 8 * sum(t.numel() for t in tensors)
            return original(g, tensors, peer)

        ids = torch.randint(3, VOCAB, (2, length + 1), generator=torch.Generator().manual_seed(3))
        chain_module.send_state = counting
        try:
            cp_step("ring", copy.deepcopy(base), {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, group)
        finally:
            chain_module.send_state = original
        out[length] = sent[0]
    return out


def main(rank: int, world_size: int, families: tuple[str, ...] | None = None, cp4: str = "ci") -> dict:
    """cp=2 on ranks {0, 1} and {2, 3} at once (the pairs split the families between them), then cp=4 on all
    four (usp as 2 x 2 there): ``{cp: {family: {(dtype, rule, method): comparison}}}``."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    chosen = {k: v for k, v in INSTALLED.items() if families is None or k in families}
    pairs = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world_size, 2)]
    n_pairs = len(pairs)
    mine = {k: v for i, (k, v) in enumerate(chosen.items()) if i % n_pairs == rank // 2}
    results = {2: run_all(pairs[rank // 2], 2, ("thd", "thd_docs", "ulysses", "ring"), mine)}
    ringed = [f for f in mine.values() if f.methods is None or "ring" in f.methods]
    results["chain_bytes"] = chain_bytes(ringed[0], pairs[rank // 2], rank % 2, 2) if ringed else None
    if world_size == 4:
        wide = chosen if cp4 == "all" else {k: v for k, v in chosen.items() if k in CP4_FAMILIES}
        results[4] = run_all(dist.new_group(backend="gloo"), 4, ("thd", "thd_docs", "ulysses", "ring", "usp"), wide)
    return results
