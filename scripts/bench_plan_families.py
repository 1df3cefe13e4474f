#!/usr/bin/env python
"""The memory plan against the measured step peak for every family of the support matrix, at cp=1 (not part of CI).

For each family of ``tests/family_matrix.py`` (its tiny config, the positions raised to the row where the config has a
table) one process trains two steps of one row (``--seq`` tokens, ``loss.chunk_tokens=256``, AdamW with lr 0) in
``--dtype`` (weights, activations and AdamW's state) with each technique set: none, activation checkpointing, the tiled
MLP with checkpointing, the tiled MLP alone. The second step's peak is the tracked allocations' (the bytes of the
storages ops create, as a device allocator would: :class:`scripts.live_tensors.AllocationTracker`), set beside the
planner's step peak for the model it ran (:func:`automodel.training.memory_plan.plan_memory`, less FSDP2's buffers:
one process holds the whole model). Each row prints both and the plan's error; rows the plan under-counts by more than
``--tolerance`` are marked ``UNDER`` and make the script exit 1, rows it over-counts by more than ``--over`` ``over``.

What a CPU measures is the CPU kernels' memory. Where a family's attention takes a path on CPU that a GPU does not
(SDPA's math kernel for q/k and v of different head sizes: MLA; the reference PyTorch kernels of linear attention and
Mamba, which the CUDA kernels replace) the measured peak holds tensors a GPU run does not make; docs/benchmarks.md says
which rows that explains.

    python scripts/bench_plan_families.py                         # every family, fp32, 2048 tokens
    python scripts/bench_plan_families.py --dtype bfloat16 --families gemma2,llama
    python scripts/bench_plan_families.py --families gemma2,cohere --chunk-transformed   # their soft-cap / scale chunked
    python scripts/bench_plan_families.py --moe-block             # one grouped_mm MoE block's peaks against the plan's

``--moe-block`` measures one Qwen3-MoE block (transformers' ``grouped_mm`` experts, 4096 tokens, fp32) at several
``(h, I_e, k)``: its forward and backward peaks beyond its input, output and their gradients, beside
``memory_plan.MOE_GROUPED_FORWARD`` / ``MOE_GROUPED_BACKWARD`` (the constants were fitted to these rows).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from automodel.distributed.launch import run_on_ranks  # noqa: E402
from scripts.bench_memory import _planned_without_fsdp, _replicated_step  # noqa: E402
from scripts.live_tensors import AllocationTracker  # noqa: E402

#: (activation checkpointing, tiled MLP) of each row
SETTINGS = ((False, False), (True, False), (True, True), (False, True))
#: a config's position-table keys, raised to the row where shorter
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx")


def sized_config(fam, sizes: dict[str, int] | None, seq: int):  # noqa: ANN001, ANN201 - a Family, its config
    """``fam``'s tiny config with ``sizes`` set where the config has them (integer attributes it can set) and its
    position tables (:data:`POSITION_KEYS`) raised to ``seq`` tokens where shorter."""
    config = fam.build_config()
    for key, value in (sizes or {}).items():
        # a size the config derives (Falcon's head_dim: a property without a setter) follows the others
        settable = not isinstance(getattr(type(config), key, None), property) or getattr(type(config), key).fset
        if isinstance(getattr(config, key, None), int) and settable:
            setattr(config, key, value)
    for key in POSITION_KEYS:
        if isinstance(getattr(config, key, None), int) and getattr(config, key) < seq:
            setattr(config, key, seq)
    return config


def family_worker(rank: int, world: int, names: list[str], seq: int, chunk: int, dtype: str,
                  settings: tuple[tuple[bool, bool], ...] = SETTINGS, sizes: dict[str, int] | None = None,
                  chunk_transformed: bool = False) -> list[dict]:  # fmt: skip
    """One process: each family of ``names`` with each of ``settings`` (:data:`SETTINGS`: activation checkpointing,
    tiled MLP): the tracked peak of the second step and the plan's step peak, MiB (or the error that stopped the
    row). ``sizes``: config attributes set on each family's tiny config where it has them (``hidden_size=256``: the
    widths of a real model's proportions, where the tiny configs' hidden 64 lets fixed terms weigh more).
    ``chunk_transformed``: a model whose logits are a transform of its head's output that the chunked loss computes
    (a soft-cap, a scale: :mod:`automodel.training.logit_transform`) runs the chunked loss too, once the run's probe
    (``check_model_for_chunked_loss``) confirms it; by default it runs the plain loss, as the audits before 2026-12-07
    did (the chunked loss refused it then)."""
    from transformers import AutoModelForCausalLM

    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.logit_transform import chunkable_transform
    from automodel.training.memory_plan import RunShape, model_dims, plan_memory
    from automodel.training.step import check_model_for_chunked_loss, logit_transform_of
    from tests.family_matrix import family_by_name

    torch.set_num_threads(1)
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    out = []
    for name in names:
        fam = family_by_name(name)
        for ac, tiled in settings:
            row = {"family": name, "ac": ac, "tiled": tiled}
            if ac and not fam.train_mode:  # PhiMoE: checkpointing recomputes in training only (these rows read -30%)
                row["error"] = "runs in eval mode (its training draws random numbers): no checkpointing to measure"
                out.append(row)
                continue
            try:
                config = sized_config(fam, sizes, seq)
                config.use_cache = False  # as the recipe's loader sets it: training builds no KV cache
                ids = torch.randint(0, min(config.vocab_size, 1000), (1, seq), generator=torch.Generator().manual_seed(1))
                inputs = {"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0)}
                labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
                torch.manual_seed(0)
                attn = fam.attn_implementation()
                model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=getattr(torch, dtype))
                model.train(fam.train_mode)
                if tiled:
                    apply_tiled_mlp(model, True)
                if ac:
                    apply_activation_checkpointing(model)
                opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)
                # a model whose logits are transformed after the head (Gemma 2's soft-cap) runs the plain loss, as the
                # audits before the chunked loss computed the transform; with chunk_transformed the chunked loss
                # where it computes the transform (the probe confirms it)
                loss_chunk = None if logit_transform_of(model) else chunk
                if chunk_transformed and loss_chunk is None and not chunkable_transform(model)[1]:
                    check_model_for_chunked_loss(model)
                    loss_chunk = chunk

                def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt, inputs: dict = inputs,
                         labels: torch.Tensor = labels, loss_chunk: int | None = loss_chunk) -> torch.Tensor:  # fmt: skip
                    return _replicated_step(model, opt, contextlib.nullcontext, inputs, labels, loss_chunk, seq)

                step()  # warm-up (untracked): AdamW's state
                gc.collect()
                tracker = AllocationTracker()
                with tracker:
                    step()
                shape = RunShape(local_batch=1, seq=seq, cp=1, chunk_tokens=loss_chunk, activation_checkpointing=ac,
                                 attn=attn, master_bytes=size, compute_bytes=size, reduce_bytes=size, tiled_mlp=tiled)  # fmt: skip
                plan = plan_memory(model_dims(model), shape)
                row.update(peak=tracker.peak / 2**20, planned=_planned_without_fsdp(plan) / 2**20, phase=plan.peak_phase)
                del model, opt
                gc.collect()
            except Exception as e:  # noqa: BLE001 - a family the harness cannot run: printed, not counted
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            out.append(row)
    return out


def dtype_rows(rank: int, world: int, jobs: dict[str, list[str]], seq: int, chunk: int,
               settings: tuple[tuple[bool, bool], ...] = SETTINGS) -> dict[str, list[dict]]:  # fmt: skip
    """:func:`family_worker` for each ``{dtype: names}`` of ``jobs`` in one process (one launch for several dtypes)."""
    return {dtype: family_worker(rank, world, names, seq, chunk, dtype, settings) for dtype, names in jobs.items()}


def moe_block_rows(tokens: int = 4096) -> None:
    """One Qwen3-MoE block per ``(h, I_e, k)``: its tracked forward and backward peaks (less its input, its output,
    their gradients and the weight gradients) against the plan's ``k (a h + b I_e)``."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from automodel.training.memory_plan import MOE_GROUPED_BACKWARD, MOE_GROUPED_FORWARD

    torch.set_num_threads(1)
    print(f"One grouped_mm MoE block (Qwen3-MoE, {tokens} tokens, fp32, 8 experts), MiB beyond its input, output and "
          "gradients\n")  # fmt: skip
    print("| h | I_e | k | forward measured | planned | backward measured | planned |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for h, ie, k in ((64, 32, 2), (64, 256, 2), (256, 32, 2), (256, 32, 4)):
        config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=ie, num_experts=8, num_experts_per_tok=k)
        config._experts_implementation = "grouped_mm"
        block = Qwen3MoeSparseMoeBlock(config)
        x = torch.randn(1, tokens, h, requires_grad=True)
        for tracked in (False, True):  # a warm-up, then the tracked pass
            x.grad = None
            for p in block.parameters():
                p.grad = None
            gc.collect()
            tracker = AllocationTracker()
            with tracker if tracked else contextlib.nullcontext():
                out = block(x)
                out = out[0] if isinstance(out, tuple) else out
                forward = tracker.peak
                tracker.peak = tracker.current
                out.backward(torch.ones_like(out))
        unit = tokens * 4 / 2**20  # one [N, 1] fp32 column, MiB
        edges = 3 * h * unit + sum(p.numel() for p in block.parameters()) * 4 / 2**20  # out, its gradient, x.grad, dW
        fwd, bwd = forward / 2**20 - h * unit, tracker.peak / 2**20 - edges
        plan_f = k * (MOE_GROUPED_FORWARD[0] * h + MOE_GROUPED_FORWARD[1] * ie) * unit
        plan_b = k * (MOE_GROUPED_BACKWARD[0] * h + MOE_GROUPED_BACKWARD[1] * ie) * unit
        print(f"| {h} | {ie} | {k} | {fwd:.1f} | {plan_f:.1f} | {bwd:.1f} | {plan_b:.1f} |", flush=True)


def main() -> int:
    from tests.family_matrix import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--families", default="", help="comma-separated names (default: every family)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--tolerance", type=float, default=0.05, help="an under-count past this fails the row")
    parser.add_argument("--over", type=float, default=0.15, help="an over-count past this is marked")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for each process of ten families; a "
                        "process past it (or one that dies) prints its families as not run and the run goes on")
    parser.add_argument("--sizes", default="", help="config sizes to set where a family has them, e.g. "
                        "hidden_size=256,intermediate_size=768,num_attention_heads=8,num_key_value_heads=4,head_dim=32")
    parser.add_argument("--chunk-transformed", action="store_true", help="the chunked loss for models whose logit "
                        "transform (a soft-cap, a scale) it computes; default: the plain loss for them")
    parser.add_argument("--moe-block", action="store_true", help="only the MoE block rows (see the module docstring)")
    args = parser.parse_args()
    if args.moe_block:
        moe_block_rows()
        return 0
    names = args.families.split(",") if args.families else [f.name for f in FAMILIES]
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in args.sizes.split(",") if kv)}
    print(f"Plan against the tracked step peak at cp=1 ({args.dtype}, {args.seq} tokens, loss.chunk_tokens=256, "
          f"AdamW; ac: activation checkpointing, tiled: model.tiled_mlp{'; ' + args.sizes if sizes else ''})\n")  # fmt: skip
    print("| family | ac | tiled | measured MiB | planned MiB | error | plan's peak phase | |")
    print("|---|---|---|---:|---:|---:|---|---|")
    under = errors = 0
    for i in range(0, len(names), 10):  # ten families a process: a crash loses few rows
        batch = names[i : i + 10]
        try:
            rows = run_on_ranks("scripts.bench_plan_families:family_worker", 1, args.timeout, names=batch,
                                seq=args.seq, chunk=256, dtype=args.dtype, sizes=sizes,
                                chunk_transformed=args.chunk_transformed)[0]  # fmt: skip
        except RuntimeError as e:  # a timed-out or dead process: its families are not run, the others are
            why = str(e).splitlines()[1] if len(str(e).splitlines()) > 1 else str(e)
            rows = [{"family": n, "ac": ac, "tiled": tiled, "error": f"their process failed ({why[:120]})"}
                    for n in batch for ac, tiled in SETTINGS]  # fmt: skip
        for r in rows:
            head = f"| {r['family']} | {'on' if r['ac'] else 'off'} | {'on' if r['tiled'] else 'off'} |"
            if "error" in r:
                errors += 1
                print(f"{head} | | | | not run: {r['error']} |", flush=True)
                continue
            err = (r["planned"] - r["peak"]) / r["peak"]
            mark = "UNDER" if err < -args.tolerance else "over" if err > args.over else ""
            under += mark == "UNDER"
            print(f"{head} {r['peak']:.1f} | {r['planned']:.1f} | {err:+.1%} | {r['phase']} | {mark} |", flush=True)
    print(f"\n{len(names)} families: {under} rows planned more than {args.tolerance:.0%} under the measured peak, "
          f"{errors} rows not run")  # fmt: skip
    return 1 if under else 0


if __name__ == "__main__":
    sys.exit(main())
