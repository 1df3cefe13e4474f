#!/usr/bin/env python
"""Per-rank training memory of a Llama-shaped model on CPU, measured and planned (issue 14, item 4).

For each setting (vocabulary, cp_size, plain or chunked loss, activation checkpointing off or on)
and each sequence length, fresh gloo processes (one thread per rank) train a few steps of a
Llama-shaped model (small hidden size, realistic vocabulary) with ring CP and AdamW, and report:

- the per-rank **step peak**: the kernel's peak RSS (VmHWM, reset just before the step) minus the
  RSS just before the step, i.e. what one forward + loss + backward + optimizer step needs on top
  of the state that persists between steps (weights, AdamW states, the batch); glibc's mmap
  threshold is fixed (:data:`automodel.training.cpu_memory.MMAP_ENV`) so freed tensors leave the RSS;
- the planner's prediction of the same quantity (:func:`automodel.training.memory_plan.plan_memory`,
  the figure ``recipe.dry_run=true`` prints as "step peak"), less its FSDP2 communication buffers:
  the measured ranks hold a replicated model and all-reduce the gradients (no FSDP2), so they have
  no gathered root and layers (at cp=2 the plan with those buffers is higher by ``2 V h 4`` bytes);
- the step time (the slower rank), so the price of recomputation is visible;
- the longest sequence whose step peak plus persistent state fits ``--budget-gib`` per rank: searched
  with the planner, then verified by one measured run at that length.

    nice python scripts/bench_memory.py                              # the table in docs/benchmarks.md
    nice python scripts/bench_memory.py --vocabs 32000 --seq-lens 1024 2048 --no-search
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import MMAP_ENV, peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402


def measure_worker(rank: int, world: int, cases: list[dict], model_kw: dict, warmup_seq: int = 256) -> list[dict]:
    """Train one step per case on this rank; return ``[{"peak_mib", "persist_mib", "time"}, ...]``.

    ``cases``: dicts with ``seq`` (global tokens of the one row), ``chunk`` (``loss.chunk_tokens``
    or None) and ``ac`` (activation checkpointing). The model, the optimizer and its states are
    built once (a warm-up step at ``warmup_seq`` tokens allocates the AdamW states and one-time
    buffers); every case is then measured as the peak RSS above the RSS just before its step.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp_utils import make_cp_batch_and_ctx
    from automodel.training.step import forward_loss_sum

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    max_seq = max([c["seq"] for c in cases] + [warmup_seq])
    config = LlamaConfig(
        max_position_embeddings=max_seq, attn_implementation="sdpa", use_cache=False, **model_kw
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)

    def step(seq: int, chunk: int | None, ac: bool) -> float:
        if ac != model.is_gradient_checkpointing:
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
        model.train()
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
        labels = torch.randint(0, config.vocab_size, (1, seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        ctx, batch = make_cp_batch_and_ctx(mesh if world > 1 else None, {"input_ids": ids, "labels": labels})
        lab = batch.pop("labels")
        with ctx():
            inputs = {k: batch[k] for k in ("input_ids", "position_ids") if batch.get(k) is not None}
            (forward_loss_sum(model, inputs, lab, chunk) / seq).backward()
        if world > 1:  # sum the gradients over the CP group (what FSDP's reduce-scatter does)
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    step(warmup_seq, None, False)  # AdamW states, lazy imports, gloo buffers
    step(warmup_seq, 64, True)
    out = []
    for case in cases:
        gc.collect()
        base = rss_mib()
        reset_peak_rss()
        t = step(case["seq"], case.get("chunk"), bool(case.get("ac")))
        out.append({"peak_mib": peak_rss_mib() - base, "time": t})
    return out


SETTINGS = [  # (label, chunk_tokens, activation checkpointing)
    ("plain", None, False),
    ("plain+AC", None, True),
    ("chunked", 256, False),
    ("chunked+AC", 256, True),
]


def _dims(model_kw: dict):  # noqa: ANN202
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.training.memory_plan import model_dims

    with torch.device("meta"):
        return model_dims(AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **model_kw)))


def _shape(seq: int, cp: int, chunk: int | None, ac: bool):  # noqa: ANN202
    from automodel.training.memory_plan import RunShape

    return RunShape(local_batch=1, seq=seq, cp=cp, chunk_tokens=chunk, activation_checkpointing=ac)


def _planned_without_fsdp(plan) -> float:  # noqa: ANN001
    """The planned step peak less FSDP2's gathered parameters: the measured ranks hold a replicated model."""
    return plan.step_peak_bytes - plan.phases[plan.peak_phase].get("communication buffers", 0.0)


def longest_planned(dims, cp: int, chunk: int | None, ac: bool, budget: float, cap: int) -> int:  # noqa: ANN001
    """Longest multiple of 256 (<= ``cap``) whose planned persistent state + step peak fits ``budget`` bytes."""
    from automodel.training.memory_plan import plan_memory

    lo, hi = 0, cap // 256
    while lo < hi:  # the plan grows monotonically with the sequence length
        mid = (lo + hi + 1) // 2
        if plan_memory(dims, _shape(mid * 256, cp, chunk, ac)).total_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=2.0, help="per-rank budget of the longest-sequence search")
    parser.add_argument("--search-cap", type=int, default=1 << 20, help="longest sequence the search considers")
    parser.add_argument("--verify-max", type=int, default=8192, help="measure the found length only up to this")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    for key, value in MMAP_ENV.items():  # read by the spawned interpreters' glibc at start-up
        os.environ.setdefault(key, value)
    from automodel.training.memory_plan import plan_memory

    h = args.hidden_size
    print(
        f"Llama-shaped: hidden {h}, MLP {4 * h}, {args.layers} layers, {h // 16} heads / {h // 32} KV heads, fp32, "
        f"AdamW, ring CP, CPU, 1 thread per rank, torch {torch.__version__}; chunked = loss.chunk_tokens=256",
        flush=True,
    )
    print("| vocab | cp | setting | seq len | step peak MiB/rank measured | planned | error | step s |")
    print("|---|---|---|---|---|---|---|---|")
    longest: list[str] = []
    for vocab in args.vocabs:
        model_kw = dict(
            hidden_size=h,
            intermediate_size=4 * h,
            num_hidden_layers=args.layers,
            num_attention_heads=h // 16,
            num_key_value_heads=h // 32,
            vocab_size=vocab,
        )
        dims = _dims(model_kw)
        for cp in args.cps:
            cases = [{"seq": s, "chunk": c, "ac": a} for _, c, a in SETTINGS for s in args.seq_lens]
            found = {}
            if not args.no_search:
                for label, c, a in SETTINGS:
                    found[label] = longest_planned(dims, cp, c, a, args.budget_gib * 2**30, args.search_cap)
                    if 0 < found[label] <= args.verify_max:
                        cases.append({"seq": found[label], "chunk": c, "ac": a, "verify": label})
            ranks = run_on_ranks(
                "scripts.bench_memory:measure_worker", cp, args.timeout, cases=cases, model_kw=model_kw
            )
            verified = {}
            for i, case in enumerate(cases):
                peak = max(r[i]["peak_mib"] for r in ranks)
                t = max(r[i]["time"] for r in ranks)
                plan = plan_memory(dims, _shape(case["seq"], cp, case["chunk"], case["ac"]))
                if "verify" in case:
                    verified[case["verify"]] = (peak + plan.persistent_bytes / 2**20, t)
                    continue
                label = next(lb for lb, c, a in SETTINGS if (c, a) == (case["chunk"], case["ac"]))
                pred = _planned_without_fsdp(plan) / 2**20
                print(
                    f"| {vocab} | {cp} | {label} | {case['seq']} | {peak:.0f} | {pred:.0f} | "
                    f"{(pred - peak) / peak:+.0%} | {t:.2f} |",
                    flush=True,
                )
            for label, _, _ in SETTINGS:
                if label not in found:
                    continue
                v = verified.get(label)
                check = (
                    f"measured {v[0]:.0f} MiB, {v[1]:.2f} s/step" if v else f"not measured (> {args.verify_max} tokens)"
                )
                longest.append(f"| {vocab} | {cp} | {label} | {found[label]} | {check} |")
    if longest:
        print(f"\nLongest sequence (multiple of 256) whose planned per-rank total fits {args.budget_gib:g} GiB:\n")
        print("| vocab | cp | setting | longest seq | verification (step peak + persistent state) |")
        print("|---|---|---|---|---|")
        print("\n".join(longest), flush=True)


if __name__ == "__main__":
    main()
