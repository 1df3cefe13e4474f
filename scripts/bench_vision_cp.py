#!/usr/bin/env python
"""Benchmark the vision tower under multimodal CP: time per rank at cp=1 vs cp=2 (CPU, gloo).

The workload: 8 images of mixed sizes (dynamic resolution, Qwen2-VL packed layout) through a
Qwen2-VL vision tower built from a config (no download), forward + backward (loss = sum of the
merged embeddings after the gather, each rank's share of the rows, as under CP).

- **cp=1**: one process encodes all 8 images.
- **cp=2**: two gloo ranks, each encodes its share (whole images, balanced by patch count with
  :func:`automodel.distributed.multimodal.cp.split_to_context_parallel_ranks_dynamic_res`), then
  the embeddings are all-gathered (reduce-scatter in the backward).

Printed per rank: images, patches, median step time over ``--steps`` timed steps after one warm-up,
and the speed-up of the slowest rank over cp=1. One intra-op thread per process.

    python scripts/bench_vision_cp.py                 # embed 256, depth 4
    python scripts/bench_vision_cp.py --steps 3 --embed-dim 128 --depth 2
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

#: (t, h, w) patch grids of the 8 images: 4x4-pixel patches, so 64x64 .. 160x96 pixel images.
GRIDS = [(1, 16, 16), (1, 8, 8), (1, 24, 16), (1, 8, 12), (1, 16, 8), (1, 12, 12), (1, 4, 8), (1, 20, 20)]


def _tower(embed_dim: int, depth: int):
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    from automodel.models.vlm_tiny import tiny_qwen2_vl_config

    cfg = tiny_qwen2_vl_config().vision_config
    cfg.embed_dim, cfg.depth, cfg.num_heads = embed_dim, depth, max(2, embed_dim // 64)
    torch.manual_seed(0)
    return Qwen2VisionTransformerPretrainedModel._from_config(cfg, dtype=torch.float32)


def _inputs():
    grid = torch.tensor(GRIDS, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, generator=g), grid


def worker(rank: int, world_size: int, embed_dim: int, depth: int, steps: int) -> dict:
    from automodel.distributed.multimodal.cp import (
        gather_from_context_parallel_ranks_dynamic_res,
        split_to_context_parallel_ranks_dynamic_res,
    )

    tower = _tower(embed_dim, depth)
    pixels, grid = _inputs()
    local, split = split_to_context_parallel_ranks_dynamic_res(pixels, grid, spatial_merge_size=2)
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        rows = gather_from_context_parallel_ranks_dynamic_res(
            tower(local, grid_thw=split.local_grid_thw).pooler_output, split
        )
        share = rows.size(0) // world_size
        rows.narrow(0, rank * share, share).sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return {
        "images": len(split.local_media),
        "patches": split.patches_per_rank[rank],
        "time": statistics.median(times),
    }


def single(embed_dim: int, depth: int, steps: int) -> dict:
    torch.set_num_threads(1)
    tower = _tower(embed_dim, depth)
    pixels, grid = _inputs()
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        tower(pixels, grid_thw=grid).pooler_output.sum().backward()
        if i:
            times.append(time.perf_counter() - t0)
    return {"images": len(GRIDS), "patches": int(grid.prod(-1).sum()), "time": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed-dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    kw = dict(embed_dim=args.embed_dim, depth=args.depth, steps=args.steps)
    ref = single(**kw)
    ranks = run_on_ranks("scripts.bench_vision_cp:worker", world_size=2, timeout=1200, **kw)
    slowest = max(r["time"] for r in ranks)
    print(f"vision tower: embed_dim {args.embed_dim}, depth {args.depth}, 8 images {GRIDS}, fwd+bwd, fp32, CPU")
    print("| run | rank | images | patches | time s |")
    print("|---|---|---|---|---|")
    print(f"| cp=1 | 0 | {ref['images']} | {ref['patches']} | {ref['time']:.3f} |")
    for r, res in enumerate(ranks):
        print(f"| cp=2 | {r} | {res['images']} | {res['patches']} | {res['time']:.3f} |")
    print(f"speed-up of the slowest cp=2 rank over cp=1: {ref['time'] / slowest:.2f}x "
          f"(ideal {ref['patches'] / max(r['patches'] for r in ranks):.2f}x from the patch balance)")


if __name__ == "__main__":
    main()
