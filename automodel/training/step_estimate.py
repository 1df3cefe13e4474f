"""A rough step-time and communication estimate for the dry run, on a named GPU (``recipe.gpu_type``).

Labelled an estimate everywhere it is printed: arithmetic on the model's sizes and the data-sheet
peaks of :mod:`automodel.config.gpu_specs`, nothing measured. Per optimizer step and per rank:

- compute: ``6 P T`` FLOPs for the matrix products (P parameters, T tokens; ``8 P T`` with activation
  checkpointing, which runs each forward twice) plus the causal attention ``6 L S^2 H d`` per row
  (``8`` with checkpointing), divided over the world; timed at the peak and at an assumed model
  FLOPs utilisation (:data:`ASSUMED_MFU`).
- communication, each collective's bytes sent per rank (ring algorithms: ``(n - 1) / n`` of the data),
  over the link its group uses (inside a node: NVLink; across nodes: the network):
  FSDP2 all-gathers the parameters in the forward and again in the backward (``reshard_after_forward``)
  and reduce-scatters the gradients, every micro-batch; HSDP all-reduces the gradient shards across
  replicas once a step; tensor parallelism all-reduces ``[N, h]`` twice per layer forward and twice in
  backward; CP attention exchanges, per layer, what the method declares
  (:meth:`CPMethod.exchange_terms`; by default from :meth:`CPMethod.attention_extent`: K and V of the
  rest of the row, forward and twice that in backward; or q, k, v and the output of a full row with
  ``heads / cp``, forward and as much again in backward). ``cp_method: auto`` ranks methods by the same terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from automodel.config.gpu_specs import GPU_SPECS, GPUSpec
from automodel.training.memory_plan import ModelDims, RunShape

__all__ = ["ASSUMED_MFU", "CommTerm", "step_estimate_lines", "compute_flops", "comm_terms"]

ASSUMED_MFU = 0.4


@dataclass(frozen=True)
class CommTerm:
    name: str
    bytes: float  # sent per rank per optimizer step
    intra_node: bool
    note: str


def compute_flops(d: ModelDims, r: RunShape, global_rows: int) -> float:
    """FLOPs of one optimizer step over all ranks (matrix products + causal attention)."""
    passes = 8 if r.activation_checkpointing else 6  # fwd (2) + bwd (4) [+ recomputed fwd (2)]
    tokens = global_rows * r.seq
    attn = passes / 2 * d.layers * r.seq**2 * d.heads * d.head_dim * global_rows  # causal: half of 2 S^2 H d
    return passes * d.params * tokens + attn


def _span_inside_node(span: int, node: int) -> bool:
    """A group of ``span`` consecutive ranks (row-major mesh) stays inside nodes of ``node`` ranks."""
    return span <= node and node % span == 0


def comm_terms(d: ModelDims, r: RunShape, sizes: dict[str, int], node: int) -> list[CommTerm]:
    """Bytes each rank sends per optimizer step, by collective (see the module docstring)."""
    from automodel.distributed.cp import get_cp_method

    out: list[CommTerm] = []
    tp, cp, fsdp, rep = sizes["tp"], sizes["cp"], r.fsdp, sizes["dp_replicate"]
    local_params, trainable = d.local_params(tp), d.local_trainable(tp)
    if r.fsdp_enabled and fsdp > 1:
        gathers = 2 if r.reshard_after_forward else 1
        frac = (fsdp - 1) / fsdp
        b = r.grad_acc * frac * (gathers * local_params * r.compute_bytes + trainable * r.reduce_bytes)
        note = f"{gathers} all-gather(s) of the parameters + 1 reduce-scatter of the gradients per micro-batch, x{r.grad_acc}"
        out.append(CommTerm(f"FSDP over {fsdp}", b, _span_inside_node(fsdp * tp, node), note))
    elif not r.fsdp_enabled and fsdp * rep > 1:
        n = sizes["dp"] * cp
        out.append(CommTerm(f"gradient all-reduce over {n}", 2 * (n - 1) / n * trainable * r.master_bytes,
                            _span_inside_node(n * tp, node), "replicated parameters: one all-reduce per step"))  # fmt: skip
    if r.fsdp_enabled and rep > 1:
        b = 2 * (rep - 1) / rep * trainable / max(1, fsdp) * r.reduce_bytes
        out.append(CommTerm(f"HSDP all-reduce over {rep} replicas", b, _span_inside_node(rep * fsdp * tp, node),
                            "the gradient shards, once per step"))  # fmt: skip
    n_tok = r.local_tokens
    if tp > 1:
        b = r.grad_acc * d.layers * 4 * 2 * (tp - 1) / tp * n_tok * d.hidden * r.compute_bytes
        out.append(CommTerm(f"tensor parallel over {tp}", b, _span_inside_node(tp, node),
                            "2 all-reduces of [N, h] per layer forward, 2 in backward"))  # fmt: skip
    if cp > 1:  # the method's own exchange terms (CPMethod.exchange_terms; cp_method auto ranks methods by them)
        for t in get_cp_method(r.cp_method).exchange_terms(d, r):
            out.append(CommTerm(f"CP attention over {t.group} ({r.cp_method})", r.grad_acc * d.layers * t.bytes,
                                _span_inside_node(t.span * tp, node),
                                f"{t.what} per layer forward, {t.passes - 1}x that in backward"))  # fmt: skip
    return out


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def step_estimate_lines(
    d: ModelDims, r: RunShape, sizes: dict[str, int], world: int, global_rows: int, gpu_type: str | None,
    nproc_per_node: int | None = None,
) -> list[str]:  # fmt: skip
    """The dry run's estimate section for ``gpu_type`` (None: one line saying how to ask for it)."""
    if gpu_type is None:
        return [f"--- step-time estimate: set recipe.gpu_type (one of {sorted(GPU_SPECS)}) for a rough one ---"]
    spec: GPUSpec = GPU_SPECS[gpu_type.lower()]
    node = nproc_per_node or spec.gpus_per_node
    out = [f"--- step-time ESTIMATE on {spec.name} (data-sheet peaks, nothing measured; {spec.network}) ---"]
    flops = compute_flops(d, r, global_rows) / world
    peak = spec.bf16_tflops * 1e12
    t_peak, t_mfu = flops / peak, flops / (peak * ASSUMED_MFU)
    out.append(
        f"compute: {flops / 1e12:.1f} TFLOP per rank per step -> {_fmt_s(t_peak)} at the BF16 peak "
        f"({spec.bf16_tflops:.0f} TFLOP/s), about {_fmt_s(t_mfu)} at an assumed {ASSUMED_MFU:.0%} utilisation"
    )
    t_comm = 0.0
    for t in comm_terms(d, r, sizes, node):
        bw = (spec.intra_node_gb_s if t.intra_node else spec.inter_node_gb_s) * 1e9
        t_comm += t.bytes / bw
        where = "inside a node" if t.intra_node else "across nodes"
        out.append(
            f"communication, {t.name}: {_fmt_bytes(t.bytes)} sent per rank per step {where} "
            f"({bw / 1e9:.0f} GB/s) -> {_fmt_s(t.bytes / bw)}; {t.note}"
        )
    if t_comm == 0:
        out.append("communication: none (one rank, no parallelism)")
    out.append(
        f"estimated step time: {_fmt_s(max(t_mfu, t_comm))} (communication fully overlapped) to "
        f"{_fmt_s(t_mfu + t_comm)} (not overlapped); {r.grad_acc} micro-batch(es), {node} GPUs per node assumed"
    )
    return out
