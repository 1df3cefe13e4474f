"""Rules across keys: combinations that type-check but cannot run (or would run wrongly).

:func:`check_rules` returns a list of problems, each naming the keys, the values, the rule and
the fix. It runs before the process group or any model is built, from the typed config and the
world size alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
from types import SimpleNamespace

from automodel.config.attention_head_chunks_rules import attention_head_chunks_problems, config_head_counts
from automodel.config.attention_rules import attention_backend_problems
from automodel.config.compile_rules import compile_problems
from automodel.config.logging_rules import logging_problems
from automodel.config.offload_rules import offload_problems
from automodel.config.peft_rules import peft_problems
from automodel.config.sample_rules import sample_problems
from automodel.config.schema import RecipeConfig
from automodel.config.tiled_layer_rules import tiled_layer_problems
from automodel.config.tiled_mlp_rules import tiled_mlp_problems
from automodel.distributed.cp import AUTO, CPMethod, cp_methods
from automodel.distributed.cp.head_chunks import HEAD_CHUNKS_KEY, head_chunks_problem
from automodel.distributed.cp.registry import alternative_label, method_reasons
from automodel.distributed.tensor_parallel import tp_size_problems

__all__ = [
    "auto_config_problems",
    "check_rules",
    "config_alternatives",
    "config_with_method",
    "method_rules",
    "parallel_sizes",
    "ranks_per_node",
]


def parallel_sizes(cfg: RecipeConfig, world_size: int) -> tuple[dict[str, int], list[str]]:
    """Resolve ``dp_shard=-1`` against ``world_size``; return the sizes and any problems.

    Sizes: ``dp_replicate, dp_shard, cp, tp, dp`` (``dp = dp_replicate * dp_shard``).
    """
    d = cfg.distributed
    problems: list[str] = []
    for key in ("dp_replicate", "cp_size", "tp_size"):
        if getattr(d, key) < 1:
            problems.append(f"distributed.{key}={getattr(d, key)} must be >= 1")
    if d.dp_shard < 1 and d.dp_shard != -1:
        problems.append(f"distributed.dp_shard={d.dp_shard} must be >= 1, or -1 to use the rest of the world")
    if problems:
        return {}, problems
    others = d.dp_replicate * d.cp_size * d.tp_size
    dp_shard = d.dp_shard
    if dp_shard == -1:
        if world_size % others:
            problems.append(
                f"world size {world_size} (processes launched) is not divisible by "
                f"distributed.dp_replicate * distributed.cp_size * distributed.tp_size = "
                f"{d.dp_replicate}*{d.cp_size}*{d.tp_size} = {others}; launch a multiple of {others} "
                f"processes (torchrun --nproc-per-node) or change those sizes"
            )
            return {}, problems
        dp_shard = world_size // others
    product = d.dp_replicate * dp_shard * d.cp_size * d.tp_size
    if product != world_size:
        problems.append(
            f"distributed.dp_replicate * dp_shard * cp_size * tp_size = {d.dp_replicate}*{dp_shard}*"
            f"{d.cp_size}*{d.tp_size} = {product} does not match the world size {world_size} "
            f"(processes launched); set distributed.dp_shard=-1 to infer it, or launch {product} processes"
        )
    sizes = {"dp_replicate": d.dp_replicate, "dp_shard": dp_shard, "cp": d.cp_size, "tp": d.tp_size}
    sizes["dp"] = d.dp_replicate * dp_shard
    return sizes, problems


def _sdpa_less_class(cfg: RecipeConfig) -> str | None:
    """Why the causal-LM class of an inline ``model.config`` has no exact SDPA path (``sdpa_problem``'s text:
    gpt-oss, Gemma 2's softcapping, Doge before transformers 5.25); ``None``: it has one, or the class is not known
    from the config alone (a pretrained config is read later)."""
    node = cfg.model.config
    if not isinstance(node, dict) or not isinstance(node.get("_target_"), str):
        return None
    try:
        from hydra.utils import get_object

        from automodel.distributed.torch_internals import MODEL_FOR_CAUSAL_LM_MAPPING, sdpa_problem

        config_cls = get_object(node["_target_"])
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[config_cls]
    except Exception:  # noqa: BLE001 - a target that is not a transformers config class: not known here
        return None
    try:  # the cap the inline config sets, else its class's default
        cap = node.get("attn_logit_softcapping", getattr(config_cls(), "attn_logit_softcapping", None))
    except Exception:  # noqa: BLE001 - a config class that needs arguments: its class decides alone
        cap = None
    return sdpa_problem(cls, SimpleNamespace(attn_logit_softcapping=cap))


def _attn_fix(accepted: tuple[str, ...], cfg: RecipeConfig) -> str:
    """The ``model.attn_implementation`` value to set: the first the method takes, ``eager`` first for an
    inline model without SDPA support (gpt-oss), and the eager fallback named where the class is not known."""
    if accepted[0] == "sdpa" and "eager" in accepted:
        sdpa_less = _sdpa_less_class(cfg)
        if sdpa_less is not None:
            return f"model.attn_implementation=eager ({sdpa_less})"
        return "model.attn_implementation=sdpa (eager for a model without SDPA support, e.g. gpt-oss)"
    return f"model.attn_implementation={accepted[0]}"


def config_alternatives(cfg: RecipeConfig, world_size: int, cuda_available: bool | None) -> list[str]:
    """The other methods (each labelled with the options that select it, e.g. ``usp (ulysses_size=2)``) that
    the config rules accept with that method selected: the ones a config refusal may name. A problem that
    every method's configuration has (a typo elsewhere) does not count against any. The model's layers are
    not known here (the model check, before any weight loads, names the methods that compute them)."""
    found: dict[str, tuple[str, set[str]]] = {}  # per method: its first configuration with the fewest problems
    for name, method in cp_methods().items():
        for configured, options in method.auto_configs(cfg.distributed.cp_size, ranks_per_node(cfg)):
            problems = set(check_rules(config_with_method(cfg, name, options), world_size, cuda_available,
                                       alternatives=False))  # fmt: skip
            if name not in found or len(problems) < len(found[name][1]):
                found[name] = (alternative_label(configured, options), problems)
    if not found:
        return []
    common = set.intersection(*(problems for _, problems in found.values()))
    return [label for name, (label, problems) in found.items()
            if name != cfg.distributed.cp_method and problems <= common]  # fmt: skip


def _other_methods(others: list[str], what: str) -> str | None:
    """The fix that names the other methods (an instruction), or ``None`` when no other method passes (the
    refusal then gives its other fixes only)."""
    if not others:
        return None
    return (
        f"set distributed.cp_method to one that takes {what} with this config: {' | '.join(others)}, or auto "
        "(which also checks the model's layers)"
    )


def either(*fixes: str | None) -> str:
    """The fixes of a refusal as one clause: ``a``, ``a or b``, ``a, b, or c`` (``;`` between fixes when one
    holds a comma); ``None`` entries are left out. Each fix is a complete instruction (``set key=value``)."""
    items = [f for f in fixes if f]
    if len(items) <= 1:
        return "".join(items)
    sep = "; " if any(", " in re.sub(r"\([^()]*\)", "", f) for f in items) else ", "  # commas outside brackets
    if len(items) == 2 and sep == ", ":
        return f"{items[0]} or {items[1]}"
    return sep.join(items[:-1]) + f"{sep}or {items[-1]}"


def _sentence(text: str) -> str:
    """``text`` with its first letter upper-case (the rest unchanged: keys stay as written)."""
    return text[:1].upper() + text[1:]


def check_rules(
    cfg: RecipeConfig, world_size: int, cuda_available: bool | None = None, *, alternatives: bool = True
) -> list[str]:
    """Every cross-key problem of ``cfg`` for a run on ``world_size`` ranks (empty list: fine).

    ``alternatives``: a refusal of the CP method names the other methods this config allows
    (:func:`config_alternatives`); ``False`` when checking those methods themselves.
    """
    problems: list[str] = []
    d, data, sched, model = cfg.distributed, cfg.data, cfg.step_scheduler, cfg.model
    sizes, size_problems = parallel_sizes(cfg, world_size)
    problems += size_problems

    problems += tp_problems(cfg)
    problems += compile_problems(cfg)  # compiled autograd / model.compile vs FSDP2 and the CP method
    problems += offload_problems(cfg)  # model.activation_offload, fsdp.offload
    problems += tiled_mlp_problems(cfg)  # model.tiled_mlp: true, false or tokens per tile >= 1
    problems += tiled_layer_problems(cfg)  # model.tiled_layer: the same values; no tensor parallelism
    problems += attention_head_chunks_problems(cfg)  # model.attention_head_chunks: cp_size 1, tp_size 1
    problems += attention_backend_problems(cfg)  # model.attention_backend: a kernel name the run can pin
    if isinstance(cfg.loss.chunk_tokens, int) and cfg.loss.chunk_tokens < 1:
        problems.append(
            f"loss.chunk_tokens={cfg.loss.chunk_tokens} must be >= 1 (tokens whose logits are computed at once, "
            "e.g. 1024), null for the plain loss, or auto"
        )
    if d.backend == "nccl" and cuda_available is False:
        problems.append(
            "distributed.backend=nccl needs CUDA, which is not available here; set distributed.backend=auto"
        )

    on_cpu = cuda_available is False or d.backend == "gloo"  # the trainer uses CUDA only with nccl
    if model.attn_implementation == "flex_attention" and on_cpu:
        problems.append(
            "model.attn_implementation=flex_attention cannot train on CPU (torch has no FlexAttention backward "
            "on CPU); set model.attn_implementation=sdpa (or eager), or train on CUDA (distributed.backend=auto)"
        )

    methods = cp_methods()
    method = methods.get(d.cp_method)
    auto = d.cp_method == AUTO  # each method's rules run on the config that selects it (below)
    if method is None and not auto:
        problems.append(
            f"distributed.cp_method={d.cp_method!r} is not one of {sorted(methods)} or {AUTO!r}; "
            f"set distributed.cp_method to one of {' | '.join(methods)} | {AUTO}"
        )

    # --- sequence length vs the CP/TP split ------------------------------------------------
    if data.seq_len < 1:
        problems.append(f"data.seq_len={data.seq_len} must be >= 1")
    if data.pad_to_multiple_of is not None and data.pad_to_multiple_of < 1:
        problems.append(f"data.pad_to_multiple_of={data.pad_to_multiple_of} must be >= 1 (or null)")
    if data.seq_len >= 1 and not auto:
        # ring/thd: 2 equal chunks per CP rank; ulysses: 1 slice; sequence parallel: split again over TP
        splitter = method if method is not None else methods["ring"]
        multiple, what = splitter.row_multiple(d.cp_size, d.tp_size, d.sequence_parallel)
        pad = data.pad_to_multiple_of
        if pad is not None and pad >= 1:
            if pad % multiple:
                lower = multiple * max(1, pad // multiple)
                problems.append(
                    f"data.pad_to_multiple_of={pad} is not a multiple of {what}; set it to a multiple of "
                    f"{multiple} (e.g. {lower} or {lower + multiple}), or to null (then {multiple})"
                )
        # data.pad_to_multiple_of=null: the collator pads every row to a multiple of `multiple` (labels
        # -100 at the end), exact for causal attention, so any data.seq_len works.

    # --- the CP method's limits --------------------------------------------------------------
    if method is not None and d.cp_size > 1:
        attn = model.attn_implementation or "sdpa"
        others = None

        def other_methods(what: str) -> str:  # computed once, only when a rule below refuses
            nonlocal others
            if others is None:
                others = config_alternatives(cfg, world_size, cuda_available) if alternatives else []
            return _other_methods(others, what)

        if method.attn_implementations is not None and attn not in method.attn_implementations:
            problems.append(
                f"distributed.cp_method={method.name} with cp_size={d.cp_size} needs model.attn_implementation "
                f"in {list(method.attn_implementations)}, got {attn!r}; "
                + either(f"set {_attn_fix(method.attn_implementations, cfg)}",
                         other_methods(f"attn_implementation={attn!r}"), "set distributed.cp_size=1")  # fmt: skip
            )
        for key in ("dataset", "validation_dataset"):
            node = getattr(data, key)
            if node is not None and node.get("pack") is True and not method.supports_packed:
                problems.append(
                    f"data.{key}.pack=true (several documents per row) with distributed.cp_method={method.name} "
                    f"and cp_size={d.cp_size}: {method.name} attention is causal over the whole row and would "
                    f"attend across documents; packed rows need a method that keeps document boundaries. "
                    + _sentence(either(other_methods("packed rows"), f"set data.{key}.pack=false",
                                       "set distributed.cp_size=1"))  # fmt: skip
                )
        if isinstance(model.config, dict):  # inline architecture (a pretrained config must match it)
            heads = (model.config_overrides or {}).get(
                "num_attention_heads", model.config.get("num_attention_heads")
            )
            if isinstance(heads, int) and heads >= 1:
                configured = method.configured(cfg) if not method.key_problems(cfg) else method
                problem = configured.head_split_problem(heads, d.cp_size, d.tp_size)
                if problem is not None:
                    other = other_methods(f"num_attention_heads={heads}")
                    problems.append(problem.replace("the model has", "model.config has", 1) + (f"; or {other}" if other else ""))

    for m in methods.values():  # each method's own keys (e.g. distributed.thd_kernel), whatever is selected
        problems += m.key_problems(cfg)
    problems += head_chunk_problems(cfg, method)
    if method is not None:  # what the selected method needs of the rest of the config
        problems += method.config_problems(cfg, cuda_available)

    # --- batch sizes ---------------------------------------------------------------------------
    for key in ("global_batch_size", "local_batch_size", "max_steps"):
        if getattr(sched, key) < 1:
            problems.append(f"step_scheduler.{key}={getattr(sched, key)} must be >= 1")
    for key in ("val_every_steps", "val_max_batches", "ckpt_every_steps"):
        value = getattr(sched, key)
        if value is not None and value < 1:
            problems.append(f"step_scheduler.{key}={value} must be >= 1, or null to turn it off")
    if sizes and sched.global_batch_size >= 1 and sched.local_batch_size >= 1:
        per_micro = sched.local_batch_size * sizes["dp"]
        if sched.global_batch_size % per_micro:
            lo = max(per_micro, sched.global_batch_size // per_micro * per_micro)
            problems.append(
                f"step_scheduler.global_batch_size={sched.global_batch_size} is not divisible by "
                f"local_batch_size * dp = {sched.local_batch_size}*{sizes['dp']} = {per_micro} "
                f"(rows per micro-step over all data-parallel ranks); set "
                f"step_scheduler.global_batch_size={lo} or change step_scheduler.local_batch_size"
            )

    # --- model -----------------------------------------------------------------------------------
    if model.pretrained_model_name_or_path is None and model.config is None:
        problems.append(
            "model: set model.pretrained_model_name_or_path (local directory or hub id) or model.config "
            "(e.g. {_target_: transformers.LlamaConfig, hidden_size: ...}) to build a model from scratch"
        )
    if cfg.clip_grad.max_norm is not None and cfg.clip_grad.max_norm <= 0:
        problems.append(
            f"clip_grad.max_norm={cfg.clip_grad.max_norm} must be > 0, or null to turn clipping off"
        )
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last < 1:
        problems.append(f"checkpoint.keep_last={cfg.checkpoint.keep_last} must be >= 1, or null to keep all")
    if cfg.recipe.dry_run_world_size is not None and cfg.recipe.dry_run_world_size < 1:
        problems.append(f"recipe.dry_run_world_size={cfg.recipe.dry_run_world_size} must be >= 1")
    if cfg.recipe.cp_self_check_tokens < 1:
        problems.append(
            f"recipe.cp_self_check_tokens={cfg.recipe.cp_self_check_tokens} must be >= 1 (tokens per row of "
            f"the CP self-check's slice; default 512)"
        )
    if cfg.recipe.memory_budget_gib is not None and not cfg.recipe.memory_budget_gib > 0:
        problems.append(f"recipe.memory_budget_gib={cfg.recipe.memory_budget_gib} must be > 0 (GiB per rank), or null")
    if cfg.recipe.max_nonfinite_in_row < 1:
        problems.append(
            f"recipe.max_nonfinite_in_row={cfg.recipe.max_nonfinite_in_row} must be >= 1 (skipped steps in a row "
            f"that stop a run with recipe.on_nonfinite=skip; default 3)"
        )
    problems += peft_problems(cfg)
    problems += logging_problems(cfg)
    problems += sample_problems(cfg)
    problems += node_plan_problems(cfg, world_size)
    if auto and not problems:  # the rest is fine: some method's rules must pass too (the model comes later)
        problems += auto_config_problems(cfg, world_size, cuda_available)
    return problems


def head_chunk_problems(cfg: RecipeConfig, method: CPMethod | None) -> list[str]:
    """``distributed.ulysses_head_chunks``: ``auto`` or a positive integer; above 1 only with a method that runs
    heads in groups (:meth:`CPMethod.head_chunk_ranks`: ulysses, usp) at ``cp_size > 1``, and dividing the KV heads
    a rank holds after the head all-to-all where an inline ``model.config`` gives the heads (a pretrained config:
    :func:`automodel.models.cp_check.check_model_for_cp_run`, before any weight loads)."""
    d = cfg.distributed
    chunks = d.ulysses_head_chunks
    problem = head_chunks_problem(chunks, None, None, 1)
    if problem is not None:
        return [problem]
    if chunks in (1, AUTO) or method is None:  # cp_method auto: a method that takes no head chunks fails here
        return []
    ranks = method.configured(cfg).head_chunk_ranks(d.cp_size) if not method.key_problems(cfg) else None
    if ranks is None or d.cp_size <= 1:
        return [
            f"{HEAD_CHUNKS_KEY}={chunks} runs the heads of a head-splitting CP method in groups, but "
            f"distributed.cp_method={d.cp_method} with cp_size={d.cp_size} splits no heads by all-to-all; set "
            f"{HEAD_CHUNKS_KEY}=1, or distributed.cp_method=ulysses (or usp) with cp_size > 1"
        ]
    counts = config_head_counts(cfg)
    if counts is None:
        return []
    heads, kv = counts
    tp = max(1, d.tp_size)
    where = f"cp_size={d.cp_size}" if ranks == d.cp_size else f"distributed.ulysses_size={ranks}"
    if tp > 1:
        where += f", tp_size={tp}"
    problem = head_chunks_problem(chunks, heads // tp, max(1, kv // tp), ranks, where)
    return [problem.replace("KV heads over", "KV heads of model.config over", 1)] if problem else []


def config_with_method(cfg: RecipeConfig, method: str, options: dict | None = None) -> RecipeConfig:
    """A copy of ``cfg`` with ``distributed.cp_method=method`` and the ``distributed.<key>`` ``options`` set."""
    return dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, cp_method=method, **(options or {})))


def method_rules(cfg: RecipeConfig, world_size: int, cuda_available: bool | None):  # noqa: ANN201 - a callable
    """``(method, options) -> problems``: the config rules of ``cfg`` with that method selected (``cp_method:
    auto``'s ``extra_problems``)."""

    def problems(method: CPMethod, options: dict) -> list[str]:
        return check_rules(config_with_method(cfg, method.name, options), world_size, cuda_available, alternatives=False)

    return problems


def auto_config_problems(cfg: RecipeConfig, world_size: int, cuda_available: bool | None) -> list[str]:
    """``cp_method: auto`` before the model is known: at least one method's configuration must pass the
    config rules (each method's own, e.g. thd's kernel, usp's head split of an inline config); else one
    problem listing every method's reasons."""
    rules = method_rules(cfg, world_size, cuda_available)
    reasons = []
    for name, method in cp_methods().items():
        configs = method.auto_configs(cfg.distributed.cp_size, ranks_per_node(cfg))
        if not configs:
            reasons.append(f"{name}: no configuration at cp_size={cfg.distributed.cp_size}")
        for m, options in configs:
            found = rules(m, options)  # (their refusals name no alternatives: auto lists every method)
            if not found:
                return []
            label = name + (" (" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")" if options else "")
            reasons.append(f"{label}: {'; '.join(found)}")
    return [
        f"distributed.cp_method=auto found no CP method this config can run. {method_reasons(reasons)}. Change "
        "what one method's reasons name (auto then picks that method), or set distributed.cp_size=1"
    ]


def ranks_per_node(cfg: RecipeConfig) -> int | None:
    """Processes per node for ``cp_method: auto``: in a dry run ``recipe.plan_nproc_per_node``, else the GPUs per
    node of ``recipe.gpu_type`` (what the step estimate assumes); else torchrun's ``$LOCAL_WORLD_SIZE``;
    ``None`` when not known (one node)."""
    if cfg.recipe.dry_run and cfg.recipe.plan_nproc_per_node is not None:
        return cfg.recipe.plan_nproc_per_node
    if cfg.recipe.dry_run and cfg.recipe.gpu_type is not None:
        from automodel.config.gpu_specs import GPU_SPECS

        spec = GPU_SPECS.get(cfg.recipe.gpu_type.lower())
        if spec is not None:
            return spec.gpus_per_node
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and not cfg.recipe.dry_run else None


def tp_problems(cfg: RecipeConfig) -> list[str]:
    """Tensor-parallel keys: what needs ``tp_size > 1``, what TP does not compose with, and (for an inline
    ``model.config``) the sizes TP splits. A pretrained config is checked the same way once it is read,
    before any weight loads (:func:`automodel.distributed.tensor_parallel.tp_config_problems`)."""
    d, problems = cfg.distributed, []
    if d.enable_loss_parallel and d.tp_size == 1:
        problems.append(
            "distributed.enable_loss_parallel=true needs a vocabulary sharded by tensor parallelism "
            "(tp_size > 1); set distributed.enable_loss_parallel=false, or distributed.tp_size=2 (or more)"
        )
    if d.sequence_parallel and d.tp_size == 1:
        problems.append(
            "distributed.sequence_parallel=true splits the tokens over the tensor-parallel ranks, but "
            "distributed.tp_size=1; set distributed.sequence_parallel=false, or distributed.tp_size=2 (or more)"
        )
    if d.tp_size <= 1:
        return problems
    if isinstance(cfg.loss.chunk_tokens, int):  # auto resolves to off under TP
        problems.append(
            f"loss.chunk_tokens={cfg.loss.chunk_tokens} with distributed.tp_size={d.tp_size}: the chunked loss "
            "multiplies each chunk by the whole LM head on every rank, which tensor parallelism shards on the "
            "vocabulary; set loss.chunk_tokens=null and distributed.enable_loss_parallel=true (the "
            "vocabulary-sharded loss: each rank holds 1/tp_size of the logits), or distributed.tp_size=1"
        )
    if not cfg.fsdp.enabled:
        problems.append(
            f"fsdp.enabled=false with distributed.tp_size={d.tp_size}: the replicated mode sums whole, plain "
            "gradients over dp x cp, but TP's parameters are DTensor shards; set fsdp.enabled=true (FSDP2 over "
            "dp_shard_cp composes with TP) or distributed.tp_size=1"
        )
    if d.enable_compiled_autograd:
        problems.append(
            f"distributed.enable_compiled_autograd=true with distributed.tp_size={d.tp_size}: compiled autograd "
            "runs only in the replicated mode (fsdp.enabled=false), which does not hold TP-sharded parameters; "
            "set distributed.enable_compiled_autograd=false (model.compile is not available with TP either), or "
            "distributed.tp_size=1"
        )
    if cfg.model.compile:
        problems.append(
            f"model.compile=true with distributed.tp_size={d.tp_size}: on torch 2.13 the compiled decoder blocks "
            "over TP's DTensor activations give gradients that differ from eager (a tiny Llama at tp=2 is 9e-4 "
            "off in the second step's loss, beyond fp32 round-off), so it is not offered; set model.compile=false "
            "or distributed.tp_size=1"
        )
    if cfg.peft is not None:
        problems.append(
            f"peft with distributed.tp_size={d.tp_size}: LoRA wraps the projections that the TP plan shards "
            "(the adapters would need a plan of their own); set distributed.tp_size=1 (LoRA trains under "
            "every CP method and FSDP2)"
        )
    if isinstance(cfg.model.config, dict):  # inline architecture: the sizes TP splits
        inline = {**cfg.model.config, **(cfg.model.config_overrides or {})}
        problems += tp_size_problems(inline, d.tp_size)
    return problems


def node_plan_problems(cfg: RecipeConfig, world_size: int) -> list[str]:
    """``recipe.plan_nnodes`` / ``recipe.plan_nproc_per_node`` (dry run only): >= 1 and they tile the world."""
    r = cfg.recipe
    n, p = r.plan_nnodes, r.plan_nproc_per_node
    problems = [f"recipe.{k}={v} must be >= 1" for k, v in (("plan_nnodes", n), ("plan_nproc_per_node", p))
                if v is not None and v < 1]  # fmt: skip
    if problems or not r.dry_run:  # the keys only plan a dry run; a real run's nodes come from torchrun
        return problems
    if n is not None and p is not None and n * p != world_size:
        problems.append(
            f"recipe.plan_nnodes={n} x recipe.plan_nproc_per_node={p} = {n * p} ranks, but the dry run plans "
            f"world size {world_size} (recipe.dry_run_world_size); make them agree or drop dry_run_world_size"
        )
    for key, v in (("plan_nnodes", n), ("plan_nproc_per_node", p)):
        if v is not None and world_size % v != 0:
            problems.append(
                f"recipe.{key}={v} does not divide the planned world size {world_size}; every node runs the "
                f"same number of processes, so set it to a divisor of {world_size}"
            )
    return problems
