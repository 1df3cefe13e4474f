"""``automodel plan``: the longest row that fits, per parallel layout and memory technique (a search over the memory planner).

For the model of a config (built on the meta device: no weights, no process group), every layout of ``N``
GPUs (``dp x cp x tp``; each CP method that computes the model exactly, judged by the registry's own checks
on the model's profile, as ``cp_method: auto`` does) and every set of memory techniques (activation
checkpointing, the chunked loss or loss parallel, the tiled MLP, activation offload, ``fsdp.offload``), a
search over :func:`automodel.training.memory_plan.plan_memory` (:func:`last_fitting`) finds the longest row (a
multiple of the layout's row multiple, at most :data:`_MAX_ROW` or the model's position table) whose predicted
per-GPU total fits the device and whose host memory (offloaded activations, optimizer, parameters) fits the
node. Pure arithmetic: a few seconds for an 8B model on a CPU.

The device budget is the GPU's memory as the driver reports it (:data:`DEVICE_MEMORY_MIB`) less
:data:`DEVICE_RESERVE_GIB` (the CUDA context, cuBLAS and NCCL workspaces); ``--gpu-memory-gib`` replaces
the capacity (the reserve still comes off). The host budget is :data:`HOST_GIB_PER_GPU` per GPU of a full
node (a DGX H100 / H200 node: 2 TiB for 8 GPUs), shared by the run's GPUs on the node;
``--host-memory-gib`` gives the node's memory. ``docs/long_context.md`` explains the output.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from automodel.config.gpu_specs import GPUSpec
from automodel.errors import UserInputError
from automodel.models.loader import ModelPositions, rope_scaling_overrides
from automodel.training.memory_plan import (
    DEFAULT_CHUNK_TOKENS,
    ModelDims,
    RunShape,
    packed_blocks_apply,
    plan_memory,
)

__all__ = [
    "DEVICE_MEMORY_MIB",
    "DEVICE_RESERVE_GIB",
    "HOST_GIB_PER_GPU",
    "HOST_LINK_GB_S",
    "HOST_ADAM_PARAMS_PER_S",
    "Layout",
    "Techniques",
    "Found",
    "PlanSearch",
    "build_search",
    "check_plan_gpu",
    "device_budget_gib",
    "run_budget_gib",
    "host_budget_gib",
    "longest_row",
    "plan_lines",
    "row_step_seconds",
    "usable_techniques",
]

_GIB = 2**30
#: total memory per GPU as ``nvidia-smi`` reports it (the data sheet's "80 GB" H100 is 81,559 MiB)
DEVICE_MEMORY_MIB = {"h100": 81559, "h200": 143771, "a100": 81920, "l40s": 46068}
#: what the planner's tensors cannot use: the CUDA context, cuBLAS and NCCL workspaces (about 0.5-0.8 GiB
#: measured on an H100 with torch 2.x) and the caching allocator's slack between large blocks
DEVICE_RESERVE_GIB = 1.0
#: host memory per GPU of a full node: a DGX H100 / H200 has 2 TiB for its 8 GPUs
HOST_GIB_PER_GPU = 256
#: host <-> device copy bandwidth per GPU and direction, GB/s: PCIe 5.0 x16 (H100, H200: 64 GB/s) and
#: 4.0 x16 (A100, L40S: 32 GB/s) at the 80% a pinned copy reaches (the step estimate's LINK_FRACTION)
HOST_LINK_GB_S = {"h100": 64 * 0.8, "h200": 64 * 0.8, "a100": 32 * 0.8, "l40s": 32 * 0.8}
#: torch's AdamW (foreach) on the host, parameters per second per GPU's process: it streams 16 B of state
#: and parameter per element (read and written) over the few cores a rank's process gets
HOST_ADAM_PARAMS_PER_S = 1.0e9
_MAX_ROW = 1 << 27  # 134M tokens: the search stops here


@dataclass(frozen=True)
class Layout:
    """``dp x cp x tp`` over the GPUs and the CP method (``None`` at cp 1)."""

    dp: int
    cp: int
    tp: int
    method: str | None = None
    sequence_parallel: bool = False
    options: tuple[tuple[str, Any], ...] = ()  # the method's distributed.<key> values (usp: ulysses_size)
    #: head groups run one at a time: distributed.ulysses_head_chunks (ulysses, usp); at cp 1 model.attention_head_chunks
    head_chunks: int = 1

    @property
    def text(self) -> str:
        parts = [f"dp {self.dp}"] if self.dp > 1 else []
        if self.cp > 1:
            opts = "".join(f" {k.split('_')[0]} {v}" for k, v in self.options)  # usp ulysses 8
            heads = f" h/{self.head_chunks}" if self.head_chunks > 1 else ""  # ulysses h/4: heads in 4 groups
            parts.append(f"cp {self.cp} {self.method}{opts}{heads}")
        elif self.head_chunks > 1:  # no CP: the attention's heads in groups (model.attention_head_chunks)
            parts.append(f"h/{self.head_chunks}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}" + (" sp" if self.sequence_parallel else ""))
        return " x ".join(parts) or "1 GPU"

    def overrides(self) -> list[str]:
        out = [f"distributed.dp_shard={self.dp}", f"distributed.cp_size={self.cp}", f"distributed.tp_size={self.tp}"]
        if self.cp > 1:
            out.append(f"distributed.cp_method={self.method}")
            out += [f"distributed.{k}={v}" for k, v in self.options]
            if self.head_chunks > 1:
                out.append(f"distributed.ulysses_head_chunks={self.head_chunks}")
        elif self.head_chunks > 1:
            out.append(f"model.attention_head_chunks={self.head_chunks}")
        out += [f"distributed.enable_loss_parallel={str(self.tp > 1).lower()}",
                f"distributed.sequence_parallel={str(self.sequence_parallel).lower()}"]  # fmt: skip
        return out


@dataclass(frozen=True)
class Techniques:
    """One set of memory techniques (each one config key)."""

    chunked_loss: bool = False  # loss.chunk_tokens (under TP: loss parallel instead)
    checkpointing: bool = True  # model.activation_checkpointing
    tiled_mlp: bool = False  # model.tiled_mlp
    activation_offload: bool = False  # model.activation_offload (with checkpointing)
    offload: bool | str = False  # fsdp.offload
    tiled_layer: bool = False  # model.tiled_layer (searched with the tiled MLP; tp 1 only)
    checkpoint_group: int = 1  # model.checkpoint_group_layers (with activation offload and fsdp.offload; tp 1 only)

    def text(self, tp: int) -> str:
        """Short form (the report's legend): ``ckpt+chunk+tile+aoff+off:all``; ``lay`` for the tiled layer (with the
        tiled MLP)."""
        parts = ["ckpt"] if self.checkpointing else []
        if self.chunked_loss:
            parts.append("lp" if tp > 1 else "chunk")
        if self.tiled_layer:  # with the tiled MLP (its MLP runs in the layer's tiles)
            parts.append("lay")
        elif self.tiled_mlp:
            parts.append("tile")
        if self.activation_offload:
            parts.append("aoff")
        if self.checkpoint_group > 1:
            parts.append(f"grp{self.checkpoint_group}")
        if self.offload:
            parts.append("off:opt" if self.offload == "optimizer" else "off:all")
        return "+".join(parts) or "none"

    def overrides(self, tp: int) -> list[str]:
        chunk = DEFAULT_CHUNK_TOKENS if self.chunked_loss and tp == 1 else "null"
        return [
            f"loss.chunk_tokens={chunk}",
            f"model.activation_checkpointing={str(self.checkpointing).lower()}",
            f"model.tiled_mlp={str(self.tiled_mlp).lower()}",
            f"model.tiled_layer={str(self.tiled_layer).lower()}",
            f"model.activation_offload={str(self.activation_offload).lower()}",
            *([f"model.checkpoint_group_layers={self.checkpoint_group}"] if self.checkpoint_group > 1 else []),
            f"fsdp.offload={self.offload or 'false'}",
        ]

    @property
    def cost_rank(self) -> int:
        """How much step time the set adds, roughly (ties of the longest row go to the cheapest)."""
        return (self.chunked_loss + 2 * self.checkpointing + 2 * self.tiled_mlp + 3 * self.activation_offload
                + 3 * self.tiled_layer + 4 * (self.checkpoint_group > 1)
                + {False: 0, "optimizer": 4, "all": 6}[self.offload])  # fmt: skip


def all_techniques() -> list[Techniques]:
    """Every combination (activation offload only with checkpointing; checkpoint groups of :data:`GROUP_SIZES` with
    activation offload and ``fsdp.offload``, the sets whose layer inputs and model state are on the host)."""
    out = []
    for loss, ckpt, tiled, act, off in itertools.product((False, True), (False, True), (False, True),
                                                          (False, True), (False, "optimizer", "all")):  # fmt: skip
        if act and not ckpt:
            continue
        out.append(Techniques(loss, ckpt, tiled, act, off))
        if tiled:  # the tiled layer: with the tiled MLP (its MLP runs over the layer's tiles)
            out.append(Techniques(loss, ckpt, tiled, act, off, tiled_layer=True))
        if act and off:  # checkpoint groups: where the host holds the layer inputs and the model state
            out += [Techniques(loss, ckpt, tiled, act, off, checkpoint_group=k) for k in GROUP_SIZES]
            if tiled:
                out += [Techniques(loss, ckpt, tiled, act, off, True, k) for k in GROUP_SIZES]
    return out


#: ``model.checkpoint_group_layers`` values the search tries (with activation offload and ``fsdp.offload``)
GROUP_SIZES = (2,)


@dataclass
class Found:
    """The longest row of one layout with one technique set (``tokens`` 0: not even the row multiple fits)."""

    layout: Layout
    techniques: Techniques
    tokens: int
    device_gib: float = 0.0
    host_node_gib: float = 0.0
    step_s: float = 0.0
    tokens_per_s_gpu: float = 0.0
    #: the search turned model.cudnn_packed_blocks off for this row: cuDNN's packed-row calls' copies would not fit
    #: beside it (:meth:`PlanSearch.usage_choice`; a config that sets it false has it off everywhere already)
    packed_off: bool = False

    @property
    def technique_text(self) -> str:
        """The technique set's short form, ``+nopk`` where the search turned ``model.cudnn_packed_blocks`` off."""
        return self.techniques.text(self.layout.tp) + ("+nopk" if self.packed_off else "")

    @property
    def text(self) -> str:
        return f"{self.layout.text}; {self.technique_text}"

    def overrides(self, positions: ModelPositions | None = None) -> list[str]:
        """The config keys that reproduce this row: the layout, the techniques, one row per data-parallel rank
        (``local_batch_size`` 1, ``global_batch_size`` dp: the plan's step) and ``data.seq_len``; past the
        model's positions (``positions``) also the YaRN RoPE scaling that covers the row
        (:func:`~automodel.models.loader.rope_scaling_overrides`; the recipe refuses the row without one)."""
        keys = [*self.layout.overrides(), "distributed.dp_replicate=1", *self.techniques.overrides(self.layout.tp),
                "step_scheduler.local_batch_size=1", f"step_scheduler.global_batch_size={self.layout.dp}",
                f"data.seq_len={self.tokens}"]  # fmt: skip
        if self.packed_off:
            keys.append("model.cudnn_packed_blocks=false")
        if positions is not None and not positions.scaling:
            keys += rope_scaling_overrides(positions, self.tokens)
        return keys


def device_budget_gib(gpu_type: str, gpu_memory_gib: float | None = None) -> tuple[float, float]:
    """``(capacity, budget)`` GiB per GPU: the driver's total (or ``gpu_memory_gib``) and that less the reserve."""
    cap = gpu_memory_gib if gpu_memory_gib is not None else DEVICE_MEMORY_MIB[gpu_type.lower()] / 1024
    return cap, cap - DEVICE_RESERVE_GIB


def run_budget_gib(memory_budget_gib: float | None, gpu_type: str | None) -> tuple[float | None, str]:
    """The per-rank budget (GiB) a dry run checks its plan against, and where it comes from (words for its line):
    ``recipe.memory_budget_gib``; else ``recipe.gpu_type``'s device budget, the one ``automodel plan`` fits rows to
    (:func:`device_budget_gib`); else ``(None, "")``: no check."""
    if memory_budget_gib is not None:
        return memory_budget_gib, "recipe.memory_budget_gib"
    if gpu_type is not None and gpu_type.lower() in DEVICE_MEMORY_MIB:
        cap, budget = device_budget_gib(gpu_type)
        return budget, (f"recipe.gpu_type={gpu_type}: {cap:.1f} GiB less the {DEVICE_RESERVE_GIB:g} GiB reserve, as "
                        f"automodel plan; recipe.memory_budget_gib sets another")  # fmt: skip
    return None, ""


def host_budget_gib(gpus: int, gpus_per_node: int, host_memory_gib: float | None = None) -> tuple[float, int]:
    """``(host GiB per node, the run's GPUs on a node)``: the node's memory is shared by those GPUs."""
    on_node = min(gpus, gpus_per_node)
    node = host_memory_gib if host_memory_gib is not None else HOST_GIB_PER_GPU * gpus_per_node
    return node, on_node


class PlanSearch:
    """The search for one model, GPU count and GPU type (module docstring).

    Args:
        dims: the model's :class:`ModelDims`; ``profile``: its CP profile (which methods compute it exactly).
        base: a :class:`RunShape` carrying the config's dtypes, attention and FSDP settings (its sizes and
            techniques are replaced per layout and set).
        gpus, spec, gpu_type: the GPUs; ``budget_bytes`` / ``host_gpu_bytes``: per GPU.
        tp_ok: ``tp -> bool``, whether the model's TP checks pass at that size (with sequence parallelism).
    """

    def __init__(self, dims: ModelDims, profile: Any, base: RunShape, gpus: int, spec: GPUSpec, gpu_type: str,
                 budget_bytes: float, host_gpu_bytes: float, tp_ok: Any = None, *,
                 positions: ModelPositions | None = None, gpus_per_node: int | None = None,
                 techniques: list[Techniques] | None = None) -> None:  # fmt: skip
        self.d, self.profile, self.base, self.gpus, self.spec = dims, profile, base, gpus, spec
        self.gpu_type = gpu_type.lower()
        self.budget, self.host = budget_bytes, host_gpu_bytes
        self.tp_ok = tp_ok or (lambda tp: True)
        self.gpus_per_node = gpus_per_node or spec.gpus_per_node
        self.node = min(gpus, self.gpus_per_node)
        self.positions = positions or ModelPositions(None, False)
        self.techniques = techniques if techniques is not None else all_techniques()
        if dims.logit_transform:  # a final logit transform the chunked loss refuses: the plain loss only
            self.techniques = [t for t in self.techniques if not t.chunked_loss]

    def past_positions(self, tokens: int) -> bool:
        """Whether a row of ``tokens`` is past the model's positions (``max_position_embeddings``)."""
        return self.positions.limit is not None and tokens > self.positions.limit

    # --- layouts ------------------------------------------------------------------------------------------
    def layouts(self) -> list[Layout]:
        """Every ``dp x cp x tp = gpus`` with tp up to a node (8) and a method that computes the model exactly."""
        from automodel.distributed.cp import cp_methods
        from automodel.distributed.cp.registry import run_problems

        d, out = self.d, []
        for tp in (t for t in (1, 2, 4, 8) if self.gpus % t == 0 and t <= self.gpus_per_node):
            if tp > 1 and not (d.tp_capable and all(x % tp == 0 for x in (d.heads, d.kv_heads, d.intermediate,
                                                                         d.vocab)) and self.tp_ok(tp)):  # fmt: skip
                continue
            for cp in (c for c in range(1, self.gpus // tp + 1) if (self.gpus // tp) % c == 0):
                dp = self.gpus // (tp * cp)
                sp = tp > 1
                if cp == 1:
                    out.append(Layout(dp, 1, tp, None, sp))
                    if tp == 1:  # no CP: the attention's heads in groups (model.attention_head_chunks)
                        out += [Layout(dp, 1, 1, None, sp, (), g) for g in self.attention_head_chunk_counts()[1:]]
                    continue
                for name, method in cp_methods().items():
                    for bound, opts in method.auto_configs(cp, self.node):  # usp: each ulysses_size
                        if run_problems(bound, self.profile, cp_size=cp, tp_size=tp, seq_len=None, packed=False):
                            continue
                        for chunks in self.head_chunk_counts(bound, cp, tp):  # headwise Ulysses: each count
                            out.append(Layout(dp, cp, tp, name, sp, tuple(sorted(opts.items())), chunks))
        return out

    def head_chunk_counts(self, method: Any, cp: int, tp: int) -> list[int]:
        """``distributed.ulysses_head_chunks`` values to search for ``method`` at ``cp x tp``: 1, and for a method that
        splits heads by all-to-all every divisor of the KV heads a rank holds after it (a group is whole KV heads)."""
        from automodel.distributed.cp.head_chunks import head_chunk_choices

        ranks = method.head_chunk_ranks(cp)
        if not ranks or not self.d.heads:
            return [1]
        return head_chunk_choices(max(1, self.d.kv_heads // tp), ranks)

    def attention_head_chunk_counts(self) -> list[int]:
        """``model.attention_head_chunks`` values to search without CP (tp 1): 1 and every divisor of the KV heads,
        for a model whose attention layers can run in head groups
        (:func:`automodel.models.attention_head_chunks.head_groups_layer_problem`)."""
        from automodel.distributed.cp.head_chunks import head_chunk_choices
        from automodel.models.attention_head_chunks import head_groups_layer_problem

        if not self.d.heads or self.profile is None or head_groups_layer_problem(self.profile) is not None:
            return [1]
        return head_chunk_choices(self.d.kv_heads, 1)

    def row_multiple(self, layout: Layout) -> int:
        from automodel.distributed.cp import get_cp_method

        if layout.cp == 1:
            return layout.tp if layout.sequence_parallel else 1
        method = get_cp_method(layout.method, **dict(layout.options))
        return method.row_multiple(layout.cp, layout.tp, layout.sequence_parallel)[0]

    # --- one shape --------------------------------------------------------------------------------------
    def shape(self, layout: Layout, t: Techniques, seq: int) -> RunShape:
        r = self._shape(layout, t, seq)
        if self.attention_backend == "auto" and layout.cp > 1:  # the CP block kernels follow their own rule
            from automodel.training.memory_plan import planned_kernel

            kernel, rule = planned_kernel("auto", self.gpu_type, r, self.d)
            r = dataclasses.replace(r, attention_kernel=kernel, attention_kernel_rule=rule)
        return r

    #: ``model.attention_backend`` of the config (``auto``: each layout's kernel by auto's rule)
    attention_backend = "auto"

    def _shape(self, layout: Layout, t: Techniques, seq: int) -> RunShape:
        return dataclasses.replace(
            self.base, local_batch=1, seq=seq, cp=layout.cp, tp=layout.tp, dp_shard=layout.dp,
            cp_method=layout.method or "ring", cp_options=layout.options, head_chunks=layout.head_chunks, grad_acc=1,
            chunk_tokens=DEFAULT_CHUNK_TOKENS if t.chunked_loss and layout.tp == 1 else None,
            loss_parallel=t.chunked_loss and layout.tp > 1, sequence_parallel=layout.sequence_parallel,
            activation_checkpointing=t.checkpointing, tiled_mlp=t.tiled_mlp, tiled_layer=t.tiled_layer,
            activation_offload=t.activation_offload, checkpoint_group=t.checkpoint_group, offload=t.offload,
        )  # fmt: skip

    def usage(self, layout: Layout, t: Techniques, seq: int) -> tuple[float, float]:
        """``(device bytes, host bytes)`` per GPU at ``seq`` tokens per row."""
        return self.usage_choice(layout, t, seq)[:2]

    def usage_choice(self, layout: Layout, t: Techniques, seq: int) -> tuple[float, float, bool]:
        """``(device bytes, host bytes, packed off)`` per GPU at ``seq`` tokens per row: with the config's
        ``model.cudnn_packed_blocks`` (on by default), or, turned off (``True``), where the row does not fit the GPU
        with cuDNN's packed-row calls and their copies are what it lacks (thd, thd_docs and usp on a torch whose
        ``varlen_attn`` runs that call: ``block_sets.packed_call_bytes``; elsewhere they cost nothing)."""
        r = self.shape(layout, t, seq)
        p = plan_memory(self.d, r)
        if p.total_bytes > self.budget and packed_blocks_apply(r):
            q = plan_memory(self.d, dataclasses.replace(r, cudnn_packed_blocks=False))
            if q.total_bytes < p.total_bytes:
                return q.total_bytes, q.host_bytes, True
        return p.total_bytes, p.host_bytes, False

    def fits(self, layout: Layout, t: Techniques, seq: int) -> bool:
        return self._measure(layout, t, seq)[0]

    def _measure(self, layout: Layout, t: Techniques, seq: int) -> tuple[bool, float]:
        """``(fits, load)`` at ``seq`` tokens per row: whether the GPU's and the host's use fit their budgets, and the
        larger of the two over its budget (only the search's guide: whether a row fits is the first)."""
        dev, host = self.usage(layout, t, seq)
        load = max(dev / self.budget if self.budget > 0 else math.inf, host / self.host if self.host > 0 else 0.0)
        return dev <= self.budget and host <= self.host, load

    def longest(self, layout: Layout, t: Techniques) -> Found:
        """The longest row that fits, a multiple of the layout's row multiple and at most the search's cap (the
        model's position table where it has one and no RoPE; memory grows with the row): :func:`last_fitting`."""
        m = self.row_multiple(layout)
        cap = _MAX_ROW  # a position table (GPT-2, OPT) has no rows past its length; RoPE rows past it are marked
        if self.positions.limit is not None and not self.positions.rope:
            cap = self.positions.limit
        k = last_fitting(lambda k: self._measure(layout, t, k * m), cap // m)
        return self.found(layout, t, k * m) if k else Found(layout, t, 0)

    def found(self, layout: Layout, t: Techniques, seq: int) -> Found:
        dev, host, packed_off = self.usage_choice(layout, t, seq)
        step_s, tok_s = self.estimate(layout, t, seq)
        return Found(layout, t, seq, dev / _GIB, host * self.node / _GIB, step_s, tok_s, packed_off)

    # --- the step estimate: the one call site -------------------------------------------------------------
    def estimate(self, layout: Layout, t: Techniques, seq: int) -> tuple[float, float]:
        """``(step seconds, tokens/s/GPU)``: :func:`~automodel.training.step_estimate.estimate_step` for one row
        per data-parallel rank, plus :func:`technique_seconds` (what the estimate does not model yet)."""
        r = self.shape(layout, t, seq)
        sizes = {"dp_replicate": 1, "dp_shard": layout.dp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
        step = row_step_seconds(self.d, r, sizes, self.gpus, self.spec, self.gpu_type, self.node)
        return step, layout.dp * seq / step / self.gpus

    # --- the whole search ---------------------------------------------------------------------------------
    def search(self) -> list[Found]:
        """The longest row of every layout with every technique set."""
        # the tiled layer runs on plain tensors: refused with tensor parallelism (automodel.config.tiled_layer_rules)
        # checkpoint groups likewise (automodel.config.offload_rules), and searched only where the same set without
        # them stops at the host memory (elsewhere they only cost: the GPU is the limit)
        out: list[Found] = []
        for layout in self.layouts():
            found: dict[Techniques, Found] = {}
            for t in self.techniques:
                if (t.tiled_layer or t.checkpoint_group > 1) and layout.tp > 1:
                    continue
                if t.checkpoint_group > 1:
                    base = found.get(dataclasses.replace(t, checkpoint_group=1))
                    if base is None or not self.host_bound(layout, base):
                        continue
                found[t] = self.longest(layout, t)
                out.append(found[t])
        return out

    def host_bound(self, layout: Layout, f: Found) -> bool:
        """Whether ``f``'s row stops at the host memory: the next longer row fits the GPU but not the host."""
        from automodel.training.memory_plan import host_bytes

        seq = f.tokens + self.row_multiple(layout)
        if sum(t.bytes for t in host_bytes(self.d, self.shape(layout, f.techniques, seq))) <= self.host:
            return False  # the host has room: the GPU stopped the row (the cheap test first)
        return self.usage(layout, f.techniques, seq)[0] <= self.budget


def last_fitting(measure: Callable[[int], tuple[bool, float]], top: int) -> int:
    """The largest ``k`` in ``[1, top]`` with ``measure(k)[0]`` (0: none), for a predicate that holds up to some ``k``
    and fails above it (memory grows with the row). ``measure(k)`` is ``(fits, load)``: ``load`` grows with ``k``
    and is about 1 at the boundary (use over budget); it only guides the search, so the answer is the bisection's
    whatever its values.

    The bracket ``[lo fits, hi fails]`` narrows by interpolation: ``log(load - floor)`` over ``log k`` across a
    wide bracket (``floor`` the load of ``k = 1``, about the weights: what is left grows near a power of the row),
    ``load`` over ``k`` across a narrow one, the kept endpoint's distance to the target halved when the other moved
    twice in a row (the Illinois rule). Where two steps did not halve ``log(hi / lo)`` the next one bisects it
    (geometrically), so no search takes more than three times bisection's evaluations. Measured over every row
    of the shipped 8B and 32B configs' plans and five families' (5,745 searches): 8.1 plans per row on average,
    where doubling, then bisecting, took 32.
    """
    if top < 1:
        return 0
    ok, load_1 = measure(1)
    if not ok:
        return 0
    if top == 1:
        return 1
    ok, load_top = measure(top)
    if ok:
        return top
    floor = min(load_1, 1.0) * (1 - 1e-3)  # the part of the load the row does not add (weights, state)
    target = math.log(1 - floor)

    def distances(load: float) -> list[float]:  # [linear, log-log] distance of a load to the boundary
        return [load - 1.0, math.log(max(load - floor, 1e-300)) - target]

    lo, hi, d_lo, d_hi = 1, top, distances(load_1), distances(load_top)
    side = 0  # the endpoint the last steps moved: +n hi / -n lo for n steps in a row
    sizes = [math.log(hi / lo)]  # the bracket's log(hi / lo) after each step
    while hi - lo > 1:
        size = sizes[-1]
        wide = hi > 2 * lo
        i = 1 if wide else 0
        stalled = len(sizes) >= 3 and size > sizes[-3] / 2
        if not stalled and d_hi[i] > 0 >= d_lo[i]:
            frac = -d_lo[i] / (d_hi[i] - d_lo[i])
            guess = math.exp(math.log(lo) + frac * size) if wide else lo + frac * (hi - lo)
        else:
            guess = math.sqrt(lo * hi)
        k = min(max(round(guess), lo + 1), hi - 1)
        ok, load = measure(k)
        if ok:
            lo, d_lo, side = k, distances(load), min(side, 0) - 1
            if side <= -2:
                d_hi = [x / 2 for x in d_hi]
        else:
            hi, d_hi, side = k, distances(load), max(side, 0) + 1
            if side >= 2:
                d_lo = [x / 2 for x in d_lo]
        sizes.append(math.log(hi / lo))
    return lo


def row_step_seconds(d: ModelDims, r: RunShape, sizes: dict[str, int], gpus: int, spec: GPUSpec, gpu_type: str,
                     gpus_per_node: int) -> float:  # fmt: skip
    """The plan's step column: one optimizer step of ``r`` (one row per data-parallel rank in the plan) by
    :func:`~automodel.training.step_estimate.estimate_step`, plus :func:`technique_seconds`. The dry run
    prints it for its config's row next to the step of its global batch."""
    from automodel.training.step_estimate import estimate_step

    est = estimate_step(d, r, sizes, gpus, sizes["dp"] * r.local_batch * r.grad_acc, spec, gpus_per_node)
    return est.step_s + sum(technique_seconds(d, r, spec, gpu_type, est.compute_s).values())


def technique_seconds(d: ModelDims, r: RunShape, spec: GPUSpec, gpu_type: str, compute_s: float) -> dict[str, float]:
    """Step seconds the memory techniques add that :func:`estimate_step` does not count (one micro-batch):

    - tiled MLP: backward recomputes each tile's MLP forward: ``2 P_mlp`` FLOPs per token (``P_mlp = 3 h I``
      per layer, ``/ tp``) at the matrix products' achieved rate (the step estimate's ``GEMM_PEAK_FRACTION``), and
      (tp 1) each tiled norm's forward, the layers' and the final one (``NORM_FORWARD_BYTES h`` per token and norm,
      memory-bound at the step estimate's ``HBM_FRACTION``);
    - tiled layer (instead of the tiled MLP's): backward recomputes each tile's forward but the attention core, the
      q/k/v and output projections and the MLP: ``2 (h (2 q + 2 kv) + 3 h I)`` FLOPs per token and layer;
    - activation offload: each layer input goes to the host in forward and back in backward
      (``2 L N h c`` bytes over :data:`HOST_LINK_GB_S`), prefetched under the layers' compute: only what
      exceeds the compute is exposed;
    - ``fsdp.offload``: the optimizer step on the host (:data:`HOST_ADAM_PARAMS_PER_S` for the rank's
      trainable shard) and the gradients down and the updated parameters up (``2 T / fsdp`` master-dtype
      values) after the backward; ``all`` also brings each layer's parameter shard up twice per step (forward,
      backward) under the compute.
    """
    from automodel.training.step_estimate import GEMM_PEAK_FRACTION, HBM_FRACTION, NORM_FORWARD_BYTES

    out: dict[str, float] = {}
    link = HOST_LINK_GB_S[gpu_type] * 1e9
    n = r.local_tokens
    if r.tiled_layer and d.heads:
        # the backward recomputes each tile's forward but the attention core: the q/k/v and output projections and
        # the MLP (which then runs in the layer's tiles: the tiled MLP's own recompute does not add to it)
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        flops = 2 * (d.hidden * (2 * q + 2 * kv) + d.mlp_matrices * d.hidden * d.intermediate) * d.calls * n
        out["tiled layer"] = flops / (spec.bf16_tflops * 1e12 * GEMM_PEAK_FRACTION)
    elif r.tiled_mlp:
        flops = 2 * d.mlp_matrices * d.hidden * d.intermediate * d.calls * n / r.tp
        out["tiled MLP"] = flops / (spec.bf16_tflops * 1e12 * GEMM_PEAK_FRACTION)
        if r.tp == 1:  # the norms in tiles (automodel.models.tiled_mlp.tile_layer_norms, tile_final_norms)
            norms = d.calls * d.layer_norms * d.layer_norm_tiles + d.final_norm_tiles
            norm_bytes = NORM_FORWARD_BYTES * d.hidden * norms * n * r.compute_bytes / 2
            out["tiled MLP"] += norm_bytes / (spec.hbm_gb_s * 1e9 * HBM_FRACTION)
    if r.activation_offloaded:
        copy = 2 * d.calls * n * d.hidden * r.compute_bytes / r.stream_split / link
        out["activation offload"] = max(0.0, copy - compute_s)
    if r.offload:
        shard = d.local_trainable(r.tp) / r.fsdp
        step = shard / HOST_ADAM_PARAMS_PER_S + 2 * shard * r.master_bytes / link
        if r.offload == "all":
            gathers = 2 * d.local_params(r.tp) / r.fsdp * r.master_bytes / link
            step += max(0.0, gathers - compute_s)
        out[f"offload {r.offload}"] = step
    return out


def _fmt_tokens(n: int) -> str:
    return f"{n:,}" if n else "-"


def _fmt_s(s: float) -> str:
    if s <= 0:
        return "-"
    return f"{s:.2f} s" if s < 60 else f"{s / 60:.1f} min"


def ablation(search: PlanSearch, results: list[Found]) -> list[tuple[str, Found | None]]:
    """ALST's ablation: plain (checkpointing, plain loss, data parallel only), + chunked loss, + CP (the best
    layout with cp > 1), + tiled MLP, + activation offload, all (+ fsdp.offload). Each step keeps the last."""

    def best(pred: Any) -> Found | None:
        cands = [f for f in results if pred(f)]
        return max(cands, key=lambda f: (f.tokens, -f.techniques.cost_rank, -f.step_s), default=None)

    base = Techniques()
    cp1 = [la for la in search.layouts() if la.cp == 1 and la.tp == 1]
    dp_only = cp1[0] if cp1 else None
    rows: list[tuple[str, Found | None]] = []
    rows.append(("plain (ckpt)", best(lambda f: f.layout == dp_only and f.techniques == base)))
    loss = dataclasses.replace(base, chunked_loss=True)
    rows.append(("+ chunked loss", best(lambda f: f.layout == dp_only and f.techniques == loss)))
    cp_any = search.gpus > 1
    rows.append(("+ context parallelism", best(lambda f: f.techniques == loss and f.layout.cp > 1) if cp_any else None))
    tiled = dataclasses.replace(loss, tiled_mlp=True)
    rows.append(("+ tiled MLP", best(lambda f: f.techniques == tiled and (f.layout.cp > 1 or not cp_any)
                                     and f.layout.head_chunks == 1)))
    usable = set(search.techniques)  # a technique the model cannot use is left out of the rows after it
    act = dataclasses.replace(tiled if tiled in usable else loss, activation_offload=True)
    rows.append(("+ activation offload", best(lambda f: f.techniques == act and (f.layout.cp > 1 or not cp_any)
                                              and f.layout.head_chunks == 1)))  # fmt: skip
    ungrouped = (lambda f: f.layout.cp > 1 or f.layout.head_chunks == 1) if not cp_any else (lambda f: True)
    rows.append(("all (+ fsdp.offload)", best(lambda f: f.techniques == dataclasses.replace(act, offload=f.techniques.offload)
                                              and bool(f.techniques.offload) and ungrouped(f)) if act in usable else
                 best(lambda f: f.techniques.chunked_loss and bool(f.techniques.offload) and ungrouped(f))))  # fmt: skip
    layered = dataclasses.replace(act, tiled_layer=True)
    if layered in usable:  # the tiled layer on top of all of them (issue 42)
        rows.append(("+ tiled layer", best(lambda f: f.techniques == dataclasses.replace(layered, offload=f.techniques.offload)
                                           and bool(f.techniques.offload) and ungrouped(f))))  # fmt: skip
        if not cp_any:  # one GPU: the attention's heads in groups (model.attention_head_chunks)
            rows.append(("+ attention head groups", best(
                lambda f: f.techniques == dataclasses.replace(layered, offload=f.techniques.offload)
                and bool(f.techniques.offload) and f.layout.head_chunks > 1)))  # fmt: skip
    top = layered if layered in usable else act
    if any(t.checkpoint_group > 1 for t in usable):  # checkpoint groups on top (the host's layer inputs / k), shown
        grouped = best(lambda f: f.techniques.checkpoint_group > 1 and bool(f.techniques.offload)  # where they help
                       and f.techniques == dataclasses.replace(top, offload=f.techniques.offload,
                                                               checkpoint_group=f.techniques.checkpoint_group))  # fmt: skip
        above = rows[-1][1]
        if grouped is not None and (above is None or grouped.tokens > above.tokens):
            rows.append(("+ checkpoint groups", grouped))
    return rows


def longest_row(results: list[Found]) -> Found:
    """The longest row over every layout and set; ties: the cheaper technique set, then the faster step."""
    return max(results, key=lambda f: (f.tokens, -f.techniques.cost_rank, -f.step_s))


LEGEND = ("techniques: ckpt activation checkpointing, chunk chunked loss (lp: loss parallel under tp), tile tiled MLP,\n"
          "  lay tiled layer and MLP, aoff activation offload, grpK checkpoint groups of K layers, off:opt / off:all\n"
          "  fsdp.offload=optimizer / all, nopk model.cudnn_packed_blocks=false; a layout's h/G: headwise Ulysses, the\n"
          "  heads in G groups one at a time (distributed.ulysses_head_chunks=G; without CP model.attention_head_chunks=G)")


def plan_lines(search: PlanSearch, model_text: str, capacity_gib: float, host_node_gib: float,
               top: int = 8, show_overrides: bool = False) -> list[str]:  # fmt: skip
    """The report: the best technique set of the best ``top`` layouts, the ablation, the longest row's config keys
    and the last line ``longest: ...``. ``show_overrides``: every row's keys under it (the longest row's always).
    A row past the model's positions is marked ``*`` and a note names the RoPE scaling it needs.

    Raises:
        UserInputError: no row fits any layout (the message names the smallest need and the budget).
    """
    results = search.search()
    budget = search.budget / _GIB
    best = longest_row(results)
    if not best.tokens:
        raise UserInputError(_nothing_fits(search, results))
    out = [
        f"automodel plan: {model_text} on {search.gpus} x {search.spec.name}",
        f"device budget {budget:.1f} GiB per GPU ({capacity_gib:.1f} GiB less {DEVICE_RESERVE_GIB:g} GiB reserve); "
        f"host {host_node_gib:g} GiB per node of {search.node} GPU(s)",
        "memory: the planner's prediction (docs/long_context.md); step: an ESTIMATE (docs/estimate.md) of one",
        "  optimizer step of one row per data-parallel rank (the dry run prints it beside its global batch's)",
        _kernel_line(search),
        LEGEND,
        "",
        f"{'layout':<24} {'techniques':<{_TECH_WIDTH}} {'tokens/row':>11} {'GPU GiB':>8} {'host GiB':>9} {'step (est.)':>11}",
    ]
    per_layout: dict[Layout, Found] = {}
    for f in results:
        cur = per_layout.get(f.layout)
        if cur is None or (f.tokens, -f.techniques.cost_rank) > (cur.tokens, -cur.techniques.cost_rank):
            per_layout[f.layout] = f
    ranked = sorted(per_layout.values(), key=lambda f: (-f.tokens, f.step_s))
    for f in ranked[:top]:
        out.append(_row(f.layout.text, f.technique_text, f, search))
        out.extend(_override_lines(search, f) if show_overrides and f.tokens else [])
    if len(ranked) > top:
        out.append(f"... {len(ranked) - top} more layouts (shorter rows)")
    out.append("")
    out.append("ablation (each row adds a technique to the row above, on its best layout):")
    for label, f in ablation(search, results):
        if f is None:
            why = f"not with {search.gpus} GPU" if label == "+ context parallelism" else "not for this model"
            out.append(f"{label:<24} ({why})")
            continue
        out.append(_row(label, f.layout.text, f, search))
        out.extend(_override_lines(search, f) if show_overrides and f.tokens else [])
    out.append("")
    pos = search.positions
    if any(search.past_positions(f.tokens) for f in results):
        if pos.scaling:
            note = (f"* past max_position_embeddings={pos.limit:,}: positions past the ones its {pos.scaling} RoPE "
                    "scaling was set for are extrapolated (the recipe trains them as configured)")  # fmt: skip
        else:
            note = (f"* past the model's {pos.limit:,} positions (max_position_embeddings): the recipe refuses such a "
                    "row unless the config sets a RoPE scaling that covers it (the row's keys below add YaRN: "
                    "++model.config_overrides.rope_parameters=...) or model.allow_position_extrapolation=true")  # fmt: skip
        out.extend(textwrap.wrap(note, width=120, subsequent_indent="  ", break_on_hyphens=False))
    if any(f.tokens >= _MAX_ROW for f in results):
        out.append(f"+ the search stops at {_MAX_ROW:,} tokens per row: a longer one may fit")
    out.append("the longest row's config keys (add --show-overrides for every row's):")
    out.extend(_override_lines(search, best))
    mark = "; past the model's positions" if search.past_positions(best.tokens) else ""
    mark += "; the search's longest" if best.tokens >= _MAX_ROW else ""
    out.append(f"longest: {best.tokens} tokens per row ({best.text}{mark})")
    return out


def _override_lines(search: PlanSearch, f: Found, width: int = 120) -> list[str]:
    """``f``'s config keys, wrapped at ``width`` characters (indented 4)."""
    return textwrap.wrap(" ".join(f.overrides(search.positions)), width=width, initial_indent="    ",
                         subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)  # fmt: skip


def _nothing_fits(search: PlanSearch, results: list[Found]) -> str:
    """The one-line refusal when no layout fits even its shortest row."""
    need = []
    for f in results:
        m = search.row_multiple(f.layout)
        need.append((search.usage(f.layout, f.techniques, m)[0], m, f))
    dev, m, f = min(need, key=lambda x: x[0])
    return (f"no layout of {search.gpus} x {search.gpu_type} fits a row: the smallest plan ({f.text}, {m} tokens) "
            f"needs {dev / _GIB:.2f} GiB per GPU, the budget is {search.budget / _GIB:.2f} GiB (the GPU's memory less "
            f"the {DEVICE_RESERVE_GIB:g} GiB reserve); plan for more GPUs (--gpus), or a larger GPU")  # fmt: skip


def _kernel_line(search: PlanSearch) -> str:
    """Which attention kernel the rows are planned for, and why (its backward buffers are in every row)."""
    from automodel.distributed.cp.attention_kernels import kernel_label

    base = search.base
    text = f"attention kernel: {kernel_label(base.attention_kernel)}; {base.attention_kernel_rule}"
    return "\n".join(textwrap.wrap(text, 116, subsequent_indent="  "))


#: the techniques column: the longest set, ``ckpt+chunk+lay+aoff+grp2+off:all+nopk``, on one line
_TECH_WIDTH = 37


def _row(first: str, second: str, f: Found, search: PlanSearch | None = None) -> str:
    w = _TECH_WIDTH
    text = f"{first[:24]:<24} {second[:w]:<{w}}" if len(second) <= w else f"{first[:24]:<24} {second}\n{'':<{w + 25}}"
    if not f.tokens:
        return f"{text} {'-':>11} {'does not fit':>20}"
    host = f"{f.host_node_gib:.0f}" if f.host_node_gib else "0"
    past = "*" if search is not None and search.past_positions(f.tokens) else ""
    past += "+" if f.tokens >= _MAX_ROW else ""
    return f"{text} {_fmt_tokens(f.tokens) + past:>11} {f.device_gib:>8.1f} {host:>9} {_fmt_s(f.step_s):>11}"


def plan_report(config: str, overrides: list[str], gpus: int, gpu_type: str, gpu_memory_gib: float | None = None,
                host_memory_gib: float | None = None, *, show_overrides: bool = False,
                gpus_per_node: int | None = None) -> list[str]:  # fmt: skip
    """``automodel plan``'s lines for a config file and its overrides (the model on the meta device).

    Raises:
        ConfigError: the config does not type-check; ValueError: the model cannot be built, the GPU type is
        unknown, the budget is not above the reserve, or no row fits.
    """
    search, text, capacity, host_node = build_search(config, overrides, gpus, gpu_type, gpu_memory_gib,
                                                     host_memory_gib, gpus_per_node=gpus_per_node)  # fmt: skip
    return plan_lines(search, text, capacity, host_node, show_overrides=show_overrides)


def check_plan_gpu(gpu_type: str, gpu_memory_gib: float | None = None) -> None:
    """Refuse an unknown ``gpu_type`` (naming the known ones) or a GPU memory not above :data:`DEVICE_RESERVE_GIB`.

    Raises:
        UserInputError: the one-line reason.
    """
    if gpu_type.lower() not in DEVICE_MEMORY_MIB:
        raise UserInputError(
            f"--gpu-type {gpu_type!r} is not a GPU automodel plan knows; use one of {', '.join(sorted(DEVICE_MEMORY_MIB))} "
            "(for another GPU: the nearest one with its memory, --gpu-memory-gib G)"
        )
    if gpu_memory_gib is not None and gpu_memory_gib <= DEVICE_RESERVE_GIB:
        raise UserInputError(
            f"--gpu-memory-gib {gpu_memory_gib:g} leaves nothing to plan with: {DEVICE_RESERVE_GIB:g} GiB of each GPU is "
            "the reserve for the CUDA context, cuBLAS and NCCL workspaces and the allocator; give the GPU's whole "
            "memory in GiB (more than the reserve)"
        )


def build_search(config: str, overrides: list[str], gpus: int, gpu_type: str, gpu_memory_gib: float | None = None,
                 host_memory_gib: float | None = None, *,
                 gpus_per_node: int | None = None) -> tuple[PlanSearch, str, float, float]:  # fmt: skip
    """The :class:`PlanSearch` of a config file and its overrides (the model on the meta device), with the
    model's one-line description, the GPU's capacity (GiB) and the node's host memory (GiB): what
    :func:`plan_report` prints, for callers that measure a row (``scripts/gpu_check.py``'s memory check).

    ``gpus_per_node``: GPUs per node (default: :data:`~automodel.config.gpu_specs.GPUSpec.gpus_per_node`, 8); the
    search keeps tp within a node and shares the node's host memory among its GPUs.

    Raises:
        ConfigError: the config does not type-check; ValueError: the model cannot be built, the GPU type is
        unknown or the budget is not above the reserve (:func:`check_plan_gpu`).
    """
    check_plan_gpu(gpu_type, gpu_memory_gib)
    from automodel.config import RecipeConfig
    from automodel.config.compose import compose_config, resolve_config_path
    from automodel.config.typecheck import ConfigError, to_dataclass
    from automodel.distributed.cp.guard import cached_profile
    from automodel.models.loader import build_model, model_positions, resolve_model_config
    from automodel.models.parallelize import check_model_config_for_tp
    from automodel.training.memory_plan import model_dims, planned_kernel, run_shape_from_config
    from automodel.training.step_estimate import gpu_spec

    raw = compose_config(resolve_config_path(config), overrides)
    problems: list[str] = []
    cfg = to_dataclass(RecipeConfig, raw, problems)
    if problems:
        raise ConfigError(problems)
    resolved = resolve_model_config(cfg.model, dry_run=True)
    attn = cfg.model.attn_implementation or "sdpa"
    model = build_model(cfg.model, resolved, attn_implementation=attn, seed=cfg.recipe.seed, meta=True)
    if cfg.peft is not None:
        from automodel.models.lora import apply_lora

        apply_lora(model, cfg.peft, seed=cfg.recipe.seed)
    dims, profile = model_dims(model), cached_profile(model)
    base = run_shape_from_config(cfg, {"cp": 1, "tp": 1, "dp_shard": 1}, 1, 1)
    # the kernel for the GPU asked for (the config's recipe.gpu_type may name another); cp 1's path, SDPA: the
    # search's CP layouts keep this kernel (a pin applies to every path; auto's rule differs only for cuDNN)
    kernel, rule = planned_kernel(cfg.model.attention_backend, gpu_type, base, dims)
    base = dataclasses.replace(base, attention_kernel=kernel, attention_kernel_rule=rule)

    def tp_ok(tp: int) -> bool:
        try:
            check_model_config_for_tp(resolved.config, tp, sequence_parallel=True)
        except ValueError:
            return False
        return True

    spec = gpu_spec(gpu_type)
    per_node = gpus_per_node or spec.gpus_per_node
    capacity, budget = device_budget_gib(gpu_type, gpu_memory_gib)
    host_node, on_node = host_budget_gib(gpus, per_node, host_memory_gib)
    search = PlanSearch(dims, profile, base, gpus, spec, gpu_type, budget * _GIB, host_node / on_node * _GIB, tp_ok,
                        positions=model_positions(resolved.config), gpus_per_node=per_node,
                        techniques=usable_techniques(model))  # fmt: skip
    search.attention_backend = cfg.model.attention_backend
    text = f"{type(model).__name__} ({dims.params / 1e9:.2f}B parameters, {dims.layers} layers, hidden {dims.hidden})"
    return search, text, capacity, host_node


def usable_techniques(model: Any) -> list[Techniques]:
    """:func:`all_techniques` less those the recipe refuses for ``model`` (on the meta device): checkpointing (and
    so activation offload) where the model does not support it, the tiled MLP where it finds no MLP to tile."""
    from automodel.models.tiled_layer import check_tiled_layer_for_model
    from automodel.models.tiled_mlp import check_tiled_mlp_for_model

    out = all_techniques()
    if not getattr(model, "supports_gradient_checkpointing", False):
        out = [t for t in out if not t.checkpointing]
    try:
        check_tiled_mlp_for_model(model, True)
    except UserInputError:
        out = [t for t in out if not t.tiled_mlp]
    try:
        check_tiled_layer_for_model(model, True)
    except UserInputError:
        out = [t for t in out if not t.tiled_layer]
    return out
