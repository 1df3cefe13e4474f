"""Headwise Ulysses (``distributed.ulysses_head_chunks``) against the run without it and against one process.

Run inside existing launches (tests/workers/ulysses_worker.py at cp=2, tests/workers/usp_worker.py at cp=4):
:func:`checks` takes the launch's ranks and returns, per case, the loss and the worst per-parameter relative
gradient error of the chunked run against the unchunked one (same CP size, same batch) and against the
single-process reference (every document alone). Cases cover the layer kinds Ulysses runs (GQA, sliding windows,
gpt-oss's sinks with eager, Gemma 2's softcapping with eager), plain and packed rows, fp32 and fp64, activation
checkpointing with activation offload and ``torch.compile`` of the decoder blocks.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.device_mesh import init_device_mesh

from tests.workers.cp_steps import reduce_over_group
from tests.workers.layer_kinds_worker import _docs, _reference
from tests.workers.thd_attention_worker import _ce, pack

# name: family, KV heads (None: as many as query heads), dtype, rows, head chunks, method, extras
CP2_CASES = {
    "llama_gqa_plain_f64": dict(family="llama", heads=8, kv=4, dtype="float64", form="plain", chunks=2),
    "llama_mha_packed_g4_f64": dict(family="llama", heads=8, kv=8, dtype="float64", form="packed", chunks=4),
    "mistral_window_packed_f64": dict(family="mistral", heads=4, kv=None, dtype="float64", form="packed", chunks=2),
    "gpt_oss_sinks_packed_f32": dict(family="gpt_oss", heads=4, kv=None, dtype="float32", form="packed", chunks=2),
    "gemma2_softcap_plain_f64": dict(family="gemma2", heads=4, kv=None, dtype="float64", form="plain", chunks=2),
    "llama_ckpt_offload_packed_f32": dict(family="llama", heads=8, kv=4, dtype="float32", form="packed", chunks=2,
                                          ckpt=True, offload=True),
    "llama_compile_ckpt_plain_f32": dict(family="llama", heads=8, kv=4, dtype="float32", form="plain", chunks=2,
                                         ckpt=True, compile=True),
    # ALiBi (BLOOM's own attention code): each head group takes its heads' slopes
    "bloom_alibi_packed_f64": dict(family="bloom", heads=4, kv=None, dtype="float64", form="packed", chunks=2),
    # model.tiled_layer (tiles of 5 tokens) composed with head groups: also against the same run untiled
    "llama_tiled_layer_packed_f64": dict(family="llama", heads=8, kv=4, dtype="float64", form="packed", chunks=2,
                                         tiled_layer=5),
    "qwen3_tiled_layer_ckpt_offload_packed_f32": dict(family="qwen3", heads=8, kv=4, dtype="float32", form="packed",
                                                      chunks=2, ckpt=True, offload=True, tiled_layer=5),
    "llama_tiled_layer_compile_ckpt_plain_f32": dict(family="llama", heads=8, kv=4, dtype="float32", form="plain",
                                                     chunks=2, ckpt=True, compile=True, tiled_layer=5),
}
# at cp=4 (4 ranks): Ulysses over all of them, and usp 2 x 2 (head groups inside the Ulysses sub-group)
CP4_CASES = {
    "ulysses_mha_packed_f64": dict(family="llama", heads=8, kv=8, dtype="float64", form="packed", chunks=2),
    "ulysses_gqa_plain_f32": dict(family="llama", heads=16, kv=8, dtype="float32", form="plain", chunks=2,
                                  ckpt=True),
    "usp2_gqa_packed_f64": dict(family="llama", heads=8, kv=4, dtype="float64", form="packed", chunks=2,
                                method="usp2"),
    "usp2_sinks_packed_f32": dict(family="gpt_oss", heads=4, kv=None, dtype="float32", form="packed", chunks=2,
                                  method="usp2"),
    "usp2_bloom_alibi_packed_f64": dict(family="bloom", heads=4, kv=None, dtype="float64", form="packed", chunks=2,
                                        method="usp2"),
    "ulysses_tiled_layer_gqa_plain_f32": dict(family="llama", heads=16, kv=8, dtype="float32", form="plain",
                                              chunks=2, ckpt=True, tiled_layer=5),
    "usp2_tiled_layer_gqa_packed_f64": dict(family="llama", heads=8, kv=4, dtype="float64", form="packed", chunks=2,
                                            method="usp2", tiled_layer=5),
}
DOCS = [21, 34, 9]


def _model(case: dict, world: int):
    from tests.family_matrix import family_by_name

    family = family_by_name(case["family"])
    config = family.build_config()
    config.num_attention_heads = case["heads"]
    config.num_key_value_heads = case["kv"] or case["heads"]
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = 8
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=family.attn_implementation(),
                                             dtype=getattr(torch, case["dtype"]))
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no fp64 kernel
    return model.train(family.train_mode)


def _batch(form: str, docs: list[dict], multiple: int) -> dict:
    if form == "packed":
        return pack([docs], multiple)
    seq = -(-max(d["input_ids"].numel() for d in docs) // multiple) * multiple  # one document per row
    batch = {"input_ids": torch.zeros(len(docs), seq, dtype=torch.long),
             "labels": torch.full((len(docs), seq), -100, dtype=torch.long)}
    for b, d in enumerate(docs):
        n = d["input_ids"].numel()
        batch["input_ids"][b, :n], batch["labels"][b, :n] = d["input_ids"], d["labels"]
    return batch


def _cp_run(case: dict, model, batch, mesh, n_labels: int, chunks: int):
    model.zero_grad(set_to_none=True)
    if case.get("method") == "usp2":
        from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention

        set_usp_attention(model)
        ctx, local = make_usp_batch_and_ctx(mesh, batch, ulysses_size=2, head_chunks=chunks)
    else:
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, mesh)
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner, head_chunks=chunks)
    with ctx() as active:
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ce = _ce(logits.flatten(0, 1), local["labels"].flatten())
        (ce / n_labels).backward()
    loss, grads = reduce_over_group(model, ce, mesh.get_group())
    return float(loss) / n_labels, grads, active.head_group_runs


def _prepare(case: dict, model, tiled: bool = True):
    if case.get("tiled_layer") and tiled:
        from automodel.models.tiled_layer import apply_tiled_layer

        apply_tiled_layer(model, case["tiled_layer"])
    if case.get("ckpt"):
        from automodel.models.block_call import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if case.get("offload"):
        from automodel.training.activation_offload import apply_activation_offload

        apply_activation_offload(model)
    if case.get("compile"):
        from automodel.models.compile import compile_decoder_blocks

        compile_decoder_blocks(model, backend="aot_eager")
    return model


def _worst(grads: dict, ref: dict) -> float:
    return max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref.items())


def one_case(case: dict, mesh, world: int) -> dict:
    base = _model(case, world)
    docs = _docs(DOCS, base.config.vocab_size)
    n_labels = sum(int((d["labels"] != -100).sum()) for d in docs)
    ref_loss, ref_grads = _reference(copy.deepcopy(base), docs, n_labels)
    batch = _batch(case["form"], docs, 2 * world)
    whole_loss, whole_grads, _ = _cp_run(case, _prepare(case, copy.deepcopy(base)), batch, mesh, n_labels, 1)
    model = _prepare(case, copy.deepcopy(base))
    loss, grads, runs = _cp_run(case, model, batch, mesh, n_labels, case["chunks"])
    untiled = {}
    if case.get("tiled_layer"):  # the same chunked run without the tiled layer
        from automodel.models.tiled_layer import layer_tile_counts

        plain_loss, plain_grads, _ = _cp_run(case, _prepare(case, copy.deepcopy(base), tiled=False), batch, mesh,
                                             n_labels, case["chunks"])  # fmt: skip
        untiled = {"loss_vs_untiled": abs(loss - plain_loss) / abs(plain_loss),
                   "grad_vs_untiled": _worst(grads, plain_grads),
                   "tiled_calls": [c.calls for c in layer_tile_counts(model)]}  # fmt: skip
    return {
        **untiled,
        "loss_vs_unchunked": abs(loss - whole_loss) / abs(whole_loss),
        "grad_vs_unchunked": _worst(grads, whole_grads),
        "loss_vs_reference": abs(loss - ref_loss) / abs(ref_loss),
        "grad_vs_reference": _worst(grads, ref_grads),
        "n_params": len(ref_grads),
        "layers": base.config.num_hidden_layers,
        "group_runs": runs,  # layers x chunks in the forward, as many again recomputed in the backward
        "zero_grads": sorted(n for n, g in grads.items() if n in ref_grads and float(g.abs().max()) == 0.0),
    }


def refusal(world: int) -> str:
    """The message a head chunk count that does not divide the rank's KV heads gets at the first call."""
    case = dict(family="llama", heads=8, kv=4, dtype="float32", form="plain", chunks=3)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = _model(case, world)
    batch = _batch("plain", _docs(DOCS, model.config.vocab_size), 2 * world)
    try:
        _cp_run(case, model, batch, mesh, 1, 3)
    except ValueError as e:
        return str(e)
    return ""


def checks(rank: int, world: int, cases: dict) -> dict:
    import transformers

    transformers.logging.set_verbosity_error()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = {name: one_case(case, mesh, world) for name, case in cases.items()}
    out["refusal"] = refusal(world)
    return out


def assert_case(name: str, case: dict, got: dict) -> None:
    """The chunked run equals the unchunked one (fp64 to round-off, fp32 to 1e-6; in practice bit for bit), both
    equal one process, every parameter gets a gradient, and the groups observably ran one at a time (``layers x
    chunks`` group calls in the forward, as many recomputed in the backward, as many again under checkpointing)."""
    f64 = case["dtype"] == "float64"
    assert got["loss_vs_unchunked"] <= (1e-15 if f64 else 1e-6), (name, got)
    assert got["grad_vs_unchunked"] <= (1e-14 if f64 else 1e-6), (name, got)
    fp32_inside = case["family"] in ("gemma2", "gpt_oss", "bloom")  # softmax in fp32 inside (tests/test_layer_kinds.py)
    loss_tol, grad_tol = (1e-12, 1e-10) if f64 and not fp32_inside else (1e-5, 1e-4)
    assert got["loss_vs_reference"] <= loss_tol and got["grad_vs_reference"] <= grad_tol, (name, got)
    assert got["zero_grads"] == [], (name, got)
    if case.get("tiled_layer"):  # the tiled layer against the same headwise run without it
        assert got["loss_vs_untiled"] <= (1e-15 if f64 else 1e-6), (name, got)
        assert got["grad_vs_untiled"] <= (1e-14 if f64 else 1e-6), (name, got)
        # every layer ran in tiles: its forward, and its recomputation under checkpointing
        assert got["tiled_calls"] == [2 if case.get("ckpt") else 1] * got["layers"], (name, got)
    passes = 3 if case.get("ckpt") else 2
    assert got["group_runs"] == got["layers"] * case["chunks"] * passes, (name, got)
