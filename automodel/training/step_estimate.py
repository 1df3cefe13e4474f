"""The dry run's step-time estimate on a named GPU (``recipe.gpu_type``): compute and communication per rank.

Labelled an estimate everywhere it is printed: arithmetic on the model's sizes, the data-sheet peaks of
:mod:`automodel.config.gpu_specs` and the few achieved-fraction constants below, nothing measured. The
formulas, the constants' sources and the calibration against published runs: ``docs/estimate.md``.
Per optimizer step and per rank (BF16 compute, the recipe's settings: no Float8, no torch.compile):

- **FLOPs** (:func:`flops_per_token`). Matrix products ``6 N`` per token (forward 2, backward 4), with
  ``N`` = :attr:`ModelDims.matmul_params` (every parameter but the input-embedding lookup table; the LM
  head counts). Causal attention ``6 L S d`` per token, forward and backward, ``d`` = heads x head_dim:
  the forward's ``Q K^T`` and ``P V`` are ``2 S d`` each per token over the whole row, causal masking
  halves them (``2 S d``), backward is twice the forward. Activation checkpointing recomputes each
  decoder layer's forward once: ``+ 2 N_layers`` (the LM head is not recomputed) and ``+ 2 L S d``; checkpoint
  groups of ``k`` (``model.checkpoint_group_layers``) run ``L - ceil(L / k)`` layer forwards once more
  (:func:`replayed_layers`: their matrix products, attention and CP exchange). A looped model
  (:attr:`ModelDims.layer_calls`: Dory, Inkling2-loop, HRM) counts ``L`` as its layer calls and its repeated
  layers' parameters once more per call; its calls under ``no_grad`` add a forward (``2 N``, ``2 S d``). A
  rank does ``1 / (cp tp)`` of a row's attention (head-tail chunks balance the causal work; TP splits
  heads) and ``1 / tp`` of the matrix products of its ``rows * S / cp`` tokens.
- **compute time**: matrix products at the achieved throughput of their GEMM shapes
  (:func:`gemm_efficiency`: a roofline, :data:`GEMM_PEAK_FRACTION` of the peak for large GEMMs, memory
  bound for thin ones); attention at the achieved fraction of the peak of the planned kernel on that
  GPU, per pass (:mod:`automodel.training.attention_speed`, each constant cited); the memory-bound rest (norms, RoPE, activations, residual adds, the loss, the
  optimizer step) as bytes over :data:`HBM_FRACTION` of the HBM bandwidth (:func:`memory_bound_bytes`);
  at least :data:`HOST_S_PER_LAYER` per layer and micro-batch (eager PyTorch's launch floor, small models).
- **communication**, bytes each rank sends per step (ring algorithms: ``(n - 1) / n`` of the data), over
  NVLink inside a node and over the node's shared NICs across nodes
  (:meth:`GPUSpec.inter_node_gb_s`), at :data:`LINK_FRACTION` of the link. What overlaps:
  FSDP2's all-gathers and reduce-scatters (and HSDP's / DDP's gradient all-reduce) run under the compute
  (prefetch); only one layer's worth is exposed. Tensor parallelism's all-reduces (2 per layer forward,
  2 backward, 2 more when checkpointing recomputes the forward) add to the step. CP attention moves what
  its method declares, read through the one cost model
  (:func:`automodel.distributed.cp.cost.exchange_cost`, which ``cp_method: auto`` ranks methods by): each
  collective's forward and backward bytes, inside a node or across nodes, the forward once more when it is
  recomputed. Each pass's exchange hides under the share of that pass's attention compute it declares
  (ring: its K/V all-gather under the diagonal block, its dK/dV rotation under the backward's other
  blocks) and adds the rest (all-gathers and all-to-alls the attention waits for).

The step time is ``max(compute + exposed communication, overlapped communication) + one layer of FSDP``;
tokens/s/GPU = the step's tokens / step time / world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from automodel.config.gpu_specs import GPU_SPECS, GPUSpec
from automodel.distributed.cp.attention_kernels import kernel_label
from automodel.distributed.cp.cost import exchange_cost
from automodel.distributed.cp.method import ExchangeTerm
from automodel.training.attention_speed import attention_seconds, kernel_speed
from automodel.training.memory_plan import ModelDims, RunShape

__all__ = [
    "GEMM_PEAK_FRACTION",
    "HBM_FRACTION",
    "NORM_FORWARD_BYTES",
    "LINK_FRACTION",
    "HOST_S_PER_LAYER",
    "CommTerm",
    "StepEstimate",
    "flops_per_token",
    "compute_flops",
    "gemm_efficiency",
    "matmul_efficiency",
    "memory_bound_bytes",
    "comm_terms",
    "estimate_step",
    "step_estimate_lines",
]

#: Large BF16 GEMMs inside a training step: cuBLAS reaches about 70-75% of the H100's data-sheet peak on
#: big square GEMMs alone; back to back in a step (power and clock limits) we take 0.6, which puts
#: torchtitan's plain-FSDP BF16 Llama-3.1-8B run (33% MFU, docs/estimate.md) within our band.
GEMM_PEAK_FRACTION = 0.60
#: Streaming (memory-bound) kernels and GEMM operand traffic reach about 80% of the HBM data sheet.
HBM_FRACTION = 0.80
#: NCCL collectives reach about 80% of the link's data-sheet bandwidth (bus bandwidth).
LINK_FRACTION = 0.80
#: Eager PyTorch launches each op from Python (about 10 us each); a Llama-style layer runs about 200 ops
#: forward + backward, so a micro-batch takes at least this long per layer however small its kernels are.
HOST_S_PER_LAYER = 2e-3
#: HBM bytes per element of one RMSNorm forward in fp32 from bf16 (upcast, square, mean, scale, downcast, weight)
NORM_FORWARD_BYTES = 36
#: The backward of the elementwise ops moves about twice the forward's bytes (the incoming gradient plus
#: the saved inputs in, the input gradients out).
_ELEMENTWISE_BACKWARD = 2.0


def flops_per_token(d: ModelDims, seq: int, activation_checkpointing: bool) -> tuple[float, float]:
    """``(matrix-product FLOPs, causal-attention FLOPs)`` per token of a row of ``seq`` tokens, forward and
    backward together (see the module docstring): ``6 N [+ 2 N_layers]`` and ``(6 [+ 2]) L S d``."""
    # a looped model (ModelDims.layer_calls) multiplies its repeated layers' parameters again per call, and runs its
    # calls under no_grad forward only (2 N, 2 S d per call)
    looped = d.layer_matmul_params + d.looped_params
    mm = 6.0 * (d.matmul_params + d.looped_params) + (2.0 * looped if activation_checkpointing else 0.0)
    mm += 2.0 * d.no_grad_params
    calls = (8.0 if activation_checkpointing else 6.0) * d.calls + 2.0 * d.no_grad_layer_calls
    attn = calls * seq * d.heads * d.head_dim
    return mm, attn


def compute_flops(d: ModelDims, r: RunShape, global_rows: int) -> float:
    """FLOPs of one optimizer step over all ranks (matrix products + causal attention)."""
    mm, attn = flops_per_token(d, r.seq, r.activation_checkpointing)
    return (mm + attn) * global_rows * r.seq


def _gemm_time(m: float, k: float, n: float, c: int, spec: GPUSpec) -> float:
    """Seconds of one ``[m, k] @ [k, n]`` GEMM: the roofline ``max(FLOPs / achieved peak, bytes / achieved HBM)``."""
    flops = 2.0 * m * k * n
    bytes_moved = c * (m * k + k * n + m * n)
    return max(flops / (spec.bf16_tflops * 1e12 * GEMM_PEAK_FRACTION), bytes_moved / (spec.hbm_gb_s * 1e9 * HBM_FRACTION))


def gemm_efficiency(m: float, k: float, n: float, spec: GPUSpec, c: int = 2) -> float:
    """Achieved fraction of the BF16 peak of one ``[m, k] @ [k, n]`` GEMM: :data:`GEMM_PEAK_FRACTION` when
    it is compute bound (large ``m``, ``k``, ``n``), falling as ``bytes / FLOPs`` grows (few tokens per
    rank, or a thin ``k`` / ``n`` after TP)."""
    return 2.0 * m * k * n / (spec.bf16_tflops * 1e12) / _gemm_time(m, k, n, c, spec)


def _layer_gemms(d: ModelDims, tokens: int, tp: int) -> list[tuple[float, float, float]]:
    """The ``(m, k, n)`` of one decoder layer's projections on one rank (Llama-style block: q, k, v, o,
    gate, up, down), TP-sharded (column-parallel ``n / tp``, row-parallel ``k / tp``)."""
    q, kv, h, i = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.hidden, d.intermediate
    up = [(tokens, h, i / tp)] * (d.mlp_matrices - 1)  # gate and up; a plain MLP (fc1 -> act -> fc2): fc1
    return [(tokens, h, q / tp), (tokens, h, kv / tp), (tokens, h, kv / tp), (tokens, q / tp, h),
            *up, (tokens, i / tp, h)]  # fmt: skip


def matmul_efficiency(d: ModelDims, tokens: int, tp: int, spec: GPUSpec, c: int = 2) -> float:
    """FLOP-weighted achieved fraction of the peak over one layer's GEMMs and the LM head, for ``tokens``
    per rank per micro-batch (the backward's two GEMMs per projection have the same three sizes)."""
    gemms = [*_layer_gemms(d, tokens, tp) * d.calls, (tokens, d.hidden, d.vocab / tp)]
    flops = sum(2.0 * m * k * n for m, k, n in gemms)
    seconds = sum(_gemm_time(m, k, n, c, spec) for m, k, n in gemms)
    return flops / (spec.bf16_tflops * 1e12) / seconds


def memory_bound_bytes(d: ModelDims, r: RunShape) -> dict[str, float]:
    """HBM bytes per rank per micro-batch of the memory-bound work (HF eager modules, no fusion), by part.

    Forward, per token and layer, in compute-dtype bytes ``c`` (counted as bf16 and scaled by ``c / 2``):
    two RMSNorms in fp32 (upcast, square, mean, scale, downcast, weight: ``36 h`` each), RoPE on q and k
    (``20`` bytes per element), the attention output's transpose (``4 q``), SiLU(gate) * up (``10 I``),
    two residual adds (``12 h``). Backward twice the forward, the recomputed forward once more. Norms and
    residual adds run on the whole stream on every TP rank (``/ tp`` under sequence parallelism), the rest
    on the rank's heads and MLP slice. The loss: about 32 bytes per logit (fp32 upcast, log-softmax,
    its backward) on ``V`` (``V / tp`` with loss parallel). The optimizer (per step, not per micro-batch;
    reported separately): AdamW reads the parameter, gradient and two states and writes three back, plus
    the gradient-norm read: ``8`` master-dtype values per trainable parameter of the rank's shard.
    """
    c = r.compute_bytes / 2.0
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    stream = (2 * NORM_FORWARD_BYTES + 12) * d.hidden / r.stream_split
    sharded = (20 * (q + kv) + 4 * q + 10 * d.intermediate) / r.tp
    passes = 1 + _ELEMENTWISE_BACKWARD + (1 if r.activation_checkpointing else 0)
    layers = r.local_tokens * d.calls * (stream + sharded) * c * passes
    vocab = d.vocab / r.tp if r.loss_parallel else d.vocab
    loss = r.local_tokens * 32 * vocab
    optimizer = 8 * r.master_bytes * d.local_trainable(r.tp) / max(1, r.fsdp)
    return {"elementwise": layers, "loss": loss, "optimizer": optimizer}


@dataclass(frozen=True)
class CommTerm:
    """One collective's traffic per rank per optimizer step.

    ``overlap``: ``"compute"`` runs under the whole step's compute (FSDP prefetch), ``"attention"`` under
    the shares of each pass's attention compute its ``exchange`` declares (ring CP), ``"none"`` adds to the
    step (TP all-reduces, all-gather and all-to-all CP methods). ``exchange``: a CP attention term, the
    method's declaration per layer and micro-batch (``None`` for the other collectives)."""

    name: str
    bytes: float  # sent per rank per optimizer step
    intra_node: bool
    note: str
    overlap: str = "none"
    exchange: ExchangeTerm | None = None


def _span_inside_node(span: int, node: int) -> bool:
    """A group of ``span`` consecutive ranks (row-major mesh) stays inside nodes of ``node`` ranks."""
    return span <= node and node % span == 0


def comm_terms(d: ModelDims, r: RunShape, sizes: dict[str, int], node: int) -> list[CommTerm]:
    """Bytes each rank sends per optimizer step, by collective, with what each overlaps (module docstring)."""
    out: list[CommTerm] = []
    tp, cp, fsdp, rep = sizes["tp"], sizes["cp"], r.fsdp, sizes["dp_replicate"]
    local_params, trainable = d.local_params(tp), d.local_trainable(tp)
    if r.fsdp_enabled and fsdp > 1:
        gathers = 2 if r.reshard_after_forward else 1
        frac = (fsdp - 1) / fsdp
        b = r.grad_acc * frac * (gathers * local_params * r.compute_bytes + trainable * r.reduce_bytes)
        note = (f"{gathers} all-gather(s) of the parameters + 1 reduce-scatter of the gradients per micro-batch, "
                f"x{r.grad_acc}; prefetched under the compute")  # fmt: skip
        out.append(CommTerm(f"FSDP over {fsdp}", b, _span_inside_node(fsdp * tp, node), note, "compute"))
    elif not r.fsdp_enabled and fsdp * rep > 1:
        n = sizes["dp"] * cp
        out.append(CommTerm(f"gradient all-reduce over {n}", 2 * (n - 1) / n * trainable * r.master_bytes,
                            _span_inside_node(n * tp, node), "replicated parameters: one all-reduce per step, "
                            "bucketed under the backward", "compute"))  # fmt: skip
    if r.fsdp_enabled and rep > 1:
        b = 2 * (rep - 1) / rep * trainable / max(1, fsdp) * r.reduce_bytes
        out.append(CommTerm(f"HSDP all-reduce over {rep} replicas", b, _span_inside_node(rep * fsdp * tp, node),
                            "the gradient shards, once per step, under the backward", "compute"))  # fmt: skip
    n_tok = r.local_tokens
    if tp > 1:
        per_layer = 4 + (2 if r.activation_checkpointing else 0)
        b = r.grad_acc * d.calls * per_layer * 2 * (tp - 1) / tp * n_tok * d.hidden * r.compute_bytes
        out.append(CommTerm(f"tensor parallel over {tp}", b, _span_inside_node(tp, node),
                            f"{per_layer} all-reduces of [N, h] per layer (2 forward, 2 backward"
                            + (", 2 recomputed" if r.activation_checkpointing else "") + "); not overlapped"))  # fmt: skip
    if cp > 1:  # the method's one declaration (exchange_cost; cp_method auto ranks methods by the same)
        method = r.method  # its options bound (usp: ulysses_size)
        cost = exchange_cost(method, d, seq_len=r.seq, cp_size=cp, tp_size=tp, ranks_per_node=node,
                             packed=r.packed, local_batch=r.local_batch, compute_bytes=r.compute_bytes,
                             head_chunks=head_groups(r))  # fmt: skip
        label = ", ".join([method.name, *(f"{k}={v}" for k, v in method.options().items())])
        ac = r.activation_checkpointing
        replay = replayed_layers(d, r)  # checkpoint groups: these layers' forwards, and their exchange, once more
        for t, across in cost.items():
            b = r.grad_acc * (d.calls * (t.bytes + (t.forward_bytes if ac else 0.0)) + replay * t.forward_bytes)
            hidden = [f"{share:.0%} of the {what} attention" for share, what in
                      ((t.forward_overlap, "forward"), (t.backward_overlap, "backward")) if share > 0]  # fmt: skip
            again = (", again recomputed" if ac else "") + (f" (and in {replay} rebuilt layer forwards)" if replay else "")
            passes = ([f"{_fmt_bytes(t.forward_bytes)} forward" + again] if t.forward_bytes else []) + ([f"{_fmt_bytes(t.backward_bytes)} backward"] if t.backward_bytes else [])  # fmt: skip
            out.append(CommTerm(f"CP attention over {t.group} ({label})", b, not across,
                                f"{t.what}: {' + '.join(passes)} per layer; "
                                + (f"under {' and '.join(hidden)}" if hidden else "not overlapped"),
                                "attention" if t.overlaps else "none", t))  # fmt: skip
    return out


@dataclass
class StepEstimate:
    """The estimate of one optimizer step on one rank (seconds, FLOPs, bytes)."""

    matmul_flops: float
    attention_flops: float
    matmul_eff: float
    matmul_s: float
    attention_s: float
    memory_bytes: dict[str, float]
    memory_s: float
    host_s: float = 0.0  # the launch floor: HOST_S_PER_LAYER per layer and micro-batch (x 4/3 recomputing)
    comm: list[tuple[CommTerm, float]] = field(default_factory=list)  # each term with its seconds
    comm_exposed: list[float] = field(default_factory=list)  # of each term's seconds, what adds to the step
    exposed_s: float = 0.0  # communication that adds to the step
    overlapped_s: float = 0.0  # communication under the compute (FSDP, gradient all-reduce)
    step_s: float = 0.0
    tokens_per_step: int = 0
    world: int = 1

    @property
    def compute_s(self) -> float:
        """The GPU's compute (matrix products, attention, memory-bound work), or the host's launch floor."""
        return max(self.matmul_s + self.attention_s + self.memory_s, self.host_s)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_s / self.world


def estimate_step(
    d: ModelDims, r: RunShape, sizes: dict[str, int], world: int, global_rows: int, spec: GPUSpec, node: int
) -> StepEstimate:
    """The step estimate of the module docstring for a run of shape ``r`` on ``world`` ranks of ``spec``
    GPUs, ``node`` ranks per node; ``global_rows`` rows of ``r.seq`` tokens per optimizer step."""
    peak = spec.bf16_tflops * 1e12
    tp = sizes["tp"]
    mm_tok, attn_tok = flops_per_token(d, r.seq, r.activation_checkpointing)
    rank_tokens = r.grad_acc * r.local_tokens  # tokens of the rank's rows (its 1/cp share) per step
    mm = mm_tok * rank_tokens / tp
    attn = attn_tok * rank_tokens / tp  # attn_tok averages a causal row; head-tail chunks balance it over cp
    passes = 4 if r.activation_checkpointing else 3  # forward attention passes: backward 2, recomputed forward 1
    if head_groups(r) > 1:  # headwise Ulysses: the backward recomputes each head group's attention forward
        attn *= (passes + 1) / passes
        passes += 1
    replay = replayed_layers(d, r) / max(1, d.calls)  # checkpoint groups: members' inputs rebuilt by a forward
    if replay:
        mm += replay * 2.0 * d.layer_matmul_params * rank_tokens / tp
        attn *= (passes + replay) / passes
        passes += replay
    eff = matmul_efficiency(d, r.local_tokens, tp, spec, r.compute_bytes)
    mem = memory_bound_bytes(d, r)
    per_step = {k: v * (1 if k == "optimizer" else r.grad_acc) for k, v in mem.items()}
    est = StepEstimate(
        matmul_flops=mm, attention_flops=attn, matmul_eff=eff, matmul_s=mm / (peak * eff),
        attention_s=attention_seconds(attn, r.attention_kernel, spec, r.activation_checkpointing), memory_bytes=per_step,
        memory_s=sum(per_step.values()) / (spec.hbm_gb_s * 1e9 * HBM_FRACTION),
        host_s=r.grad_acc * d.calls * HOST_S_PER_LAYER * (4 / 3 if r.activation_checkpointing else 1.0),
        tokens_per_step=global_rows * r.seq, world=world,
    )  # fmt: skip
    # one layer's forward attention per micro-batch: backward is twice it, a recomputed forward once more
    forward_attention_s = est.attention_s / (r.grad_acc * max(1, d.calls) * passes)
    for t in comm_terms(d, r, sizes, node):
        bw = (spec.intra_node_gb_s if t.intra_node else spec.inter_node_gb_s(node)) * 1e9 * LINK_FRACTION
        seconds = t.bytes / bw
        if t.overlap == "compute":
            exposed = 0.0
            est.overlapped_s += seconds
        elif t.exchange is not None:  # CP attention: each pass hides under its own overlapped compute only
            ac = r.activation_checkpointing
            per_layer = t.exchange.exposed_seconds(bw, forward_attention_s, ac)
            # a rebuilt layer forward (checkpoint groups) exchanges as a recomputed forward does
            forward_once = (t.exchange.exposed_seconds(bw, forward_attention_s, True)
                            - t.exchange.exposed_seconds(bw, forward_attention_s, False))  # fmt: skip
            exposed = r.grad_acc * (d.calls * per_layer + replayed_layers(d, r) * forward_once)
            est.exposed_s += exposed
        else:
            exposed = seconds
            est.exposed_s += seconds
        est.comm.append((t, seconds))
        est.comm_exposed.append(exposed)
    first_layer = est.overlapped_s / max(1, d.layers)  # the first all-gather / last reduce-scatter wait
    est.step_s = max(est.compute_s + est.exposed_s, est.overlapped_s) + first_layer
    return est


def replayed_layers(d: ModelDims, r: RunShape) -> int:
    """Layer forwards that checkpoint groups (``model.checkpoint_group_layers=k``) run again per micro-batch to
    rebuild their members' inputs: ``L - ceil(L / k)`` (0 without groups)."""
    if r.group <= 1:
        return 0
    from automodel.models.checkpoint_groups import group_starts

    return d.calls - group_starts(d.calls, r.group)


def head_groups(r: RunShape) -> int:
    """The head groups the run's attention runs one at a time (``distributed.ulysses_head_chunks`` under a method
    that splits heads, ``model.attention_head_chunks`` without CP; else 1)."""
    if r.head_chunks <= 1 or (r.cp > 1 and not r.method.head_chunk_ranks(r.cp)):
        return 1
    return r.head_chunks


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def gpu_spec(gpu_type: str) -> GPUSpec:
    """The :data:`GPU_SPECS` entry of ``recipe.gpu_type`` (validated by the config)."""
    return GPU_SPECS[gpu_type.lower()]


def step_estimate_lines(
    d: ModelDims, r: RunShape, sizes: dict[str, int], world: int, global_rows: int, gpu_type: str | None,
    nproc_per_node: int | None = None,
) -> list[str]:  # fmt: skip
    """The dry run's estimate section for ``gpu_type`` (None: one line saying how to ask for it)."""
    if gpu_type is None:
        return [f"--- step-time estimate: set recipe.gpu_type (one of {sorted(GPU_SPECS)}) for one ---"]
    spec = gpu_spec(gpu_type)
    node = nproc_per_node or spec.gpus_per_node
    est = estimate_step(d, r, sizes, world, global_rows, spec, node)
    speed = kernel_speed(r.attention_kernel, spec)
    out = [f"--- step-time ESTIMATE on {spec.name} (data-sheet peaks x the achieved fractions of docs/estimate.md; "
           f"BF16, no Float8 / torch.compile; nothing measured; {spec.network}) ---"]  # fmt: skip
    ac = " + the recomputed forward" if r.activation_checkpointing else ""
    out.append(
        f"compute: {(est.matmul_flops + est.attention_flops) / 1e12:.1f} TFLOP per rank per step = matrix products "
        f"{est.matmul_flops / 1e12:.1f} (6N{ac}, N = {d.matmul_params / 1e9:.2f}B) + causal attention "
        f"{est.attention_flops / 1e12:.1f} (6 L S d per token{ac}"
        + (f" + the attention forward once more: {head_groups(r)} head groups, each recomputed in the backward"
           if head_groups(r) > 1 else "")
        + f", S = {r.seq})"
    )
    tp_note = f", tp {sizes['tp']}" if sizes["tp"] > 1 else ""
    out.append(
        f"  matrix products at {est.matmul_eff:.0%} of the BF16 peak ({spec.bf16_tflops:.0f} TFLOP/s; GEMMs of "
        f"{r.local_tokens} tokens per rank{tp_note}) -> {_fmt_s(est.matmul_s)}; "
        f"attention at {speed.fraction(r.activation_checkpointing):.0%} -> {_fmt_s(est.attention_s)}"
    )
    out.append(f"  attention kernel: {kernel_label(r.attention_kernel)}: forward {speed.forward:.0%}, backward "
               f"{speed.backward:.0%} of the peak ({speed.source})")  # fmt: skip
    parts = ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in est.memory_bytes.items())
    out.append(
        f"  memory-bound work ({parts}) at {HBM_FRACTION:.0%} of {spec.hbm_gb_s / 1e3:.2f} TB/s HBM -> {_fmt_s(est.memory_s)}"
    )
    if est.host_s > est.matmul_s + est.attention_s + est.memory_s:
        out.append(f"  kernels this small are launch bound: at least {_fmt_s(est.host_s)} of Python dispatch "
                   f"({HOST_S_PER_LAYER * 1e3:.0f} ms per layer and micro-batch, eager PyTorch)")  # fmt: skip
    for (t, seconds), exposed in zip(est.comm, est.comm_exposed):
        where = "inside a node (NVLink)" if t.intra_node else f"across nodes (the node's NICs shared by {node} ranks)"
        shown = f" ({_fmt_s(exposed)} of it exposed)" if t.overlap == "attention" else ""
        out.append(f"communication, {t.name}: {_fmt_bytes(t.bytes)} sent per rank per step {where} -> "
                   f"{_fmt_s(seconds)}{shown}; {t.note}")  # fmt: skip
    if not est.comm:
        out.append("communication: none (one rank, no parallelism)")
    mfu = (est.matmul_flops + est.attention_flops) / est.step_s / (spec.bf16_tflops * 1e12)
    out.append(
        f"estimated step time: {_fmt_s(est.step_s)} (compute {_fmt_s(est.compute_s)} + exposed communication "
        f"{_fmt_s(est.exposed_s)}; {_fmt_s(est.overlapped_s)} under the compute); {r.grad_acc} micro-batch(es), "
        f"{node} GPUs per node assumed"
    )
    out.append(
        f"estimated throughput: {est.tokens_per_s_per_gpu:,.0f} tokens/s/GPU ({est.tokens_per_step} tokens per step "
        f"over {world} GPUs; {mfu:.0%} of the BF16 peak in model FLOPs, recompute included)"
    )
    if r.compute_bytes > 2:
        out.append("  (the compute dtype is float32: the BF16 peak does not apply, expect several times slower)")
    if r.attn == "eager":
        out.append("  (model.attn_implementation=eager materialises the scores: its attention is slower than assumed)")
    return out
