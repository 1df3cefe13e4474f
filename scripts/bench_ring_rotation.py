#!/usr/bin/env python
"""What the synchronous CPU ring rotation costs: torch's asynchronous rotaters vs ``cpu_ring``'s blocking one.

Two gloo ranks (one thread each) run causal SDPA forward + backward under ring CP
(``create_context_parallel_ctx``, i.e. ``automodel.distributed.cp.ring.cpu_ring``) on ``[1, H, S, D]`` fp32
q/k/v, alternating the two rotations step by step (A B A B ...) so that a changing machine load hits
both alike. Printed per sequence length: the median step time (slower rank) of

- ``torch``: torch 2.13's own rotaters (k/v all-gather and dk/dv all-to-all as asynchronous
  functional collectives, overlapped with the attention kernels), put back for the timed step;
- ``sync``: ``cpu_ring._SyncRotater`` (a blocking all-to-all per ring step; what automodel runs),

and the ratio sync / torch.

    python scripts/bench_ring_rotation.py                      # S = 2048, 8192; 10 steps each
    python scripts/bench_ring_rotation.py --seq-lens 4096 --steps 20
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
from automodel.distributed.torch_internals import cp_attention_module  # noqa: E402


def _worker(rank: int, world: int, seq_lens: list[int], steps: int, heads: int, head_dim: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    from automodel.distributed.cp_utils import create_context_parallel_ctx
    from automodel.distributed.mesh import ParallelDims

    torch.set_num_threads(1)
    attn = cp_attention_module()
    torch_rotater = attn._create_rotater  # torch's own, before cpu_ring replaces it inside the context
    mesh = ParallelDims(cp=world, world_size=world).build_mesh("cpu")
    out: dict = {}
    for seq in seq_lens:
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, heads, seq, head_dim, generator=g) for _ in range(4))
        times: dict[str, list[float]] = {"torch": [], "sync": []}
        for i in range(2 * (steps + 1)):
            variant = ("torch", "sync")[i % 2]
            bufs = [q.clone(), k.clone(), v.clone(), dout.clone()]
            with create_context_parallel_ctx(mesh["cp"], bufs, [2, 2, 2, 2], set(bufs)):
                sync_rotater = attn._create_rotater
                if variant == "torch":
                    attn._create_rotater = torch_rotater
                try:
                    local = [t.detach().requires_grad_() for t in bufs[:3]]
                    dist.barrier()
                    t0 = time.perf_counter()
                    o = F.scaled_dot_product_attention(*local, is_causal=True)
                    o.backward(bufs[3])
                    elapsed = time.perf_counter() - t0
                finally:
                    attn._create_rotater = sync_rotater
            slowest = torch.tensor([elapsed], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if i >= 2:  # the first pair is warm-up
                times[variant].append(slowest.item())
        out[seq] = {name: statistics.median(ts) for name, ts in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    results = run_on_ranks(
        "scripts.bench_ring_rotation:_worker",
        world_size=2,
        timeout=args.timeout,
        seq_lens=args.seq_lens,
        steps=args.steps,
        heads=args.heads,
        head_dim=args.head_dim,
    )[0]
    print(f"ring SDPA fwd+bwd, cp=2 gloo, [1, {args.heads}, S, {args.head_dim}] fp32, median of {args.steps} steps")
    print(f"{'S':>7} {'torch async (ms)':>17} {'sync (ms)':>10} {'sync/torch':>11}")
    for seq, r in results.items():
        print(f"{seq:>7} {1e3 * r['torch']:>17.1f} {1e3 * r['sync']:>10.1f} {r['sync'] / r['torch']:>11.3f}")


if __name__ == "__main__":
    main()
