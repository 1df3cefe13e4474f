"""Document-placement attention (cp_method thd_docs) parity on a tiny HF Llama (gloo ranks, run by
tests/test_doc_attention.py).

Reference: every document run ALONE through the unswitched model in one process. CP: the documents packed
into rows with no padding to any multiple (the row's trailing padding folded into its last document),
placed by make_doc_batch_and_ctx, the model switched to thd_docs attention, the local CE sum / global
label count back-propagated, gradients all-reduced (SUM) over the CP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import automodel.distributed.cp.exchange.p2p as p2p_module
from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention
from automodel.distributed.cp.thd_docs.placement import CostModel
from tests.workers.cp_steps import sum_over_group
from tests.workers.thd_attention_worker import VOCAB, _ce, pack, reference, rel, tiny_llama

#: Batches of rows of document lengths. Each covers something: one-token documents, a document longer
#: than S/cp (split over a subset of the ranks), fewer documents than ranks, many tiny ones, one huge one.
BATCHES = {
    "mixed": [[1, 22, 1], [13, 7, 5, 3]],
    "fewer_docs_than_ranks": [[1, 29]],
    "tiny": [[1] * 9 + [2] * 6],
    "huge": [[61, 1, 2]],
}
#: KV heads per dtype: GQA 4/2, and a single KV head (fewer than cp)
KV_HEADS = {"float64": (1,), "float32": (2,)}
#: Placement tolerances tried (the default).
TOLERANCES = (1.02,)


def make_rows(lengths: list[list[int]], seed: int = 0) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        docs = []
        for n in row:
            labels = torch.randint(0, VOCAB, (n,), generator=g)
            labels[torch.rand(n, generator=g) < 0.2] = -100
            docs.append({"input_ids": torch.randint(0, VOCAB, (n,), generator=g), "labels": labels})
        rows.append(docs)
    return rows


class _Counter:
    """Counts the elements this rank sends through the placement's point-to-point exchanges."""

    def __init__(self) -> None:
        self.sent = 0
        self._p2p = p2p_module.batch_p2p

        def p2p(sends, send_to, recvs, recv_from, group):
            self.sent += sum(t.numel() for t in sends)
            return self._p2p(sends, send_to, recvs, recv_from, group)

        p2p_module.batch_p2p = p2p


def cp_run(model, mesh, batch, n_labels: int, tolerance: float):
    model.zero_grad(set_to_none=True)
    ctx, local = make_doc_batch_and_ctx(mesh, batch, cost=CostModel(token=4.0), tolerance=tolerance)
    shapes: list[tuple[int, ...]] = []

    def pack_hook(t):
        shapes.append(tuple(t.shape))
        return t

    with ctx(), torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        ce = _ce(logits[0], local["labels"][0])
        (ce / n_labels).backward()
    group = mesh.get_group()
    loss = ce.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = sum_over_group({n: p.grad for n, p in model.named_parameters()}, group)
    return float(loss) / n_labels, grads, local, shapes


def main(rank: int, world_size: int, dtypes: list[str]) -> dict:
    import time

    t0 = time.perf_counter()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    counter = _Counter()
    out: dict = {}
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for kv_heads in KV_HEADS[dtype_name]:
            model = tiny_llama(kv_heads, dtype)
            for name, lengths in BATCHES.items():
                rows = make_rows(lengths)
                n_labels = sum(int((d["labels"] != -100).sum()) for row in rows for d in row)
                ref_loss, ref_grads = reference(model, rows, n_labels)
                batch = pack(rows, 1)
                switched = set_doc_attention(model)
                for tol in TOLERANCES:
                    counter.sent = 0
                    loss, grads, local, shapes = cp_run(model, mesh, batch, n_labels, tol)
                    placement = local["placement"]
                    layers = model.config.num_hidden_layers
                    per_token = 2 * kv_heads * (model.config.hidden_size // model.config.num_attention_heads)
                    total = batch["input_ids"].numel()
                    out[(dtype_name, kv_heads, name, tol)] = {
                        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                        "grad_rel": {n: rel(grads[n], ref_grads[n]) for n in ref_grads},
                        "spans": {d: list(s) for d, s in placement.spans.items()},
                        "tokens": placement.tokens,
                        "real_tokens": sum(sum(row) for row in lengths),  # the row's trailing pad is not computed
                        "sent": counter.sent,
                        "sent_expected": layers * placement.step_tokens(rank) * per_token,
                        "global_saved": [
                            s for s in shapes if total in s and total != local["input_ids"].shape[1]
                        ],
                    }
                model.set_attn_implementation(switched)
    out["seconds"] = time.perf_counter() - t0
    return out
