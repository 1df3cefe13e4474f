#!/usr/bin/env python
"""Per-rank training memory of a Llama-shaped model on CPU, measured and planned (issue 14, item 4).

For each setting (vocabulary, cp_size, plain or chunked loss, activation checkpointing off or on)
and each sequence length, fresh gloo processes (one thread per rank) train a few steps of a
Llama-shaped model (small hidden size, realistic vocabulary) with ring CP and AdamW, and report:

- the per-rank **step peak**: the kernel's peak RSS (VmHWM, reset just before the step) minus the
  RSS just before the step, i.e. what one forward + loss + backward + optimizer step needs on top
  of the state that persists between steps (weights, AdamW states, the batch); glibc's mmap
  threshold is fixed (:data:`automodel.training.cpu_memory.MMAP_ENV`) so freed tensors leave the RSS;
- the planner's prediction of the same quantity (:func:`automodel.training.memory_plan.plan_memory`,
  the figure ``recipe.dry_run=true`` prints as "step peak"), less its FSDP2 communication buffers:
  the measured ranks hold a replicated model and all-reduce the gradients (no FSDP2), so they have
  no gathered root and layers (at cp=2 the plan with those buffers is higher by ``2 V h 4`` bytes);
- the step time (the slower rank), so the price of recomputation is visible;
- the longest sequence whose step peak plus persistent state fits ``--budget-gib`` per rank: searched
  with the planner, then verified by one measured run at that length.

Then (``--wide also``, the default; ``--wide only`` for these alone) the memory techniques of issue 35, in one
process, on the same weights and batch (AdamW with lr 0: every row's loss must be equal):

- a **wide MLP** (hidden 128, MLP 16384, 4 layers, 4096 tokens, checkpointing, ``loss.chunk_tokens=256``)
  without and with ``model.tiled_mlp=true`` (step peak by RSS as above; the tiled / untiled ratio, target
  <= 0.6), then tiled with ``model.activation_offload`` and ``fsdp.offload=optimizer``;
- a **deep, narrow** model (hidden 256, MLP 1024, 8 layers), where the checkpointed layer inputs that
  activation offload moves are a large part of the peak: without, with activation offload, with both offloads;
- a **mixture of experts** (Mixtral-like: 4 experts, top-2, 2 layers) without and with checkpointing: the
  routed experts' saved activations and the router (issue 41).

Then (``--tiled-layer also``, the default; ``--tiled-layer only`` for these alone) **the tiled layer** (issue 42,
``model.tiled_layer``): ring, Ulysses and Ulysses in 2 head groups at cp=2 (16 heads / 8 KV heads, checkpointing, tiled
MLP), without and with the tiled layer: the tracked step peak against the plan (torch's ring attention's own
allocations counted: :func:`scripts.live_tensors.tracked_inside`; every row held to ``--tolerance``), the step's CPU
time against the run without it, and the losses (equal).

Then (``--groups also``, the default; ``--groups only`` for these alone) **checkpoint groups**
(``model.checkpoint_group_layers``) on a deep, narrow model (hidden 128, MLP 512, 16 layers, vocabulary 2048, 8192
tokens), one process: groups of 2 and 4 without activation
offload (the kept layer inputs on the device fall from ``L`` to ``ceil(L / k)``, the backward of a group holds its
``k``) and groups of 2 with it (the host holds half the inputs; the device one more in a group's backward): the tracked
step peak and the host bytes against the plan, the losses equal.

Then (``--headwise also``, the default; ``--headwise only`` for these alone) **headwise Ulysses** (issue 42): Ulysses
at cp=2 on a model with 16 heads / 8 KV heads (tiled MLP, so the step peaks in the attention's backward), with
``distributed.ulysses_head_chunks`` 1, 2 and 4: the tracked step
peak against the plan, one attention block's tracked peak against ``1/G`` of the unchunked one plus the
projections, the step's CPU time against the unchunked one, and the losses (equal).

Then (``--head-groups also``, the default; ``--head-groups only`` for these alone) **attention head groups without CP**
(issue 42, ``model.attention_head_chunks``): cp=1 in one process (16 heads / 8 KV heads, checkpointing, tiled MLP),
untiled and with the tiled layer, 1, 2 and 8 head groups: the tracked step peak against the plan (held to
``--tolerance``), the step's CPU time against the ungrouped run, the losses (equal) and that the groups ran.

On a CPU the "device" and the host are one memory, so RSS cannot show what an offload moved: those rows
count the **tracked allocations** (:class:`scripts.live_tensors.AllocationTracker`, the bytes of the storages
ops create, as a device allocator would) with the offload's host buffers and the host optimizer's step left out: the
device-side step peak and persistent state (parameters + optimizer state on the device) as the planner
defines them, and the host bytes. Each row prints the plan, the measurement and the error; the script exits 1
when a row is off by more than ``--tolerance`` (10%), the tiled ratio is above 0.6 or the losses differ.

    nice python scripts/bench_memory.py                              # the tables in docs/benchmarks.md
    nice python scripts/bench_memory.py --vocabs 32000 --seq-lens 1024 2048 --no-search --wide no
    nice python scripts/bench_memory.py --wide only                  # the issue-35 rows alone (~10 min)
    nice python scripts/bench_memory.py --headwise only              # headwise Ulysses at cp=2 (issue 42)
    nice python scripts/bench_memory.py --tiled-layer only           # model.tiled_layer at cp=2 (issue 42)
    nice python scripts/bench_memory.py --head-groups only           # model.attention_head_chunks at cp=1 (issue 42)
    nice python scripts/bench_memory.py --groups only                # model.checkpoint_group_layers (deep model)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import MMAP_ENV, peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402
from scripts.live_tensors import AllocationTracker, tracked_inside  # noqa: E402

MIB = 2**20


def measure_worker(rank: int, world: int, cases: list[dict], model_kw: dict, warmup_seq: int = 256) -> list[dict]:
    """Train one step per case on this rank; return ``[{"peak_mib", "persist_mib", "time"}, ...]``.

    ``cases``: dicts with ``seq`` (global tokens of the one row), ``chunk`` (``loss.chunk_tokens``
    or None) and ``ac`` (activation checkpointing). The model, the optimizer and its states are
    built once (a warm-up step at ``warmup_seq`` tokens allocates the AdamW states and one-time
    buffers); every case is then measured as the peak RSS above the RSS just before its step.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp_utils import make_cp_batch_and_ctx
    from automodel.training.step import forward_loss_sum

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    max_seq = max([c["seq"] for c in cases] + [warmup_seq])
    config = LlamaConfig(
        max_position_embeddings=max_seq, attn_implementation="sdpa", use_cache=False, **model_kw
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(1)

    def step(seq: int, chunk: int | None, ac: bool) -> float:
        if ac != model.is_gradient_checkpointing:
            if ac:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_disable()
        model.train()
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
        labels = torch.randint(0, config.vocab_size, (1, seq), generator=g)
        dist.barrier()
        start = time.perf_counter()
        ctx, batch = make_cp_batch_and_ctx(mesh if world > 1 else None, {"input_ids": ids, "labels": labels})
        lab = batch.pop("labels")
        with ctx():
            inputs = {k: batch[k] for k in ("input_ids", "position_ids") if batch.get(k) is not None}
            (forward_loss_sum(model, inputs, lab, chunk) / seq).backward()
        if world > 1:  # sum the gradients over the CP group (what FSDP's reduce-scatter does)
            for p in model.parameters():
                dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor(time.perf_counter() - start)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    step(warmup_seq, None, False)  # AdamW states, lazy imports, gloo buffers
    step(warmup_seq, 64, True)
    out = []
    for case in cases:
        gc.collect()
        base = rss_mib()
        reset_peak_rss()
        t = step(case["seq"], case.get("chunk"), bool(case.get("ac")))
        out.append({"peak_mib": peak_rss_mib() - base, "time": t})
    return out


SETTINGS = [  # (label, chunk_tokens, activation checkpointing)
    ("plain", None, False),
    ("plain+AC", None, True),
    ("chunked", 256, False),
    ("chunked+AC", 256, True),
]


def _dims(model_kw: dict):  # noqa: ANN202
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.training.memory_plan import model_dims

    with torch.device("meta"):
        return model_dims(AutoModelForCausalLM.from_config(LlamaConfig(use_cache=False, **model_kw)))


def _shape(seq: int, cp: int, chunk: int | None, ac: bool):  # noqa: ANN202
    from automodel.training.memory_plan import RunShape

    return RunShape(local_batch=1, seq=seq, cp=cp, chunk_tokens=chunk, activation_checkpointing=ac)


def _planned_without_fsdp(plan) -> float:  # noqa: ANN001
    """The planned step peak less FSDP2's gathered parameters: the measured ranks hold a replicated model."""
    return plan.step_peak_bytes - plan.phases[plan.peak_phase].get("communication buffers", 0.0)


def longest_planned(dims, cp: int, chunk: int | None, ac: bool, budget: float, cap: int) -> int:  # noqa: ANN001
    """Longest multiple of 256 (<= ``cap``) whose planned persistent state + step peak fits ``budget`` bytes."""
    from automodel.training.memory_plan import plan_memory

    lo, hi = 0, cap // 256
    while lo < hi:  # the plan grows monotonically with the sequence length
        mid = (lo + hi + 1) // 2
        if plan_memory(dims, _shape(mid * 256, cp, chunk, ac)).total_bytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * 256


# --- wide-MLP rows (issue 35): model.tiled_mlp, model.activation_offload, fsdp.offload=optimizer ------------


WIDE_SETTINGS = [  # (label, model.tiled_mlp, model.activation_offload, fsdp.offload, measured by)
    ("AC+chunked", False, False, False, "rss"),
    ("AC+chunked+tiled_mlp", True, False, False, "rss"),
    ("AC+chunked+tiled_mlp", True, False, False, "tracked"),
    ("+activation_offload", True, True, False, "tracked"),
    ("+fsdp.offload=optimizer", True, True, "optimizer", "tracked"),
]
DEEP_SETTINGS = [  # many layers, a narrow MLP: what activation offload moves is a large part of the peak
    ("AC+chunked", False, False, False, "tracked"),
    ("+activation_offload", False, True, False, "tracked"),
    ("+fsdp.offload=optimizer", False, True, "optimizer", "tracked"),
]
#: checkpoint groups (model.checkpoint_group_layers, a 6th element: layers per group) on the deep, narrow model
GROUP_SETTINGS = [
    ("AC+chunked", False, False, False, "tracked", 1),
    ("+checkpoint groups of 2", False, False, False, "tracked", 2),
    ("+checkpoint groups of 4", False, False, False, "tracked", 4),
    ("AC+chunked+activation_offload", False, True, False, "tracked", 1),
    ("+checkpoint groups of 2", False, True, False, "tracked", 2),
]


def wide_worker(rank: int, world: int, model_kw: dict, seq: int, chunk: int, settings: list) -> list[dict]:
    """One measured training step per row of ``settings`` (:data:`WIDE_SETTINGS`) on the same weights (AdamW
    lr 0, the same batch: the losses must be equal); per row ``{"peak_mib", "persist_mib", "host_mib", "loss",
    "time"}``.

    ``rss`` rows: the peak RSS above the RSS before the step (a warm-up step of 256 tokens first).
    ``tracked`` rows: a fresh optimizer, a warm-up forward + backward (the offload store's host pool fills)
    and first optimizer step: ``persist_mib`` = the parameters plus the device bytes that step leaves
    allocated (its state; the host optimizer's are not counted); then the tracked step: ``peak_mib`` = the
    :class:`AllocationTracker` peak of forward + loss + backward + optimizer step (the host optimizer's
    step not counted), ``host_mib`` = the store's pool and the host optimizer's copies.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.models.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp
    from automodel.training.activation_offload import apply_activation_offload
    from automodel.training.optimizer_offload import HostOffloadOptimizer
    from automodel.training.step import forward_loss_sum

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    base_model = AutoModelForCausalLM.from_config(config)
    state = {k: v.clone() for k, v in base_model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (1, seq), generator=g)

    def adamw(params: list) -> torch.optim.Optimizer:
        # lr 0: every row trains the same weights; foreach: what AdamW runs on a GPU (its temporaries planned)
        return torch.optim.AdamW(params, lr=0.0, foreach=True)

    def fwd_bwd(model: torch.nn.Module, n: int) -> torch.Tensor:
        loss = forward_loss_sum(model, {"input_ids": ids[:, :n]}, labels[:, :n], chunk) / n
        loss.backward()
        return loss.detach()

    out = []
    for _, tiled, act_offload, offload, how, *group in settings:
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state)
        remove_tiled_mlp(model)
        apply_tiled_mlp(model, tiled)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if group and group[0] > 1:
            from automodel.models.checkpoint_groups import apply_checkpoint_groups

            apply_checkpoint_groups(model, group[0])
        store = apply_activation_offload(model) if act_offload else None
        params = list(model.parameters())
        opt = HostOffloadOptimizer(params, adamw) if offload == "optimizer" else adamw(params)
        row: dict = {"persist_mib": sum(p.numel() * p.element_size() for p in params) / MIB, "host_mib": 0.0}
        if how == "rss":
            fwd_bwd(model, 256)  # warm-up: AdamW states, lazy imports, the tiled MLP's first-call probe
            opt.step()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            base = rss_mib()
            reset_peak_rss()
            start = time.perf_counter()
            loss = fwd_bwd(model, seq)
            opt.step()
            opt.zero_grad(set_to_none=True)
            row.update(peak_mib=peak_rss_mib() - base, time=time.perf_counter() - start)
        else:
            fwd_bwd(model, seq)  # warm-up (untracked): the store's host pool, the probe
            made = AllocationTracker()  # the first step creates the optimizer state: its device bytes
            with made, (made.host() if offload else contextlib.nullcontext()):
                opt.step()
            opt.zero_grad(set_to_none=True)
            row["persist_mib"] += made.current / MIB
            gc.collect()
            tracker = AllocationTracker()
            start = time.perf_counter()
            with tracker:
                loss = fwd_bwd(model, seq)
                with tracker.host() if offload else contextlib.nullcontext():
                    opt.step()
                opt.zero_grad(set_to_none=True)
            row.update(peak_mib=tracker.peak / MIB, time=time.perf_counter() - start)
            host = (store.peak_host_bytes() if store else 0) + (opt.host_bytes() if offload else 0)
            row["host_mib"] = host / MIB
        row["loss"] = loss.item()
        out.append(row)
        del model, opt, store, params
        gc.collect()
    return out


MOE_SETTINGS = [("MoE, no checkpointing", False), ("MoE + checkpointing", True)]  # (label, checkpointing)


def moe_worker(rank: int, world: int, model_kw: dict, seq: int, chunk: int) -> list[dict]:
    """A Mixtral-like model (routed experts, top-k): one tracked training step per row of :data:`MOE_SETTINGS`
    on the same weights and batch; per row ``{"peak_mib", "persist_mib", "loss", "time"}`` as the ``tracked``
    rows of :func:`wide_worker` (the device-side step peak above the persistent state)."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from automodel.training.step import forward_loss_sum

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = MixtralConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    out = []
    for _, ac in MOE_SETTINGS:
        model = AutoModelForCausalLM.from_config(config)
        model.load_state_dict(state)
        if ac:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)

        def fwd_bwd(model: torch.nn.Module) -> torch.Tensor:
            loss = forward_loss_sum(model, {"input_ids": ids}, labels, chunk) / seq
            loss.backward()
            return loss.detach()

        fwd_bwd(model)  # warm-up (untracked), then the first optimizer step creates the state
        made = AllocationTracker()
        with made:
            opt.step()
        opt.zero_grad(set_to_none=True)
        persist = (sum(p.numel() * p.element_size() for p in model.parameters()) + made.current) / MIB
        gc.collect()
        tracker = AllocationTracker()
        start = time.perf_counter()
        with tracker:
            loss = fwd_bwd(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
        out.append({"peak_mib": tracker.peak / MIB, "persist_mib": persist, "loss": loss.item(),
                    "time": time.perf_counter() - start})  # fmt: skip
        del model, opt
        gc.collect()
    return out


def moe_rows(args: argparse.Namespace) -> bool:
    """The mixture-of-experts table: plan against the tracked measurement, with and without checkpointing."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from automodel.training.memory_plan import RunShape, model_dims, plan_memory

    seq, chunk = args.wide_seq, 256
    model_kw = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=args.wide_vocab)  # fmt: skip
    with torch.device("meta"):
        dims = model_dims(AutoModelForCausalLM.from_config(MixtralConfig(use_cache=False, **model_kw)))
    (rows,) = run_on_ranks("scripts.bench_memory:moe_worker", 1, args.timeout, model_kw=model_kw, seq=seq, chunk=chunk)
    print(
        f"\nMixture of experts (Mixtral-like): hidden 128, expert MLP 512, 4 experts, top-2, 2 layers, vocab "
        f"{args.wide_vocab}, fp32, {seq} tokens, one process, loss.chunk_tokens={chunk}, AdamW; tracked = peak of "
        "the allocations ops make, forward + loss + backward + AdamW (foreach) step\n",
        flush=True,
    )
    print("| setting | step peak MiB measured | planned | error | persistent MiB measured | planned | error | loss |")
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for (label, ac), r in zip(MOE_SETTINGS, rows, strict=True):
        plan = plan_memory(dims, RunShape(local_batch=1, seq=seq, chunk_tokens=chunk, activation_checkpointing=ac))
        peak, persist = _planned_without_fsdp(plan) / MIB, plan.persistent_bytes / MIB
        err, perr = (peak - r["peak_mib"]) / r["peak_mib"], (persist - r["persist_mib"]) / r["persist_mib"]
        ok &= abs(err) <= args.tolerance and abs(perr) <= args.tolerance
        print(f"| {label} | {r['peak_mib']:.0f} | {peak:.0f} | {err:+.0%} | {r['persist_mib']:.0f} | {persist:.0f} | "
              f"{perr:+.0%} | {r['loss']:.6f} |", flush=True)  # fmt: skip
    return ok


def wide_rows(args: argparse.Namespace) -> bool:
    """Print the wide-MLP table and the deep one (plan against measurement per row, the tiled / untiled ratio,
    the losses); ``True`` when every row is within ``--tolerance`` of the plan, the ratio <= 0.6 and the
    losses equal."""
    wide = (args.wide_hidden, args.wide_intermediate, args.wide_layers)
    ok = technique_rows(args, "Wide MLP", *wide, WIDE_SETTINGS)
    deep = (args.deep_hidden, 4 * args.deep_hidden, args.deep_layers)
    ok = technique_rows(args, "Deep, narrow MLP", *deep, DEEP_SETTINGS) and ok
    return moe_rows(args) and ok


def group_rows(args: argparse.Namespace) -> bool:
    """The checkpoint-group table (:data:`GROUP_SETTINGS`) on the deep, narrow model: the kept layer inputs on the
    device (without offload) and on the host (with it), planned against measured; the losses equal."""
    # the kept layer inputs a large part of the recompute's peak: many narrow layers, a small vocabulary, long rows
    shape = argparse.Namespace(**{**vars(args), "wide_seq": 8192, "wide_vocab": 2048})
    return technique_rows(shape, "Checkpoint groups, deep, narrow MLP", 128, 512, 16, GROUP_SETTINGS)


def technique_rows(args: argparse.Namespace, title: str, h: int, i: int, layers: int, settings: list) -> bool:
    """One table of :func:`wide_rows`: ``settings`` on a Llama shape of hidden ``h``, MLP ``i``, ``layers``."""
    from automodel.training.memory_plan import RunShape, plan_memory

    seq, chunk = args.wide_seq, 256
    model_kw = dict(
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=layers,
        num_attention_heads=max(h // 32, 1),
        num_key_value_heads=max(h // 64, 1),
        vocab_size=args.wide_vocab,
    )
    dims = _dims(model_kw)
    (rows,) = run_on_ranks(
        "scripts.bench_memory:wide_worker", 1, args.timeout, model_kw=model_kw, seq=seq, chunk=chunk,
        settings=settings,
    )
    print(
        f"\n{title}: hidden {h}, MLP {i}, {layers} layers, vocab {args.wide_vocab}, fp32, {seq} tokens, one "
        f"process, activation checkpointing, loss.chunk_tokens={chunk}, AdamW; rss = peak RSS above the RSS "
        "before the step, tracked = peak of the allocations ops make (device-side: not the offload's host "
        "buffers nor the host optimizer's), forward + loss + backward + AdamW (foreach) step\n",
        flush=True,
    )
    print("| setting | measured by | step peak MiB measured | planned | error | persistent MiB measured | planned "
          "| error | host MiB measured | planned | loss | step s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for (label, tiled, act_offload, offload, how, *group), r in zip(settings, rows, strict=True):
        shape = RunShape(local_batch=1, seq=seq, chunk_tokens=chunk, activation_checkpointing=True,
                         tiled_mlp=tiled, activation_offload=act_offload, offload=offload,
                         checkpoint_group=group[0] if group else 1)  # fmt: skip
        plan = plan_memory(dims, shape)
        peak_plan = _planned_without_fsdp(plan) / MIB
        persist_plan = plan.persistent_bytes / MIB
        err = (peak_plan - r["peak_mib"]) / r["peak_mib"]
        persist = ""
        if how == "tracked":  # the persistent state is counted by the tracker only (RSS holds both sides)
            perr = (persist_plan - r["persist_mib"]) / r["persist_mib"]
            ok &= abs(perr) <= args.tolerance
            persist = f"{r['persist_mib']:.0f} | {persist_plan:.0f} | {perr:+.0%}"
        else:
            persist = "- | - | -"
        ok &= abs(err) <= args.tolerance
        host = f"{r['host_mib']:.0f} | {plan.host_bytes / MIB:.0f}" if how == "tracked" else "- | -"
        print(f"| {label} | {how} | {r['peak_mib']:.0f} | {peak_plan:.0f} | {err:+.0%} | {persist} | {host} | "
              f"{r['loss']:.6f} | {r['time']:.1f} |", flush=True)  # fmt: skip
    same = len({r["loss"] for r in rows}) == 1
    print(f"\nlosses equal in every row: {same}")
    if settings[0][1:5] == (False, False, False, "rss") and settings[1][1:] == (True, False, False, "rss"):
        ratio = rows[1]["peak_mib"] / rows[0]["peak_mib"]
        print(f"step peak (rss) tiled / untiled: {ratio:.3f} (target <= 0.6)")
        ok &= ratio <= 0.6
    return ok and same


# --- headwise Ulysses (issue 42): distributed.ulysses_head_chunks at cp=2 ------------------------------------------


def _replicated_step(model, opt, ctx, inputs: dict, labels, chunk: int, seq: int):  # noqa: ANN001, ANN202
    """One training step of a model replicated on every rank (no FSDP) under a CP context ``ctx``: the loss summed
    over the rank's tokens / ``seq``, the gradients all-reduced, an optimizer step. Returns the loss summed over the
    ranks (a scalar tensor)."""
    import torch.distributed as dist

    from automodel.training.step import forward_loss_sum

    with ctx():
        loss = forward_loss_sum(model, inputs, labels, chunk) / seq
        loss.backward()
    for p in model.parameters():
        if p.grad is not None:  # a parameter the row did not reach (an expert no token was routed to)
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total


def headwise_worker(rank: int, world: int, model_kw: dict, seq: int, chunk: int, counts: list[int]) -> dict:
    """Ulysses at cp=``world`` with ``ulysses_head_chunks`` each of ``counts``, the same weights and batch (AdamW lr 0:
    every loss equal). Per count: ``step`` (tracked step peak of forward + loss + backward + the gradients'
    all-reduce + AdamW, and its CPU seconds), ``block`` (tracked peak of one attention module's forward and backward
    alone, its inputs made before) and the loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    model = AutoModelForCausalLM.from_config(config)
    inner = set_ulysses_attention(model, mesh)
    from automodel.models.tiled_mlp import apply_tiled_mlp

    apply_tiled_mlp(model, True)  # the MLP's backward moment below the attention's: where head groups matter
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq), generator=g),
             "labels": torch.randint(0, config.vocab_size, (1, seq), generator=g)}  # fmt: skip

    def step(chunks: int) -> torch.Tensor:
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner, head_chunks=chunks)
        inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
        return _replicated_step(model, opt, ctx, inputs, local["labels"], chunk, seq)

    def block(chunks: int) -> int:
        attn = model.model.layers[0].self_attn
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner, head_chunks=chunks)
        n = local["input_ids"].shape[1]
        hidden = torch.randn(1, n, config.hidden_size, generator=torch.Generator().manual_seed(2), requires_grad=True)
        pos = model.model.rotary_emb(hidden, local["position_ids"])
        grad = torch.randn(1, n, config.hidden_size, generator=torch.Generator().manual_seed(3))
        tracker = AllocationTracker()
        with ctx(), tracker:
            out = attn(hidden, position_embeddings=pos, attention_mask=None)[0]
            out.backward(grad)
            del out
        model.zero_grad(set_to_none=True)
        return tracker.peak

    out = {}
    for chunks in counts:
        step(chunks)  # warm-up (untracked): AdamW state, lazy imports
        gc.collect()
        tracker = AllocationTracker()
        cpu = time.process_time()
        with tracker:
            loss = step(chunks)
        cpu = time.process_time() - cpu
        gc.collect()
        untracked = []  # the step's CPU time without the tracker's per-op bookkeeping: the cost of the head groups
        for _ in range(3):
            t0 = time.process_time()
            step(chunks)
            untracked.append(time.process_time() - t0)
        out[chunks] = {"peak_mib": tracker.peak / MIB, "cpu_s": min(untracked), "loss": loss.item(),
                       "block_mib": block(chunks) / MIB}  # fmt: skip
    return out


def headwise_rows(args: argparse.Namespace) -> bool:
    """The headwise-Ulysses table: per ``ulysses_head_chunks`` the step peak measured against the plan (within
    ``--tolerance``), one attention block's peak against ``1/G`` of the unchunked one plus the projections (the
    local q, k, v and output and their gradients), the CPU time of the step against the unchunked one, the losses."""
    from automodel.training.memory_plan import RunShape, plan_memory

    h, heads, kv, layers, seq, cp, chunk = 256, 16, 8, 2, args.headwise_seq, 2, 256
    model_kw = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, vocab_size=args.headwise_vocab)  # fmt: skip
    dims = _dims(model_kw)
    counts = [1, 2, 4]
    ranks = run_on_ranks("scripts.bench_memory:headwise_worker", cp, args.timeout, model_kw=model_kw, seq=seq,
                         chunk=chunk, counts=counts)  # fmt: skip
    n, c = seq // cp, 4
    projections = 2 * (2 * h + 2 * kv * (h // heads)) * n * c / MIB  # local q, k, v, output and their gradients
    print(
        f"\nHeadwise Ulysses (distributed.ulysses_head_chunks): hidden {h}, {heads} heads / {kv} KV heads of "
        f"{h // heads}, MLP {2 * h}, {layers} layers, vocab {args.headwise_vocab}, fp32, {seq} tokens, cp={cp} "
        f"(Ulysses, sdpa), activation checkpointing, tiled MLP, loss.chunk_tokens={chunk}, AdamW; tracked peaks (the rank's "
        "larger); block = one attention module's forward + backward alone; projections = the local q, k, v, output "
        f"and their gradients = {projections:.1f} MiB\n",
        flush=True,
    )
    print("| head chunks | step peak MiB measured | planned | error | block peak MiB | bound: block(1) / G + projections "
          "| step CPU s (best of 3, untracked) | vs unchunked | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    base = ranks[0][1]
    for chunks in counts:
        peak = max(r[chunks]["peak_mib"] for r in ranks)
        blk = max(r[chunks]["block_mib"] for r in ranks)
        cpu = max(r[chunks]["cpu_s"] for r in ranks)
        shape = RunShape(local_batch=1, seq=seq, cp=cp, cp_method="ulysses", chunk_tokens=chunk,
                         activation_checkpointing=True, head_chunks=chunks, tiled_mlp=True)  # fmt: skip
        planned = _planned_without_fsdp(plan_memory(dims, shape)) / MIB
        err = (planned - peak) / peak
        bound = max(r[1]["block_mib"] for r in ranks) / chunks + projections
        ok &= abs(err) <= args.tolerance and blk <= bound
        ok &= ranks[0][chunks]["loss"] == base["loss"]
        print(f"| {chunks} | {peak:.1f} | {planned:.1f} | {err:+.0%} | {blk:.1f} | {bound:.1f} | {cpu:.2f} | "
              f"{cpu / max(r[1]['cpu_s'] for r in ranks):.2f} | {ranks[0][chunks]['loss']:.6f} |", flush=True)  # fmt: skip
    return ok


# --- the tiled layer (issue 42, item 2): model.tiled_layer at cp=2 ---------------------------------------------------


def tiled_layer_worker(rank: int, world: int, model_kw: dict, seq: int, chunk: int, method: str,
                       settings: list[list]) -> dict:  # fmt: skip
    """``method`` at cp=``world`` with checkpointing and the tiled MLP, per setting ``(label, tiled_layer,
    head_chunks)``: the same weights and batch (AdamW lr 0: every loss equal); the tracked step peak (forward + loss +
    backward + the gradients' all-reduce + AdamW), the moment it was reached, the step's CPU seconds (best of three
    untracked) and the loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.distributed.cp import context_parallel
    from automodel.distributed.cp.ring import cpu_ring
    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.tiled_layer import apply_tiled_layer, layer_tile_counts
    from automodel.models.tiled_mlp import apply_tiled_mlp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(1)
    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq), generator=g),
             "labels": torch.randint(0, config.vocab_size, (1, seq), generator=g)}  # fmt: skip
    out = {}
    for label, tiled, chunks in settings:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        apply_tiled_mlp(model, True)
        if tiled:
            apply_tiled_layer(model, tiled)
        apply_activation_checkpointing(model)
        options = {"head_chunks": chunks} if method == "ulysses" else {}
        cp = context_parallel(model, mesh, method=method, **options)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)

        def step(model: torch.nn.Module = model, cp=cp, opt: torch.optim.Optimizer = opt) -> torch.Tensor:  # noqa: ANN001
            ctx, local = cp.shard(batch)
            inputs = {k: v for k, v in local.items() if k in ("input_ids", "position_ids")}
            return _replicated_step(model, opt, ctx, inputs, local["shift_labels"], chunk, seq)

        step()  # warm-up (untracked): AdamW state, lazy imports, the tiled layer's probe
        gc.collect()
        tracker = AllocationTracker()
        # torch's ring attention runs inside DTensor's handler of the SDPA op, where the tracker is off: count it
        with tracked_inside(tracker, cpu_ring, "_run_ring"), tracker:
            loss = step()
        gc.collect()
        untracked = []
        for _ in range(3):
            t0 = time.process_time()
            step()
            untracked.append(time.process_time() - t0)
        out[label] = {"peak_mib": tracker.peak / MIB, "cpu_s": min(untracked), "loss": loss.item(),
                      "tiled_calls": sum(c.calls for c in layer_tile_counts(model))}  # fmt: skip
        cp.restore()
    return out


def tiled_layer_rows(args: argparse.Namespace) -> bool:
    """The tiled-layer table: cp=2 (ring, and Ulysses with and without 2 head groups), checkpointing and the tiled
    MLP, without and with ``model.tiled_layer=true``: the tracked step peak against the plan (within ``--tolerance``),
    the step's CPU time against the run without it, the losses (equal)."""
    from automodel.training.memory_plan import RunShape, plan_memory

    h, heads, kv, layers, seq, cp, chunk = 256, 16, 8, 2, args.tiled_seq, 2, 256
    model_kw = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, vocab_size=args.tiled_vocab)  # fmt: skip
    dims = _dims(model_kw)
    print(
        f"\nTiled layer (model.tiled_layer): hidden {h}, {heads} heads / {kv} KV heads of {h // heads}, MLP {2 * h}, "
        f"{layers} layers, vocab {args.tiled_vocab}, fp32, {seq} tokens, cp={cp} (sdpa), activation checkpointing, "
        f"tiled MLP, loss.chunk_tokens={chunk}, AdamW; tracked step peak (the rank's larger)\n",
        flush=True,
    )
    print("| method | setting | step peak MiB measured | planned | error | step CPU s (best of 3, untracked) | "
          "vs without | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    # (method, head groups, held to --tolerance): every row (ring's with its ring attention's own buffers counted:
    # tracked_inside)
    for method, chunks, held in (("ring", 1, True), ("ulysses", 1, True), ("ulysses", 2, True)):
        settings = [["untiled", False, chunks], ["tiled_layer", True, chunks]]
        ranks = run_on_ranks("scripts.bench_memory:tiled_layer_worker", cp, args.timeout, model_kw=model_kw, seq=seq,
                             chunk=chunk, method=method, settings=settings)  # fmt: skip
        name = method if chunks == 1 else f"{method} h/{chunks}"
        for label, tiled, _ in settings:
            peak = max(r[label]["peak_mib"] for r in ranks)
            cpu = max(r[label]["cpu_s"] for r in ranks)
            shape = RunShape(local_batch=1, seq=seq, cp=cp, cp_method=method, chunk_tokens=chunk,
                             activation_checkpointing=True, head_chunks=chunks, tiled_mlp=True,
                             tiled_layer=tiled)  # fmt: skip
            planned = _planned_without_fsdp(plan_memory(dims, shape)) / MIB
            err = (planned - peak) / peak
            ok &= abs(err) <= args.tolerance or not held
            ok &= ranks[0][label]["loss"] == ranks[0]["untiled"]["loss"]
            ok &= (ranks[0][label]["tiled_calls"] > 0) == bool(tiled)
            print(f"| {name} | {label} | {peak:.1f} | {planned:.1f} | {err:+.0%}{'' if held else ' (not held)'} | {cpu:.2f} | "
                  f"{cpu / max(r['untiled']['cpu_s'] for r in ranks):.2f} | {ranks[0][label]['loss']:.6f} |",
                  flush=True)  # fmt: skip
    return ok


# --- attention head groups without CP (issue 42, item 4): model.attention_head_chunks at cp=1 -----------------------


def head_groups_worker(rank: int, world: int, model_kw: dict, seq: int, chunk: int, settings: list[list]) -> dict:
    """cp=1 on ``world`` replicated ranks (each the whole row), checkpointing and the tiled MLP, per setting ``(label,
    tiled_layer, attention_head_chunks)``: the same weights and batch (AdamW lr 0: every loss equal); the tracked step
    peak, the step's CPU seconds (best of three untracked), the loss and the head groups run."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.models.attention_head_chunks import (
        ATTENTION_HEAD_GROUP_COUNTS,
        apply_attention_head_chunks,
    )
    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.models.tiled_layer import apply_tiled_layer
    from automodel.models.tiled_mlp import apply_tiled_mlp

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    batch = {"input_ids": torch.randint(0, config.vocab_size, (1, seq), generator=g),
             "labels": torch.randint(0, config.vocab_size, (1, seq), generator=g)}  # fmt: skip
    inputs = {"input_ids": batch["input_ids"], "position_ids": torch.arange(seq).unsqueeze(0)}
    labels = torch.cat([batch["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
    out = {}
    for label, tiled, chunks in settings:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        apply_tiled_mlp(model, True)
        if tiled:
            apply_tiled_layer(model, tiled)
        apply_attention_head_chunks(model, chunks)
        apply_activation_checkpointing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)

        def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            return _replicated_step(model, opt, contextlib.nullcontext, inputs, labels, chunk, seq)

        step()  # warm-up (untracked): AdamW state, lazy imports, the tiled layer's probe
        gc.collect()
        ATTENTION_HEAD_GROUP_COUNTS.reset()
        tracker = AllocationTracker()
        with tracker:
            loss = step()
        groups = ATTENTION_HEAD_GROUP_COUNTS.groups
        gc.collect()
        untracked = []
        for _ in range(3):
            t0 = time.process_time()
            step()
            untracked.append(time.process_time() - t0)
        out[label] = {"peak_mib": tracker.peak / MIB, "cpu_s": min(untracked), "loss": loss.item(), "groups": groups}
    return out


def head_groups_rows(args: argparse.Namespace) -> bool:
    """The cp=1 head-groups table: checkpointing and the tiled MLP, with and without the tiled layer, with
    ``model.attention_head_chunks`` 1 and more: the tracked step peak against the plan (within ``--tolerance``), the
    step's CPU time against the ungrouped run, the losses (equal) and that the groups ran."""
    from automodel.training.memory_plan import RunShape, plan_memory

    h, heads, kv, layers, seq, chunk, world = 256, 16, 8, 2, args.head_groups_seq, 256, 1
    model_kw = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, vocab_size=args.tiled_vocab)  # fmt: skip
    dims = _dims(model_kw)
    print(
        f"\nAttention head groups without CP (model.attention_head_chunks): hidden {h}, {heads} heads / {kv} KV heads "
        f"of {h // heads}, MLP {2 * h}, {layers} layers, vocab {args.tiled_vocab}, fp32, {seq} tokens, cp=1 (sdpa, "
        f"{world} process), activation checkpointing, tiled MLP, loss.chunk_tokens={chunk}, AdamW; tracked step peak\n",
        flush=True,
    )
    print("| layer | head groups | step peak MiB measured | planned | error | step CPU s (best of 3, untracked) | "
          "vs ungrouped | loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    for tiled in (False, True):
        settings = [[f"G{g}", tiled, g] for g in (1, 2, 8)]
        ranks = run_on_ranks("scripts.bench_memory:head_groups_worker", world, args.timeout, model_kw=model_kw,
                             seq=seq, chunk=chunk, settings=settings)  # fmt: skip
        base = ranks[0]["G1"]
        for label, _, g in settings:
            peak = max(r[label]["peak_mib"] for r in ranks)
            cpu = max(r[label]["cpu_s"] for r in ranks)
            shape = RunShape(local_batch=1, seq=seq, cp=1, chunk_tokens=chunk, activation_checkpointing=True,
                             head_chunks=g, tiled_mlp=True, tiled_layer=tiled)  # fmt: skip
            planned = _planned_without_fsdp(plan_memory(dims, shape)) / MIB
            err = (planned - peak) / peak
            ok &= abs(err) <= args.tolerance
            ok &= ranks[0][label]["loss"] == base["loss"]
            ok &= (ranks[0][label]["groups"] > 0) == (g > 1)
            print(f"| {'tiled' if tiled else 'untiled'} | {g} | {peak:.1f} | {planned:.1f} | {err:+.0%} | {cpu:.2f} | "
                  f"{cpu / max(r['G1']['cpu_s'] for r in ranks):.2f} | {ranks[0][label]['loss']:.6f} |",
                  flush=True)  # fmt: skip
    return ok


# --- model structures the planner reads from the modules (cp=1): plain MLPs, K/V repeated above head size 256,
# GPT-Neo's own attention -------------------------------------------------------------------------------------------

#: ``(label, transformers config class, its keyword arguments, attn_implementation)`` of ``--structures``
STRUCTURES = [
    ("GPT-NeoX (GELU MLP)", "GPTNeoXConfig", dict(hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
     num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"),
    ("GPT-2 (gelu_new MLP)", "GPT2Config", dict(n_embd=128, n_inner=2048, n_layer=2, n_head=4, resid_pdrop=0.0,
     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), "sdpa"),
    ("Falcon (GELU MLP, its mask always built)", "FalconConfig", dict(hidden_size=128, ffn_hidden_size=2048,
     num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False, multi_query=False, alibi=False,
     hidden_dropout=0.0, attention_dropout=0.0), "sdpa"),
    ("Llama GQA 4/2 heads of 320", "LlamaConfig", dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
     num_attention_heads=4, num_key_value_heads=2, head_dim=320), "sdpa"),
    ("Gemma-3-like (3 of 4 layers sliding 256, GQA 4/2)", "Gemma3TextConfig", dict(hidden_size=160,
     intermediate_size=640, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=40,
     sliding_window=256, layer_types=["sliding_attention"] * 3 + ["full_attention"]), "sdpa"),
    ("GPT-Neo (global + local 256, own eager code)", "GPTNeoConfig", dict(hidden_size=64, intermediate_size=256,
     num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=256, resid_dropout=0.0,
     embed_dropout=0.0, attention_dropout=0.0), "eager"),
]  # fmt: skip


#: rows only the ``--structures-dtype bfloat16`` table has: a Llama whose norms are a larger share of its layers (its
#: bf16 peak without checkpointing is the final norm's backward: docs/recipe.md, "Memory plan")
STRUCTURES_HALF = [
    ("Llama hidden 512 (GQA 4/2 heads of 128, MLP 1024)", "LlamaConfig", dict(hidden_size=512, intermediate_size=1024,
     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128), "sdpa"),
]  # fmt: skip


def structure_worker(rank: int, world: int, seq: int, chunk: int, vocab: int, dtype: str = "float32") -> list[dict]:
    """cp=1, one process: each of :data:`STRUCTURES` without and with activation checkpointing, in ``dtype`` (weights,
    activations and AdamW's state), AdamW: the tracked step peak (forward + loss + backward + optimizer step) and the
    plan's step peak for the model it ran (:func:`~automodel.training.memory_plan.model_dims` of that model); in a
    half dtype :data:`STRUCTURES_HALF` too."""
    import transformers
    from transformers import AutoModelForCausalLM

    from automodel.models.block_call import apply_activation_checkpointing
    from automodel.training.memory_plan import RunShape, model_dims, plan_memory

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, seq), generator=g)
    inputs = {"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0)}
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    out = []
    for label, cls, kw, attn in STRUCTURES + (STRUCTURES_HALF if dtype != "float32" else []):
        config = getattr(transformers, cls)(vocab_size=vocab, use_cache=False, **kw)
        if hasattr(config, "max_position_embeddings"):
            config.max_position_embeddings = seq
        if hasattr(config, "n_positions"):
            config.n_positions = seq
        for ac in (False, True):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=getattr(torch, dtype)).train()
            if ac:
                apply_activation_checkpointing(model)
            opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)

            def step(model: torch.nn.Module = model, opt: torch.optim.Optimizer = opt) -> torch.Tensor:
                return _replicated_step(model, opt, contextlib.nullcontext, inputs, labels, chunk, seq)

            step()  # warm-up (untracked): AdamW state
            gc.collect()
            tracker = AllocationTracker()
            with tracker:
                step()
            size = torch.finfo(getattr(torch, dtype)).bits // 8
            shape = RunShape(local_batch=1, seq=seq, cp=1, chunk_tokens=chunk, activation_checkpointing=ac, attn=attn,
                             master_bytes=size, compute_bytes=size, reduce_bytes=size)  # fmt: skip
            plan = plan_memory(model_dims(model), shape)
            out.append({"label": label, "ac": ac, "peak_mib": tracker.peak / MIB,
                        "planned_mib": _planned_without_fsdp(plan) / MIB})  # fmt: skip
            del model, opt
            gc.collect()
    return out


def structure_rows(args: argparse.Namespace) -> bool:
    """The cp=1 structures table (:data:`STRUCTURES`): tracked step peak against the plan, within ``--tolerance``."""
    seq, chunk, vocab, dtype = args.structures_seq, 256, 1024, args.structures_dtype
    print(f"\nModel structures at cp=1 (one process, {dtype}, {seq} tokens, vocab {vocab}, loss.chunk_tokens={chunk}, "
          "AdamW; tracked step peak)\n", flush=True)  # fmt: skip
    print("| model | checkpointing | step peak MiB measured | planned | error |")
    print("|---|---|---|---|---|")
    rows = run_on_ranks("scripts.bench_memory:structure_worker", 1, args.timeout, seq=seq, chunk=chunk, vocab=vocab,
                        dtype=dtype)[0]  # fmt: skip
    ok = True
    for row in rows:
        err = (row["planned_mib"] - row["peak_mib"]) / row["peak_mib"]
        ok &= abs(err) <= args.tolerance
        print(f"| {row['label']} | {'on' if row['ac'] else 'off'} | {row['peak_mib']:.1f} | {row['planned_mib']:.1f} | "
              f"{err:+.0%} |", flush=True)  # fmt: skip
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=2.0, help="per-rank budget of the longest-sequence search")
    parser.add_argument("--search-cap", type=int, default=1 << 20, help="longest sequence the search considers")
    parser.add_argument("--verify-max", type=int, default=8192, help="measure the found length only up to this")
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--wide", choices=("also", "only", "no"), default="also",
                        help="the wide-MLP rows (tiled MLP, activation offload, optimizer offload): also, only, no")
    parser.add_argument("--wide-hidden", type=int, default=128)
    parser.add_argument("--wide-intermediate", type=int, default=16384)
    parser.add_argument("--wide-layers", type=int, default=4)
    parser.add_argument("--wide-vocab", type=int, default=32000)
    parser.add_argument("--wide-seq", type=int, default=4096, help="tokens of the wide and the deep rows")
    parser.add_argument("--deep-hidden", type=int, default=256)
    parser.add_argument("--deep-layers", type=int, default=8)
    parser.add_argument("--tolerance", type=float, default=0.10, help="the wide rows' plan error that fails (exit 1)")
    parser.add_argument("--headwise", choices=("also", "only", "no"), default="also",
                        help="the headwise-Ulysses rows (distributed.ulysses_head_chunks at cp=2): also, only, no")
    parser.add_argument("--headwise-seq", type=int, default=8192)
    parser.add_argument("--headwise-vocab", type=int, default=2048)
    parser.add_argument("--groups", choices=("also", "only", "no"), default="also",
                        help="the checkpoint-group rows (model.checkpoint_group_layers, the deep model): also, only, no")
    parser.add_argument("--tiled-layer", choices=("also", "only", "no"), default="also",
                        help="the tiled-layer rows (model.tiled_layer at cp=2): also, only, no")
    parser.add_argument("--tiled-seq", type=int, default=8192)
    parser.add_argument("--head-groups", choices=("also", "only", "no"), default="also",
                        help="the cp=1 head-group rows (model.attention_head_chunks): also, only, no")
    parser.add_argument("--head-groups-seq", type=int, default=8192)
    parser.add_argument("--tiled-vocab", type=int, default=2048)
    parser.add_argument("--structures", choices=("also", "only", "no"), default="also",
                        help="model structures read from the modules at cp=1: plain MLPs, K/V repeated above head size "
                             "256, GPT-Neo's own attention")
    parser.add_argument("--structures-seq", type=int, default=2048)
    parser.add_argument("--structures-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the structures' dtype (weights, activations, AdamW state; bfloat16: the norms' fp32 copies)")
    args = parser.parse_args()
    for key, value in MMAP_ENV.items():  # read by the spawned interpreters' glibc at start-up
        os.environ.setdefault(key, value)
    if args.structures == "only":
        sys.exit(0 if structure_rows(args) else 1)
    if args.tiled_layer == "only":
        sys.exit(0 if tiled_layer_rows(args) else 1)
    if args.head_groups == "only":
        sys.exit(0 if head_groups_rows(args) else 1)
    if args.groups == "only":
        sys.exit(0 if group_rows(args) else 1)
    if args.headwise == "only":
        sys.exit(0 if headwise_rows(args) else 1)
    if args.wide == "only":
        sys.exit(0 if wide_rows(args) else 1)
    from automodel.training.memory_plan import plan_memory

    h = args.hidden_size
    print(
        f"Llama-shaped: hidden {h}, MLP {4 * h}, {args.layers} layers, {h // 16} heads / {h // 32} KV heads, fp32, "
        f"AdamW, ring CP, CPU, 1 thread per rank, torch {torch.__version__}; chunked = loss.chunk_tokens=256",
        flush=True,
    )
    print("| vocab | cp | setting | seq len | step peak MiB/rank measured | planned | error | step s |")
    print("|---|---|---|---|---|---|---|---|")
    longest: list[str] = []
    for vocab in args.vocabs:
        model_kw = dict(
            hidden_size=h,
            intermediate_size=4 * h,
            num_hidden_layers=args.layers,
            num_attention_heads=h // 16,
            num_key_value_heads=h // 32,
            vocab_size=vocab,
        )
        dims = _dims(model_kw)
        for cp in args.cps:
            cases = [{"seq": s, "chunk": c, "ac": a} for _, c, a in SETTINGS for s in args.seq_lens]
            found = {}
            if not args.no_search:
                for label, c, a in SETTINGS:
                    found[label] = longest_planned(dims, cp, c, a, args.budget_gib * 2**30, args.search_cap)
                    if 0 < found[label] <= args.verify_max:
                        cases.append({"seq": found[label], "chunk": c, "ac": a, "verify": label})
            ranks = run_on_ranks(
                "scripts.bench_memory:measure_worker", cp, args.timeout, cases=cases, model_kw=model_kw
            )
            verified = {}
            for i, case in enumerate(cases):
                peak = max(r[i]["peak_mib"] for r in ranks)
                t = max(r[i]["time"] for r in ranks)
                plan = plan_memory(dims, _shape(case["seq"], cp, case["chunk"], case["ac"]))
                if "verify" in case:
                    verified[case["verify"]] = (peak + plan.persistent_bytes / 2**20, t)
                    continue
                label = next(lb for lb, c, a in SETTINGS if (c, a) == (case["chunk"], case["ac"]))
                pred = _planned_without_fsdp(plan) / 2**20
                print(
                    f"| {vocab} | {cp} | {label} | {case['seq']} | {peak:.0f} | {pred:.0f} | "
                    f"{(pred - peak) / peak:+.0%} | {t:.2f} |",
                    flush=True,
                )
            for label, _, _ in SETTINGS:
                if label not in found:
                    continue
                v = verified.get(label)
                check = (
                    f"measured {v[0]:.0f} MiB, {v[1]:.2f} s/step" if v else f"not measured (> {args.verify_max} tokens)"
                )
                longest.append(f"| {vocab} | {cp} | {label} | {found[label]} | {check} |")
    if longest:
        print(f"\nLongest sequence (multiple of 256) whose planned per-rank total fits {args.budget_gib:g} GiB:\n")
        print("| vocab | cp | setting | longest seq | verification (step peak + persistent state) |")
        print("|---|---|---|---|---|")
        print("\n".join(longest), flush=True)
    if args.wide == "also" and not wide_rows(args):
        sys.exit(1)
    if args.headwise == "also" and not headwise_rows(args):
        sys.exit(1)
    if args.tiled_layer == "also" and not tiled_layer_rows(args):
        sys.exit(1)
    if args.head_groups == "also" and not head_groups_rows(args):
        sys.exit(1)
    if args.groups == "also" and not group_rows(args):
        sys.exit(1)
    if args.structures == "also" and not structure_rows(args):
        sys.exit(1)


if __name__ == "__main__":
    main()
