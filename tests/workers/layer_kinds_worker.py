"""Parity of the per-layer-kind CP kernels (tests/test_layer_kinds.py), on every rank of one gloo group.

Kernel level: :func:`halo_attention` on this rank's tokens of a ring or thd layout against a dense
single-process reference on the whole stream (its own mask code: documents, window, chunk, sinks,
softcap); loss = sum(out * w), and the gradients of q, k, v and the sinks are assembled over the ranks.

Model level: tiny models of tests/family_matrix.py in fp32 and fp64 through the own-loop APIs: ring on
one whole row against the row in one process (eager families too); thd and Ulysses on packed rows against
every document run alone. Each case records the model's attention implementation inside the CP context and
after it.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel.distributed.cp.layers.masked_attention import halo_attention
from automodel.distributed.cp.layout import ring_layout, thd_layout
from tests.workers.cp_steps import reduce_over_group
from tests.workers.exact_norms import norms_in_input_dtype
from tests.workers.thd_attention_worker import _ce, pack

SENTINEL = -1000
#: DeepSeek-V4's test model (tests/test_layer_kinds.py, test_doc_layer_kinds.py, test_usp.py,
#: test_compressed_attention.py): a window with sinks (layer 0 alone), HCA (blocks of 8) and CSA (blocks of 4,
#: overlapping pools, the indexer keeping 3 per query), and the parameters drawn afresh (:func:`randomize`)
V4_CONFIG = {
    "num_hidden_layers": 4, "sliding_window": 8, "index_topk": 3,
    "layer_types": ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                    "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
}  # fmt: skip
V4_RANDOM = ("sinks", "position_bias", "tid2eid")
ATTN_SEEN: list[tuple[str, str]] = []  # the model's attention implementation inside and after each CP step


# ------------------------------------------------------------------------------------------- kernel level
def dense_reference(q, k, v, doc_start, window, chunk, sinks, softcap, scale):
    """``[B, Hq, T, Dv]`` attention over the whole stream, with its own dense mask."""
    t = q.shape[2]
    i = torch.arange(t).unsqueeze(1)
    j = torch.arange(t).unsqueeze(0)
    ds = doc_start
    allowed = (j <= i) & (ds[j] == ds[i])
    if window is not None:
        allowed &= i - j < window
    if chunk is not None:
        allowed &= (i - ds[i]) // chunk == (j - ds[j]) // chunk
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(s.shape[0], -1, t, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :t]
    return p @ vv


def kernel_case(case: dict, rank: int, world: int, group) -> dict:
    dtype = getattr(torch, case["dtype"])
    if "cu" in case:
        layout = thd_layout(case["cu"], group, world, rank)
    else:
        layout = ring_layout(case["seq"], group, world, rank)
    t, b, hq, hkv = layout.total, 2, 4, case.get("hkv", 2)
    dqk, dv = case.get("dqk", 8), case.get("dv", 8)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, hq, t, dqk, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, t, dqk, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, t, dv, generator=g, dtype=torch.float64).to(dtype)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64).to(dtype) if case.get("sinks") else None
    w = torch.randn(b, hq, t, dv, generator=g, dtype=torch.float64).to(dtype)
    scale = dqk**-0.5
    opts = dict(window=case.get("window"), chunk=case.get("chunk"), softcap=case.get("softcap"))

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    s_ref = sinks.clone().requires_grad_(True) if sinks is not None else None
    ref = dense_reference(*leaves, layout.doc_start, sinks=s_ref, scale=scale, **opts)
    (ref * w).sum().backward()

    ids = layout.ids
    local = [x.index_select(2, ids).clone().requires_grad_(True) for x in (q, k, v)]
    s_loc = sinks.clone().requires_grad_(True) if sinks is not None else None
    backend = "math" if case.get("force_math") else None  # the math blocks off-CPU kernels run
    out = halo_attention(*local, layout, sinks=s_loc, scale=scale, block=case.get("block", 256), backend=backend, **opts)
    loss = (out.transpose(1, 2) * w.index_select(2, ids)).sum()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    errs = {"loss": abs(float(total) - float((ref * w).sum())) / abs(float((ref * w).sum()))}
    for name, leaf, full in zip("qkv", local, leaves):
        grad = torch.zeros_like(full).index_copy(2, ids, leaf.grad)
        dist.all_reduce(grad, group=group)
        errs[f"d{name}"] = float((grad - full.grad).abs().max() / full.grad.abs().max())
    if sinks is not None:
        gs = s_loc.grad.clone()
        dist.all_reduce(gs, group=group)
        errs["dsinks"] = float((gs - s_ref.grad).abs().max() / s_ref.grad.abs().max())
    plan = layout.halo_plan(opts["window"], opts["chunk"], case.get("block", 256))
    return {"errors": errs, "halo_ids": plan.halo_ids.tolist(), "sent": plan.sent_tokens,
            "out_shape": tuple(out.shape)}


# -------------------------------------------------------------------------------------------- model level
def _docs(lengths: list[int], vocab: int, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=g)
        labels = torch.randint(3, vocab, (n,), generator=g)
        labels[torch.rand(n, generator=g) < 0.2] = -100
        docs.append({"input_ids": ids, "labels": labels})
    return docs


def _reference(model, docs, n_labels):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for d in docs:
        logits = model(input_ids=d["input_ids"][None], position_ids=torch.arange(d["input_ids"].numel())[None],
                       use_cache=False).logits
        ce = _ce(logits[0], d["labels"])
        (ce / n_labels).backward()
        total += float(ce.detach())
    return total / n_labels, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cp_step(method, model, batch, mesh, n_labels):
    try:
        return _cp_step_inner(method, model, batch, mesh, n_labels)
    finally:
        if method == "ring_graph_break":  # put transformers' registry back for the next cases
            from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

            ALL_ATTENTION_FUNCTIONS._local_mapping.pop("sdpa", None)


def _cp_step_inner(method, model, batch, mesh, n_labels):
    model.zero_grad(set_to_none=True)
    if method.startswith("ring"):
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx
        from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

        if method == "ring_graph_break":  # as models/compile.py breaks the compiled graph at the attention
            from automodel.models.compile import attention_outside_graph

            ALL_ATTENTION_FUNCTIONS["sdpa"] = attention_outside_graph(ALL_ATTENTION_FUNCTIONS["sdpa"])
        ctx, local = make_cp_batch_and_ctx(mesh, batch)
        if method == "ring_eager_backward":  # as the trainer wraps it for compiled autograd
            from automodel.models.compile import attention_backward_eager

            inner_ctx = ctx

            def ctx():
                stack = contextlib.ExitStack()
                stack.enter_context(attention_backward_eager(model))
                stack.enter_context(inner_ctx())
                return stack
    elif method == "thd":
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        set_thd_attention(model, mesh)
        ctx, local = make_thd_batch_and_ctx(mesh, batch)
    else:
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, mesh)
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner)
    if method == "ulysses_local_positions":  # a negative control: RoPE at each rank's local index, not the global one
        local = {**local, "position_ids": torch.arange(local["input_ids"].shape[1])[None]}
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ce = _ce(logits.flatten(0, 1), local["labels"].flatten())
        (ce / n_labels).backward()
        attn_inside = model.config._attn_implementation
    ATTN_SEEN.append((attn_inside, model.config._attn_implementation))  # inside the context, after it
    loss, grads = reduce_over_group(model, ce, mesh.get_group())
    return float(loss) / n_labels, grads


#: Qwen4-Exp with QSA layers only (query-sparse attention: K, V and the indexer's raw keys gathered,
#: cp/layers/qsa.py) and one routed expert (its router's softmax is fp32 whatever the dtype); fp64 cases run its
#: RMSNorms in fp64 too (exact_norms). Its Gated DeltaNet is proven by tests/test_state_mixers.py
QSA_CONFIG = dict(num_hidden_layers=2, layer_types=["indexed_attention"] * 2, num_experts=1, num_experts_per_tok=1)


#: Kolibri-1.1 with every part of its indexed attention: sliding layers around a pool-source indexed layer that
#: stores its K/V and a later indexed layer that reuses both the pool and those K/V; every MLP dense (its MoE router
#: computes in fp32 whatever the dtype); fp64 cases run its RMSNorms in fp64 (exact_norms)
KOLIBRI_CONFIG = dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention"] * 2,
                      index_layers=[1], kv_source_layers=[0, 1, 2, 1],
                      mlp_only_layers=[0, 1, 2, 3])


def build_case_model(case: dict):
    """The family's tiny model; ``random_A``: Doge's ``A`` drawn from N(0, 1); ``dense_mlp``: every MLP dense (no MoE router, which computes in fp32 whatever the
    model's dtype), the attention layer pattern unchanged, so that an fp64 run shows fp64's round-off; ``config``:
    config attributes set before the model is built (with ``dense_mlp``, on the built config: GLM-5's
    indexer_types), or else given to the config's constructor over the family's keys (Gemma's KV sharing)."""
    from transformers import AutoModelForCausalLM

    from tests.family_matrix import family_by_name, nontrivial_init

    fam = family_by_name(case["family"])
    if case.get("random_A"):  # Doge: A ~ N(0, 1) (zeros at init: every key's bias 1, the top-k all ties)
        model = build_case_model({k: v for k, v in case.items() if k != "random_A"})
        g = torch.Generator().manual_seed(7)
        for module in model.modules():
            if type(module).__name__ == "DogeAttention":
                module.A.data = torch.randn(module.A.shape, generator=g)
        return model
    if not case.get("dense_mlp") and not case.get("config"):
        return fam.build_model(0)
    if not case.get("dense_mlp"):  # config keys given to the constructor, the family's sizes kept (Gemma's KV sharing)
        from transformers import AutoConfig

        torch.manual_seed(0)
        config = AutoConfig.for_model(fam.model_type, **{**fam.config_kwargs, **case["config"]})
        model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation()).train()
        nontrivial_init(fam.model_type, model)  # ZAYA's key scale
        return model
    config = fam.build_config()
    n = config.num_hidden_layers
    if case.get("dense_mlp"):
        config.first_k_dense_replace, config.mlp_layer_types = n, ["dense"] * n
    for key, value in case.get("config", {}).items():  # e.g. GLM-5's indexer_types
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation(), dtype=torch.float32)
    nontrivial_init(fam.model_type, model)
    return model.train(fam.train_mode)


def randomize(model, names) -> None:
    """Draw the parameters and buffers whose name contains one of ``names`` afresh (seeded; mutates ``model``): those
    transformers initialises to a constant (DeepSeek-V4's sinks and pooling biases at 0, its hash-routing table at
    expert 0), so that a kernel that dropped them or misaligned a block would show."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not any(part in name for part in names):
                continue
            if tensor.dtype == torch.int64:  # a routing table: experts drawn per token id
                tensor.copy_(torch.randint(0, int(tensor.max()) + 4, tensor.shape, generator=g) % 4)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=torch.float64).to(tensor.dtype) * 0.5)


def model_case(case: dict, mesh, world: int) -> dict:
    """One model case; ``case["exact_norms"]``: an fp64 model's Gemma RMSNorms compute in fp64
    (tests/workers/exact_norms.py); ``case["config"]``, ``case["dense_mlp"]``: see :func:`build_case_model`."""
    dtype = getattr(torch, case["dtype"])
    with norms_in_input_dtype(case.get("exact_norms", False) and dtype == torch.float64), default_dtype(case):
        return _model_case(case, mesh, world, dtype)


@contextlib.contextmanager
def default_dtype(case: dict):
    """torch's default dtype is the case's while it runs where ``case["default_dtype"]`` (XGLM in fp64: transformers
    clamps its scores with ``torch.full((), finfo(fp64).min)`` in the default dtype, which fp32 cannot hold)."""
    saved = torch.get_default_dtype()
    if case.get("default_dtype"):
        torch.set_default_dtype(getattr(torch, case["default_dtype"]))
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _model_case(case: dict, mesh, world: int, dtype: torch.dtype) -> dict:
    from tests.family_matrix import VOCAB

    base = build_case_model(case)
    randomize(base, case.get("randomize", ()))
    if dtype == torch.float64 and hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    base = base.to(dtype)
    docs = _docs(case["docs"], VOCAB)
    n_labels = sum(int((d["labels"] != -100).sum()) for d in docs)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), docs, n_labels)
    if case["method"].startswith("ring"):  # one document, one whole row
        batch = {"input_ids": docs[0]["input_ids"][None].clone(), "labels": docs[0]["labels"][None].clone()}
    else:
        batch = pack([docs], 2 * world)
        if case["method"] == "ulysses":
            batch = {k: v for k, v in batch.items()}
    loss, grads = _cp_step(case["method"], copy.deepcopy(base), batch, mesh, n_labels)
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), **grad_errors(grads, ref_grads), "attn": ATTN_SEEN[-1]}


def grad_errors(grads: dict, ref_grads: dict) -> dict:
    """``grad_rel``: the largest over the parameters of the difference over the parameter's largest reference entry;
    ``grad_rel_floored``: the same, that entry floored at 1e-3 of the model's largest (the support table's measure:
    a gradient that cancels to nearly 0, e.g. a scalar scale summed over every token, is then not judged by its own
    round-off); the parameters of :data:`SHIFT_INVARIANT` (zero in exact arithmetic) are measured against the model's
    largest reference gradient in both; ``worst``: the parameter of ``grad_rel``; ``missing``: parameters with a reference gradient and none."""
    top = max(float(g.abs().max()) for g in ref_grads.values())
    errors = {n: float((grads[n] - g).abs().max()) / (top if n.endswith(SHIFT_INVARIANT) else max(float(g.abs().max()), 1e-30))
              for n, g in ref_grads.items()}  # fmt: skip
    floored = max(float((grads[n] - g).abs().max()) / max(float(g.abs().max()), 1e-3 * top, 1e-30)
                  for n, g in ref_grads.items())  # fmt: skip
    missing = sorted(n for n in ref_grads if float(grads[n].abs().max()) == 0.0 and float(ref_grads[n].abs().max()) > 0)
    return {"grad_rel": max(errors.values()), "grad_rel_floored": floored, "worst": max(errors, key=errors.get),
            "missing": missing, "n_params": len(ref_grads)}


#: parameters whose gradient is zero in exact arithmetic: a key projection's bias adds ``q . b`` to every score of a
#: query, which the softmax cancels (XGLM's ``k_proj.bias``); one process and CP leave different round-off there
SHIFT_INVARIANT = (".self_attn.k_proj.bias",)


def main(rank: int, world_size: int, kernel_cases: dict, model_cases: dict | None = None) -> dict:
    if model_cases:
        import transformers

        transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    out: dict = {}
    for name, case in kernel_cases.items():
        out[name] = kernel_case(case, rank, world_size, group)
    for name, case in (model_cases or {}).items():
        out[name] = model_case(case, mesh, world_size)
    return out
