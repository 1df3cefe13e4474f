#!/usr/bin/env python
"""Benchmark compilation on CPU: eager vs ``model.compile`` vs compiled autograd vs both, through the recipe.

Each (mode, sequence length) runs ``configs/cp.yaml`` (the default tiny Llama: 4 layers, hidden 128)
with ring CP on 2 gloo ranks in a fresh process group, fp32, ``--steps`` steps of one micro-batch
(``local_batch_size=global_batch_size=--batch``), no validation, checkpoints or export. Printed per run:

- ``compile s``: seconds spent compiling (dynamo + compiled autograd, summed over the steps; almost
  all of it in step 1), as the recipe reports it in ``metrics.jsonl`` (``compile_time_s``);
- ``step 1 wall s``: the whole first step (compilation, compiled autograd's capture of the backward
  graph, which torch does not count as compile time, and the step itself);
- ``step s``: the median ``step_time_s`` of steps 2..N (compilation excluded), and the speed-up over
  eager at the same length;
- ``graphs after step 1``: graphs compiled after the first step (recompiles; expected 0).

Modes: ``eager``; ``compile`` (``model.compile=true``, FSDP2); ``ca`` (compiled autograd,
``fsdp.enabled=false``); ``both``; and ``eager_rep`` (eager with ``fsdp.enabled=false``, the fair
baseline for ``ca``/``both``).

    python scripts/bench_compile.py                                  # seq 256 and 1024, inductor
    python scripts/bench_compile.py --seq-lens 256 --backend aot_eager --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402

MODES = {
    "eager": [],
    "eager_rep": ["fsdp.enabled=false"],
    "compile": ["model.compile=true"],
    "ca": ["distributed.enable_compiled_autograd=true", "fsdp.enabled=false"],
    "both": ["distributed.enable_compiled_autograd=true", "fsdp.enabled=false", "model.compile=true"],
}


def _worker(rank: int, world: int, out: str, overrides: list[str]) -> dict:
    from automodel.config import load_config
    from automodel.training.trainer import FinetuneTrainer, TrainHooks

    records: list[dict] = []
    argv = ["--config", "configs/cp.yaml", f"recipe.output_dir={out}", *overrides]
    hooks = TrainHooks(on_step_end=lambda step, record: records.append(dict(record)))
    FinetuneTrainer(load_config(argv, world_size=world), hooks).run()
    return {
        "compile_s": sum(r["compile_time_s"] for r in records),
        "first_step_s": records[0]["step_time_s"] + records[0]["compile_time_s"],
        "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "graphs_after_first": sum(r["graphs_compiled"] for r in records[1:]),
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=2, help="rows per step (one micro-batch)")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()

    print(f"backend {args.backend}, ring cp=2 on 2 gloo ranks, fp32, {args.steps} steps, batch {args.batch}")
    print("| seq | mode | compile s | step 1 wall s | step s | vs eager | graphs after step 1 |")
    print("|---|---|---|---|---|---|---|")
    for seq in args.seq_lens:
        eager_step = None
        for mode in args.modes:
            overrides = [
                f"data.seq_len={seq}",
                f"step_scheduler.max_steps={args.steps}",
                "lr_scheduler.warmup_steps=0",  # within max_steps (a warmup longer than the run is refused)
                f"step_scheduler.global_batch_size={args.batch}",
                f"step_scheduler.local_batch_size={args.batch}",
                "step_scheduler.val_every_steps=null",
                "step_scheduler.ckpt_every_steps=null",
                "checkpoint.enabled=false",
                "export.enabled=false",
                "logging.progress_bar=false",
                "logging.plot=false",
                "distributed.cp_size=2",
                f"model.compile_backend={args.backend}",
                *MODES[mode],
            ]
            with tempfile.TemporaryDirectory() as out:
                (r, _) = run_on_ranks(
                    "scripts.bench_compile:_worker", world_size=2, timeout=args.timeout, out=out, overrides=overrides
                )
            if mode == "eager":
                eager_step = r["step_s"]
            speedup = f"{eager_step / r['step_s']:.2f}x" if eager_step else "-"
            print(
                f"| {seq} | {mode} | {r['compile_s']:.1f} | {r['first_step_s']:.1f} | {r['step_s']:.3f} | {speedup} "
                f"| {r['graphs_after_first']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
