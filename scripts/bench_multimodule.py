#!/usr/bin/env python
"""Benchmark the multi-module pipeline communicator's bridge against a bare send/recv (CPU, gloo).

ONE launched group of 3 ranks: an encoder on rank 0 sends a ``[B, S, H]`` fp32 activation to an LLM at
cp=2 (head-tail) on ranks 1-2, and the gradient comes back (``send_forward`` / ``recv_forward`` then
``send_backward`` / ``recv_backward``). Baseline: the same bytes moved with plain ``dist.send`` /
``dist.recv`` of the two precomputed head-tail halves (what a hand-written bridge with known shapes
would do). The difference is the price of the shape headers, the accept/reject round and the
index gathers/scatters. Time: median over ``--steps`` round trips after one warm-up, on rank 0.

    python scripts/bench_multimodule.py
    python scripts/bench_multimodule.py --hidden 256 --steps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402


def _bridge(comm, rank: int, x: torch.Tensor) -> None:
    if rank == 0:
        comm.send_forward({"enc": x})
        comm.recv_backward()
    else:
        y = comm.recv_forward()["enc"]
        comm.send_backward({"enc": y})


def _bare(rank: int, x: torch.Tensor, halves: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    b, seq, hidden = x.shape
    if rank == 0:
        for c in range(2):
            dist.send(x.index_select(1, halves[c]).contiguous(), c + 1)
        g = torch.empty_like(x)
        for c in range(2):
            piece = torch.empty(b, seq // 2, hidden)
            dist.recv(piece, c + 1)
            g[:, halves[c]] = piece
    else:
        y = torch.empty(b, seq // 2, hidden)
        dist.recv(y, 0)
        dist.send(y, 0)


def _bench(rank: int, world_size: int, seq_lens: list[int], hidden: int, steps: int) -> list[dict]:
    import torch.distributed as dist

    from automodel.distributed.pipeline.bridge import cp_sequence_indices
    from automodel.distributed.pipeline.multimodule import ModuleGrid, MultiModulePipelineCommunicator

    grids = {"enc": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, cp=2)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, timeout=600)
    rows = []
    for seq in seq_lens:
        x = torch.randn(2, seq, hidden)  # rank 0's activation; the llm ranks only use its shape
        halves = [cp_sequence_indices(seq, 2, c, "head_tail") for c in range(2)]
        row = {"seq": seq, "MiB": x.numel() * 4 / 2**20}
        for name, fn in (("bridge", lambda: _bridge(comm, rank, x)), ("bare", lambda: _bare(rank, x, halves))):  # noqa: B023
            fn()
            dist.barrier()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
                dist.barrier()
            row[name] = statistics.median(times)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 4096, 16384])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    results = run_on_ranks(
        "scripts.bench_multimodule:_bench", 3, timeout=900, seq_lens=args.seq_lens, hidden=args.hidden, steps=args.steps
    )
    print(f"encoder (rank 0) -> llm cp=2 head-tail (ranks 1-2), [2, S, {args.hidden}] fp32, forward + backward")
    print("| S | MiB | bridge ms | bare send/recv ms | overhead |")
    print("|---|---|---|---|---|")
    for row in results[0]:
        print(
            f"| {row['seq']} | {row['MiB']:.1f} | {row['bridge'] * 1e3:.1f} | {row['bare'] * 1e3:.1f} | "
            f"{row['bridge'] / row['bare']:.2f}x |"
        )


if __name__ == "__main__":
    main()
