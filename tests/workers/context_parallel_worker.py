"""Every CP method through ``context_parallel`` against one process (gloo ranks, run by
tests/test_context_parallel.py).

Reference: every document (a plain row is one document) run ALONE through the model's own attention in
one process: the sum of its token cross-entropies over the whole batch's label count, gradients summed
over documents. CP: the same batch dict for every method, given three ways (plain rows with right
padding and a loss mask; packed rows by ``seq_lens``; packed rows by ``position_ids`` restarts only),
``cp.shard(batch)``, ``model(**local).loss`` (fp64: the same sum from ``.logits`` in fp64, since
transformers' loss is fp32), ``backward``, ``cp.reduce_gradients()`` and
``cp.reduce_loss``. Then every method once more on the plain rows with activation checkpointing and activation
offload, and the offloaded optimizer stepping on its gradients (:func:`offload_checks`); and a tiny Falcon under
every method (:func:`falcon_checks`), whose attention materialises its causal mask.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from automodel.distributed.cp import context_parallel
from automodel.distributed.cp.thd_docs.placement import CostModel
from automodel.errors import CPUnsupportedError
from tests.workers.thd_attention_worker import VOCAB, _ce, rel, tiny_llama

SENTINEL = -1000
#: label -> (method, keyword options): usp at cp=2 as a Ulysses sub-group of 2 ranks or a ring of 2; thd_docs
#: with its own cost model and with the one context_parallel reads from the model
METHODS = {
    "ring": ("ring", {}),
    "ulysses": ("ulysses", {}),
    "thd": ("thd", {"kernel": "portable"}),
    "thd_docs": ("thd_docs", {}),
    "thd_docs_cost": ("thd_docs", {"cost": CostModel(token=4.0)}),
    "usp": ("usp", {"ulysses_size": 2}),
    "usp_u1": ("usp", {"ulysses_size": 1}),
    "toy_gather": ("toy_gather", {}),  # tests/toy_cp_method.py: a method registered by the test
    "auto": ("auto", {"packed": True, "seq_len": 32}),  # cp_method auto: the method chosen for the model
}
#: per row, its documents' lengths (row 1 ends in 5 padding slots)
DOCS = [[5, 9, 1], [7, 3]]


def _docs(seed: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in DOCS:
        docs = []
        for n in row:
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.2] = -100
            docs.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "labels": labels})
        rows.append(docs)
    return rows


def batches() -> dict[str, tuple[dict, list[list[dict]]]]:
    """name -> (the caller's batch, its documents as the reference runs them)."""
    rows = _docs(0)
    seq = max(sum(d["input_ids"].numel() for d in row) for row in rows)
    out = {}
    # packed rows, three documents in row 0 and two in row 1, by seq_lens (no position_ids)
    ids = torch.zeros(2, seq, dtype=torch.long)
    labels = torch.full((2, seq), -100)
    pos = torch.zeros(2, seq, dtype=torch.long)
    mask = torch.zeros(2, seq, dtype=torch.long)
    seq_lens = torch.full((2, 3), SENTINEL)
    for b, row in enumerate(rows):
        at = 0
        for i, d in enumerate(row):
            n = d["input_ids"].numel()
            ids[b, at : at + n], labels[b, at : at + n] = d["input_ids"], d["labels"]
            pos[b, at : at + n] = torch.arange(n)
            mask[b, at : at + n] = 1
            seq_lens[b, i] = n
            at += n
    out["packed_seq_lens"] = ({"input_ids": ids, "labels": labels, "seq_lens": seq_lens}, rows)
    # the same rows given by position_ids restarts only; row 1's trailing slots by attention_mask
    out["packed_restarts"] = ({"input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask}, rows)
    # plain rows: one document each, row 1 right-padded (attention_mask), a loss_mask hiding two labels
    g = torch.Generator().manual_seed(1)
    plain_ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    plain_labels = torch.randint(0, VOCAB, (2, 13), generator=g)
    plain_labels[1, 10:] = -100
    plain_mask = torch.ones(2, 13, dtype=torch.long)
    plain_mask[1, 10:] = 0
    loss_mask = torch.ones(2, 13, dtype=torch.long)
    loss_mask[0, 3] = loss_mask[1, 7] = 0
    plain = {"input_ids": plain_ids, "labels": plain_labels, "attention_mask": plain_mask, "loss_mask": loss_mask}
    masked = plain_labels.masked_fill(loss_mask == 0, -100)
    ref_rows = [
        [{"input_ids": plain_ids[0], "labels": masked[0]}],
        [{"input_ids": plain_ids[1, :10], "labels": masked[1, :10]}],
    ]
    out["plain"] = (plain, ref_rows)
    return out


def reference(model, rows) -> tuple[float, dict]:
    n_labels = sum(int((d["labels"] != -100).sum()) for row in rows for d in row)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for row in rows:
        for d in row:
            ce = _ce(model(input_ids=d["input_ids"][None]).logits[0], d["labels"])
            (ce / n_labels).backward()
            total += float(ce.detach())
    return total / n_labels, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def offload_checks(mesh, dtype: torch.dtype, plain_runs: dict, batch: dict) -> dict:
    """Every method on the plain rows with activation checkpointing and activation offload, against the same
    method without them (``plain_runs``: label -> loss, gradients); then two offloaded optimizer steps on its
    gradients against plain ones (tests/workers/offload_checks.py)."""
    from automodel.models.block_call import block_calls
    from tests.workers.offload_checks import compare_runs, offloaded, optimizer_steps_equal

    model = tiny_llama(2, dtype)
    store = offloaded(model)
    out = {}
    for label, (method, options) in METHODS.items():
        cp = context_parallel(model, mesh, method=method, **options)
        model.zero_grad(set_to_none=True)
        before = store.stats()
        recomputed = sum(c.counts.recomputed for c in block_calls(model))
        ctx, local = cp.shard(batch)
        with ctx():
            loss = model(**local).loss
            loss.backward()
        cp.reduce_gradients()
        total = float(cp.reduce_loss(loss))
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[label] = {
            **compare_runs(total, grads, *plain_runs[label]),
            "unpacked": store.stats().unpacked - before.unpacked,  # the 2 layer inputs came back from the host
            "packed": store.stats().packed - before.packed,  # and nothing else went there (issue 41)
            "recomputed": sum(c.counts.recomputed for c in block_calls(model)) - recomputed,  # each layer once
            "optimizer_equal": optimizer_steps_equal(list(model.parameters()), [p.grad for p in model.parameters()]),
        }
        cp.restore()
    return out


#: the methods the Falcon checks run (every registered one, usp as a Ulysses sub-group of 2 and auto packed)
FALCON_METHODS = ("ring", "ulysses", "thd", "thd_docs", "usp", "auto")


def tiny_falcon(dtype: torch.dtype):
    """A 2-layer Falcon with RoPE and grouped KV heads (``new_decoder_architecture``: 4 query heads, 2 KV heads,
    two layer norms in parallel attention); its default (multi-query) form runs in the family matrix."""
    from transformers import AutoModelForCausalLM, FalconConfig

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                       new_decoder_architecture=True, num_kv_heads=2, max_position_embeddings=256,
                       attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def _zero_grad_and_shard(model, cp, batch: dict, refused: dict, key: tuple):
    """Clear ``model``'s gradients and shard ``batch`` for ``cp``: ``(ctx, local)``, or ``None`` with the refusal
    recorded under ``key`` in ``refused`` (a batch form the method does not take)."""
    model.zero_grad(set_to_none=True)
    try:
        return cp.shard(batch)
    except ValueError as e:
        refused[key] = str(e)
        return None


def falcon_checks(mesh, dtypes: list[str], cases: dict) -> dict:
    """Falcon (its attention dispatched through transformers' ``AttentionInterface`` from 5.25, with the causal
    mask materialised) under every method, in each dtype, on every batch form against each document run alone:
    ``{"checks": {(dtype, label, form): {...}}, "refused": {(dtype, label, form) or label: message}}``. Where the
    installed Falcon computes its own attention (5.17), every method refuses it when prepared."""
    out: dict = {"checks": {}, "refused": {}}
    for dtype_name in dtypes:
        model = tiny_falcon(getattr(torch, dtype_name))
        refs = {name: reference(model, rows) for name, (_, rows) in cases.items()}
        for label in FALCON_METHODS:
            method, options = METHODS[label]
            try:
                cp = context_parallel(model, mesh, method=method, **options)
            except CPUnsupportedError as e:
                out["refused"][label] = str(e)
                continue
            for name, (batch, _) in cases.items():
                sharded = _zero_grad_and_shard(model, cp, batch, out["refused"], (dtype_name, label, name))
                if sharded is None:
                    continue
                ctx, local = sharded
                with ctx():
                    logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
                    loss = _ce(logits.flatten(0, 1), local["shift_labels"].flatten()) / local["num_items_in_batch"]
                    loss.backward()
                cp.reduce_gradients()
                ref_loss, ref_grads = refs[name]
                grads = {n: p.grad for n, p in model.named_parameters()}
                out["checks"][(dtype_name, label, name)] = {
                    "loss_rel": abs(float(cp.reduce_loss(loss)) - ref_loss) / abs(ref_loss),
                    "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                    "grads": len(ref_grads),
                }
            cp.restore()
    return out


def tiled_layer_checks(mesh, dtypes: list[str], cases: dict) -> dict:
    """model.tiled_layer (tiles of 3 tokens, not dividing the rank's tokens) under every method at cp=2, every batch
    form the method runs, each dtype: the loss and every gradient against the same method without it."""
    import copy

    from automodel.models.tiled_layer import apply_tiled_layer, layer_tile_counts

    out = {}
    for dtype_name in dtypes:
        plain = tiny_llama(2, getattr(torch, dtype_name))
        tiled = copy.deepcopy(plain)
        apply_tiled_layer(tiled, 3)
        for label, (method, options) in METHODS.items():
            runs = []
            for model in (plain, tiled):
                cp = context_parallel(model, mesh, method=method, **options)
                got = {}
                for name, (batch, _) in cases.items():
                    model.zero_grad(set_to_none=True)
                    try:
                        ctx, local = cp.shard(batch)
                    except ValueError:
                        continue
                    with ctx():
                        logits = model(**{k: v for k, v in local.items() if k != "labels"}).logits
                        loss = _ce(logits.flatten(0, 1), local["shift_labels"].flatten()) / local["num_items_in_batch"]
                        loss.backward()
                    cp.reduce_gradients()
                    got[name] = (float(cp.reduce_loss(loss)), {n: p.grad.clone() for n, p in model.named_parameters()})
                cp.restore()
                runs.append(got)
            for name, (loss, grads) in runs[1].items():
                ref_loss, ref_grads = runs[0][name]
                out[(dtype_name, label, name)] = {
                    "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                    "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                }
        out[(dtype_name, "calls")] = [c.calls for c in layer_tile_counts(tiled)]
    return out


#: checkpoint groups under FSDP2: label -> (method, layers per group); 5 layers: groups 2+2+1 and 3+2
GROUP_CASES = {"ring_k2": ("ring", 2), "ulysses_k3": ("ulysses", 3)}


def checkpoint_group_checks(mesh, dtypes: list[str], batch: dict) -> dict:
    """model.checkpoint_group_layers (automodel.models.checkpoint_groups) at cp=2 under FSDP2 over the two ranks, with
    the tiled layer, the tiled MLP, activation checkpointing and activation offload: the loss and every (gathered)
    gradient against the same run with groups of 1; what the groups and the offload did."""
    import copy

    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.models.block_call import apply_activation_checkpointing, block_calls
    from automodel.models.checkpoint_groups import apply_checkpoint_groups
    from automodel.models.tiled_layer import apply_tiled_layer
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.activation_offload import apply_activation_offload

    def run(base, method: str, k: int) -> tuple[float, dict, dict]:
        model = copy.deepcopy(base)
        cp = context_parallel(model, mesh, method=method)
        apply_tiled_mlp(model, 3)
        apply_tiled_layer(model, 3)
        apply_activation_checkpointing(model)
        groups = apply_checkpoint_groups(model, k)
        store = apply_activation_offload(model)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
        ctx, local = cp.shard(batch)
        with ctx():
            logits = model(**{key: v for key, v in local.items() if key != "labels"}).logits
            loss = _ce(logits.flatten(0, 1), local["shift_labels"].flatten()) / local["num_items_in_batch"]
            loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        did = {"packed": store.stats().packed, "recomputed": [c.counts.recomputed for c in block_calls(model)]}
        if groups is not None:
            did.update(groups.counts.__dict__)
        return float(cp.reduce_loss(loss)), grads, did

    out = {}
    for dtype_name in dtypes:
        cfg = AutoConfig.for_model("llama", hidden_size=48, intermediate_size=96, num_hidden_layers=5,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=256)  # fmt: skip
        torch.manual_seed(1234)
        base = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(getattr(torch, dtype_name))
        for label, (method, k) in GROUP_CASES.items():
            ref_loss, ref_grads, _ = run(base, method, 1)
            loss, grads, did = run(base, method, k)
            out[(dtype_name, label)] = {
                "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                "grads": len(grads),
                **did,
            }
    return out


def main(rank: int, world_size: int, dtypes: list[str]) -> dict:
    from tests.toy_cp_method import register

    register()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    cases = batches()
    out: dict = {"checks": {}, "refused": {}, "describe": {}, "restored": {}}
    plain_runs: dict = {}
    for dtype_name in dtypes:
        model = tiny_llama(2, getattr(torch, dtype_name))
        refs = {name: reference(model, rows) for name, (_, rows) in cases.items()}
        for label, (method, options) in METHODS.items():
            cp = context_parallel(model, mesh, method=method, **options)
            out["describe"][label] = cp.describe()
            if cp.choice is not None:
                out.setdefault("chosen", {})[label] = (cp.method.name, cp.choice.reason)
            for name, (batch, _) in cases.items():
                sharded = _zero_grad_and_shard(model, cp, batch, out["refused"], (dtype_name, label, name))
                if sharded is None:
                    continue
                ctx, local = sharded
                with ctx():
                    output = model(**local)
                    loss = output.loss  # transformers' loss: cross-entropy in fp32 whatever the dtype
                    if dtype_name == "float64":  # the same sum over the same count, in fp64
                        hf_loss = float(cp.reduce_loss(loss))
                        loss = _ce(output.logits.flatten(0, 1), local["shift_labels"].flatten()) / local["num_items_in_batch"]
                    loss.backward()
                cp.reduce_gradients()
                total = float(cp.reduce_loss(loss))
                ref_loss, ref_grads = refs[name]
                grads = {n: p.grad for n, p in model.named_parameters()}
                if name == "plain" and dtype_name == dtypes[0]:  # the offload checks' references
                    plain_runs[label] = (total, {n: g.clone() for n, g in grads.items()})
                out["checks"][(dtype_name, label, name)] = {
                    "loss_rel": abs(total - ref_loss) / abs(ref_loss),
                    "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
                    "local_tokens": int(local["input_ids"].numel()),
                }
                if dtype_name == "float64":
                    out["checks"][(dtype_name, label, name)]["hf_loss_rel"] = abs(hf_loss - ref_loss) / abs(ref_loss)
            cp.restore()
            out["restored"][label] = model.config._attn_implementation
    out["offload"] = offload_checks(mesh, getattr(torch, dtypes[0]), plain_runs, cases["plain"][0])
    # model.tiled_mlp: every method with each MLP run over tiles of 3 tokens (not dividing the rank's tokens),
    # against the same untiled one-process reference
    from automodel.models.tiled_mlp import apply_tiled_mlp

    out["tiled"] = {}
    model = tiny_llama(2, torch.float64)
    refs = {name: reference(model, rows) for name, (_, rows) in cases.items() if name != "packed_restarts"}
    apply_tiled_mlp(model, 3)
    for label, (method, options) in METHODS.items():
        cp = context_parallel(model, mesh, method=method, **options)
        for name in refs:
            model.zero_grad(set_to_none=True)
            try:
                ctx, local = cp.shard(cases[name][0])
            except ValueError:
                continue
            with ctx():
                output = model(**local)
                loss = _ce(output.logits.flatten(0, 1), local["shift_labels"].flatten()) / local["num_items_in_batch"]
                loss.backward()
            cp.reduce_gradients()
            ref_loss, ref_grads = refs[name]
            grads = {n: p.grad for n, p in model.named_parameters()}
            out["tiled"][(label, name)] = {
                "loss_rel": abs(float(cp.reduce_loss(loss)) - ref_loss) / abs(ref_loss),
                "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            }
        cp.restore()
    out["tiled_layer"] = tiled_layer_checks(mesh, dtypes, cases)
    out["checkpoint_groups"] = checkpoint_group_checks(mesh, dtypes, cases["plain"][0])
    out["falcon"] = falcon_checks(mesh, dtypes, cases)
    # a model the method would not compute exactly is refused when it is prepared, before any work
    flex = tiny_llama(2, torch.float32)
    flex.set_attn_implementation("flex_attention")  # ring replaces only SDPA (eager models are routed)
    try:
        context_parallel(flex, mesh, method="ring")
    except CPUnsupportedError as e:
        out["refused"]["ring_flex"] = str(e)
    return out
