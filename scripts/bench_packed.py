#!/usr/bin/env python
"""Benchmark packed documents under CP on CPU: thd vs ulysses (packed rows) vs ring (one padded row per document).

The same documents (lengths drawn uniformly from ``[S/16, S/4]`` with a fixed seed, packed greedily
into one row of ``S`` tokens), the same tiny Llama (fp32) and the same step (forward + backward,
token cross-entropy sum / label count), one thread per rank, gloo on 127.0.0.1, each run in fresh
processes:

- ``thd`` cp=2: one packed row, every document padded to a multiple of ``2*cp`` (=4);
- ``ulysses`` cp=2: the same packed row (documents padded to ``cp``), SDPA with the document mask;
- ``ring`` cp=2: ring CP cannot keep documents apart, so every document is its own row, right-padded
  to the longest document (rounded to ``2*cp``): the unpacked baseline;
- ``thd`` cp=1: the packed row on one process (THD attention at world size 1), the memory reference.

Printed per method and length:

- **tokens/s**: real (document) tokens per second of step time (median of ``--steps`` timed steps
  after a warm-up, the slower rank);
- **pad %**: the fraction of computed tokens that are padding;
- **MiB sent/rank/step**: thd and ulysses count the payload of their own collectives (wrapped
  ``torch.distributed`` calls: an all-gather sends ``n*(W-1)``, a reduce-scatter / all-to-all
  ``N*(W-1)/W`` elements); ring from the gloo events of ``torch.profiler`` (as scripts/bench_sp.py);
- **peak MiB/rank**: the kernel's peak RSS during the timed steps above the RSS before them (as
  scripts/bench_cp.py: VmHWM reset after the warm-up, glibc's mmap threshold fixed at 64 KiB), and
  its ratio to the thd cp=1 peak.

    nice python scripts/bench_packed.py                       # S = 4K, 8K, 16K
    python scripts/bench_packed.py --seq-lens 2048 --steps 1
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402
from scripts.bench_cp import add_model_args, model_kwargs, use_mmap_env  # noqa: E402
from scripts.bench_sp import _sent_bytes  # noqa: E402


def documents(seq_len: int, seed: int = 0, multiple: int = 4) -> list[int]:
    """Document lengths (before padding) that fill one row of ``seq_len`` once padded to ``multiple``."""
    rng = random.Random(seed)
    lens, used = [], 0
    while True:
        n = rng.randint(seq_len // 16, seq_len // 4)
        p = -(-n // multiple) * multiple
        if used + p > seq_len:
            break
        lens.append(n)
        used += p
    return lens


def _packed_batch(lens: list[int], seq_len: int, multiple: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    padded = [-(-n // multiple) * multiple for n in lens]
    padded[-1] += seq_len - sum(padded)  # the row's trailing padding belongs to the last document
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    labels = torch.full((1, seq_len), -100)
    pos, at = [], 0
    for n, p in zip(lens, padded):
        ids[0, at : at + n] = torch.randint(0, vocab, (n,), generator=g)
        labels[0, at : at + n] = torch.randint(0, vocab, (n,), generator=g)
        pos.append(torch.arange(p))
        at += p
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat(pos).unsqueeze(0),
        "seq_lens": torch.tensor([lens]),
        "seq_lens_padded": torch.tensor([padded]),
    }


def _rows_batch(lens: list[int], multiple: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    width = -(-max(lens) // multiple) * multiple
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    labels = torch.full((len(lens), width), -100)
    for b, n in enumerate(lens):
        ids[b, :n] = torch.randint(0, vocab, (n,), generator=g)
        labels[b, :n] = torch.randint(0, vocab, (n,), generator=g)
    return {"input_ids": ids, "labels": labels}


class _SentCounter:
    """Wraps the torch.distributed collectives thd and ulysses call; counts the elements sent."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        import automodel.distributed.thd_attention as ta

        self.bytes = 0.0
        w = world

        def wrap(fn, sent):
            def inner(out, inp, *a, **k):
                self.bytes += sent(out, inp) * inp.element_size()
                return fn(out, inp, *a, **k)

            return inner

        gather = lambda out, inp: inp.numel() * (w - 1)  # noqa: E731
        scatter = lambda out, inp: inp.numel() * (w - 1) / w  # noqa: E731
        ta._all_gather = wrap(ta._all_gather, gather)
        ta._reduce_scatter = wrap(ta._reduce_scatter, scatter)
        dist.all_to_all_single = wrap(dist.all_to_all_single, scatter)


def _worker(rank: int, world: int, method: str, seq_len: int, steps: int, model_kw: dict) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    vocab = model_kw["vocab_size"]
    lens = documents(seq_len)
    torch.manual_seed(0)
    config = LlamaConfig(
        max_position_embeddings=seq_len, attn_implementation="sdpa", use_cache=False, **model_kw
    )
    model = AutoModelForCausalLM.from_config(config)
    counter = _SentCounter(world)
    if method == "ring":
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        batch = _rows_batch(lens, 2 * world, vocab)
        fn = make_cp_batch_and_ctx
    elif method == "ulysses":
        from automodel.distributed.ulysses import make_ulysses_batch_and_ctx, set_ulysses_attention

        batch = _packed_batch(lens, seq_len, world, vocab)
        inner = set_ulysses_attention(model, mesh)

        def fn(m, b):
            return make_ulysses_batch_and_ctx(m, b, inner_attn=inner)
    else:
        from automodel.distributed.thd_attention import make_thd_batch_and_ctx, set_thd_attention

        batch = _packed_batch(lens, seq_len, 2 * world, vocab)
        set_thd_attention(model)
        fn = make_thd_batch_and_ctx
    computed = batch["input_ids"].numel()
    count = int((batch["labels"] != -100).sum())

    def step() -> float:
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        ctx, local = fn(mesh, dict(batch))
        with ctx():
            logits = model(input_ids=local["input_ids"], position_ids=local.get("position_ids")).logits
            loss = (
                F.cross_entropy(
                    logits.flatten(0, 1), local["labels"].flatten(), ignore_index=-100, reduction="sum"
                )
                / count
            )
            loss.backward()
        model.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    step()  # warm-up
    counter.bytes = 0.0
    if method == "ring" and world > 1:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        sent = _sent_bytes(prof, world)
    else:
        step()
        sent = counter.bytes
    gc.collect()
    baseline = rss_mib()
    reset_peak_rss()
    times = [step() for _ in range(steps)]
    peak = peak_rss_mib() - baseline
    return {
        "time": statistics.median(times),
        "peak_mib": peak,
        "sent_mib": sent / 2**20,
        "real": sum(lens),
        "computed": computed,
        "docs": len(lens),
    }


def run(method: str, world: int, seq_len: int, steps: int, model_kw: dict, timeout: float) -> dict:
    res = run_on_ranks(
        "scripts.bench_packed:_worker",
        world,
        timeout,
        method=method,
        seq_len=seq_len,
        steps=steps,
        model_kw=model_kw,
    )
    out = dict(res[0])
    out["time"] = max(r["time"] for r in res)
    out["peak_mib"] = max(r["peak_mib"] for r in res)
    out["sent_mib"] = max(r["sent_mib"] for r in res)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--methods", nargs="+", default=["thd1", "thd", "ulysses", "ring"])
    parser.add_argument("--steps", type=int, default=2)
    add_model_args(parser)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    use_mmap_env()
    model_kw = model_kwargs(args)
    print(f"tiny Llama {model_kw}, fp32, CPU, 1 thread per rank, torch {torch.__version__}", flush=True)
    print("| S | method | cp | docs | tokens/s | pad % | MiB sent/rank/step | peak MiB/rank | vs thd cp=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        ref = None
        for name in args.methods:
            method, world = ("thd", 1) if name == "thd1" else (name, 2)
            r = run(method, world, seq_len, args.steps, model_kw, args.timeout)
            if name == "thd1":
                ref = r["peak_mib"]
            ratio = f"{r['peak_mib'] / ref:.2f}" if ref else "-"
            pad = 100 * (r["computed"] - r["real"]) / r["computed"]
            print(
                f"| {seq_len} | {method} | {world} | {r['docs']} | {r['real'] / r['time']:.0f} | {pad:.1f} | "
                f"{r['sent_mib']:.2f} | {r['peak_mib']:.0f} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
