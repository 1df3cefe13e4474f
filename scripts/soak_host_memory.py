#!/usr/bin/env python
"""Host-memory soak: the resident memory of a long recipe run, every N steps (issue 41: with activation offload
the host store must not grow; host memory is flat after the first steps).

    torchrun --standalone --nproc-per-node 1 scripts/soak_host_memory.py --steps 300 --every 25 \\
        -- model.activation_checkpointing=true model.activation_offload=true model.tiled_mlp=16
    torchrun --standalone --nproc-per-node 4 scripts/soak_host_memory.py --config configs/cp_usp.yaml \\
        --steps 200 -- model.activation_checkpointing=true model.activation_offload=true model.tiled_mlp=16

The run is the recipe (``FinetuneTrainer``) on ``--config`` (default configs/cp.yaml, at cp_size = the ranks)
with a tiny model (2 layers of width 64, rows of ``--seq-len`` tokens, 2 rows per micro-batch, 2 micro-batches
per step: small enough for 2 loaded cores), no checkpoints, no export, validation every 100 steps; the
overrides after ``--`` come last. Every ``--every`` steps rank 0 prints one line: the step, the resident
memory (``/proc/self/statm``) of the largest rank in MiB, its change since step ``--settle``, the peak resident
memory (``VmHWM``), and the activation-offload pool's host bytes (the largest rank's). The last line gives the
growth from step ``--settle`` to the end; the exit status is 1 when the resident memory grew by more than
``--max-growth`` percent (default 5) or the offload pool reached a new high in the second half of the run.

Measured (docs/benchmarks.md, "Host memory over a long run"): with activation offload the pool stays at one
micro-batch's layer inputs and the resident memory creeps by ~2-3% over a few hundred steps with or without
the offload (the allocator and the run's own bookkeeping, not the store).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.dtype=float32",
    "fsdp.param_dtype=float32",
    "step_scheduler.local_batch_size=2",
    "step_scheduler.val_every_steps=100",
    "step_scheduler.val_max_batches=2",
    "step_scheduler.ckpt_every_steps=null",
    "checkpoint.enabled=false",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
    "logging.log_every_steps=1000",
]


def _rss_mib() -> tuple[float, float]:
    """This process's resident memory and its peak (VmHWM), MiB."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    rss = pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    hwm = 0.0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) / 1024
    return rss, hwm


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cp.yaml")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25, help="print every N steps")
    parser.add_argument("--settle", type=int, default=25, help="growth is measured from this step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-growth", type=float, default=5.0, help="percent; above it the exit status is 1")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (1: shared cores)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)

    from automodel.config import load_config
    from automodel.training.trainer import FinetuneTrainer, TrainHooks

    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = tempfile.mkdtemp(prefix="automodel-soak-memory-")
    overrides = [
        *TINY,
        f"distributed.cp_size={world}",
        f"data.seq_len={args.seq_len}",
        "step_scheduler.global_batch_size=4",  # 2 micro-batches of 2 rows (dp = 1)
        f"step_scheduler.max_steps={args.steps}",
        f"recipe.output_dir={out}",
        *args.overrides,
    ]
    rows: list[tuple[int, float, float, int]] = []
    trainer: FinetuneTrainer | None = None

    def on_step_end(step: int, record: dict) -> None:
        if step % args.every and step != args.settle and step != args.steps:
            return
        rss, hwm = _rss_mib()
        store = trainer.activation_offload if trainer is not None else None
        pool = store.pool.host_bytes if store is not None else 0
        got = [None] * dist.get_world_size() if dist.is_initialized() else [(rss, hwm, pool)]
        if dist.is_initialized():
            dist.all_gather_object(got, (rss, hwm, pool))
        if trainer is not None and trainer.rank != 0:
            return
        rss_max = max(g[0] for g in got)
        hwm_max = max(g[1] for g in got)
        pool_max = max(g[2] for g in got)
        rows.append((step, rss_max, hwm_max, pool_max))
        base = next((r[1] for r in rows if r[0] == args.settle), None)
        delta = f"{rss_max - base:+8.1f}" if base is not None and step >= args.settle else "        "
        print(f"step {step:5d}  rss {rss_max:8.1f} MiB  {delta} since step {args.settle}  peak {hwm_max:8.1f} MiB  "
              f"offload pool {pool_max / 2**20:7.3f} MiB", flush=True)  # fmt: skip

    trainer = FinetuneTrainer(load_config(["--config", args.config, *overrides], world_size=world),
                              TrainHooks(on_step_end=on_step_end))  # fmt: skip
    trainer.setup()
    trainer.train()
    status = 0
    if trainer.rank == 0:
        settled = [r for r in rows if r[0] >= args.settle]
        if len(settled) >= 2:
            first, last = settled[0], settled[-1]
            growth = 100.0 * (last[1] - first[1]) / first[1]
            print(f"rss from step {first[0]} to {last[0]}: {first[1]:.1f} -> {last[1]:.1f} MiB ({growth:+.2f}%); "
                  f"peak {last[2]:.1f} MiB; offload pool {first[3] / 2**20:.3f} -> {last[3] / 2**20:.3f} MiB; "
                  f"run dir {out}")  # fmt: skip
            half = max(len(settled) // 2, 1)  # the pool follows the shapes (it may shrink and refill): no new high
            pool_grew = max(r[3] for r in settled[half:]) > max(r[3] for r in settled[:half])
            status = 1 if growth > args.max_growth or pool_grew else 0
    if dist.is_initialized():
        dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
