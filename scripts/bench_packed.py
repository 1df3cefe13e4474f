#!/usr/bin/env python
"""Benchmark packed documents under CP on CPU: thd_docs vs thd vs ulysses (packed rows) vs ring (one padded row per document).

The same documents, the same tiny Llama (fp32) and the same step (forward + backward, token
cross-entropy sum / label count), one thread per rank, gloo on 127.0.0.1, each run in fresh processes.
Documents: ``--dist uniform`` (default): lengths uniform in ``[S/16, S/4]``, packed greedily into one
row of ``S`` tokens; ``--dist lognormal --medians 256 1024 4096``: SFT-like lognormal lengths
(sigma 1, seed 0) filling the row exactly (:func:`automodel.distributed.cp.thd_docs.placement.sample_lengths`).

- ``thd_docs`` cp=N: the packed row (no per-document padding), documents placed by cost
  (``distributed.cp_method: thd_docs``); ``docs1``: the same at cp=1 (one process, every document
  whole), the reference of the **eff.** column (its time / (N x the method's time));

- ``thd`` cp=N: one packed row, every document padded to a multiple of ``2*cp`` (the row grows by
  that padding when the documents fill it exactly);
- ``ulysses`` cp=N: the packed row (documents padded to ``cp`` under ``--dist uniform``, not at all
  under ``lognormal``), SDPA per document block;
- ``ring`` cp=N: ring CP cannot keep documents apart, so every document is its own row, right-padded
  to the longest document (rounded to ``2*cp``): the unpacked baseline;
- ``thd1``: the packed row on one process (THD attention at world size 1), the memory reference.

Printed per method and length:

- **tokens/s**: real (document) tokens per second of step time (median of ``--steps`` timed steps
  after a warm-up, the slower rank);
- **pad %**: the fraction of computed tokens that are padding;
- **MiB sent/rank/step**: thd_docs, thd and ulysses count the payload of their own collectives
  (wrapped calls: an all-gather sends ``n*(W-1)``, a reduce-scatter / all-to-all ``N*(W-1)/W``
  elements, thd_docs' point-to-point sends their size); ring from the gloo events of
  ``torch.profiler`` (as scripts/bench_sp.py);
- **CPU s**: the slowest rank's process CPU time of the step (median), and the efficiency and Ulysses
  ratio computed from it: less disturbed by other jobs on a loaded machine than the wall-clock figures,
  but blind to time spent waiting for a peer (it flatters methods that communicate);
- **peak MiB/rank**: the kernel's peak RSS during the timed steps above the RSS before them (as
  scripts/bench_cp.py: VmHWM reset after the warm-up, glibc's mmap threshold fixed at 64 KiB), and
  its ratio to the thd cp=1 peak.

    nice python scripts/bench_packed.py                       # S = 4K, 8K, 16K, uniform lengths
    python scripts/bench_packed.py --seq-lens 2048 --steps 1
    # the headline (issue 23): SFT-like rows, S = 8K, median 256, cp=2, one run gives both ratios
    python scripts/bench_packed.py --headline
    # the full SFT-like table: S = 8K and 32K, medians 256 / 1024 / 4096, cp=2 and 4
    python scripts/bench_packed.py --dist lognormal --seq-lens 8192 32768 --medians 256 1024 4096 --cp 2 4 \
        --methods docs1 thd_docs thd ulysses --heads 8
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

from automodel.distributed.cp.thd_docs.placement import sample_lengths  # noqa: E402
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


def _row_lengths(dist_name: str, seq_len: int, median: int) -> list[int]:
    if dist_name == "lognormal":
        return sample_lengths(seq_len, median)
    return documents(seq_len)


def _packed_batch(lens: list[int], seq_len: int, multiple: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    padded = [-(-n // multiple) * multiple for n in lens]
    seq_len = max(seq_len, -(-sum(padded) // multiple) * multiple)  # per-document padding may lengthen the row
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

        import automodel.distributed.cp.exchange.gather as ta

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

        import automodel.distributed.cp.exchange.p2p as da

        p2p = da.batch_p2p

        def counted(sends, *args):
            self.bytes += sum(t.numel() * t.element_size() for t in sends)
            return p2p(sends, *args)

        da.batch_p2p = counted


def _worker(
    rank: int, world: int, method: str, seq_len: int, steps: int, model_kw: dict, dist_name: str = "uniform", median: int = 256
) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    vocab = model_kw["vocab_size"]
    lens = _row_lengths(dist_name, seq_len, median)
    torch.manual_seed(0)
    config = LlamaConfig(
        max_position_embeddings=2 * seq_len, attn_implementation="sdpa", use_cache=False, **model_kw
    )
    model = AutoModelForCausalLM.from_config(config)
    counter = _SentCounter(world)
    if method == "ring":
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        batch = _rows_batch(lens, 2 * world, vocab)
        fn = make_cp_batch_and_ctx
    elif method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        batch = _packed_batch(lens, seq_len, world if dist_name == "uniform" else 1, vocab)
        inner = set_ulysses_attention(model, mesh)

        def fn(m, b):
            return make_ulysses_batch_and_ctx(m, b, inner_attn=inner)
    elif method == "thd_docs":
        from automodel.distributed.cp.thd_docs import model_cost
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention

        batch = _packed_batch(lens, seq_len, 1, vocab)
        set_doc_attention(model)
        cost = model_cost(model)  # what the recipe binds

        def fn(m, b):
            return make_doc_batch_and_ctx(m, b, cost=cost)
    else:
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        batch = _packed_batch(lens, seq_len, 2 * world, vocab)
        set_thd_attention(model)
        fn = make_thd_batch_and_ctx
    computed = batch["input_ids"].numel()
    count = int((batch["labels"] != -100).sum())

    cpu: list[float] = []

    def step() -> float:
        if world > 1:
            dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
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
        elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        cpu.append(elapsed[1].item())
        return elapsed[0].item()

    placement = fn(mesh, dict(batch))[1].get("placement")
    if placement is not None:  # thd_docs computes the documents' real tokens only (pad slots carry no loss)
        computed = sum(placement.tokens)
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
    cpu.clear()
    times = [step() for _ in range(steps)]
    peak = peak_rss_mib() - baseline
    return {
        "time": statistics.median(times),
        "cpu": statistics.median(cpu),
        "peak_mib": peak,
        "sent_mib": sent / 2**20,
        "real": sum(lens),
        "computed": computed,
        "docs": len(lens),
        "imbalance": placement.imbalance if placement is not None else None,
        "split": len(placement.spans) if placement is not None else None,
    }


def run(
    method: str, world: int, seq_len: int, steps: int, model_kw: dict, timeout: float, dist_name: str = "uniform", median: int = 256
) -> dict:
    res = run_on_ranks(
        "scripts.bench_packed:_worker",
        world,
        timeout,
        method=method,
        seq_len=seq_len,
        steps=steps,
        model_kw=model_kw,
        dist_name=dist_name,
        median=median,
    )
    out = dict(res[0])
    out["time"] = max(r["time"] for r in res)
    out["cpu"] = max(r["cpu"] for r in res)
    out["peak_mib"] = max(r["peak_mib"] for r in res)
    out["sent_mib"] = max(r["sent_mib"] for r in res)
    return out


ONE_PROCESS = {"thd1": "thd", "docs1": "thd_docs"}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--methods", nargs="+", default=["thd1", "thd", "ulysses", "ring"],
                        help="thd1 | docs1 (one process) | thd_docs | thd | ulysses | ring")
    parser.add_argument("--cp", type=int, nargs="+", default=[2], help="CP sizes of the multi-process methods")
    parser.add_argument("--dist", choices=["uniform", "lognormal"], default="uniform")
    parser.add_argument("--medians", type=int, nargs="+", default=[256], help="lognormal medians")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--headline", action="store_true",
        help="S=8192, lognormal median 256, cp=2, docs1 / thd_docs / ulysses, 8 heads, 3 steps (issue 23's bar)",
    )
    add_model_args(parser)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    if args.headline:
        args.seq_lens, args.dist, args.medians, args.cp = [8192], "lognormal", [256], [2]
        args.methods, args.heads, args.steps = ["docs1", "thd_docs", "ulysses"], 8, max(args.steps, 3)
    use_mmap_env()
    model_kw = model_kwargs(args)
    print(f"tiny Llama {model_kw}, fp32, CPU, 1 thread per rank, torch {torch.__version__}", flush=True)
    print(
        "| S | lengths | method | cp | docs | split | imbalance | step s | tokens/s | eff. | vs ulysses | CPU s | "
        "CPU eff. | CPU vs ulysses | pad % | MiB sent/rank/step | peak MiB/rank | vs one process |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    medians = args.medians if args.dist == "lognormal" else [0]
    for seq_len in args.seq_lens:
        for median in medians:
            lengths = f"lognormal {median}" if args.dist == "lognormal" else "uniform S/16..S/4"
            ref: dict[str, dict] = {}
            rows = []
            for name in [m for m in args.methods if m in ONE_PROCESS]:
                ref[ONE_PROCESS[name]] = r = run(
                    ONE_PROCESS[name], 1, seq_len, args.steps, model_kw, args.timeout, args.dist, median
                )
                rows.append((name, 1, r))
            for world in args.cp:
                uly = None
                for name in [m for m in args.methods if m not in ONE_PROCESS]:
                    r = run(name, world, seq_len, args.steps, model_kw, args.timeout, args.dist, median)
                    if name == "ulysses":
                        uly = r
                    rows.append((name, world, r))
                for name, w, r in rows:
                    if w == world and name != "ulysses" and uly is not None:
                        r["vs_ulysses"] = r["time"] / uly["time"]
                        r["cpu_vs_ulysses"] = r["cpu"] / uly["cpu"]
            base = ref.get("thd_docs") or ref.get("thd")
            for name, world, r in rows:
                one = ref.get(ONE_PROCESS.get(name, name)) or base
                eff = f"{one['time'] / (world * r['time']):.2f}" if one and world > 1 else "-"
                mem = f"{r['peak_mib'] / one['peak_mib']:.2f}" if one and world > 1 else "-"
                pad = 100 * (r["computed"] - r["real"]) / r["computed"]
                imb = f"{r['imbalance']:.3f}" if r.get("imbalance") else "-"
                split = r["split"] if r.get("split") is not None else "-"
                vs = f"{r['vs_ulysses']:.2f}" if "vs_ulysses" in r else "-"
                cpu_eff = f"{one['cpu'] / (world * r['cpu']):.2f}" if one and world > 1 else "-"
                cpu_vs = f"{r['cpu_vs_ulysses']:.2f}" if "cpu_vs_ulysses" in r else "-"
                print(
                    f"| {seq_len} | {lengths} | {name} | {world} | {r['docs']} | {split} | {imb} | {r['time']:.3f} | "
                    f"{r['real'] / r['time']:.0f} | {eff} | {vs} | {r['cpu']:.3f} | {cpu_eff} | {cpu_vs} | {pad:.1f} | "
                    f"{r['sent_mib']:.2f} | {r['peak_mib']:.0f} | {mem} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
