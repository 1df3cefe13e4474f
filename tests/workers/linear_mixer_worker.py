"""Gated DeltaNet under CP (tests/test_linear_mixer.py): Qwen3-Next, packed documents, against each document alone.

On every rank: a tiny Qwen3-Next (one Gated DeltaNet layer, one gated full-attention layer, MoE MLPs), a
packed row of several documents, and the single-process reference: the loss (sum CE / label count) and
every parameter's gradient with each document run ALONE through the unmodified model. Then Ulysses and
thd at cp = world size through the own-loop API (set_*_attention + make_*_batch_and_ctx) on the packed
row; loss and gradients are SUM-all-reduced over the group and compared. Ring (no packed rows) runs two
unpacked rows against the single-process batch.

At cp=2 thd also runs with activation checkpointing (non-reentrant, as the recipe), whose recompute runs
the state chain again inside the backward. Cases: ``(dtype, rule)``; rule ``"hf"`` is transformers' torch kernel (fp32 inside, whatever the dtype),
``"fp64"`` substitutes :func:`~automodel.distributed.cp.layers.gated_deltanet.recurrent_gated_delta_rule` in
BOTH runs (the model module's function and the CP kernel), so that the chaining is proven to fp64
round-off.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist

from tests.workers.cp_steps import (
    documents_reference,
    packed_documents,
    reduce_flat,
    rows_reference,
    sum_ce,
    unpacked_rows,
)

VOCAB = 128
DOCS = (13, 29, 6)  # real lengths; each is padded to a multiple of 2*cp for thd


def documents(world: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The documents (ids of length L+1, the last is the next-token label) and the packed row."""
    return packed_documents(DOCS, VOCAB, world)


def ring_rows(cp: int) -> dict[str, torch.Tensor]:
    """Two unpacked rows (ring takes no packed rows) of 24 tokens: 2*cp chunks of 6 (cp=2) or 3 (cp=4)."""
    return unpacked_rows(VOCAB)


_ce, _reduce = sum_ce, reduce_flat
reference, ring_reference = documents_reference, rows_reference


def build_model(dtype: torch.dtype, k_heads: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=k_heads,
        linear_num_value_heads=2 * k_heads, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, tie_word_embeddings=False, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", dtype=dtype, experts_implementation="eager"  # grouped_mm: no fp64
    )
    with torch.no_grad():  # non-trivial decay / gate parameters (the init is all ones / one value)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.dt_bias.uniform_(-1.0, 1.0)
                layer.linear_attn.A_log.uniform_(-2.0, 1.0)
                layer.linear_attn.norm.weight.uniform_(0.5, 1.5)
    return model.train()


def cp_step(method: str, model, row, group) -> tuple[float, dict, int]:
    count = int((row["labels"] != -100).sum())
    batch = {k: v.clone() for k, v in row.items()}
    if method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, group)
        ctx, local = make_ulysses_batch_and_ctx(group, batch, inner_attn=inner)
    else:
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        set_thd_attention(model, group)
        ctx, local = make_thd_batch_and_ctx(group, batch)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = _ce(logits, local["labels"]) / count
        loss.backward()
    return (*_reduce(model, loss, group), local["input_ids"].shape[1])


def ring_step(model, rows, group) -> tuple[float, dict]:
    from torch.distributed.device_mesh import DeviceMesh

    from automodel.distributed.cp_utils import make_cp_batch_and_ctx

    count = int((rows["labels"] != -100).sum())
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    ctx, local = make_cp_batch_and_ctx(mesh, {k: v.clone() for k, v in rows.items()})
    with ctx():  # entering shards `local` in place
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = _ce(logits, local["labels"]) / count
        loss.backward()
    return _reduce(model, loss, group)


def compare(ref_loss, ref_grads, loss, grads) -> dict:
    rel = {}
    for name, ref in ref_grads.items():
        rel[name] = ((grads[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": rel,
            "missing": sorted(set(ref_grads) - {n for n, g in grads.items() if g.abs().max() > 0})}


def run_cases(group, cp: int, cases) -> dict:
    """Every case at CP size ``cp`` on ``group``: ``{(dtype, rule, method): comparison}``."""
    import contextlib

    from automodel.distributed.cp.layers import gated_deltanet as gd

    out: dict = {}
    for dtype_name, rule in cases:
        base = build_model(getattr(torch, dtype_name), k_heads=cp)
        modeling = sys.modules[type(base).__module__]
        original = modeling.torch_chunk_gated_delta_rule
        switch = contextlib.nullcontext()
        if rule == "fp64":
            modeling.torch_chunk_gated_delta_rule = gd.recurrent_gated_delta_rule
            switch = gd.rule_override(gd.recurrent_gated_delta_rule)
        try:
            with switch:
                docs, row = documents(cp)
                ref_loss, ref_grads = reference(copy.deepcopy(base), docs)
                for method in ("thd", "ulysses"):
                    loss, grads, n_local = cp_step(method, copy.deepcopy(base), row, group)
                    out[(dtype_name, rule, method)] = compare(ref_loss, ref_grads, loss, grads)
                    out[("local_tokens", method)] = n_local
                rows = ring_rows(cp)
                ring_ref = ring_reference(copy.deepcopy(base), rows)
                out[(dtype_name, rule, "ring")] = compare(*ring_ref, *ring_step(copy.deepcopy(base), rows, group))
                if cp == 2 and rule == "hf":  # activation checkpointing recomputes the chain inside the backward
                    model = copy.deepcopy(base)
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                    loss, grads, _ = cp_step("thd", model, row, group)
                    out[(dtype_name, rule, "thd+checkpointing")] = compare(ref_loss, ref_grads, loss, grads)
        finally:
            modeling.torch_chunk_gated_delta_rule = original
    out["row_tokens"] = int(documents(cp)[1]["input_ids"].shape[1])
    return out


def main(rank: int, world_size: int, cases=(("float64", "fp64"), ("float32", "hf"))) -> dict:
    """cp=2 on ranks {0, 1} and {2, 3} at once, then cp=4 on all four: ``{cp: run_cases(...)}``."""
    import transformers

    transformers.logging.set_verbosity_error()
    pairs = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world_size, 2)]
    results = {2: run_cases(pairs[rank // 2], 2, cases)}
    if world_size == 4:
        results[4] = run_cases(dist.new_group(backend="gloo"), 4, cases)
    return results
