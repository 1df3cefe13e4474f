#!/usr/bin/env python
"""Ring vs Ulysses vs hybrid Ulysses x ring (USP 2x2) at cp=4 on CPU: step time and bytes per rank, intra vs inter node.

One launched group of 4 gloo ranks (one thread each) treated as 2 "nodes" x 2 ranks (node = rank // 2, as
torchrun places them). On the same rows (``B x S`` random tokens, one document per row) and the same
weights, per method, a tiny Llama's forward + backward (token cross-entropy sum / label count):

- ``ring``: torch's ring attention (``cp_utils.make_cp_batch_and_ctx``; K/V rotate around all 4 ranks);
- ``thd``: K/V all-gathered over all 4 ranks (``thd_attention.make_thd_batch_and_ctx``);
- ``ulysses``: all-to-all over all 4 ranks (``ulysses.make_ulysses_batch_and_ctx``; needs heads % 4 == 0);
- ``usp 2x2``: all-to-all inside each node, K/V all-gathered across the nodes
  (``usp_attention.make_usp_batch_and_ctx``, ``ulysses_size=2``).

Bytes: every collective the step issues is intercepted (``dist.all_to_all_single``, the all-gather /
reduce-scatter of the thd kernel, ...) and what this rank sends to each peer is added to the peer's bucket:
**intra-node** (same node) or **inter-node**. An all-to-all sends each peer its split, an all-gather the
whole input to every peer, a reduce-scatter ``1/W`` of the input to every peer. The loss all-reduce and the
parameter-gradient all-reduce are left out (the same for every method). Figures are per rank per step,
the mean over the 4 ranks (ring: the ranks whose next neighbour is on the other node send all their K/V
inter-node, the others none). Time: median of ``--steps`` after one warm-up, the slowest rank.

    python scripts/bench_usp.py                    # S = 2048
    python scripts/bench_usp.py --seq-len 4096 --steps 3
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

WORLD = 4
PER_NODE = 2
MODELS = ((8, 4), (6, 2))  # (query heads, kv heads): 6 query heads do not split over cp=4 (Ulysses)


class ByteCounter:
    """Bytes this rank sends per peer kind while :attr:`on`; installed by wrapping the collectives."""

    def __init__(self, rank: int) -> None:
        self.rank, self.on = rank, False
        self.intra = self.inter = 0.0

    def _add(self, group, per_peer: list[float]) -> None:
        import torch.distributed as dist

        if not self.on:
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        for peer, n in zip(ranks, per_peer, strict=True):
            if peer == self.rank:
                continue
            if peer // PER_NODE == self.rank // PER_NODE:
                self.intra += n
            else:
                self.inter += n

    def install(self) -> None:
        import torch.distributed as dist

        import automodel.distributed.cp.exchange.gather as thd

        a2a, gather, scatter = dist.all_to_all_single, thd._all_gather, thd._reduce_scatter

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            w = dist.get_world_size(group)
            if input_split_sizes:
                row = input.nbytes / max(1, input.shape[0])
                self._add(group, [s * row for s in input_split_sizes])
            else:
                self._add(group, [input.nbytes / w] * w)
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def all_gather(out, inp, group=None, **kw):
            self._add(group, [float(inp.nbytes)] * dist.get_world_size(group))
            return gather(out, inp, group=group, **kw)

        def reduce_scatter(out, inp, group=None, **kw):
            w = dist.get_world_size(group)
            self._add(group, [inp.nbytes / w] * w)
            return scatter(out, inp, group=group, **kw)

        dist.all_to_all_single = all_to_all_single
        thd._all_gather, thd._reduce_scatter = all_gather, reduce_scatter


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention
    from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention
    from automodel.distributed.cp_utils import make_cp_batch_and_ctx

    counter = ByteCounter(rank)
    counter.install()
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    seq, results = args.seq_len, {}
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, args.vocab_size, (args.batch, seq), generator=g)
    labels = torch.randint(0, args.vocab_size, (args.batch, seq), generator=g)
    count = int((labels != -100).sum())

    for heads, kv in MODELS:
        config = LlamaConfig(
            hidden_size=heads * args.head_dim,
            intermediate_size=4 * heads * args.head_dim,
            num_hidden_layers=args.layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=args.head_dim,
            vocab_size=args.vocab_size,
            max_position_embeddings=seq,
            attn_implementation="sdpa",
            use_cache=False,
        )
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config)
        methods = {
            "ring": (None, make_cp_batch_and_ctx, {}),
            "thd": (set_thd_attention, make_thd_batch_and_ctx, {}),
            "ulysses": (set_ulysses_attention, make_ulysses_batch_and_ctx, {}),
            "usp 2x2": (set_usp_attention, make_usp_batch_and_ctx, {"ulysses_size": 2}),
        }
        for name, (switch, batch_fn, options) in methods.items():
            key = f"{heads}q/{kv}kv {name}"
            model = copy.deepcopy(base)
            try:
                if switch is not None:
                    switch(model, mesh)
            except ValueError as err:  # Ulysses: heads not divisible by cp
                results[key] = {"refused": str(err).split(";")[0]}
                continue

            def step(model=model, batch_fn=batch_fn, options=options) -> float:
                ctx, batch = batch_fn(mesh, {"input_ids": input_ids, "labels": labels}, **options)
                with ctx():
                    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum") / count
                    loss.backward()
                model.zero_grad(set_to_none=True)
                counter.on = False
                total = loss.detach().clone()
                dist.all_reduce(total)
                return total.item()

            step()  # warm-up (and the sub-groups built)
            times, loss = [], 0.0
            for _ in range(args.steps):
                dist.barrier()
                counter.intra = counter.inter = 0.0
                counter.on = True
                start = time.perf_counter()
                loss = step()
                times.append(time.perf_counter() - start)
            t = torch.tensor(statistics.median(times))
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results[key] = {"s": t.item(), "intra": counter.intra, "inter": counter.inter, "loss": loss}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.seq_len % (2 * WORLD):
        parser.error(f"--seq-len must be divisible by {2 * WORLD}")

    res = run_on_ranks("scripts.bench_usp:_worker", WORLD, args.timeout, args=args)
    print(
        f"cp=4 on CPU (gloo, 1 thread/rank, 2 'nodes' x 2 ranks), torch {torch.__version__}; tiny Llama "
        f"head_dim={args.head_dim} layers={args.layers} vocab={args.vocab_size}; B={args.batch} S={args.seq_len}; fp32"
    )
    print("| model | method | fwd+bwd s | intra-node MiB/rank/step | inter-node MiB/rank/step | loss |")
    print("|---|---|---|---|---|---|")
    for key in res[0]:
        model, method = key.split(" ", 1)
        r0 = res[0][key]
        if "refused" in r0:
            print(f"| {model} | {method} | refused: {r0['refused']} | | | |")
            continue
        intra = statistics.mean(r[key]["intra"] for r in res) / 2**20
        inter = statistics.mean(r[key]["inter"] for r in res) / 2**20
        print(f"| {model} | {method} | {r0['s']:.3f} | {intra:.2f} | {inter:.2f} | {r0['loss']:.6f} |")


if __name__ == "__main__":
    main()
