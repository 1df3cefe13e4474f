#!/usr/bin/env python
"""Benchmark ring CP vs Ulysses CP at cp=2 on CPU (gloo, one thread per rank), on the same shapes.

Measured per method, in ONE launched group of 2 ranks:

- **attention layer**: forward+backward of one Llama attention module (q/k/v/o projections, RoPE,
  the CP attention) on this rank's ``S/2`` tokens, loss = sum of the output;
- **model**: forward+backward of a tiny Llama through the public entry points
  (``cp_utils.make_cp_batch_and_ctx`` for ring, ``ulysses.make_ulysses_batch_and_ctx`` for Ulysses),
  loss = token cross-entropy sum / global label count;
- **time**: median over ``--steps`` timed steps after one warm-up, the slower rank;
- **MiB sent per rank per step**: from the gloo collectives recorded by ``torch.profiler`` during
  one step (all payloads are fp32): an all-to-all of N elements sends ``N*(W-1)/W``, an all-gather
  of n elements ``n*(W-1)``, an all-reduce of N elements ``2*N*(W-1)/W`` (ring algorithm), a
  send ``N``. Parameter-gradient all-reduces are not part of the step (identical for both methods).

A sanity column gives ``|loss_ring - loss_ulysses| / loss`` (both must be exact CP).

    python scripts/bench_sp.py                        # S = 4096
    python scripts/bench_sp.py --seq-len 1024 --steps 2
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

WORLD = 2


def _sent_bytes(prof, world: int) -> float:
    """Bytes this rank sent, from the gloo events of a torch.profiler run (fp32 payloads)."""
    total = 0.0
    for ev in prof.events():
        if not ev.name.startswith("gloo:") or not ev.input_shapes or not ev.input_shapes[0]:
            continue
        n = 1
        for d in ev.input_shapes[0]:
            n *= d
        kind = ev.name.split(":", 1)[1]
        if kind == "all_to_all":
            total += n * (world - 1) / world * 4
        elif kind == "all_gather":
            total += n * (world - 1) * 4
        elif kind == "all_reduce":
            total += 2 * n * (world - 1) / world * 4
        elif kind in ("send", "reduce_scatter"):
            total += n * 4
    return total


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("cp",))
    seq = args.seq_len
    config = LlamaConfig(
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab_size,
        max_position_embeddings=seq,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    ring_model = AutoModelForCausalLM.from_config(config)
    ulysses_model = copy.deepcopy(ring_model)
    set_ulysses_attention(ulysses_model, mesh)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (args.batch, seq), generator=g)
    count = int((labels != -100).sum())
    local_h = torch.randn(args.batch, seq // WORLD, args.hidden_size, generator=g)

    def timed(step) -> tuple[float, float, float]:
        step()  # warm-up
        times, value = [], 0.0
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            value = step()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
        t = torch.tensor(statistics.median(times))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item(), _sent_bytes(prof, WORLD), value

    # ---- Ulysses
    def ulysses_model_step() -> float:
        ctx, batch = make_ulysses_batch_and_ctx(mesh, {"input_ids": input_ids, "labels": labels})
        with ctx():
            logits = ulysses_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum") / count
            loss.backward()
        ulysses_model.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        return total.item()

    u_attn = ulysses_model.model.layers[0].self_attn
    u_rope = ulysses_model.model.rotary_emb

    def ulysses_attention_step() -> float:
        ctx, batch = make_ulysses_batch_and_ctx(mesh, {"input_ids": input_ids})
        h = local_h.clone().requires_grad_(True)
        with ctx():
            cos_sin = u_rope(h, batch["position_ids"])
            out, _ = u_attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=None)
            out.sum().backward()
        u_attn.zero_grad(set_to_none=True)
        return 0.0

    results = {
        "ulysses_layer": timed(ulysses_attention_step),
        "ulysses_model": timed(ulysses_model_step),
    }

    # ---- ring
    # RING HALF: torch's context_parallel ring attention, on CPU through automodel.distributed.cp.ring.cpu_ring,
    # driven by the lead's public API automodel.distributed.cp_utils.make_cp_batch_and_ctx.
    try:
        from automodel.distributed.cp_utils import create_context_parallel_ctx, make_cp_batch_and_ctx
    except ImportError as e:  # pragma: no cover - only before cp_utils existed
        results["ring_error"] = f"ring CP unavailable: {e}"
    else:

        def ring_model_step() -> float:
            ctx, batch = make_cp_batch_and_ctx(mesh, {"input_ids": input_ids, "labels": labels})
            with ctx():
                logits = ring_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss = (
                    F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum") / count
                )
                loss.backward()
            ring_model.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            return total.item()

        r_attn = ring_model.model.layers[0].self_attn
        r_rope = ring_model.model.rotary_emb

        def ring_attention_step() -> float:
            pos = torch.arange(seq).unsqueeze(0).expand(args.batch, seq).contiguous()
            ctx = create_context_parallel_ctx(mesh, [pos], [1], {pos})
            h = local_h.clone().requires_grad_(True)
            with ctx:  # pos is sharded in place to this rank's head-tail positions
                cos_sin = r_rope(h, pos)
                out, _ = r_attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=None)
                out.sum().backward()
            r_attn.zero_grad(set_to_none=True)
            return 0.0

        results["ring_layer"] = timed(ring_attention_step)
        results["ring_model"] = timed(ring_model_step)

    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.seq_len % (2 * WORLD):
        parser.error(f"--seq-len must be divisible by {2 * WORLD} (ring CP's load balancing)")

    res = run_on_ranks("scripts.bench_sp:_worker", WORLD, args.timeout, args=args)

    print(
        f"cp=2 on CPU (gloo, 1 thread/rank), torch {torch.__version__}; tiny Llama hidden={args.hidden_size} "
        f"layers={args.layers} heads={args.heads} kv_heads={args.kv_heads} vocab={args.vocab_size}; "
        f"B={args.batch} S={args.seq_len}; fp32"
    )
    print("| what | method | fwd+bwd s | MiB sent/rank/step |")
    print("|---|---|---|---|")
    for what in ("layer", "model"):
        for method in ("ring", "ulysses"):
            key = f"{method}_{what}"
            if key not in res[0]:
                print(f"| {what} | {method} | n/a | n/a |")
                continue
            t, _, _ = res[0][key]
            sent = max(r[key][1] for r in res) / 2**20
            print(
                f"| {'attention layer' if what == 'layer' else 'model'} | {method} | {t:.3f} | {sent:.2f} |"
            )
    if "ring_model" in res[0]:
        lr, lu = res[0]["ring_model"][2], res[0]["ulysses_model"][2]
        print(f"loss ring {lr:.6f}, ulysses {lu:.6f}, rel diff {abs(lr - lu) / abs(lr):.1e}")
    else:
        print(res[0].get("ring_error", "ring CP not run"))


if __name__ == "__main__":
    main()
