"""Ring-CP parity checks run on every rank of one gloo group (see tests/test_cp_parity.py).

Each check compares a CP run against the single-process computation of the same thing, done on the
same rank, and returns error figures; the test module asserts on them.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from automodel.distributed.cp_utils import create_context_parallel_ctx, get_cp_mesh, make_cp_batch_and_ctx
from automodel.distributed.torch_internals import context_parallel_unshard
from tests.workers.cp_steps import sum_over_group


def head_tail_index(seq_len: int, world: int, rank: int) -> torch.Tensor:
    """Independent statement of the head-tail layout: chunks r and 2W-1-r of 2W equal chunks."""
    c = seq_len // (2 * world)
    return torch.cat(
        [
            torch.arange(rank * c, (rank + 1) * c),
            torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c),
        ]
    )


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def sdpa_checks(mesh, rank: int, world: int) -> dict:
    """Raw SDPA under create_context_parallel_ctx vs single-process SDPA: out, dq, dk, dv."""
    results = {}
    seq = 8 * world
    for dtype in (torch.float32, torch.float64):
        for method in ("allgather", "alltoall"):
            for kv_heads in (4, 2):
                g = torch.Generator().manual_seed(1234)
                q = torch.randn(2, 4, seq, 16, dtype=dtype, generator=g)
                k = torch.randn(2, kv_heads, seq, 16, dtype=dtype, generator=g)
                v = torch.randn(2, kv_heads, seq, 16, dtype=dtype, generator=g)
                dout = torch.randn(2, 4, seq, 16, dtype=dtype, generator=g)
                gqa = kv_heads != 4
                ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=gqa)
                ref.backward(dout)
                bufs = [q.clone(), k.clone(), v.clone(), dout.clone()]
                ctx = create_context_parallel_ctx(
                    mesh, bufs, [2, 2, 2, 2], set(bufs), cp_rotate_method=method
                )
                with ctx:
                    local = [t.detach().clone().requires_grad_() for t in bufs[:3]]
                    out = F.scaled_dot_product_attention(*local, is_causal=True, enable_gqa=gqa)
                    out.backward(bufs[3])
                    full = context_parallel_unshard(
                        mesh, [out.detach(), *(t.grad for t in local)], [2, 2, 2, 2]
                    )
                expected = [ref.detach(), *(t.grad for t in ref_in)]
                key = f"{str(dtype).split('.')[-1]}-{method}-kv{kv_heads}"
                results[key] = {
                    name: _max_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), full, expected)
                }
                # the shard this rank held is exactly its head-tail chunks of the global q
                results[key]["shard_ok"] = torch.equal(
                    local[0].detach(), q[:, :, head_tail_index(seq, world, rank)]
                )
    return results


def _tiny_model(family: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )
    config = LlamaConfig(**common) if family == "llama" else Qwen2Config(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def model_checks(mesh, rank: int, world: int, families=("llama", "qwen2"), dtypes=(torch.float32,)) -> dict:
    """Tiny HF model through make_cp_batch_and_ctx vs single process: loss and every gradient."""
    results = {}
    seq = 16 * world
    for family in families:
        for dtype in dtypes:
            model = _tiny_model(family, dtype)
            g = torch.Generator().manual_seed(7)
            input_ids = torch.randint(0, 128, (2, seq), generator=g)
            labels = torch.randint(0, 128, (2, seq), generator=g)
            labels[0, -5:] = -100  # right padding, excluded through labels only
            labels[1, :3] = -100  # a masked prompt
            count = int((labels != -100).sum())

            ref_model = copy.deepcopy(model)
            ref_logits = ref_model(input_ids=input_ids).logits
            ref_loss = _token_loss_sum(ref_logits, labels) / count
            ref_loss.backward()

            batch = {
                "input_ids": input_ids.clone(),
                "labels": labels.clone(),
                "attention_mask": torch.ones_like(input_ids),
            }
            method = "alltoall" if family == "qwen2" else "allgather"
            train_ctx, cp_batch = make_cp_batch_and_ctx(mesh, batch, cp_rotate_method=method)
            with train_ctx():
                shard_ok = torch.equal(cp_batch["input_ids"], input_ids[:, head_tail_index(seq, world, rank)])
                logits = model(input_ids=cp_batch["input_ids"], position_ids=cp_batch["position_ids"]).logits
                loss = _token_loss_sum(logits, cp_batch["labels"]) / count
                loss.backward()
            loss = loss.detach()
            dist.all_reduce(loss)
            grad_rel = {}
            summed = sum_over_group({n: p.grad for n, p in model.named_parameters()})
            for (name, _), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
                grad = summed[name]
                grad_rel[name] = (
                    (grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp_min(1e-30)
                ).item()
            results[f"{family}-{str(dtype).split('.')[-1]}"] = {
                "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                "grad_rel_max": max(grad_rel.values()),
                "worst_param": max(grad_rel, key=grad_rel.get),
                "n_params": len(grad_rel),
                "shard_ok": shard_ok,
                "user_batch_untouched": torch.equal(batch["input_ids"], input_ids)
                and "position_ids" not in batch
                and "attention_mask" in batch,
            }
    return results


def buffer_checks(mesh, rank: int, world: int) -> dict:
    """position_ids built when missing, mRoPE [3, B, S] sharded on dim 2, loss/padding masks sharded."""
    seq = 8 * world
    idx = head_tail_index(seq, world, rank)
    input_ids = torch.arange(2 * seq).view(2, seq)
    mrope = torch.arange(3 * 2 * seq).view(3, 2, seq)
    loss_mask = torch.arange(2 * seq).view(2, seq) % 3 == 0
    padding_mask = input_ids % 5 == 0
    batch = {
        "input_ids": input_ids.clone(),
        "labels": input_ids.clone() + 1,
        "padding_mask": padding_mask.clone(),
    }
    ctx, out = make_cp_batch_and_ctx(mesh, batch, loss_mask=loss_mask.clone())
    with ctx():
        built = out["position_ids"].clone()
        sharded = {k: out[k].clone() for k in ("input_ids", "labels", "loss_mask", "padding_mask")}
    batch3 = {"input_ids": input_ids.clone(), "labels": input_ids.clone(), "position_ids": mrope.clone()}
    ctx3, out3 = make_cp_batch_and_ctx(mesh, batch3)
    with ctx3():
        mrope_local = out3["position_ids"].clone()
    # an exception raised inside the ring context undoes it (torch < 2.13 itself does not:
    # torch_internals.context_parallel)
    sdpa = F.scaled_dot_product_attention
    kept = input_ids.clone()
    patched_inside = sharded_inside = raised = False
    try:
        with create_context_parallel_ctx(get_cp_mesh(mesh), [kept], [1], set()):
            patched_inside = F.scaled_dot_product_attention is not sdpa
            sharded_inside = torch.equal(kept, input_ids[:, idx])
            raise KeyError("inside the ring context")
    except KeyError:
        raised = True
    return {
        "undone_after_raise": raised
        and patched_inside
        and sharded_inside
        and F.scaled_dot_product_attention is sdpa
        and torch.equal(kept, input_ids),
        "position_ids": torch.equal(built, idx.unsqueeze(0)),
        "input_ids": torch.equal(sharded["input_ids"], input_ids[:, idx]),
        "labels": torch.equal(sharded["labels"], input_ids[:, idx] + 1),
        "loss_mask": torch.equal(sharded["loss_mask"], loss_mask[:, idx]),
        "padding_mask": torch.equal(sharded["padding_mask"], padding_mask[:, idx]),
        "mrope": torch.equal(mrope_local, mrope[:, :, idx]),
    }


def _grad_rel(model, ref_model) -> dict[str, float]:
    """Per-parameter max relative error of the CP gradient (summed over ranks) against the reference."""
    rel = {}
    summed = sum_over_group({n: p.grad for n, p in model.named_parameters()})
    for (name, _), (_, p_ref) in zip(model.named_parameters(), ref_model.named_parameters()):
        grad = summed[name]
        rel[name] = ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max().clamp_min(1e-30)).item()
    return rel


def pad_checks(mesh, rank: int, world: int, seq_lens=(29, 30), dtype=torch.float32, embeds=True) -> dict:
    """Auto-padding: a length not divisible by 2*cp, through make_cp_batch_and_ctx, against one process on
    the UNPADDED batch (loss and every gradient). With ``embeds``, the same through ``inputs_embeds``
    (computed from the embedding inside the graph, so the embedding's gradient flows through the shard)
    with mRoPE-free [B, S] position_ids given by the caller."""
    results = {}
    for seq in seq_lens:
        model = _tiny_model("llama", dtype)
        g = torch.Generator().manual_seed(11 + seq)
        input_ids = torch.randint(1, 128, (2, seq), generator=g)
        labels = torch.randint(0, 128, (2, seq), generator=g)
        labels[1, :4] = -100
        count = int((labels != -100).sum())
        ref_model = copy.deepcopy(model)
        ref_loss = _token_loss_sum(ref_model(input_ids=input_ids).logits, labels) / count
        ref_loss.backward()
        variants = ("input_ids", "inputs_embeds") if embeds else ("input_ids",)
        for variant in variants:
            model.zero_grad(set_to_none=True)
            if variant == "input_ids":
                batch = {"input_ids": input_ids, "labels": labels}
            else:
                batch = {
                    "inputs_embeds": model.get_input_embeddings()(input_ids),
                    "labels": labels,
                    "position_ids": torch.arange(seq).unsqueeze(0).expand(2, seq),
                }
            ctx, out = make_cp_batch_and_ctx(mesh, batch, padding_token_id=0)
            padded_len = out[variant].shape[1]
            pads_ok = bool(
                (out["labels"][:, seq:] == -100).all()
                and (out["position_ids"][..., seq:] == torch.arange(seq, padded_len)).all()
                and (variant != "input_ids" or (out["input_ids"][:, seq:] == 0).all())
            )
            with ctx():
                shard_len = out[variant].shape[1]
                kwargs = {variant: out[variant], "position_ids": out["position_ids"]}
                loss = _token_loss_sum(model(**kwargs).logits, out["labels"]) / count
                loss.backward()
            loss = loss.detach()
            dist.all_reduce(loss)
            rel = _grad_rel(model, ref_model)
            results[f"S{seq}-{variant}"] = {
                "padded_len": padded_len,
                "shard_len": shard_len,
                "pads_ok": pads_ok,
                "caller_untouched": batch["labels"] is labels
                and labels.shape[1] == seq
                and batch[variant].shape[1] == seq
                and (variant == "inputs_embeds") == ("position_ids" in batch)
                and batch.get("position_ids", labels).shape[-1] == seq,
                "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
                "grad_rel_max": max(rel.values()),
                "worst_param": max(rel, key=rel.get),
            }
    return results


def mesh_checks(rank: int, world: int) -> dict:
    """ParallelDims meshes: dim sizes and flattened views; CP through the full 4-D mesh."""
    import warnings

    from automodel.distributed.mesh import ParallelDims, get_submesh

    sizes = {}
    names = ("dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for cp in (1, world):
            mesh = ParallelDims(cp=cp).build_mesh("cpu")
            sizes[cp] = {name: get_submesh(mesh, name).size() for name in names}
            hsdp = get_submesh(mesh, "dp_replicate", "dp_shard_cp")
            sizes[cp]["hsdp"] = (hsdp.mesh_dim_names, tuple(hsdp.shape))
    full_mesh = ParallelDims(cp=world).build_mesh("cpu")
    return {
        "sizes": sizes,
        "mesh_warnings": [str(w.message) for w in caught if "mesh" in str(w.message).lower()],
        "buffers_via_full_mesh": buffer_checks(full_mesh, rank, world),
    }


def offload_checks(mesh, rank: int, world: int, dtype: torch.dtype) -> dict:
    """Llama through ring (make_cp_batch_and_ctx) with activation checkpointing + activation offload, against the
    same without them (bit for bit) and against one process; two offloaded optimizer steps on its gradients."""
    from tests.workers.offload_checks import compare_runs, offloaded, optimizer_steps_equal

    seq = 16 * world
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 128, (2, seq), generator=g)
    labels = torch.randint(0, 128, (2, seq), generator=g)
    count = int((labels != -100).sum())
    ref_model = _tiny_model("llama", dtype)
    ref_loss = _token_loss_sum(ref_model(input_ids=input_ids).logits, labels) / count
    ref_loss.backward()
    runs = {}
    for offload in (False, True):
        model = _tiny_model("llama", dtype)
        store = offloaded(model) if offload else None
        batch = {"input_ids": input_ids.clone(), "labels": labels.clone()}
        train_ctx, cp_batch = make_cp_batch_and_ctx(mesh, batch)
        with train_ctx():
            logits = model(input_ids=cp_batch["input_ids"], position_ids=cp_batch["position_ids"]).logits
            loss = _token_loss_sum(logits, cp_batch["labels"]) / count
            loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss)
        runs[offload] = (loss.item(), sum_over_group({n: p.grad for n, p in model.named_parameters()}), model, store)
    loss, grads, model, store = runs[True]
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
    return {
        **compare_runs(loss, grads, *runs[False][:2]),
        "loss_rel": abs(loss - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel_max": max(float((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-30)) for n, r in ref_grads.items()),
        "unpacked": store.stats().unpacked,
        "optimizer_equal": optimizer_steps_equal([p for _, p in model.named_parameters()],
                                                 [grads[n] for n, _ in model.named_parameters()]),  # the summed ones
    }


def unread_checks(mesh, rank: int, world_size: int) -> dict:
    """Parameters a rank's share does not reach. ``all_reduce_gradients`` (``fsdp.enabled=false``) with a parameter
    that has a gradient on one rank only and one that has none anywhere; at cp 4, ZAYA's CCA under Ulysses, whose
    last rank holds only delayed-value heads and reads none of the conv weights: every rank must have a gradient for
    every parameter (FSDP2 reduce-scatters what a rank has: a size mismatch, or a hang on NCCL), and the summed
    gradients are the single process's."""
    from automodel.distributed.replicate import all_reduce_gradients

    group = mesh["cp"].get_group()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(3, 2) for name in ("every", "one", "none")})
    x = torch.full((1, 3), float(rank + 1))
    loss = model["every"](x).sum() + (model["one"](x).sum() if rank == 1 else 0.0)
    loss.backward()
    all_reduce_gradients(model, group)
    total = sum(range(1, world_size + 1))
    out = {
        "every": torch.equal(model["every"].weight.grad, torch.full((2, 3), float(total))),
        "one": torch.equal(model["one"].weight.grad, torch.full((2, 3), 2.0)),  # rank 1's x, here on every rank
        "none": model["none"].weight.grad is None and model["none"].bias.grad is None,
    }
    if world_size != 4:
        return out
    from tests.family_matrix import family_by_name
    from tests.workers.family_matrix_worker import _reduce_grads, compare, make_row, reference, run_method

    base = family_by_name("zaya").build_model()
    row = make_row()
    model = copy.deepcopy(base)
    local = run_method("ulysses", model, row, mesh)
    without = [n for n, q in model.named_parameters() if q.requires_grad and q.grad is None]
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, without, group=group)
    loss, grads, partial = _reduce_grads(model, local, group)
    out["zaya_partial"] = partial
    out["zaya_without"] = everyone
    out["zaya"] = compare(*reference(copy.deepcopy(base), row), loss, grads)["status"]
    return out


def main(
    rank: int,
    world_size: int,
    model_families=("llama", "qwen2"),
    model_dtypes=("float32",),
    pad_seq_lens=(29, 30),
    pad_dtype="float32",
    pad_embeds=True,
    offload_dtype: str | None = None,
) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    dtypes = tuple(getattr(torch, d) for d in model_dtypes)
    return {
        "offload": offload_checks(mesh, rank, world_size, getattr(torch, offload_dtype)) if offload_dtype else None,
        "pad": pad_checks(mesh, rank, world_size, pad_seq_lens, getattr(torch, pad_dtype), pad_embeds),
        "sdpa": sdpa_checks(mesh, rank, world_size),
        "model": model_checks(mesh, rank, world_size, families=model_families, dtypes=dtypes),
        "buffers": buffer_checks(mesh, rank, world_size),
        "mesh": mesh_checks(rank, world_size),
        "unread": unread_checks(mesh, rank, world_size),
    }
