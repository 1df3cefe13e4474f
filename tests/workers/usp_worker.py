"""USP (hybrid Ulysses x ring) on 4 ranks = cp 4 = ulysses 2 x ring 2 (tests/test_usp.py).

Run as a simulated two-node launch (``torchrun --nnodes 2 --nproc-per-node 2`` twice, static rendezvous
on 127.0.0.1; ``python -m tests.workers.usp_worker --out DIR [--recipe-out DIR]``): every rank writes
``rank<R>.pt``.

Checks, in one launched group:

- **placement**: the recipe's mesh (:class:`automodel.distributed.mesh.ParallelDims`, cp=4) factored by
  USP: each Ulysses sub-group's ranks on one node (the node each process was launched as), each ring
  sub-group across both nodes;
- **library parity** against one process: every document run alone through the unswitched model
  (tests/workers/thd_attention_worker.py's reference), loss and every gradient, in fp64 and fp32, on
  packed rows and on plain rows (fp64), for 6 query heads (Ulysses alone cannot split them over cp=4) with 2 KV
  heads, and 4 query heads with 1 KV head (replicated over the Ulysses sub-group);
- a negative control: the unswitched model on the local tokens is far from the reference;
- every attention layer kind (tests/workers/usp_layer_kinds.py): sliding windows, sinks, softcapping, MLA,
  chunks and Llama 4's query temperature on tiny models of the support matrix's families, fp32 and fp64;
- with ``--recipe-out``: the recipe runs of tests/workers/usp_recipe_worker.py (``quad``) on the same nodes.
"""

from __future__ import annotations

import argparse
import copy
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.workers.cp_steps import sum_over_group
from tests.workers.thd_attention_worker import _ce, pack, reference, rel

VOCAB = 80
ULYSSES = 2
#: Per row, document lengths: a 1-token document, lengths not multiples of 2*cp = 8, one longer than S/cp.
PACKED_DOCS = [[1, 22, 6], [13, 7]]
PLAIN_DOCS = [[32], [29]]  # one document per row (the second right-padded)


def tiny_llama(heads: int, kv_heads: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=8 * heads,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def docs(lengths: list[list[int]], seed: int) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        out = []
        for n in row:
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.2] = -100
            out.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "labels": labels})
        rows.append(out)
    return rows


def usp_run(model, mesh, batch, n_labels: int):
    from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx

    model.zero_grad(set_to_none=True)
    ctx, local = make_usp_batch_and_ctx(mesh, batch, ulysses_size=ULYSSES)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        ce = _ce(logits[0], local["labels"][0])
        (ce / n_labels).backward()
    group = mesh["cp"].get_group()
    loss = ce.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = sum_over_group({n: p.grad for n, p in model.named_parameters()}, group)
    return float(loss) / n_labels, grads, local


def placement(mesh, node: int) -> dict:
    from automodel.distributed.cp.group import resolve_cp_group
    from automodel.distributed.cp.usp.groups import usp_process_groups

    group, world, rank = resolve_cp_group(mesh)
    g = usp_process_groups(group, world, rank, ULYSSES)
    out = {"cp_ranks": dist.get_process_group_ranks(group), "node": node}
    for name, sub in (("ulysses", g.ulysses_group), ("ring", g.ring_group)):
        nodes = [None] * dist.get_world_size(sub)
        dist.all_gather_object(nodes, node, group=sub)
        out[name] = {"ranks": dist.get_process_group_ranks(sub), "nodes": nodes}
    return out


def check(rank: int, world_size: int, node: int | None = None) -> dict:
    from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention
    from automodel.distributed.mesh import ParallelDims

    assert world_size == 4, world_size
    mesh = ParallelDims(cp=4, world_size=world_size).build_mesh("cpu")
    out: dict = {"placement": placement(mesh, rank // 2 if node is None else node)}
    cases = [
        ("packed", torch.float64, 6, 2),
        ("plain", torch.float64, 6, 2),
        ("packed", torch.float64, 4, 1),  # 1 KV head < ulysses_size 2: replicated
        ("packed", torch.float32, 6, 2),  # fp32 is also held by the recipe runs (tests/workers/usp_recipe_worker.py)
    ]
    for kind, dtype, heads, kv in cases:
        rows = docs(PACKED_DOCS if kind == "packed" else PLAIN_DOCS, seed=heads + kv)
        batch = pack(rows, 2 * world_size)
        if kind == "plain":  # plain rows: no packing keys, padding at the end of the short row
            batch = {
                "input_ids": batch["input_ids"],
                "labels": batch["labels"],
                "attention_mask": (torch.arange(batch["input_ids"].shape[1]) < torch.tensor([[32], [29]])).long(),
            }
        n_labels = int((batch["labels"] != -100).sum())
        ref_model = tiny_llama(heads, kv, dtype)
        ref_loss, ref_grads = reference(ref_model, rows, n_labels)
        model = copy.deepcopy(ref_model)
        set_usp_attention(model)
        loss, grads, local = usp_run(model, mesh, batch, n_labels)
        out[(kind, str(dtype).removeprefix("torch."), heads, kv)] = {
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
            "local_tokens": int(local["input_ids"].shape[-1]),
            "total_tokens": int(batch["input_ids"].numel()),
        }
        if (kind, dtype, heads) == ("packed", torch.float64, 6):
            # negative control: the unswitched model on the local tokens (attending within them) is not the reference
            wrong = copy.deepcopy(ref_model)
            wrong.zero_grad(set_to_none=True)
            ce = _ce(wrong(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0], local["labels"][0])
            (ce / n_labels).backward()
            wrong_grads = sum_over_group({n: p.grad for n, p in wrong.named_parameters()})
            out["negative_control_grad_rel"] = max(rel(wrong_grads[n], ref_grads[n]) for n in ref_grads)
            # and the USP context notices a model that was not switched
            ctx, local = make_usp_batch_and_ctx(mesh, batch, ulysses_size=ULYSSES)
            try:
                with ctx(), torch.no_grad():
                    ref_model(input_ids=local["input_ids"], position_ids=local["position_ids"])
            except RuntimeError as err:
                out["forgotten_switch"] = str(err)
    from tests.workers.usp_layer_kinds import layer_kind_cases

    out["layer_kinds"] = layer_kind_cases(mesh, world_size)  # windows, sinks, softcap, MLA, chunks + temperature
    from tests.workers.headwise_worker import CP4_CASES, checks

    out["headwise"] = checks(rank, world_size, CP4_CASES)  # ulysses_head_chunks: Ulysses at cp=4, usp 2 x 2
    return out


def main() -> None:
    """torchrun entry point: the env gives rank / world; ``--out`` gets ``rank<R>.pt`` (or the error)."""
    import traceback

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe-out", default=None, help="also run the recipe checks, writing runs here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    path = Path(args.out) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=90))  # an orphaned rank gives up
        node = int(os.environ["GROUP_RANK"])  # torchrun's node rank (--node-rank)
        result = check(rank, dist.get_world_size(), node=node)
        if args.recipe_out:  # the recipe at cp=4 = 2 x 2 on the same two nodes (tests/workers/usp_recipe_worker.py)
            from tests.workers.usp_recipe_worker import quad

            result["recipe"] = quad(rank, dist.get_world_size(), args.recipe_out)
        torch.save({"ok": True, "result": result}, path)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the test reads the traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise


if __name__ == "__main__":
    main()
