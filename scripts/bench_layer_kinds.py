#!/usr/bin/env python
"""What each attention layer kind and each state mixer costs under CP: bytes sent per rank per step and time.

Two gloo ranks (CPU, one thread each) run one attention layer's forward + backward on ``[1, H, S, D]``
fp32 q/k/v (``H`` query heads, ``H/4`` KV heads) for every entry of :data:`KINDS`, with the kernel the
CP method picks for that kind (automodel/distributed/cp/layers). Bytes are counted at the collectives
(``all_to_all_single``, all-gather, reduce-scatter: what this rank sends to the other ranks, forward +
backward; deterministic); the time is the slower rank's (noisy on a shared machine).

    python scripts/bench_layer_kinds.py                          # S = 4096, 16384; W = 512
    python scripts/bench_layer_kinds.py --seq-lens 4096 --kinds full/ring sliding/ring --steps 3

Extend :data:`KINDS` with ``name -> builder(q, k, v, ctx) -> callable`` for a new layer kind (``ctx``:
world, rank, group, mesh, seq, window); the callable runs forward + backward once.

**State mixers** (``--mixers``; :data:`MIXERS`: one module per kernel family, at benchmark widths): one mixer
layer's forward + backward on ``[1, S, D]`` fp32 under every method with a linear-mixer kernel, on
``--mixer-world`` gloo ranks (default 4, so that usp runs as 2 x 2): ulysses (head shard), ring and thd (the
state chain over head-tail chunks of one document), thd_docs (the placement of one document of S tokens,
split over every rank), usp (head shard over 2, chain over 2). Bytes are counted at ``all_to_all_single``
and at the state hand-off (``state`` column: what the chain sends, fp64 on the wire); the script checks
that the hand-off's bytes are the same at every S and equal to
:func:`automodel.distributed.cp.layers.state_chain.chain_bytes_per_rank`.

    python scripts/bench_layer_kinds.py --kinds full/ring --mixers mamba2 --mixer-world 4
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
    from automodel.distributed.cp.gathered_attention import THDPlan, thd_attention

    seq = ctx["seq"]
    plan = THDPlan(ctx["group"], ctx["world"], ctx["rank"], [0, seq], [0, seq], seq)
    ids = plan.token_layout().ids
    return _grad_step(lambda a, b, c: thd_attention(a, b, c, plan), *(_local(x, ids) for x in (q, k, v)))


def _halo(layout_name: str, **kernel):
    def build(q, k, v, ctx):
        from automodel.distributed.cp.layers.masked_attention import halo_attention
        from automodel.distributed.cp.layout import ring_layout, thd_layout

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


# ----------------------------------------------------------------------------------------- state mixers
#: kernel family -> (model type, config) of a model whose first registered mixer is benchmarked
MIXERS: dict[str, tuple[str, dict]] = {
    "mamba2": ("bamba", dict(hidden_size=256, num_hidden_layers=1, attn_layer_indices=[], num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=256, mamba_n_heads=8, mamba_d_head=32,
                             mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=1,
                             mamba_chunk_size=256)),
    "gated_deltanet": ("qwen3_5_text", dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                                            layer_types=["linear_attention"], linear_conv_kernel_dim=4,
                                            linear_key_head_dim=32, linear_value_head_dim=32,
                                            linear_num_key_heads=4, linear_num_value_heads=8)),
    "mamba1": ("jamba", dict(hidden_size=256, num_hidden_layers=1, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, expert_layer_offset=1, num_attention_heads=4,
                             num_key_value_heads=4, intermediate_size=256, mamba_d_state=16, mamba_dt_rank=16)),
    "short_conv": ("lfm2", dict(hidden_size=256, num_hidden_layers=1, layer_types=["conv"], num_attention_heads=4,
                                num_key_value_heads=4, intermediate_size=256, block_auto_adjust_ff_dim=False)),
    "kimi_delta": ("kimi_linear", dict(hidden_size=256, num_hidden_layers=1, layer_types=["linear_attention"],
                                       mlp_layer_types=["dense"], linear_num_heads=4, linear_head_dim=64,
                                       num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
                                       pad_token_id=0)),
    "lightning": ("minimax", dict(hidden_size=256, num_hidden_layers=1, layer_types=["linear_attention"],
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=64, block_size=256,
                                  intermediate_size=256, num_local_experts=2, num_experts_per_tok=1)),
    "rg_lru": ("recurrent_gemma", dict(hidden_size=256, lru_width=256, num_hidden_layers=1, block_types=["recurrent"],
                                       num_attention_heads=4, num_key_value_heads=4, intermediate_size=256)),
    # RWKV's time mixing with its token shift (a TokenShift under CP: its hand-off counted with the WKV state's);
    # two layers: its weight init divides by num_hidden_layers - 1
    "rwkv": ("rwkv", dict(hidden_size=256, attention_hidden_size=256, num_hidden_layers=2, context_length=65536)),
    "xlstm": ("xlstm", dict(hidden_size=256, embedding_dim=256, num_heads=4, num_hidden_layers=1, chunk_size=64)),
}
MIXER_METHODS = ("ulysses", "ring", "thd", "thd_docs", "usp")


def _mixer_module(family: str) -> torch.nn.Module:
    import types

    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.distributed.cp.layers.linear_mixer import linear_mixer_forward
    from automodel.distributed.cp.layers.mixer_kernel import kernel_for
    from automodel.distributed.cp.layers.rwkv import TOKEN_SHIFT_OWNERS, TokenShift

    model_type, config = MIXERS[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=64, **config))
    mixer = next(m for m in model.modules() if kernel_for(m) is not None)
    attr = TOKEN_SHIFT_OWNERS.get(type(mixer).__name__)
    if attr:  # what the CP install does to RWKV: its one-token shift runs under the method too
        shift = TokenShift(getattr(mixer, attr), mixer.config.hidden_size)
        shift.forward = types.MethodType(linear_mixer_forward, shift)
        setattr(mixer, attr, shift)
    return mixer


def _token_shift(mixer: torch.nn.Module) -> torch.nn.Module | None:
    """The :class:`TokenShift` inside ``mixer`` (RWKV), else ``None``."""
    from automodel.distributed.cp.layers.rwkv import TokenShift

    return next((m for m in mixer.modules() if isinstance(m, TokenShift)), None)


def _method_context(method: str, seq: int, group: Any, world: int, rank: int) -> tuple[Any, slice | torch.Tensor]:
    """The context object of ``method`` for one document of ``seq`` tokens and this rank's token ids."""
    from automodel.distributed.cp.gathered_attention import THDPlan
    from automodel.distributed.cp.layout import head_tail_indices, ring_layout

    if method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import UlyssesContext

        ctx = UlyssesContext(group, world, rank, "sdpa", torch.arange(seq)[None])
        return ctx, torch.arange(ctx.shard_offset, ctx.shard_offset + ctx.shard_sizes[rank])
    if method == "ring":
        layout = ring_layout(seq, group, world, rank)
        return layout, layout.rank_ids[rank]
    if method == "thd":
        plan = THDPlan(group, world, rank, [0, seq], [0, seq], seq)
        return plan, head_tail_indices(torch.tensor([0, seq]), world, rank)
    if method == "thd_docs":
        from automodel.distributed.cp.thd_docs.attention import DocPlan
        from automodel.distributed.cp.thd_docs.placement import plan_documents

        plan = DocPlan(group, world, rank, plan_documents([seq], world), seq)
        ids = torch.cat([torch.arange(p.start, p.end) for p in plan.placement.ranks[rank]])
        return plan, ids
    from automodel.distributed.cp.usp.attention import UspContext
    from automodel.distributed.cp.usp.groups import usp_process_groups

    groups = usp_process_groups(group, world, rank, 2)
    plan = THDPlan(groups.ring_group, groups.ring_size, groups.ring_rank, [0, seq], [0, seq], seq)
    share = head_tail_indices(torch.tensor([0, seq]), groups.ring_size, groups.ring_rank)
    per = len(share) // groups.ulysses_size
    return UspContext(groups, plan), share[groups.ulysses_rank * per : (groups.ulysses_rank + 1) * per]


def _mixer_worker(rank: int, world: int, seq_lens: list[int], families: list[str], steps: int) -> dict:
    import torch.distributed as dist

    import automodel.distributed.cp.layers.state_chain as chain_module
    from automodel.distributed.cp import active
    from automodel.distributed.cp.layers import linear_mixer
    from automodel.distributed.cp.layers.mixer_kernel import HeadShard, kernel_for

    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for family in families:
        mixer = _mixer_module(family)
        kernel = kernel_for(mixer)
        for seq in seq_lens:
            hidden = torch.randn(1, seq, mixer.hidden_size if hasattr(mixer, "hidden_size") else 256,
                                 generator=torch.Generator().manual_seed(1))
            for method in MIXER_METHODS:
                if method == "usp" and world % 2:
                    continue
                ctx, ids = _method_context(method, seq, group, world, rank)
                local = hidden[:, ids].contiguous()
                state_sent = [0]
                original = chain_module.send_state

                def counting(g, tensors, peer, _orig=original, _box=state_sent):
                    _box[0] += 8 * sum(t.numel() for t in tensors)
                    return _orig(g, tensors, peer)

                def step(local=local, mixer=mixer, method=method, ctx=ctx, kernel=kernel) -> None:
                    x = local.detach().requires_grad_()
                    mixer.zero_grad(set_to_none=True)
                    with active.activate(method, ctx, require_attention=False):
                        y = linear_mixer._METHODS[method](kernel, mixer, x, ctx)
                        y = y[0] if isinstance(y, tuple) else y  # (output, None): lightning, RG-LRU
                        y.backward(torch.ones_like(y))

                chain_module.send_state = counting
                try:
                    with count_sent_bytes(rank, world) as sent:
                        step()
                    counted_state = state_sent[0]
                    times = []
                    for _ in range(steps):
                        dist.barrier()
                        t0 = time.perf_counter()
                        step()
                        slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                        times.append(slowest.item())
                finally:
                    chain_module.send_state = original
                totals = torch.tensor([sent[0] + counted_state, counted_state], dtype=torch.float64)
                dist.all_reduce(totals, op=dist.ReduceOp.MAX)
                expected = 0
                parts = [(kernel, mixer)]
                if _token_shift(mixer) is not None:
                    parts.append((kernel_for(_token_shift(mixer)), _token_shift(mixer)))
                if method in ("ring", "thd", "thd_docs"):
                    expected = max(sum(chain_module.chain_bytes_per_rank(k, m, world, r) for k, m in parts)
                                   for r in range(world))
                elif method == "usp":
                    shard = HeadShard(0, 2)
                    expected = max(sum(chain_module.chain_bytes_per_rank(k, m, world // 2, r, shard=shard)
                                       for k, m in parts) for r in range(world // 2))
                out[f"{seq}/{family}/{method}"] = {
                    "bytes": int(totals[0].item()), "state": int(totals[1].item()), "expected_state": expected,
                    "seconds": statistics.median(times) if times else float("nan"),
                }
    return out


def _print_mixers(results: dict, seq_lens: list[int], families: list[str], world: int) -> None:
    print(f"\none state-mixer layer fwd+bwd, cp={world} gloo, one document of S tokens, fp32; bytes: sent per rank "
          "per step (max over ranks); state: the chain's hand-off (fp64), part of the total")
    print(f"{'S':>6} {'mixer/method':<26} {'MiB sent':>9} {'state KiB':>10} {'step (s)':>9}")
    for family in families:
        for seq in seq_lens:
            for method in MIXER_METHODS:
                r = results.get(f"{seq}/{family}/{method}")
                if r is None:
                    continue
                print(f"{seq:>6} {family + '/' + method:<26} {r['bytes'] / 2**20:>9.3f} {r['state'] / 2**10:>10.1f} "
                      f"{r['seconds']:>9.3f}")
        for method in MIXER_METHODS:
            states = {results[k]["state"] for k in results if k.endswith(f"/{family}/{method}")}
            expected = {results[k]["expected_state"] for k in results if k.endswith(f"/{family}/{method}")}
            if len(states) > 1 or states != expected:
                raise SystemExit(f"{family}/{method}: the state hand-off sent {sorted(states)} bytes at S = {seq_lens}, "
                                 f"expected {sorted(expected)} at every S")
    print("the state hand-off's bytes are the same at every S and equal chain_bytes_per_rank (checked)")


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
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--mixers", nargs="*", default=list(MIXERS), choices=list(MIXERS))
    parser.add_argument("--mixer-world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    if args.mixers:
        mixed = run_on_ranks(
            "scripts.bench_layer_kinds:_mixer_worker", world_size=args.mixer_world, timeout=args.timeout,
            seq_lens=args.seq_lens, families=args.mixers, steps=args.steps,
        )[0]
        _print_mixers(mixed, args.seq_lens, args.mixers, args.mixer_world)
    if not args.kinds:
        return
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
