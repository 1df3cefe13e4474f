#!/usr/bin/env python
"""Benchmark ring CP on CPU: a tiny Llama forward+backward at growing sequence lengths, cp=1 vs cp=2.

Every (cp, length) pair runs in fresh processes (one thread per rank, gloo on 127.0.0.1) so the
memory figures do not inherit an earlier run's high-water mark. Printed per length:

- step time (median over ``--steps`` timed steps after one warm-up; for cp=2 the slower rank);
- parallel efficiency ``T(cp=1) / (2 * T(cp=2))`` (1.0 = perfect scaling over 2 ranks);
- per-rank peak memory above the process baseline: the kernel's peak RSS (VmHWM, reset after the
  warm-up step) during the timed steps minus the RSS just before them, i.e. what one training
  step needs on top of the model, the batch and one-time costs; and its ratio cp=2 / cp=1.
  glibc's mmap threshold is fixed at 64 KiB in the workers so that freed tensors leave the RSS.

Targets (issue 2): efficiency >= 0.8 and memory ratio <= 0.6 at the longest length.

    python scripts/bench_cp.py                       # 2k, 4k, 8k, 16k
    python scripts/bench_cp.py --seq-lens 1024 2048 --steps 2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import MMAP_ENV, peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402


def _worker(rank: int, world: int, seq_len: int, steps: int, model_kw: dict) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp_utils import make_cp_batch_and_ctx

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    config = LlamaConfig(
        max_position_embeddings=seq_len, attn_implementation="sdpa", use_cache=False, **model_kw
    )
    model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g)
    labels = torch.randint(0, config.vocab_size, (1, seq_len), generator=g)
    count = int((labels != -100).sum())

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        ctx, batch = make_cp_batch_and_ctx(
            mesh if world > 1 else None, {"input_ids": input_ids, "labels": labels}
        )
        with ctx():
            logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum") / count
            loss.backward()
        model.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    step()  # warm-up: lazy imports, gloo buffers, allocator pools
    gc.collect()
    baseline = rss_mib()
    if not reset_peak_rss():
        baseline = rss_mib()  # peak then includes the warm-up's one-time costs (conservative)
    times = [step() for _ in range(steps)]
    peak = peak_rss_mib() - baseline
    return {"time": statistics.median(times), "peak_mib": peak}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The tiny Llama's size options shared by the CPU benchmarks."""
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024)


def model_kwargs(args: argparse.Namespace) -> dict:
    """``LlamaConfig`` keyword arguments from :func:`add_model_args`' options (MLP = 4 x hidden)."""
    return dict(
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
    )


def use_mmap_env() -> None:
    """Workers are fresh interpreters that read these at start-up. A fixed mmap threshold puts every
    tensor above 64 KiB in its own mapping that free() returns to the OS, so RSS follows the live
    tensors instead of glibc's retained heap (its adaptive threshold would otherwise keep freed
    activations of the warm-up step in the baseline and make the peak figures noise)."""
    for key, value in MMAP_ENV.items():
        os.environ.setdefault(key, value)


def run(world: int, seq_len: int, steps: int, model_kw: dict, timeout: float) -> dict:
    results = run_on_ranks(
        "scripts.bench_cp:_worker", world, timeout, seq_len=seq_len, steps=steps, model_kw=model_kw
    )
    return {"time": max(r["time"] for r in results), "peak_mib": max(r["peak_mib"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=3)
    add_model_args(parser)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    use_mmap_env()
    model_kw = model_kwargs(args)
    print(f"tiny Llama {model_kw}, fp32, CPU, 1 thread per rank, torch {torch.__version__}", flush=True)
    header = (
        "| seq len | T(cp=1) s | T(cp=2) s | efficiency | peak MiB cp=1 | peak MiB/rank cp=2 | mem ratio |"
    )
    print(header)
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        one = run(1, seq_len, args.steps, model_kw, args.timeout)
        two = run(2, seq_len, args.steps, model_kw, args.timeout)
        eff = one["time"] / (2 * two["time"])
        ratio = two["peak_mib"] / one["peak_mib"]
        print(
            f"| {seq_len} | {one['time']:.3f} | {two['time']:.3f} | {eff:.2f} | {one['peak_mib']:.0f} | "
            f"{two['peak_mib']:.0f} | {ratio:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
