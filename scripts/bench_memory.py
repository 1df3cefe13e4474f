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
  the figure ``recipe.dry_run=true`` prints as "step peak");
- the step time (the slower rank), so the price of recomputation is visible;
- the longest sequence whose step peak plus persistent state fits ``--budget-gib`` per rank: searched
  with the planner, then verified by one measured run at that length.

    nice python scripts/bench_memory.py                              # the README table
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
