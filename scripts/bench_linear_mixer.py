#!/usr/bin/env python
"""Benchmark a Gated DeltaNet (linear-attention) layer against a full-attention layer under CP, cp=2, CPU.

One launched gloo group of 2 ranks (one thread each). Layers: Qwen3-Next's ``Qwen3NextGatedDeltaNet`` and
``Qwen3NextAttention`` (gated q, partial rotary) of one config, fp32. Per layer kind, CP method and row
length S, one step = forward + backward of the layer on this rank's S/2 tokens (loss = sum of the
output), inside the method's context:

- ``thd``: linear layer: the conv halo and recurrent state chained across the ranks
  (:mod:`automodel.distributed.cp.layers.linear_mixer`); full attention: K/V all-gathered per layer, dK/dV
  reduce-scattered (the portable THD kernel);
- ``ulysses``: linear layer: q/k/v/b/a all-to-all to a head shard, output back; full attention: q/k/v
  all-to-all, output back.

Reported per cell: **bytes sent per rank per step** (counted at the torch.distributed calls: a send of N
bytes is N, an all-to-all of N bytes sends N*(W-1)/W, an all-gather of an n-byte shard n*(W-1), a
reduce-scatter of N bytes N*(W-1)/W), and the **step time** (median of ``--steps`` after one warm-up, the
slower rank). The chain's bytes do not depend on S: one state ``Hv*dk*dv`` and one conv halo ``C*(K-1)``
per document per hop, sent as fp64.

    python scripts/bench_linear_mixer.py                      # S = 4096, 16384
    python scripts/bench_linear_mixer.py --seq-lens 1024 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402

WORLD = 2
CONFIG = dict(
    vocab_size=128, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
    num_experts=0, tie_word_embeddings=False,
)


class _Counter:
    """Bytes this rank sends through torch.distributed while installed (patches the functions it wraps)."""

    def __init__(self, world: int) -> None:
        import torch.distributed as dist

        from automodel.distributed.cp.exchange import gather as thd_attention

        self.sent, self.world, self._undo = 0.0, world, []
        w = world

        def nbytes(t):
            return t.numel() * t.element_size()

        def wrap(owner, name, count):
            original = getattr(owner, name)

            def wrapped(*args, **kwargs):
                self.sent += count(*args, **kwargs)
                return original(*args, **kwargs)

            setattr(owner, name, wrapped)
            self._undo.append((owner, name, original))

        wrap(dist, "send", lambda t, *a, **k: nbytes(t))
        wrap(dist, "all_to_all_single", lambda out, inp, *a, **k: nbytes(inp) * (w - 1) / w)
        wrap(thd_attention, "_all_gather", lambda out, inp, *a, **k: nbytes(inp) * (w - 1))
        wrap(thd_attention, "_reduce_scatter", lambda out, inp, *a, **k: nbytes(inp) * (w - 1) / w)

    def close(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _layers():
    from transformers import AutoConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    config = AutoConfig.for_model("qwen3_next", **CONFIG)
    torch.manual_seed(0)
    return config, m.Qwen3NextGatedDeltaNet(config, 0), m.Qwen3NextAttention(config, 1), m.Qwen3NextRotaryEmbedding(config)


def _context(method: str, seq: int, group, world: int, rank: int):
    if method == "thd":
        from automodel.distributed.cp.gathered_attention import THDPlan
        from automodel.distributed.cp.thd.attention import register_thd_attention, thd_context

        register_thd_attention()
        plan = THDPlan(group=group, world_size=world, rank=rank, cu_seqlens_padded=[0, seq], cu_seqlens=[0, seq],
                       max_seqlen=seq)
        local_pos = torch.cat([torch.arange(r * seq // (2 * world), (r + 1) * seq // (2 * world))
                               for r in (rank, 2 * world - 1 - rank)])
        return (lambda: thd_context(plan, require_attention=False)), local_pos
    from automodel.distributed.cp.ulysses.attention import (
        UlyssesContext,
        register_ulysses_attention,
        ulysses_context,
    )

    register_ulysses_attention()
    ctx = UlyssesContext(group=group, world_size=world, rank=rank, inner_attn="sdpa",
                         position_ids=torch.arange(seq)[None])
    return (lambda: ulysses_context(ctx, require_attention=False)), ctx.shard(torch.arange(seq)[None], 1)[0]


def _step(kind: str, layer, rotary, hidden, pos):
    if kind == "linear":
        out = layer(hidden)
    else:
        out, _ = layer(hidden, position_embeddings=rotary(hidden, pos[None]), attention_mask=None)
    out.sum().backward()


def worker(rank: int, world_size: int, seq_lens: list[int], steps: int) -> list[dict]:
    import torch.distributed as dist
    import transformers

    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
    from automodel.distributed.cp.profile import LINEAR, LayerSpec
    from automodel.distributed.cp.thd.attention import current_thd_plan
    from automodel.distributed.cp.ulysses.attention import current_ulysses_context

    transformers.logging.set_verbosity_error()
    group = dist.new_group(backend="gloo")
    config, linear, attention, rotary = _layers()
    profile = types.SimpleNamespace(layers=[LayerSpec(index=0, kind=LINEAR, mixer=type(linear).__name__)])
    rows = []
    for method in ("thd", "ulysses"):
        install_linear_mixers(linear, profile, method, current_thd_plan if method == "thd" else current_ulysses_context)
        config._attn_implementation = method
        for seq in seq_lens:
            ctx_factory, pos = _context(method, seq, group, world_size, rank)
            hidden = torch.randn(1, len(pos), config.hidden_size, generator=torch.Generator().manual_seed(rank))
            for kind, layer in (("linear", linear), ("full attention", attention)):
                times = []
                for i in range(steps + 1):
                    counter = _Counter(world_size)
                    dist.barrier(group=group)
                    t0 = time.perf_counter()
                    with ctx_factory():
                        _step(kind, layer, rotary, hidden.clone().requires_grad_(True), pos)
                    elapsed = time.perf_counter() - t0
                    counter.close()
                    layer.zero_grad(set_to_none=True)
                    if i:
                        times.append(elapsed)
                stats = torch.tensor([statistics.median(times), counter.sent], dtype=torch.float64)
                dist.all_reduce(stats[:1], op=dist.ReduceOp.MAX, group=group)
                dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX, group=group)
                rows.append({"method": method, "S": seq, "layer": kind, "seconds": stats[0].item(),
                             "bytes": stats[1].item()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    rows = run_on_ranks("scripts.bench_linear_mixer:worker", world_size=WORLD, timeout=3600,
                        seq_lens=args.seq_lens, steps=args.steps)[0]
    c = CONFIG
    print(f"cp={WORLD}, CPU, fp32; hidden {c['hidden_size']}; linear: {c['linear_num_key_heads']} k / "
          f"{c['linear_num_value_heads']} v heads of {c['linear_key_head_dim']}, conv {c['linear_conv_kernel_dim']}; "
          f"attention: {c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads of {c['head_dim']}")
    print("| method | S | layer | MiB sent per rank per step | step time (s) |")
    print("| --- | ---: | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['method']} | {r['S']} | {r['layer']} | {r['bytes'] / 2**20:.3f} | {r['seconds']:.3f} |")


if __name__ == "__main__":
    main()
