"""Ulysses CP parity on a tiny HF Llama (2 gloo ranks, run by tests/test_ulysses.py).

For every case, each rank computes the single-process reference (the whole batch, the model's own
attention) and the Ulysses run (its slice, CP attention), then returns both losses and the
per-parameter relative gradient errors. Loss under CP: sum of token cross-entropies over the local
slice / GLOBAL number of label tokens (counted before sharding); parameter gradients all-reduced (SUM)
over the CP group. Reference: sum CE / count.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention
from automodel.distributed.sp.all_to_all import even_split_sizes
from tests.workers.cp_steps import sum_over_group

SEQ = 16
VOCAB = 96


def tiny_llama(num_kv_heads: int, attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        attn_implementation=attn,
    )
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_batch(kind: str, seq: int = SEQ) -> dict:
    """A [2, seq] batch of the given kind (identical on every rank)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, seq), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    batch = {"input_ids": ids, "labels": labels}
    if kind == "padding":
        mask = torch.ones(2, seq, dtype=torch.long)
        mask[1, seq - 5 :] = 0  # right padding on row 1
        labels[mask == 0] = -100
        labels[1, seq - 6] = -100  # the last real token predicts nothing
        batch["attention_mask"] = mask
    elif kind in ("packed", "packed_seq_lens"):
        docs = [[5, 7, 4], [9, 7]]  # document lengths per row, each row sums to seq
        pos = torch.cat([torch.cat([torch.arange(n) for n in row]).unsqueeze(0) for row in docs])
        for b, row in enumerate(docs):
            end = 0
            for n in row:
                end += n
                labels[b, end - 1] = -100  # no prediction across a document boundary
        if kind == "packed":
            batch["position_ids"] = pos
        else:
            batch["seq_lens_padded"] = torch.tensor([[5, 7, 4], [9, 7, -1000]])
            batch["position_ids"] = pos
    return batch


def _loss(logits: torch.Tensor, labels: torch.Tensor, count: int) -> torch.Tensor:
    return (
        F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
        )
        / count
    )


CASES = {
    # name: (num kv heads, batch kind, inner/ref attention, sequence length, use a 2-D mesh)
    "gqa_sdpa": (2, "plain", "sdpa", SEQ, False),
    "kv1_lt_cp": (1, "plain", "sdpa", SEQ, True),
    "padding_sdpa": (2, "padding", "sdpa", SEQ, False),
    "padding_eager": (2, "padding", "eager", SEQ, False),
    "packed_position_ids": (2, "packed", "sdpa", SEQ, False),
    "packed_seq_lens_eager": (1, "packed_seq_lens", "eager", SEQ, False),
    "uneven_seq": (2, "padding", "sdpa", 15, False),
}


def run_case(rank: int, world: int, name: str) -> dict:
    n_kv, kind, attn, seq, mesh_2d = CASES[name]
    ref = tiny_llama(n_kv, attn)
    model = copy.deepcopy(ref)
    batch = make_batch(kind, seq)
    count = int((batch["labels"] != -100).sum())

    # single-process reference: the HF model on the whole batch
    ref_kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    ref_logits = ref(input_ids=batch["input_ids"], use_cache=False, **ref_kwargs).logits
    ref_loss = _loss(ref_logits, batch["labels"], count)
    ref_loss.backward()

    mesh = (
        init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "cp"))
        if mesh_2d
        else init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    )
    set_ulysses_attention(model, mesh)
    ctx_factory, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=attn)
    with ctx_factory():
        logits = model(
            input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
        ).logits
        loss = _loss(logits, local["labels"], count)
        loss.backward()
    offset = sum(even_split_sizes(seq, world)[:rank])
    ref_slice = ref_logits.detach().narrow(1, offset, logits.size(1))
    logit_rel = float((logits.detach() - ref_slice).norm() / ref_slice.norm())
    total = loss.detach().clone()
    dist.all_reduce(total)
    rel = {}
    summed = sum_over_group({n: p.grad for n, p in model.named_parameters()})
    for (pname, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        p.grad.copy_(summed[pname])
        rel[pname] = float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30))
    return {
        "ref_loss": float(ref_loss.detach()),
        "cp_loss": float(total),
        "grad_rel": rel,
        "logit_rel": logit_rel,
        "local_len": local["input_ids"].size(1),
        "local_keys": sorted(local),
    }


def naive_local_attention(rank: int, world: int) -> float:
    """Negative control: plain sdpa on each rank's slice (no CP attention); relative logit error vs reference.

    On the last rank the error is large (its tokens lose the first slice as context); on rank 0 it is 0.
    """
    ref = tiny_llama(2, "sdpa")
    batch = make_batch("plain")
    n = SEQ // world
    sl = slice(rank * n, (rank + 1) * n)
    with torch.no_grad():
        full = ref(input_ids=batch["input_ids"], use_cache=False).logits[:, sl]
        pos = torch.arange(SEQ).unsqueeze(0)[:, sl]
        naive = ref(input_ids=batch["input_ids"][:, sl], position_ids=pos, use_cache=False).logits
    return float((naive - full).norm() / full.norm())


def errors(rank: int, world: int) -> dict:
    """Error messages users get; every rank raises the same way before any communication."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = {}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cfg = LlamaConfig(
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        vocab_size=VOCAB,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    try:
        set_ulysses_attention(model, mesh)
    except ValueError as e:
        out["heads_set"] = str(e)
    # the same model switched without the mesh check fails at the first attention call
    set_ulysses_attention(model)
    ctx_factory, local = make_ulysses_batch_and_ctx(mesh, make_batch("plain"))
    try:
        with ctx_factory():
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    except ValueError as e:
        out["heads_call"] = str(e)
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    try:
        make_ulysses_batch_and_ctx(dp_mesh, make_batch("plain"))
    except ValueError as e:
        out["no_cp_dim"] = str(e)
    ref = tiny_llama(2, "sdpa")
    try:
        with ctx_factory():
            ref(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    except RuntimeError as e:
        out["not_switched"] = str(e)
    return out


def main(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    out = {name: run_case(rank, world_size, name) for name in CASES}
    out["naive_logit_rel"] = naive_local_attention(rank, world_size)
    out["errors"] = errors(rank, world_size)
    from tests.workers.headwise_worker import CP2_CASES, checks

    out["headwise"] = checks(rank, world_size, CP2_CASES)  # distributed.ulysses_head_chunks at cp=2
    return out
