"""Predicted per-rank memory of a training run, term by term, and the cheapest change that fits a budget.

``recipe.dry_run=true`` prints :func:`memory_plan_lines`; ``scripts/bench_memory.py`` checks the
prediction against measurement. Two figures, reported separately because they are measured separately:

* **persistent state**: what lives between optimizer steps on each rank: the FSDP2 shard of the
  parameters (master dtype) and of the AdamW states (two per trainable parameter, master dtype).
  Gradients do not persist (the trainer zeroes them with ``set_to_none=True``).
* **step peak**: the most one step (forward, loss, backward, optimizer step of one micro-batch) holds
  *above* that state at any moment. It is the largest of three phases, each a sum of terms:

  - ``loss``: end of forward / start of backward: the saved activations, the logits-and-loss
    peak, the FSDP2 buffers, the gradients of earlier micro-batches (grad_acc > 1);
  - ``recompute`` (activation checkpointing only): backward through one layer: the saved layer
    inputs, one layer's recomputed activations and its backward temporaries, the gradients, buffers;
  - ``optimizer``: all gradients, the FSDP2 buffers and the optimizer's temporaries.

Terms (bytes per rank; ``N`` = local tokens of one micro-batch = ``local_batch_size * seq / cp``,
``h`` hidden, ``I`` MLP width, ``kv`` = kv_heads * head_dim, ``V`` vocab, ``c`` compute-dtype bytes):

* parameters, AdamW states: ``params / fsdp`` and ``2 * trainable / fsdp`` master-dtype values, where
  ``fsdp = dp_shard * cp`` (FSDP2 shards over ``dp_shard_cp``, see ``automodel.models.parallelize``).
* gradients: ``trainable / fsdp`` in the master dtype (FSDP2 keeps sharded gradients).
* activations, per decoder layer and local token (HF Llama-style block under sdpa, counted tensor by
  tensor from what autograd saves): ``(10 h + 2 kv + 4 I) c`` without checkpointing, i.e. two RMSNorm
  outputs each (4 h), q after RoPE (h), k after RoPE and v (2 kv), k and v as a GQA attention
  kernel saves them (2 h: CPU and ring kernels repeat them to all heads; 0 without GQA), the
  attention output and its transposed copy (2 h), the residual (h), and gate, up, silu(gate),
  silu(gate) * up (4 I); measured within 10% on CPU (see docs/recipe.md, "Memory plan"); plus
  ``(h + 3 h) c`` outside the layers (embedding output, final norm), the ids/labels/positions (24 B).
  With activation checkpointing only each layer's input (``h c``) is kept; backward recomputes one
  layer at a time and holds its activations plus the gradients at its output and input (``2 h c``;
  its other backward temporaries replace saved tensors it has already freed).
  Activations divide by ``cp`` (the local tokens) and ``tp`` (sequence-parallel TP; TP is not yet
  available).
* attention workspace: ring: the K/V blocks in flight (received + being sent: ``4 kv c`` per local
  token) and the fp32 partial output and LSE being merged (``2 (h + heads) 4``); backward
  additionally rotates dK/dV in fp32 (``4 kv 4``). Ulysses: the all-to-all buffers of q, k, v and
  the output (in and out: ``2 (2 h + 2 kv') c``, ``kv'`` the kv heads sent). ``eager`` attention saves
  its ``[heads, S_q, S_k]`` probabilities per layer (an S² term; shown under activations).
* logits and loss: plain: the fp32 log-softmax output, the incoming gradient and the logits
  gradient alive together in backward, ``3 N V 4``, plus the hidden-state gradient ``N h c``.
  Chunked (``loss.chunk_tokens = n``): ``2 n V 4`` (one chunk's logits and their softmax; the loop
  frees each chunk before the next), the fp32 LM-head gradient accumulator ``V h 4`` (plus its cast for a non-fp32 weight)
  and ``N h c``.
* communication buffers (FSDP2, when ``fsdp > 1`` or the compute dtype differs from the master
  dtype): the root module (embeddings, final norm, LM head) stays gathered from forward to
  backward (``reshard_after_forward=False``), two decoder layers gathered at a time (the current one
  and the prefetched next; all of them when ``fsdp.reshard_after_forward=false``) and one layer's
  unsharded gradient before its reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

__all__ = [
    "ModelDims",
    "RunShape",
    "MemoryTerm",
    "MemoryPlan",
    "model_dims",
    "plan_memory",
    "suggest_changes",
    "memory_plan_lines",
    "run_shape_from_config",
    "DEFAULT_CHUNK_TOKENS",
]

DEFAULT_CHUNK_TOKENS = 1024  # what a suggestion turns the chunked loss on with
_GIB = 2**30


@dataclass(frozen=True)
class ModelDims:
    """The sizes the planner needs from a decoder-only causal LM (see :func:`model_dims`)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # unique parameters (tied weights once)
    trainable: int  # parameters with requires_grad (LoRA: the adapters)
    layer_params: int  # parameters of the largest decoder layer
    root_params: int  # parameters outside the decoder layers (embeddings, final norm, LM head)


@dataclass(frozen=True)
class RunShape:
    """How one rank runs: parallel sizes, sequence, dtypes and the memory switches of the config."""

    local_batch: int  # rows per micro-batch (step_scheduler.local_batch_size)
    seq: int  # padded global row length
    cp: int = 1
    tp: int = 1
    dp_shard: int = 1
    cp_method: str = "ring"  # ring | ulysses
    attn: str = "sdpa"
    activation_checkpointing: bool = False
    chunk_tokens: int | None = None
    master_bytes: int = 4
    compute_bytes: int = 4
    reduce_bytes: int = 4
    grad_acc: int = 1
    reshard_after_forward: bool = True
    fsdp_enabled: bool = True  # fsdp.enabled=false: every rank holds the whole model (replicated)

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp if self.fsdp_enabled else 1

    @property
    def local_tokens(self) -> int:
        return self.local_batch * self.seq // (self.cp * self.tp)


@dataclass(frozen=True)
class MemoryTerm:
    name: str  # one of TERMS
    bytes: float
    note: str = ""


# step terms in print order; a phase sums a subset of them
TERMS = (
    "gradients",
    "activations",
    "attention workspace",
    "logits and loss",
    "communication buffers",
    "optimizer temporaries",
)


@dataclass
class MemoryPlan:
    """Per-rank prediction. ``phases`` maps a phase name to ``{term: bytes}``; the peak is the largest."""

    persistent: list[MemoryTerm]
    terms: dict[str, MemoryTerm]
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def persistent_bytes(self) -> float:
        return sum(t.bytes for t in self.persistent)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def step_peak_bytes(self) -> float:
        return sum(self.phases[self.peak_phase].values())

    @property
    def total_bytes(self) -> float:
        return self.persistent_bytes + self.step_peak_bytes

    @property
    def dominant(self) -> str:
        """The largest single term of the total: a persistent term or a term of the peak phase."""
        cands = {t.name: t.bytes for t in self.persistent} | self.phases[self.peak_phase]
        return max(cands, key=cands.get)


def model_dims(model) -> ModelDims:  # noqa: ANN001 (an HF PreTrainedModel, possibly on the meta device)
    """Read :class:`ModelDims` from an HF causal LM (meta tensors are fine: only shapes are read)."""
    from automodel.models.parallelize import decoder_layers

    c = model.config
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    unique = {id(p): p for p in model.parameters()}.values()
    try:
        layers = decoder_layers(model)
    except ValueError:  # a model that does not name its blocks: every parameter counts as root
        layers = []
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    return ModelDims(
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        intermediate=getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        vocab=c.vocab_size,
        params=sum(p.numel() for p in unique),
        trainable=sum(p.numel() for p in unique if p.requires_grad),
        layer_params=max((sum(p.numel() for p in layer.parameters()) for layer in layers), default=0),
        root_params=sum(p.numel() for p in unique if id(p) not in in_layers),
    )


def _activation_terms(d: ModelDims, r: RunShape) -> tuple[float, float, str]:
    """(saved activations, extra of one recomputed layer in backward, note), bytes per rank."""
    n, c = r.local_tokens, r.compute_bytes
    h, kv, i = d.hidden, d.kv_heads * d.head_dim, d.intermediate
    repeated = 2 * h if d.kv_heads < d.heads else 0  # GQA: the kernel saves K/V repeated to all heads
    layer = (8 * h + repeated + 2 * kv + 4 * i) * c + d.heads * 4 / r.tp  # + the kernel's fp32 LSE
    outside = 4 * h * c + 24
    s2 = 0.0
    if r.attn == "eager":  # probabilities and their pre-dropout copy, [heads, S_q, S_k] per layer
        heads_local = d.heads // (r.cp if r.cp_method == "ulysses" else 1)
        s_q = r.seq if r.cp_method == "ulysses" else r.local_tokens // r.local_batch
        s2 = 2 * r.local_batch * heads_local * s_q * r.seq * c
    if r.activation_checkpointing:
        saved = n * (d.layers * h * c + outside)
        recompute = n * (layer + 2 * h * c) + s2
        note = f"{d.layers} layer inputs kept; one layer recomputed in backward: {_fmt(recompute)}"
        return saved, recompute, note
    saved = n * (d.layers * layer + outside) + d.layers * s2
    note = f"{d.layers} layers x {_fmt(n * layer + s2)}" + (" (eager: an S^2 term per layer)" if s2 else "")
    return saved, 0.0, note


def _attention_workspace(d: ModelDims, r: RunShape) -> tuple[float, str]:
    n, c = r.local_tokens, r.compute_bytes
    h, kv = d.hidden, d.kv_heads * d.head_dim
    if r.cp == 1:
        return 0.0, "no CP"
    if r.cp_method == "ulysses":
        kv_sent = d.kv_heads * (r.cp // math.gcd(d.kv_heads, r.cp)) * d.head_dim
        return 2 * (2 * h + 2 * kv_sent) * c * n, "ulysses all-to-all buffers of q, k, v and the output"
    fwd = 4 * kv * c + 2 * (h + d.heads) * 4
    bwd = 4 * kv * c + 4 * kv * 4 + (h + 2 * kv) * 4
    return n * max(fwd, bwd), "ring: K/V blocks in flight, fp32 partial outputs and dK/dV rotation"


def _loss_term(d: ModelDims, r: RunShape) -> tuple[float, str]:
    n, c, v, h = r.local_tokens, r.compute_bytes, d.vocab, d.hidden
    grad_h = n * h * c
    if r.chunk_tokens is None:
        return 3 * n * v * 4 + grad_h, f"plain: [{n}, {v}] fp32 log-probs, their gradient and the logits gradient"
    rows = min(r.chunk_tokens, n)
    live = 2  # one chunk's logits and their softmax (each chunk is freed before the next)
    acc = v * h * 4 + (v * h * r.compute_bytes if r.compute_bytes != 4 else 0)
    return live * rows * v * 4 + acc + grad_h, f"chunked: [{rows}, {v}] per chunk + the fp32 LM-head gradient"


def _comm_buffers(d: ModelDims, r: RunShape) -> tuple[float, str]:
    if not r.fsdp_enabled:  # automodel.distributed.replicate: one flat buffer of every gradient
        return d.trainable * r.master_bytes, "replicated: flat gradient all-reduce buffer"
    if r.fsdp == 1 and r.compute_bytes == r.master_bytes:
        return 0.0, "no FSDP sharding (fsdp size 1)"
    gathered_layers = 2 if r.reshard_after_forward else d.layers
    b = d.root_params * r.compute_bytes + d.layer_params * (gathered_layers * r.compute_bytes + r.reduce_bytes)
    return b, f"root gathered fwd->bwd, {gathered_layers} layers gathered, one layer's gradient before reduce-scatter"


def plan_memory(d: ModelDims, r: RunShape) -> MemoryPlan:
    """Predict one rank's persistent state and step peak (see the module docstring for every term).

    Returns:
        A :class:`MemoryPlan`; nothing is mutated and nothing is allocated.
    """
    shard = 1 / r.fsdp
    persistent = [
        MemoryTerm("parameters", d.params * shard * r.master_bytes, f"1/{r.fsdp} of {d.params / 1e6:.1f}M"),
        MemoryTerm("optimizer states", 2 * d.trainable * shard * r.master_bytes, "AdamW exp_avg, exp_avg_sq"),
    ]
    grads = d.trainable * shard * r.master_bytes
    saved, recompute, act_note = _activation_terms(d, r)
    attn, attn_note = _attention_workspace(d, r)
    loss, loss_note = _loss_term(d, r)
    comm, comm_note = _comm_buffers(d, r)
    terms = {
        "gradients": MemoryTerm("gradients", grads, f"1/{r.fsdp} of {d.trainable / 1e6:.1f}M trainable"),
        "activations": MemoryTerm("activations", saved + recompute, act_note),
        "attention workspace": MemoryTerm("attention workspace", attn, attn_note),
        "logits and loss": MemoryTerm("logits and loss", loss, loss_note),
        "communication buffers": MemoryTerm("communication buffers", comm, comm_note),
        "optimizer temporaries": MemoryTerm("optimizer temporaries", grads, "one gradient-sized temporary"),
    }
    earlier_grads = grads if r.grad_acc > 1 else 0.0
    phases = {
        "loss": {
            "gradients": earlier_grads,
            "activations": saved,
            "attention workspace": attn,
            "logits and loss": loss,
            "communication buffers": comm,
        },
        "optimizer": {"gradients": grads, "communication buffers": comm, "optimizer temporaries": grads},
    }
    if r.activation_checkpointing:
        phases["recompute"] = {
            "gradients": grads,
            "activations": saved + recompute,
            "attention workspace": attn,
            "communication buffers": comm,
        }
    else:  # the attention workspace of the last layer's forward, on top of all but its own activations
        phases["loss"]["attention workspace"] = 0.0 if loss >= attn else attn
    return MemoryPlan(persistent, terms, phases)


def _fmt(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def _changes(r: RunShape, world: int) -> list[tuple[str, RunShape, str]]:
    """Candidate changes, cheapest first: (config overrides, new shape, its price)."""
    out: list[tuple[str, RunShape, str]] = []
    chunk = {"chunk_tokens": DEFAULT_CHUNK_TOKENS}
    ac = {"activation_checkpointing": True}
    local = []
    if r.chunk_tokens is None:
        local.append((f"loss.chunk_tokens={DEFAULT_CHUNK_TOKENS}", chunk, "one more LM-head matmul per token"))
    if not r.activation_checkpointing:
        local.append(("model.activation_checkpointing=true", ac, "one more forward of every layer (~+30% time)"))
    if r.chunk_tokens is None and not r.activation_checkpointing:
        local.append((f"loss.chunk_tokens={DEFAULT_CHUNK_TOKENS} model.activation_checkpointing=true", chunk | ac,
                      "both recomputations"))  # fmt: skip
    for keys, kw, price in local:
        out.append((keys, dataclasses.replace(r, **kw), price))
    factor = 2
    while r.cp * factor <= 64 and r.seq % (2 * r.cp * factor) == 0:
        cp = r.cp * factor
        if r.dp_shard % factor == 0:
            where = f"same {world} ranks: dp_shard {r.dp_shard} -> {r.dp_shard // factor}, grad_acc x{factor}"
            shape = dataclasses.replace(r, cp=cp, dp_shard=r.dp_shard // factor, grad_acc=r.grad_acc * factor)
        else:
            where = f"{world * factor} ranks instead of {world}"
            shape = dataclasses.replace(r, cp=cp)
        out.append((f"distributed.cp_size={cp}", shape, where))
        for keys, kw, price in local:
            out.append((f"distributed.cp_size={cp} {keys}", dataclasses.replace(shape, **kw), f"{where}; {price}"))
        factor *= 2
    return out


def suggest_changes(d: ModelDims, r: RunShape, budget_bytes: float, world: int) -> list[str]:
    """Lines saying whether ``r`` fits ``budget_bytes`` per rank and, if not, the cheapest change that does.

    Changes are tried cheapest first: the chunked loss, activation checkpointing, both, then doubling
    ``cp_size`` (on the same ranks when ``dp_shard`` allows, else on more ranks), alone and with the
    cheaper changes. Tensor parallelism is not available yet (``distributed.tp_size > 1`` is rejected).
    """
    plan = plan_memory(d, r)
    head = f"budget {_fmt(budget_bytes)} per rank (recipe.memory_budget_gib): predicted {_fmt(plan.total_bytes)}"
    if plan.total_bytes <= budget_bytes:
        return [head + " -> fits"]
    lines = [head + f" -> does NOT fit (over by {_fmt(plan.total_bytes - budget_bytes)})"]
    for keys, shape, price in _changes(r, world):
        p = plan_memory(d, shape)
        if p.total_bytes <= budget_bytes:
            lines.append(f"cheapest change that fits: {keys} -> {_fmt(p.total_bytes)} per rank ({price})")
            break
    else:
        lines.append(
            "no change tried fits (chunked loss, activation checkpointing, cp_size up to 64): the persistent "
            f"state alone is {_fmt(plan.persistent_bytes)}; shard it over more ranks (dp_shard) or shorten data.seq_len"
        )
    lines.append("tensor parallelism (distributed.tp_size > 1) would divide activations too, but is not available yet")
    return lines


def memory_plan_lines(d: ModelDims, r: RunShape, *, budget_gib: float | None = None, world: int = 1) -> list[str]:
    """The dry run's memory section: persistent state, step terms by phase, peak, dominant term, budget."""
    plan = plan_memory(d, r)
    out = ["--- predicted memory per rank (automodel.training.memory_plan; CPU-calibrated) ---"]
    out.append(
        f"local tokens per micro-batch {r.local_tokens} (= {r.local_batch} x {r.seq} / cp {r.cp}"
        + (f" / tp {r.tp}" if r.tp > 1 else "") + f"); compute {r.compute_bytes} B, master {r.master_bytes} B"
    )
    out.append(f"persistent between steps: {_fmt(plan.persistent_bytes)}")
    for t in plan.persistent:
        out.append(f"  {t.name:<24}{_fmt(t.bytes):>12}  {t.note}")
    out.append("step terms:")
    for name in TERMS:
        t = plan.terms[name]
        out.append(f"  {name:<24}{_fmt(t.bytes):>12}  {t.note}")
    for phase, parts in plan.phases.items():
        mark = "  <- step peak" if phase == plan.peak_phase else ""
        out.append(f"  phase {phase:<18}{_fmt(sum(parts.values())):>12}{mark}")
    out.append(
        f"step peak {_fmt(plan.step_peak_bytes)} above the persistent state; total {_fmt(plan.total_bytes)} per "
        f"rank; dominant term: {plan.dominant}"
    )
    if budget_gib is not None:
        out.extend(suggest_changes(d, r, budget_gib * _GIB, world))
    return out


def run_shape_from_config(cfg, sizes: dict[str, int], seq: int, grad_acc: int) -> RunShape:  # noqa: ANN001
    """The :class:`RunShape` of a validated :class:`~automodel.config.schema.RecipeConfig`.

    ``sizes``: the resolved parallel sizes (``parallel_sizes``); ``seq``: the padded row length.
    ``fsdp.param_dtype=auto`` is planned as bfloat16 (CUDA), like the rest of the dry run.
    """
    nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}
    compute = "bfloat16" if cfg.fsdp.param_dtype == "auto" else cfg.fsdp.param_dtype
    return RunShape(
        local_batch=cfg.step_scheduler.local_batch_size,
        seq=seq,
        cp=sizes["cp"],
        tp=sizes["tp"],
        dp_shard=sizes["dp_shard"],
        cp_method=cfg.distributed.cp_method,
        attn=cfg.model.attn_implementation or "sdpa",
        activation_checkpointing=cfg.model.activation_checkpointing,
        chunk_tokens=cfg.loss.chunk_tokens,
        master_bytes=nbytes[cfg.model.dtype],
        compute_bytes=nbytes[compute] if cfg.fsdp.enabled else nbytes[cfg.model.dtype],
        reduce_bytes=nbytes[cfg.fsdp.reduce_dtype],
        grad_acc=grad_acc,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        fsdp_enabled=cfg.fsdp.enabled,
    )
