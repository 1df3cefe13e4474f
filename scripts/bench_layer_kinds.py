#!/usr/bin/env python
"""What each attention layer kind costs under CP: bytes sent per rank per step and step time.

Two gloo ranks (CPU, one thread each) run one attention layer's forward + backward on ``[1, H, S, D]``
fp32 q/k/v (``H`` query heads, ``H/4`` KV heads) for every entry of :data:`KINDS`, with the kernel the
CP method picks for that kind (automodel/distributed/cp/kernels). Bytes are counted at the collectives
(``all_to_all_single``, all-gather, reduce-scatter: what this rank sends to the other ranks, forward +
backward; deterministic); the time is the slower rank's (noisy on a shared machine).

    python scripts/bench_layer_kinds.py                          # S = 4096, 16384; W = 512
    python scripts/bench_layer_kinds.py --seq-lens 4096 --kinds full/ring sliding/ring --steps 3

Extend :data:`KINDS` with ``name -> builder(q, k, v, ctx) -> callable`` for a new layer kind (``ctx``:
world, rank, group, mesh, seq, window); the callable runs forward + backward once.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402


# ----------------------------------------------------------------------------------------- byte counting
@contextlib.contextmanager
def count_sent_bytes(rank: int, world: int) -> Iterator[list[int]]:
    """Count the bytes this rank sends to other ranks in the collectives the CP kernels use."""
    import torch.distributed as dist

    import automodel.distributed.cp.exchange.gather as thd

    sent = [0]
    originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather_into_tensor",
                                                         "reduce_scatter_tensor", "all_gather_single",
                                                         "reduce_scatter_single") if hasattr(dist, name)}
    thd_originals = (thd._all_gather, thd._reduce_scatter)

    def a2a(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        row = input.element_size() * (input[0].numel() if input.dim() and input.shape[0] else 0)
        if input_split_sizes:
            sent[0] += row * sum(n for p, n in enumerate(input_split_sizes) if p != rank)
        else:
            sent[0] += input.numel() * input.element_size() * (world - 1) // world
        return originals["all_to_all_single"](output, input, output_split_sizes, input_split_sizes, **kw)

    def gather(name):
        def fn(output, input, *a, **kw):
            sent[0] += input.numel() * input.element_size() * (world - 1)
            return originals[name](output, input, *a, **kw)
        return fn

    def scatter(name):
        def fn(output, input, *a, **kw):
            sent[0] += input.numel() * input.element_size() * (world - 1) // world
            return originals[name](output, input, *a, **kw)
        return fn

    patched = {"all_to_all_single": a2a}
    for name in originals:
        if "gather" in name:
            patched[name] = gather(name)
        elif "scatter" in name:
            patched[name] = scatter(name)
    for name, fn in patched.items():
        setattr(dist, name, fn)
    thd._all_gather = patched.get("all_gather_single", patched["all_gather_into_tensor"])
    thd._reduce_scatter = patched.get("reduce_scatter_single", patched["reduce_scatter_tensor"])
    try:
        yield sent
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        thd._all_gather, thd._reduce_scatter = thd_originals


# ----------------------------------------------------------------------------------------- the layer kinds
def _grad_step(fn: Callable[..., torch.Tensor], q, k, v) -> Callable[[], None]:
    def step() -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
    return step


def full_ring(q, k, v, ctx):
    """torch's ring attention (SDPA under ``context_parallel``, the CPU ring on gloo)."""
    import torch.nn.functional as F

    from automodel.distributed.cp_utils import create_context_parallel_ctx

    def step() -> None:
        bufs = [q.clone(), k.clone(), v.clone()]  # the global tensors: the context shards them in place
        with create_context_parallel_ctx(ctx["mesh"], bufs, [2, 2, 2], set(bufs)):
            leaves = [t.detach().requires_grad_() for t in bufs]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
    return step


def _local(x, ids):
    return x.index_select(2, ids).contiguous()


def full_thd(q, k, v, ctx):
    """thd's portable kernel: K/V all-gathered, dK/dV reduce-scattered (one document per row)."""
    from automodel.distributed.thd_attention import THDPlan, thd_attention

    seq = ctx["seq"]
    plan = THDPlan(ctx["group"], ctx["world"], ctx["rank"], [0, seq], [0, seq], seq)
    ids = plan.token_layout().ids
    return _grad_step(lambda a, b, c: thd_attention(a, b, c, plan), *(_local(x, ids) for x in (q, k, v)))


def _halo(layout_name: str, **kernel):
    def build(q, k, v, ctx):
        from automodel.distributed.cp.kernels.masked_attention import halo_attention
        from automodel.distributed.cp.kernels.token_layout import ring_layout, thd_layout

        seq = ctx["seq"]
        if layout_name == "ring":
            layout = ring_layout(seq, ctx["group"], ctx["world"], ctx["rank"])
        else:
            layout = thd_layout([0, seq], ctx["group"], ctx["world"], ctx["rank"])
        opts = {key: (ctx["window"] if value == "W" else value) for key, value in kernel.items()}
        if opts.pop("sinks", False):
            opts["sinks"] = torch.zeros(q.shape[1])
        return _grad_step(lambda a, b, c: halo_attention(a, b, c, layout, **opts),
                          *(_local(x, layout.ids) for x in (q, k, v)))
    return build


#: layer kind / method -> builder (see the module docstring)
KINDS: dict[str, Callable[..., Callable[[], None]]] = {
    "full/ring": full_ring,
    "full/thd": full_thd,
    "sliding/ring": _halo("ring", window="W"),
    "sliding/thd": _halo("thd", window="W"),
    "chunked/ring": _halo("ring", chunk="W"),
    "sliding+sinks/thd": _halo("thd", window="W", sinks=True),
}


# ----------------------------------------------------------------------------------------- driver
def _worker(rank: int, world: int, seq_lens: list[int], window: int, kinds: list[str], steps: int,
            heads: int, head_dim: int) -> dict:
    import torch.distributed as dist

    from automodel.distributed.mesh import ParallelDims

    torch.set_num_threads(1)
    mesh = ParallelDims(cp=world, world_size=world).build_mesh("cpu")["cp"]
    out: dict[str, Any] = {}
    for seq in seq_lens:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, seq, head_dim, generator=g)
        k, v = (torch.randn(1, max(1, heads // 4), seq, head_dim, generator=g) for _ in range(2))
        ctx = {"world": world, "rank": rank, "group": mesh.get_group(), "mesh": mesh, "seq": seq, "window": window}
        for name in kinds:
            step = KINDS[name](q, k, v, ctx)
            with count_sent_bytes(rank, world) as sent:
                step()  # warm-up (plans, caches), and the byte count of one step
            times = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                times.append(slowest.item())
            most = torch.tensor([sent[0]], dtype=torch.float64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            out[f"{seq}/{name}"] = {"bytes": int(most.item()), "seconds": statistics.median(times)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    results = run_on_ranks(
        "scripts.bench_layer_kinds:_worker", world_size=2, timeout=args.timeout, seq_lens=args.seq_lens,
        window=args.window, kinds=args.kinds, steps=args.steps, heads=args.heads, head_dim=args.head_dim,
    )[0]
    kv = max(1, args.heads // 4)
    print(f"one attention layer fwd+bwd, cp=2 gloo, q [1, {args.heads}, S, {args.head_dim}], k/v [1, {kv}, S, "
          f"{args.head_dim}] fp32, W = chunk = {args.window}; bytes: sent per rank per step (max over ranks)")
    print(f"{'S':>6} {'kind/method':<20} {'MiB sent':>9} {'vs full/ring':>13} {'step (s)':>9} {'vs full/ring':>13}")
    for seq in args.seq_lens:
        base = results.get(f"{seq}/full/ring")
        for name in args.kinds:
            r = results[f"{seq}/{name}"]
            rb = f"{r['bytes'] / base['bytes']:.4f}" if base and base["bytes"] else "-"
            rt = f"{r['seconds'] / base['seconds']:.3f}" if base else "-"
            print(f"{seq:>6} {name:<20} {r['bytes'] / 2**20:>9.2f} {rb:>13} {r['seconds']:>9.3f} {rt:>13}")


if __name__ == "__main__":
    main()
