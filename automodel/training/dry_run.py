"""``recipe.dry_run=true``: print the plan (mesh layout, per-rank shapes, memory, a step-time estimate); train nothing.

No process group, no weights, no network: the mesh is computed from the sizes (the same row-major
layout ``init_device_mesh`` uses), the model is built on the meta device from its config (the
pretrained ``config.json`` if it is available locally, else the inline ``model.config``), and the
shapes and memory figures are arithmetic. So a config for a 64-GPU cluster can be checked on a
laptop: ``python recipes/finetune.py --config configs/X.yaml recipe.dry_run=true``
(``recipe.dry_run_world_size=N`` plans for N ranks, else ``recipe.gpus``, the GPUs the config is
written for; ``recipe.plan_nnodes`` / ``recipe.plan_nproc_per_node`` place them on nodes, see
``node_plan.py``; ``recipe.gpu_type`` adds a step-time and communication estimate,
``step_estimate.py``; ``recipe.plan_layouts`` ranks other layouts by it, ``layout_ranking.py``). The resolved config follows the plan with ``recipe.dry_run_print_config=true``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from automodel.config import LoadedConfig, parallel_sizes
from automodel.distributed.cp.layout import head_tail_spans
from automodel.training.node_plan import node_plan_lines, planned_nodes

__all__ = ["rank_layout", "head_tail_positions", "dry_run_report"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def rank_layout(sizes: dict[str, int]) -> list[dict[str, int]]:
    """Per global rank: its coordinates on (dp_replicate, dp_shard, cp, tp), dp rank and FSDP index.

    Row-major over ``(dp_replicate, dp_shard, cp, tp)`` like ``init_device_mesh``.
    """
    shape = (sizes["dp_replicate"], sizes["dp_shard"], sizes["cp"], sizes["tp"])
    grid = np.arange(int(np.prod(shape))).reshape(shape)
    out = []
    for rank in range(grid.size):
        rep, shard, cp, tp = (int(i) for i in np.argwhere(grid == rank)[0])
        out.append(
            {
                "rank": rank,
                "dp_replicate": rep,
                "dp_shard": shard,
                "cp": cp,
                "tp": tp,
                "dp_rank": rep * sizes["dp_shard"] + shard,
                "fsdp_index": shard * sizes["cp"] + cp,  # index in the dp_shard_cp group
            }
        )
    return out


def head_tail_positions(seq_len: int, cp: int, cp_rank: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of a row that CP rank ``cp_rank`` holds: chunks r and 2cp-1-r.

    The whole row at ``cp == 1``; else :func:`automodel.distributed.cp.layout.head_tail_spans` (the
    one head-tail formula; ``ValueError`` unless ``seq_len`` is a multiple of ``2 * cp``).
    """
    if cp == 1:
        return [(0, seq_len)]
    return head_tail_spans(seq_len, cp, cp_rank)


def _gib(n_bytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def _tokenizer_vocab(name: str | None, pretrained_model: str | None) -> tuple[int | None, str]:
    """Vocabulary size of the run's tokenizer (``data.tokenizer``, else the model's own, else the shipped one:
    :func:`~automodel.data.tokenizer.tokenizer_source`) if it can be read locally (no network in a dry run)."""
    from automodel.data.tokenizer import load_run_tokenizer, own_tokenizer_note, tokenizer_source

    source = tokenizer_source(name, pretrained_model)
    own = own_tokenizer_note(name, pretrained_model)
    if source not in (None, "default") and not Path(str(source)).expanduser().is_dir():
        return None, f"{source}{own} (hub id: not loaded in a dry run)"
    tok = load_run_tokenizer(name, pretrained_model)
    return len(tok), f"{source or 'shipped default'}{own} ({len(tok)} ids)"


@dataclass
class _Plan:
    """The figures the report's sections share (computed by :func:`_layout_lines`)."""

    loaded: LoadedConfig
    sizes: dict[str, int]
    method: Any  # the configured CP method
    grad_acc: int
    fsdp_size: int
    seq: int  # the padded row length
    local_seq: int  # one CP rank's share of it

    @property
    def cfg(self) -> Any:
        return self.loaded.cfg

    @property
    def world(self) -> int:
        return self.loaded.world_size


def _layout_lines(loaded: LoadedConfig, out: list[str]) -> _Plan:
    """The parallel layout: the mesh, the batch, each rank's coordinates and token ranges, the nodes."""
    from automodel.distributed.cp import get_cp_method
    from automodel.training.row_padding import pad_multiple

    cfg, world = loaded.cfg, loaded.world_size
    sizes, problems = parallel_sizes(cfg, world)
    assert not problems, problems  # validated before
    sched = cfg.step_scheduler
    mult = pad_multiple(cfg)
    seq = -(-cfg.data.seq_len // mult) * mult
    method = get_cp_method(cfg.distributed.cp_method).configured(cfg)  # its options bound (usp: ulysses_size)
    plan = _Plan(loaded, sizes, method, sched.global_batch_size // (sched.local_batch_size * sizes["dp"]),
                 sizes["dp_shard"] * sizes["cp"], seq, seq // sizes["cp"])  # fmt: skip
    out.append("--- parallel layout ---")
    out.append(
        f"world size {world} = dp_replicate {sizes['dp_replicate']} x dp_shard {sizes['dp_shard']} x "
        f"cp {sizes['cp']} x tp {sizes['tp']}; dp = {sizes['dp']}; FSDP shards over dp_shard_cp = {plan.fsdp_size}"
        + (f" (HSDP: replicated {sizes['dp_replicate']}x)" if sizes["dp_replicate"] > 1 else "")
    )
    out.append(method.describe(seq, sizes["cp"]))
    out.append(
        f"global batch {sched.global_batch_size} rows = local {sched.local_batch_size} x dp {sizes['dp']} x grad_acc "
        f"{plan.grad_acc}; {sched.global_batch_size * seq} tokens per optimizer step, {sched.max_steps} steps"
    )
    layout = rank_layout(sizes)
    out.append("rank  dp_rep dp_shard cp tp | dp_rank fsdp_idx | token ranges of each row")
    for r in layout[:64]:
        ranges = ", ".join(f"[{a}, {b})" for a, b in method.token_ranges(seq, sizes["cp"], r["cp"]))
        out.append(
            f"{r['rank']:>4}  {r['dp_replicate']:>6} {r['dp_shard']:>8} {r['cp']:>2} {r['tp']:>2} | "
            f"{r['dp_rank']:>7} {r['fsdp_index']:>8} | {ranges}"
        )
    if len(layout) > 64:
        out.append(f"... ({len(layout) - 64} more ranks, same pattern)")
    nodes = planned_nodes(cfg.recipe.plan_nnodes, cfg.recipe.plan_nproc_per_node, world)
    if nodes is not None:  # recipe.plan_nnodes / plan_nproc_per_node: ranks per node, groups vs nodes
        out.extend(node_plan_lines(sizes, *nodes, cp_sub_groups=method.cp_sub_groups(sizes["cp"])))
    return plan


def _resolve_auto(loaded: LoadedConfig) -> Any:
    """``distributed.cp_method: auto``: the method chosen for the model (profiled on the meta device), written
    into ``loaded.cfg`` as a run would (:func:`automodel.config.cp_auto.resolve_cp_method`); the choice, or
    ``None`` when the config names a method. ``recipe.plan_nproc_per_node`` is the node layout it plans for."""
    import torch

    from automodel.distributed.cp import AUTO

    cfg = loaded.cfg
    if cfg.distributed.cp_method != AUTO:
        return None
    from automodel.config.cp_auto import resolve_cp_method
    from automodel.models.cp_check import profile_for_run
    from automodel.models.loader import resolve_model_config

    attn = cfg.model.attn_implementation or "sdpa"
    profile = profile_for_run(cfg, resolve_model_config(cfg.model, dry_run=True), attn)
    return resolve_cp_method(cfg, profile, loaded.world_size, torch.cuda.is_available())


def _meta_model(plan: _Plan) -> tuple[Any, Any, str, Any]:
    """The model on the meta device, checked for this run: ``(model, resolved config, tokenizer text, profile)``.

    Raises ``ValueError`` for a model that cannot train this run (the run's own checks, in its order).
    """
    from automodel.models.cp_check import check_model_for_cp_run
    from automodel.models.loader import build_model, check_model_for_run, resolve_model_config
    from automodel.models.parallelize import check_model_config_for_tp

    cfg, d = plan.cfg, plan.cfg.distributed
    resolved = resolve_model_config(cfg.model, dry_run=True)
    vocab_needed, tok_desc = _tokenizer_vocab(cfg.data.tokenizer, cfg.model.pretrained_model_name_or_path)
    attn = cfg.model.attn_implementation or "sdpa"
    check_model_for_run(
        resolved.config,
        attn_implementation=attn,
        cp_size=d.cp_size,
        cp_method=d.cp_method,
        seq_len=cfg.data.seq_len,
        vocab_needed=vocab_needed,
        trust_remote_code=cfg.model.trust_remote_code,
        allow_position_extrapolation=cfg.model.allow_position_extrapolation,
    )
    check_model_config_for_tp(resolved.config, d.tp_size, sequence_parallel=d.sequence_parallel)
    model = build_model(cfg.model, resolved, attn_implementation=attn, seed=cfg.recipe.seed, meta=True)
    profile = check_model_for_cp_run(cfg, resolved, attn, model)  # exact or refused, per layer kind
    if cfg.peft is not None:  # peft.target_modules must select modules of this model
        from automodel.models.lora import apply_lora

        apply_lora(model, cfg.peft, seed=cfg.recipe.seed)  # checks the targets; meta: nothing allocated
    return model, resolved, tok_desc, profile


def _model_lines(plan: _Plan, model: Any, resolved: Any, tok_desc: str, profile: Any, out: list[str]) -> Any:
    """The model section: class, sizes, parameters per rank (and LoRA's). Returns its dims (memory_plan)."""
    from automodel.training.memory_plan import model_dims

    cfg, attn = plan.cfg, plan.cfg.model.attn_implementation or "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    n_unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    master = _BYTES[cfg.model.dtype]
    dims = model_dims(model)
    tp = plan.sizes["tp"]
    shard = dims.local_params(tp) / plan.fsdp_size  # TP-sharded weights / tp, norms whole; then FSDP2
    out.append("--- model ---")
    out.append(f"source: {resolved.source}")
    out.append(
        f"class: {type(model).__name__}, attn_implementation={attn}, activation_checkpointing="
        f"{cfg.model.activation_checkpointing}"
    )
    if profile is not None:
        from automodel.distributed.cp.profile import profile_line

        out.append(f"{profile_line(profile)}; exact under cp_method {plan.method.name}")
    out.append(f"tokenizer: {tok_desc}")
    heads = f"heads {dims.heads} (kv {dims.kv_heads}, head_dim {dims.head_dim})" if dims.heads else "no attention"
    out.append(
        f"layers {dims.layers}, hidden {dims.hidden}, {heads}, vocab {dims.vocab}, parameters {n_unique / 1e6:.1f}M"
        + (f" ({n_params / 1e6:.1f}M counting tied weights twice)" if n_params != n_unique else "")
    )
    over = f"FSDP over {plan.fsdp_size}"
    if tp > 1:
        over = f"TP over {tp}: {dims.tp_params / 1e6:.1f}M sharded, norms whole; then {over}"
    out.append(
        f"per rank ({over}): {shard / 1e6:.1f}M parameters = {_gib(shard * master)} master "
        f"({cfg.model.dtype}) + {_gib(shard * master)} grads + {_gib(2 * shard * master)} AdamW states; "
        f"compute dtype {cfg.fsdp.param_dtype}"
        + (" (estimates assume bfloat16, i.e. CUDA)" if cfg.fsdp.param_dtype == "auto" else "")
    )
    if cfg.peft is not None:
        n_lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out.append(
            f"peft {cfg.peft.method} r={cfg.peft.r}: {n_lora / 1e6:.3f}M of them are trainable adapters; grads "
            f"and AdamW states exist only for these: {_gib(3 * n_lora / plan.fsdp_size * master)} per rank, not "
            f"the figures above"
        )
    return dims


def _shape_lines(plan: _Plan, model: Any, dims: Any, out: list[str]) -> None:
    """Per-rank shapes of one micro-batch, the logits with the loss, the activations kept for backward."""
    from automodel.training.memory_plan import plan_memory, run_shape_from_config

    cfg, d, sizes = plan.cfg, plan.cfg.distributed, plan.sizes
    tp, seq, local_seq = sizes["tp"], plan.seq, plan.local_seq
    heads, kv, head_dim = dims.heads, dims.kv_heads, dims.head_dim  # 0: a model without attention (Mamba)
    compute_name = "bfloat16" if cfg.fsdp.param_dtype == "auto" else cfg.fsdp.param_dtype
    b = cfg.step_scheduler.local_batch_size
    out.append("--- per-rank shapes of one micro-batch (identical on every rank) ---")
    out.append(f"input_ids, labels        [{b}, {seq}] int64 before CP -> [{b}, {local_seq}] on each rank")
    out.append(
        f"position_ids             [1, {seq}] -> [1, {local_seq}] (global positions of the rank's chunks)"
    )
    sp = d.sequence_parallel and tp > 1
    out.append(
        f"hidden states            [{b}, {local_seq // tp if sp else local_seq}, {dims.hidden}] {compute_name}"
        + (f" between blocks (sequence parallel: 1/{tp} of the rank's tokens; gathered for the projections)" if sp else "")
    )
    if heads:
        out.append(
            f"attention q / k,v        [{b}, {heads // tp}, {local_seq}, {head_dim}] / [{b}, {kv // tp}, {local_seq}, {head_dim}]"
            + (f" (tp {tp}: {heads // tp} of {heads} heads, {kv // tp} of {kv} kv heads)" if tp > 1 else "")
        )
    attn = cfg.model.attn_implementation or "sdpa"
    if sizes["cp"] > 1 and heads:  # the method's own exchange (ring rotation, Ulysses all-to-all, thd all-gather)
        out.extend(plan.method.describe_attention(b, heads // tp, kv // tp, head_dim, seq, sizes["cp"], attn))
    shape = run_shape_from_config(cfg, sizes, seq, plan.grad_acc)  # predicted per-rank peak, term by term
    loss_term = plan_memory(dims, shape).terms["logits and loss"]  # the one logits figure of the report
    lp = tp > 1 and d.enable_loss_parallel
    out.append(
        f"logits                   [{b}, {local_seq}, {dims.vocab // tp if lp else dims.vocab}] {compute_name}"
        + (f" (loss parallel: V / tp {tp})" if lp else " (gathered over tp)" if tp > 1 else "")
        + f"; with the loss: {_gib(loss_term.bytes)} (the 'logits and loss' term below: {loss_term.note})"
    )
    per_layer_act = b * (local_seq // tp if sp else local_seq) * dims.hidden * _BYTES[compute_name]
    group = cfg.model.checkpoint_group_layers if cfg.model.activation_checkpointing else 1
    if isinstance(group, int) and group > 1:  # model.checkpoint_group_layers: each group's first layer's input
        from automodel.models.checkpoint_groups import group_starts

        kept = group_starts(dims.calls, group)
        out.append(f"layer inputs kept for backward: {kept} of {dims.calls} x {_gib(per_layer_act)} (checkpoint "
                   f"groups of {group}: each group's first; the others rebuilt in the backward by one more forward of "
                   f"{dims.calls - kept} layers)")  # fmt: skip
        return
    out.append(
        f"layer inputs kept for backward: {dims.calls} x {_gib(per_layer_act)}"
        + (" (activation checkpointing: only these)" if cfg.model.activation_checkpointing else "")
        + (f" (a looped model: {dims.layers} layers called {dims.calls} times)" if dims.layer_calls else "")
    )


def _kernel_lines(plan: _Plan, profile: Any, out: list[str]) -> None:
    """The attention kernel of each layer kind's blocks on the planned GPU (``recipe.gpu_type``, else an H100),
    with this torch and its cuDNN (on a CPU-only torch the reference wheel's, ``REFERENCE_CUDNN_VERSION``; a CUDA
    build's own without a GPU too, as the memory plan takes it), ``model.attention_backend``'s pin and
    ``model.cudnn_packed_blocks``, as the run's CUDA block kernels select them (``block_backend.select_kernel``)."""
    import torch

    from automodel.config.cp_auto import packed_rows
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.distributed.cp.attention_kernels import AUTO_BACKEND, KERNEL_OF_BACKEND
    from automodel.distributed.cp.block_backend import REFERENCE_CUDNN_VERSION, GpuInfo
    from automodel.distributed.cp.kernel_plan import layer_kind_kernel_lines

    cfg = plan.cfg
    if profile is None or not any(layer.is_attention for layer in profile.layers):
        return
    gpu_type = (cfg.recipe.gpu_type or "h100").lower()
    spec = GPU_SPECS.get(gpu_type)
    gpu = GpuInfo(spec.name if spec else gpu_type, spec.capability if spec else (9, 0))
    # the installed torch's cuDNN, with or without a GPU here: the plan's (memory_plan.planned_kernel)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    backend = cfg.model.attention_backend
    pinned = None if backend == AUTO_BACKEND else KERNEL_OF_BACKEND[backend]
    cudnn_text = f"cuDNN {cudnn}"
    if cudnn is None:  # a CPU-only torch: the reference CUDA wheel's cuDNN, as the memory plan assumes
        cudnn, cudnn_text = REFERENCE_CUDNN_VERSION, "cuDNN unknown here: the reference wheel's 9.19 assumed"
    out.append(f"--- attention kernels per layer kind on {gpu.name} (model.attention_backend={backend}; torch "
               f"{torch.__version__.split('+')[0]}, {cudnn_text}) ---")  # fmt: skip
    try:
        out.extend(layer_kind_kernel_lines(profile, gpu, torch.__version__, cudnn, pinned=pinned,
                                           packed=packed_rows(cfg), packed_blocks=cfg.model.cudnn_packed_blocks))  # fmt: skip
    except ValueError as e:  # a torch outside the kernel table
        out.append(f"  not planned: {e}")


def _memory_and_time_lines(plan: _Plan, dims: Any, out: list[str]) -> None:
    """The per-rank memory plan against the budget (``recipe.memory_budget_gib``, else ``recipe.gpu_type``'s, as
    ``automodel plan`` fits rows) and the step-time estimate."""
    from automodel.training.memory_plan import memory_plan_lines, run_shape_from_config
    from automodel.training.plan_search import run_budget_gib
    from automodel.training.step_estimate import step_estimate_lines

    cfg, sizes = plan.cfg, plan.sizes
    shape = run_shape_from_config(cfg, sizes, plan.seq, plan.grad_acc)
    node_gpus = _gpus_per_node(cfg, plan.world)
    node = min(plan.world, node_gpus)  # the run's ranks on a node, as automodel plan counts them
    budget, source = run_budget_gib(cfg.recipe.memory_budget_gib, cfg.recipe.gpu_type)
    out.extend(memory_plan_lines(dims, shape, budget_gib=budget, world=plan.world, budget_source=source))
    out.extend(_host_lines(dims, shape, node, node_gpus))
    out.extend(
        step_estimate_lines(
            dims, shape, sizes, plan.world, cfg.step_scheduler.global_batch_size, cfg.recipe.gpu_type, node,
        )
    )  # fmt: skip
    if cfg.recipe.gpu_type is not None:
        out.append(_row_step_line(plan, dims, shape, node))


def _gpus_per_node(cfg: Any, world: int) -> int:
    """The GPUs of a node the dry run plans with, as ``automodel plan --gpus-per-node`` does:
    ``recipe.plan_nproc_per_node`` (``automodel finetune --nproc-per-node N recipe.dry_run=true`` sets it), else
    the world over ``recipe.plan_nnodes``, else the GPU's usual node (8, ``gpu_specs``). The run's ranks on a node
    are the world up to that many (the step estimate's and the plan's node)."""
    from automodel.config.gpu_specs import GPU_SPECS

    if cfg.recipe.plan_nproc_per_node:
        return cfg.recipe.plan_nproc_per_node
    if cfg.recipe.plan_nnodes:
        return max(1, world // cfg.recipe.plan_nnodes)
    return GPU_SPECS[cfg.recipe.gpu_type.lower()].gpus_per_node if cfg.recipe.gpu_type else 8


def _host_lines(dims: Any, shape: Any, node: int, node_gpus: int) -> list[str]:
    """Host memory per node (what ``automodel plan`` limits by): the pinned host terms of each rank x the run's
    ranks on a node, against the plan's default: :data:`HOST_GIB_PER_GPU` per GPU of the node."""
    from automodel.training.memory_plan import plan_memory
    from automodel.training.plan_search import HOST_GIB_PER_GPU

    p = plan_memory(dims, shape)
    per_node, limit = p.host_bytes * node, HOST_GIB_PER_GPU * node_gpus * 2**30
    what = ", ".join(f"{t.name} {_gib(t.bytes)}" for t in p.host) or "nothing offloaded"
    verdict = "fits" if per_node <= limit else "EXCEEDS it: lower data.seq_len or turn an offload off"
    return [f"host memory per node: {_gib(per_node)} = {node} rank(s) x {_gib(p.host_bytes)} ({what}); automodel "
            f"plan's usual limit {HOST_GIB_PER_GPU * node_gpus} GiB per node of {node_gpus} GPUs ({HOST_GIB_PER_GPU} "
            f"GiB per GPU; --gpus-per-node, --host-memory-gib) -> {verdict}"]  # fmt: skip


def _row_step_line(plan: _Plan, dims: Any, shape: Any, node: int) -> str:
    """The step of one row per data-parallel rank (``automodel plan``'s step column) next to the global batch's."""
    import dataclasses

    from automodel.training.plan_search import row_step_seconds
    from automodel.training.step_estimate import gpu_spec

    cfg = plan.cfg
    row = dataclasses.replace(shape, local_batch=1, grad_acc=1)
    seconds = row_step_seconds(dims, row, plan.sizes, plan.world, gpu_spec(cfg.recipe.gpu_type), cfg.recipe.gpu_type,
                               node)  # fmt: skip
    rows = cfg.step_scheduler.global_batch_size
    return (f"estimated step per row: {_seconds(seconds)} for one row of {plan.seq} tokens per data-parallel rank "
            f"({plan.sizes['dp']} row(s); automodel plan's step column, the memory techniques' own time included); "
            f"the step above is the config's global batch of {rows} rows")  # fmt: skip


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s" if s < 60 else f"{s / 60:.1f} min"


def dry_run_report(loaded: LoadedConfig) -> str:
    """The dry-run text. Raises ``ValueError`` for a model that cannot train this run."""
    import torch
    from omegaconf import OmegaConf

    out = [f"=== dry run: {loaded.path} (planned for world size {loaded.world_size}) ==="]
    written = loaded.cfg.distributed.cp_method  # as the config says (auto: resolved per layout below)
    choice = _resolve_auto(loaded)
    if choice is not None:
        out.append(choice.reason)
    plan = _layout_lines(loaded, out)
    model, resolved, tok_desc, profile = _meta_model(plan)
    dims = _model_lines(plan, model, resolved, tok_desc, profile, out)
    if plan.cfg.loss.chunk_tokens == "auto":  # resolved as the run resolves it (trainer._resolve_loss_auto)
        from automodel.training.memory_plan import resolve_chunk_tokens

        plan.cfg.loss.chunk_tokens, reason = resolve_chunk_tokens(plan.cfg, dims, plan.sizes, plan.seq, plan.grad_acc)
        out.append(reason)
    if plan.cfg.distributed.ulysses_head_chunks == "auto":  # as the run resolves it (trainer)
        from automodel.training.memory_plan import resolve_head_chunks

        plan.cfg.distributed.ulysses_head_chunks, reason = resolve_head_chunks(
            plan.cfg, dims, plan.sizes, plan.seq, plan.grad_acc
        )
        out.append(reason)
    if plan.cfg.model.attention_head_chunks == "auto":  # cp_size 1: as the run resolves it (trainer)
        from automodel.training.memory_plan import resolve_attention_head_chunks

        plan.cfg.model.attention_head_chunks, reason = resolve_attention_head_chunks(
            plan.cfg, dims, plan.sizes, plan.seq, plan.grad_acc
        )
        out.append(reason)
    if plan.cfg.model.checkpoint_group_layers == "auto":  # as the run resolves it (trainer)
        from automodel.training.memory_plan import resolve_checkpoint_group
        from automodel.training.plan_search import HOST_GIB_PER_GPU

        plan.cfg.model.checkpoint_group_layers, reason = resolve_checkpoint_group(
            plan.cfg, dims, plan.sizes, plan.seq, plan.grad_acc, HOST_GIB_PER_GPU * 2**30
        )
        out.append(reason)
    _shape_lines(plan, model, dims, out)
    _kernel_lines(plan, profile, out)
    _memory_and_time_lines(plan, dims, out)
    if loaded.cfg.recipe.plan_layouts:  # recipe.plan_layouts: each layout estimated (or refused), fastest first
        from automodel.training.layout_ranking import layout_ranking_lines

        out.extend(layout_ranking_lines(loaded, written, dims, resolved, model, profile))
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if loaded.cfg.recipe.dry_run_print_config:
        out.append("--- resolved config (schema defaults included) ---")
        out.append(OmegaConf.to_yaml(OmegaConf.create(loaded.effective)).rstrip())
    else:
        out.append("resolved config: not shown (recipe.dry_run_print_config=true prints it)")
    out.append("dry run: nothing was trained")
    return "\n".join(out)
