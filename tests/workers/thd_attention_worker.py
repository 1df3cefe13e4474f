"""THD attention parity on a tiny HF Llama (gloo ranks, run by tests/test_thd_attention*.py).

Reference: every document run ALONE through the unswitched model in one process (sum of token
cross-entropies / the global label count, gradients summed over documents). CP: the documents packed
into rows (each padded to a multiple of 2*cp), the batch sharded by make_thd_batch_and_ctx, the model
switched to THD attention, the local CE sum / global label count back-propagated, gradients
all-reduced (SUM) over the CP group.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from automodel.distributed.cp import blocks
from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention
from automodel.distributed.thd_utils import thd_partition_indices
from tests.workers.cp_steps import sum_over_group

VOCAB = 80
SENTINEL = -1000
#: Document lengths per row: a 1-token document, one longer than S/cp, lengths not multiples of 2*cp.
DOCS = [[1, 22], [13, 7]]


def tiny_llama(num_kv_heads: int, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def make_docs(seed: int = 0) -> list[list[dict]]:
    """Per row, per document: ``input_ids``/``labels`` ``[n]`` (labels -100 on a few positions)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in DOCS:
        docs = []
        for n in row:
            ids = torch.randint(0, VOCAB, (n,), generator=g)
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.2] = -100
            docs.append({"input_ids": ids, "labels": labels})
        rows.append(docs)
    return rows


def pack(rows: list[list[dict]], multiple: int) -> dict:
    """Pack documents into ``[B, S]`` rows, every document padded to ``multiple``, trailing pad folded in."""
    padded = [[-(-d["input_ids"].numel() // multiple) * multiple for d in row] for row in rows]
    seq = max(sum(p) for p in padded)
    bsz, n_docs = len(rows), max(len(r) for r in rows)
    batch = {
        "input_ids": torch.zeros(bsz, seq, dtype=torch.long),
        "labels": torch.full((bsz, seq), -100, dtype=torch.long),
        "position_ids": torch.zeros(bsz, seq, dtype=torch.long),
        "seq_lens": torch.full((bsz, n_docs), SENTINEL),
        "seq_lens_padded": torch.full((bsz, n_docs), SENTINEL),
    }
    for b, row in enumerate(rows):
        at = 0
        for i, d in enumerate(row):
            n, p = d["input_ids"].numel(), padded[b][i]
            if i == len(row) - 1:
                p += seq - sum(padded[b])
            batch["input_ids"][b, at : at + n] = d["input_ids"]
            batch["labels"][b, at : at + n] = d["labels"]
            batch["position_ids"][b, at : at + p] = torch.arange(p)
            batch["seq_lens"][b, i] = n
            batch["seq_lens_padded"][b, i] = p
            at += p
    return batch


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies in fp32 (fp64 for fp64 logits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference(model, rows, n_labels: int):
    """Loss and gradients of every document run alone (sum over documents)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for row in rows:
        for d in row:
            logits = model(input_ids=d["input_ids"][None]).logits
            ce = _ce(logits[0], d["labels"])
            (ce / n_labels).backward()
            total += float(ce.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return total / n_labels, grads


def cp_run(model, mesh, batch, n_labels: int, backward: bool = True):
    model.zero_grad(set_to_none=True)
    ctx, local = make_thd_batch_and_ctx(mesh, batch)
    saved_shapes: list[tuple[int, ...]] = []

    def pack_hook(t):
        saved_shapes.append(tuple(t.shape))
        return t

    with ctx(), torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        ce = _ce(logits[0], local["labels"][0])
        if backward:
            (ce / n_labels).backward()
    group = mesh.get_group()
    loss = ce.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = sum_over_group({n: p.grad for n, p in model.named_parameters()}, group) if backward else {}
    return float(loss) / n_labels, grads, logits.detach(), local, saved_shapes


def local_document_ids(batch: dict, world: int, rank: int) -> torch.Tensor:
    """Document index (global, row-major) of every local token."""
    lens = batch["seq_lens_padded"][batch["seq_lens_padded"] != SENTINEL]
    doc = torch.repeat_interleave(torch.arange(lens.numel()), lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return doc[thd_partition_indices(cu, int(cu[-1]), world, rank).long()]


def main(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    rows = make_docs()
    batch = pack(rows, 2 * world_size)
    n_labels = int((batch["labels"] != -100).sum())
    out: dict = {"seq_len": batch["input_ids"].shape[1], "n_docs": sum(len(r) for r in rows)}
    for dtype_name, kv in cases:
        dtype = getattr(torch, dtype_name)
        ref_model = tiny_llama(kv, dtype)
        ref_loss, ref_grads = reference(ref_model, rows, n_labels)
        model = copy.deepcopy(ref_model)
        set_thd_attention(model)
        loss, grads, _, local, saved = cp_run(model, mesh, batch, n_labels)
        total = batch["input_ids"].numel()
        out[(dtype_name, kv)] = {
            "loss": loss,
            "ref_loss": ref_loss,
            "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
            "grad_rel": {n: rel(grads[n], ref_grads[n]) for n in ref_grads},
            "local_tokens": local["input_ids"].shape,
            "saved_global_sized": [s for s in saved if total in s],
        }
        if (dtype_name, kv) == cases[0]:
            # exact math blocks (what the portable kernel runs off CPU) give the same result
            with blocks.force_backend("math"):
                m_loss, m_grads, *_ = cp_run(model, mesh, batch, n_labels)
            out["math_blocks"] = {
                "loss_rel": abs(m_loss - ref_loss) / abs(ref_loss),
                "grad_rel": max(rel(m_grads[n], ref_grads[n]) for n in ref_grads),
            }
            # isolation: changing document 3's tokens changes no output of any other document
            changed = copy.deepcopy(batch)
            b, lo, hi = 1, 0, DOCS[1][0]  # row 1, first document (document index 2 overall)
            changed["input_ids"][b, lo:hi] = (changed["input_ids"][b, lo:hi] + 1) % VOCAB
            with torch.no_grad():
                _, _, logits_a, _, _ = cp_run(model, mesh, batch, n_labels, backward=False)
                _, _, logits_b, _, _ = cp_run(model, mesh, changed, n_labels, backward=False)
            docs = local_document_ids(batch, world_size, rank)
            others = docs != 2
            out["isolation"] = {
                "others_max_diff": float((logits_a[0, others] - logits_b[0, others]).abs().max()),
                "changed_max_diff": float((logits_a[0, ~others] - logits_b[0, ~others]).abs().max()),
                "n_others": int(others.sum()),
            }
            # negative control: the unswitched model on the local tokens is not the reference
            ctx, local = make_thd_batch_and_ctx(mesh, batch)
            with torch.no_grad():
                wrong = ref_model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
                ce = _ce(wrong[0], local["labels"][0])
            dist.all_reduce(ce)
            out["negative_control_loss_rel"] = abs(float(ce) / n_labels - ref_loss) / abs(ref_loss)
            # model.tiled_mlp: the MLPs over tiles of 3 tokens (not dividing the rank's share) under THD
            from automodel.models.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp

            apply_tiled_mlp(model, 3)
            t_loss, t_grads, *_ = cp_run(model, mesh, batch, n_labels)
            remove_tiled_mlp(model)
            out["tiled_mlp"] = {
                "loss_rel": abs(t_loss - ref_loss) / abs(ref_loss),
                "grad_rel": max(rel(t_grads[n], ref_grads[n]) for n in ref_grads),
            }
    return out
