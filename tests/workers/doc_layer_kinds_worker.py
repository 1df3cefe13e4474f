"""thd_docs on every attention layer kind (tests/test_doc_layer_kinds.py), on every rank of one gloo group.

Tiny models of tests/family_matrix.py (sliding windows, softcapping, sinks, MLA, chunks, Llama 4's query
temperature) in fp32 and fp64 through ``set_doc_attention`` + ``make_doc_batch_and_ctx`` with the model's
cost model: a packed row of documents against every document run alone in one process, and an unpacked
row against the row alone. Each case also returns its placement and what the halo kernel exchanged.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.workers.cp_steps import reduce_over_group
from tests.workers.exact_norms import norms_in_input_dtype
from tests.workers.layer_kinds_worker import _docs, _reference, default_dtype, grad_errors
from tests.workers.thd_attention_worker import _ce, pack


def build_model(family: str):
    """The family's tiny model; Llama 4 with its NoPE query temperature on and varying within a few tokens."""
    from transformers import AutoModelForCausalLM

    from tests.family_matrix import family_by_name

    fam = family_by_name(family)
    if family != "llama4_text":
        return fam.build_model(0)
    config = fam.build_config()
    config.attn_temperature_tuning, config.floor_scale, config.attn_scale = True, 4, 0.5
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation(), dtype=torch.float32)
    return model.train(fam.train_mode)


def _doc_step(model, batch, mesh, n_labels):
    from automodel.distributed.cp.thd_docs import model_cost
    from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention

    model.zero_grad(set_to_none=True)
    set_doc_attention(model, mesh)
    ctx, local = make_doc_batch_and_ctx(mesh, batch, cost=model_cost(model))
    with ctx() as plan:
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ce = _ce(logits.flatten(0, 1), local["labels"].flatten())
        (ce / n_labels).backward()
    loss, grads = reduce_over_group(model, ce, mesh.get_group())
    halos = {  # (window, chunk, block) -> tokens this rank received, per halo plan the layers used
        str(key[:2]): int(sum(p.recv_splits)) for key, p in plan.token_layout()._plans.items() if isinstance(key, tuple)
    }
    placement = local["placement"]
    info = {
        "spans": {d: list(s) for d, s in placement.spans.items()},
        "lengths": list(placement.lengths),
        "halos": halos,
        "lent": sum(placement.exchange_tokens(mesh.get_local_rank())),
    }
    return float(loss) / n_labels, grads, info


def model_case(case: dict, mesh) -> dict:
    """One model case; ``case["exact_norms"]``: an fp64 model's Gemma RMSNorms compute in fp64
    (tests/workers/exact_norms.py)."""
    dtype = getattr(torch, case["dtype"])
    with norms_in_input_dtype(case.get("exact_norms", False) and dtype == torch.float64), default_dtype(case):
        return _model_case(case, mesh, dtype)


def _model_case(case: dict, mesh, dtype: torch.dtype) -> dict:
    from tests.family_matrix import VOCAB

    dtype = getattr(torch, case["dtype"])
    if case.get("dense_mlp") or case.get("config") or case.get("random_A"):  # DSA with every MLP dense (no fp32 MoE router); Falcon's ALiBi
        from tests.workers.layer_kinds_worker import build_case_model

        base = build_case_model(case)
    else:
        base = build_model(case["family"])
    from tests.workers.layer_kinds_worker import randomize

    randomize(base, case.get("randomize", ()))
    if dtype == torch.float64 and hasattr(base, "set_experts_implementation"):
        base.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    base = base.to(dtype)
    rows = case["rows"]
    docs = _docs([n for row in rows for n in row], VOCAB)
    n_labels = sum(int((d["labels"] != -100).sum()) for d in docs)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), docs, n_labels)
    if case["packed"]:  # no padding per document: thd_docs cuts documents anywhere
        at = [sum(len(r) for r in rows[:i]) for i in range(len(rows) + 1)]
        batch = pack([docs[at[i] : at[i + 1]] for i in range(len(rows))], 1)
    else:  # one document per row (equal lengths), no seq_lens
        batch = {k: torch.stack([d[k] for d in docs]) for k in ("input_ids", "labels")}
    loss, grads, info = _doc_step(copy.deepcopy(base), batch, mesh, n_labels)
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), **grad_errors(grads, ref_grads), **info}


def main(rank: int, world_size: int, model_cases: dict) -> dict:
    import time

    import transformers

    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out: dict = {}
    t0 = time.perf_counter()
    for name, case in model_cases.items():
        out[name] = model_case(case, mesh)
    out["seconds"] = time.perf_counter() - t0
    return out
