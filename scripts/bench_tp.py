#!/usr/bin/env python
"""Tensor parallelism on CPU: per-rank memory and step time of tp=1 vs tp=2, loss parallel off / on.

A Llama-shaped model whose vocabulary makes the logits matter (default: vocab 32000, hidden 128,
2 layers) trains one long row (default 4096 tokens) per step with AdamW, in fresh gloo processes
(one thread per rank): tp=1 on one rank, then on two ranks tp=2 with the logits gathered, tp=2 with
loss parallel (``distributed.enable_loss_parallel``: the logits stay ``[tokens, V / tp]``) and tp=2
with loss parallel and sequence parallel. The model is sharded by the recipe's own
:func:`automodel.distributed.tensor_parallel.apply_tensor_parallel` and the loss is the recipe's
:func:`automodel.training.step.forward_loss_sum` inside :func:`automodel.distributed.cp_utils.get_train_context`
(no FSDP2: one TP group, nothing to shard over). Printed per setting (a markdown table):

- parameters per rank: the local (``DTensor.to_local``) parameter bytes, and the memory plan's figure;
- the per-rank **step peak**: the kernel's peak RSS (VmHWM, reset just before the step) minus the RSS
  just before it (:mod:`automodel.training.cpu_memory`; glibc's mmap threshold fixed so freed tensors
  leave the RSS), the slower rank's, next to the plan's step peak
  (:func:`automodel.training.memory_plan.plan_memory`, what ``recipe.dry_run=true`` prints);
- the step time (median of ``--steps``, the slower rank) and the CPU time the slower rank's process
  spent in it (``time.process_time``). On a machine whose cores are shared with other work the wall
  time varies several-fold from run to run; the CPU time much less (it counts this process's work,
  gloo's waits included, not the time spent waiting for a core). With one core per rank, tp=2's
  CPU time per rank against tp=1's shows what TP saves per rank and what its collectives cost.

    nice python scripts/bench_tp.py                          # the table in docs/benchmarks.md (3-6 min on 2 busy cores)
    nice python scripts/bench_tp.py --seq-len 2048 --steps 1 # quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402
from scripts.bench_cp import add_model_args, model_kwargs, use_mmap_env  # noqa: E402

MIB = 2**20
# (label, tp, loss parallel, sequence parallel)
SETTINGS = [
    ("tp=1", 1, False, False),
    ("tp=2, logits gathered", 2, False, False),
    ("tp=2, loss parallel", 2, True, False),
    ("tp=2, loss parallel + SP", 2, True, True),
]


def _train_step(  # noqa: ANN202
    model, optimizer, train_ctx, g: torch.Generator, vocab: int, world: int, n: int  # noqa: ANN001
) -> tuple[float, float]:
    """One forward + loss + backward + AdamW step on a random ``[1, n]`` row.

    Returns:
        (wall seconds, CPU seconds of this process), each the slowest rank's.
    """
    import torch.distributed as dist

    from automodel.training.step import forward_loss_sum

    ids = torch.randint(0, vocab, (1, n), generator=g)
    labels = torch.randint(0, vocab, (1, n), generator=g)
    if world > 1:
        dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    with train_ctx():
        (forward_loss_sum(model, {"input_ids": ids}, labels) / n).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
    if world > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed[0].item(), elapsed[1].item()


def measure_worker(
    rank: int, world: int, settings: list[dict], seq: int, steps: int, model_kw: dict, warmup_seq: int = 256
) -> list[dict]:
    """Train ``steps`` steps of one ``[1, seq]`` row per setting on this rank (tp = ``world``).

    ``settings``: dicts with ``lp`` (loss parallel) and ``sp`` (sequence parallel). Each setting builds
    its model (seed 0), shards it over the 1-D tp mesh of all ranks (world > 1), builds AdamW and runs a
    warm-up step at ``warmup_seq`` tokens (AdamW states, one-time buffers) before the measured steps.

    Returns:
        Per setting ``{"param_mib": local parameter MiB, "peak_mib": step peak above the pre-step RSS
        of the first measured step, "time": median step seconds (slowest rank)}``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp_utils import get_train_context
    from automodel.distributed.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)) if world > 1 else None
    config = LlamaConfig(
        max_position_embeddings=max(seq, warmup_seq), attn_implementation="sdpa", use_cache=False, **model_kw
    )
    out = []
    for setting in settings:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if mesh is not None:
            apply_tensor_parallel(model, mesh, loss_parallel=setting["lp"], sequence_parallel=setting["sp"])
        local = {id(p): p for p in model.parameters()}.values()
        param_mib = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in local)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        train_ctx = get_train_context(setting["lp"], False)
        g = torch.Generator().manual_seed(1)  # the same ids on every rank: one TP group, one batch

        model.train()
        args = (model, optimizer, train_ctx, g, config.vocab_size, world)
        _train_step(*args, warmup_seq)
        gc.collect()
        base = rss_mib()
        reset_peak_rss()
        times = [_train_step(*args, seq)]
        peak = peak_rss_mib() - base
        times += [_train_step(*args, seq) for _ in range(steps - 1)]
        del args
        out.append(
            {
                "param_mib": param_mib / MIB,
                "peak_mib": peak,
                "time": statistics.median(t for t, _ in times),
                "cpu": statistics.median(c for _, c in times),
            }
        )
        del model, optimizer
        gc.collect()
    return out


def planned(model_kw: dict, seq: int, tp: int, lp: bool, sp: bool):  # noqa: ANN201
    """The memory plan of one setting: a :class:`~automodel.training.memory_plan.MemoryPlan` (fp32, no FSDP2)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.training.memory_plan import RunShape, model_dims, plan_memory

    with torch.device("meta"):
        dims = model_dims(AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **model_kw)))
    return plan_memory(dims, RunShape(local_batch=1, seq=seq, tp=tp, loss_parallel=lp, sequence_parallel=sp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=1, help="measured steps per setting (median time)")
    add_model_args(parser)
    parser.set_defaults(hidden_size=128, heads=4, kv_heads=2, vocab_size=32000)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    use_mmap_env()
    model_kw = model_kwargs(args)
    print(
        f"Llama-shaped {model_kw}, fp32, AdamW, one row of {args.seq_len} tokens per step, CPU (gloo), 1 thread "
        f"per rank, torch {torch.__version__}",
        flush=True,
    )
    results: dict[str, dict] = {}
    for tp in sorted({s[1] for s in SETTINGS}):
        mine = [s for s in SETTINGS if s[1] == tp]
        ranks = run_on_ranks(
            "scripts.bench_tp:measure_worker",
            tp,
            args.timeout,
            settings=[{"lp": lp, "sp": sp} for _, _, lp, sp in mine],
            seq=args.seq_len,
            steps=args.steps,
            model_kw=model_kw,
        )
        for i, (label, *_) in enumerate(mine):
            results[label] = {k: max(r[i][k] for r in ranks) for k in ("param_mib", "peak_mib", "time", "cpu")}
    print(
        "| setting | params MiB/rank (plan) | step peak MiB/rank measured | planned | error "
        "| logits+loss term planned MiB | step s | step CPU s/rank |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, tp, lp, sp in SETTINGS:
        r, plan = results[label], planned(model_kw, args.seq_len, tp, lp, sp)
        pred = plan.step_peak_bytes / MIB  # no FSDP2 and compute = master dtype: no communication buffers
        print(
            f"| {label} | {r['param_mib']:.1f} ({plan.persistent[0].bytes / MIB:.1f}) | {r['peak_mib']:.0f} | "
            f"{pred:.0f} | {(pred - r['peak_mib']) / r['peak_mib']:+.0%} | "
            f"{plan.terms['logits and loss'].bytes / MIB:.0f} | {r['time']:.2f} | {r['cpu']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
