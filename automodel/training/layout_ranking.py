"""The dry run's ranking of ``recipe.plan_layouts`` by the step estimate (fastest first).

Each layout (:mod:`automodel.config.plan_layouts`) is the config with ``distributed.tp_size`` /
``cp_size`` / ``cp_method`` (and the method's own keys, e.g. ``ulysses_size``) replaced and ``dp_shard``
taking the rest of the world. It goes through what a run of it would: the config's rules
(:func:`automodel.config.validate_config`); ``cp_method: auto`` resolved for the layout as a run resolves it
(:func:`automodel.distributed.cp.choose_cp_method` on the model's profile, restricted to the layout's method
when it names one without its number: ``cp64.usp``); then the model's checks (attention implementation and
layer kinds under the method, heads over cp and tp). A layout refused by any of them is listed with the
reason instead of being ranked. The others get the step estimate
(:func:`automodel.training.step_estimate.estimate_step`, whose CP term is the method's declared exchange,
:func:`automodel.distributed.cp.cost.exchange_cost`, the one ``auto`` ranks methods by) and the memory
plan's total per rank against ``recipe.memory_budget_gib`` (else the GPU's budget, as ``automodel plan``'s:
:func:`automodel.training.plan_search.run_budget_gib`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

__all__ = ["RankedLayout", "rank_layouts", "layout_ranking_lines"]


@dataclass
class RankedLayout:
    """One layout's outcome: its estimate (``step_s``, ``tokens_per_s_gpu``, ``memory_gib``) or ``refused``.
    ``method``: the method it runs with its options (``"usp, ulysses_size=8"``; ``"auto -> ..."`` where
    ``auto`` picked it)."""

    text: str
    method: str
    step_s: float = 0.0
    tokens_per_s_gpu: float = 0.0
    memory_gib: float = 0.0
    fits: bool = True
    current: bool = False  # the config's own layout
    refused: str | None = None


def _label(cfg: Any) -> str:
    """``"usp, ulysses_size=8"``: the config's CP method with its bound options."""
    from automodel.distributed.cp import get_cp_method

    method = get_cp_method(cfg.distributed.cp_method).configured(cfg)
    return ", ".join([method.name, *(f"{k}={v}" for k, v in method.options().items())])


def _layout_config(loaded: Any, layout: Any, cp_method: str) -> Any:
    """The layout's validated RecipeConfig (raises ConfigError for a layout the config's rules refuse);
    ``cp_method``: the config's method as written (``auto`` included)."""
    from automodel.config import validate_config

    raw = copy.deepcopy(loaded.raw)
    dist = raw.setdefault("distributed", {})
    dist.update(layout.overrides(cp_method, dist))
    raw.setdefault("recipe", {})["plan_layouts"] = None
    cfg, _ = validate_config(raw, world_size=loaded.world_size)
    return cfg


def _resolve(cfg: Any, layout: Any, profile: Any, world: int, node: int) -> str | None:
    """``cp_method: auto`` of a layout replaced by ``auto``'s pick for it (mutates ``cfg.distributed``), among
    the layout's method's configurations when it names one (``cp64.usp``); why nothing was picked, else ``None``."""
    from automodel.config.cp_auto import packed_rows
    from automodel.config.rules import method_rules
    from automodel.distributed.cp import AUTO, choose_cp_method

    d = cfg.distributed
    if d.cp_method != AUTO:
        return None
    rules = method_rules(cfg, world, None)
    only = None if layout.method in (None, AUTO) else layout.method

    def problems(m: Any, options: dict[str, Any]) -> list[str]:
        if only is not None and m.name != only:
            return [f"the layout names {only}"]
        return rules(m, options)

    try:
        choice = choose_cp_method(profile, d.cp_size, seq_len=cfg.data.seq_len, packed=packed_rows(cfg),
                                  tp_size=d.tp_size, ranks_per_node=node, extra_problems=problems)  # fmt: skip
    except ValueError as e:
        return str(e)
    d.cp_method = choice.name
    for key, value in choice.options.items():
        setattr(d, key, value)
    return None


def _model_problem(cfg: Any, resolved: Any, model: Any) -> str | None:
    """Why the model cannot train under ``cfg``'s layout (the run's own checks), else ``None``."""
    from automodel.models.cp_check import check_model_for_cp_run
    from automodel.models.loader import check_model_for_run
    from automodel.models.parallelize import check_model_config_for_tp

    d, attn = cfg.distributed, cfg.model.attn_implementation or "sdpa"
    try:
        check_model_for_run(
            resolved.config, attn_implementation=attn, cp_size=d.cp_size, cp_method=d.cp_method,
            seq_len=cfg.data.seq_len, vocab_needed=None, trust_remote_code=cfg.model.trust_remote_code,
            allow_position_extrapolation=cfg.model.allow_position_extrapolation,
        )  # fmt: skip
        check_model_config_for_tp(resolved.config, d.tp_size, sequence_parallel=d.sequence_parallel)
        check_model_for_cp_run(cfg, resolved, attn, model)
    except ValueError as e:
        return str(e)
    return None


def rank_layouts(
    loaded: Any, cp_method: str, dims: Any, resolved: Any, model: Any, profile: Any = None
) -> list[RankedLayout]:
    """Every ``recipe.plan_layouts`` entry estimated or refused, ranked fastest first (refused ones last).

    ``cp_method``: the config's method as written (``auto`` is resolved per layout); ``dims``: the model's
    ModelDims; ``resolved`` / ``model``: the dry run's resolved model config and meta-device model (not
    mutated); ``profile``: the model's CP profile (``None``: profiled here when a layout needs ``auto``).
    """
    from automodel.config import ConfigError, parallel_sizes
    from automodel.config.plan_layouts import plan_layouts
    from automodel.training.memory_plan import plan_memory, run_shape_from_config
    from automodel.training.plan_search import run_budget_gib
    from automodel.training.row_padding import pad_multiple
    from automodel.training.step_estimate import estimate_step, gpu_spec

    base, world = loaded.cfg, loaded.world_size
    spec = gpu_spec(base.recipe.gpu_type)
    node = base.recipe.plan_nproc_per_node or spec.gpus_per_node
    budget = run_budget_gib(base.recipe.memory_budget_gib, base.recipe.gpu_type)[0]
    here = (base.distributed.tp_size, base.distributed.cp_size, _label(base) if base.distributed.cp_method != "auto" else None)
    out: list[RankedLayout] = []
    for layout in plan_layouts(base):
        item = RankedLayout(layout.text, layout.label or cp_method)
        out.append(item)
        try:
            cfg = _layout_config(loaded, layout, cp_method)
        except ConfigError as e:
            item.refused = "; ".join(e.problems)
            continue
        picked = cfg.distributed.cp_method == "auto"
        if picked and profile is None:
            profile = _profile(cfg, resolved, model)
        item.refused = _resolve(cfg, layout, profile, world, node) if picked else None
        if item.refused:
            continue
        item.method = ("auto -> " if picked else "") + _label(cfg)
        item.current = (layout.tp, layout.cp, _label(cfg)) == here
        item.refused = _model_problem(cfg, resolved, model)
        if item.refused:
            continue
        sizes, _ = parallel_sizes(cfg, world)
        mult = pad_multiple(cfg)
        seq = -(-cfg.data.seq_len // mult) * mult
        sched = cfg.step_scheduler
        grad_acc = sched.global_batch_size // (sched.local_batch_size * sizes["dp"])
        shape = run_shape_from_config(cfg, sizes, seq, grad_acc, dims=dims)  # loss.chunk_tokens auto resolved
        est = estimate_step(dims, shape, sizes, world, sched.global_batch_size, spec, node)
        item.step_s, item.tokens_per_s_gpu = est.step_s, est.tokens_per_s_per_gpu
        item.memory_gib = plan_memory(dims, shape).total_bytes / 2**30
        item.fits = item.memory_gib <= budget
    ranked = sorted((r for r in out if not r.refused), key=lambda r: r.step_s)
    return ranked + [r for r in out if r.refused]


def _profile(cfg: Any, resolved: Any, model: Any) -> Any:
    """The model's CP profile as a run of ``cfg`` reads it (the meta-device model)."""
    from automodel.models.cp_check import profile_for_run

    return profile_for_run(cfg, resolved, cfg.model.attn_implementation or "sdpa", model)


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def layout_ranking_lines(
    loaded: Any, cp_method: str, dims: Any, resolved: Any, model: Any, profile: Any = None
) -> list[str]:
    """The dry run's section for ``recipe.plan_layouts`` (none when the key is unset); arguments as
    :func:`rank_layouts`."""
    if not loaded.cfg.recipe.plan_layouts:
        return []
    from automodel.training.plan_search import run_budget_gib
    from automodel.training.step_estimate import gpu_spec

    spec = gpu_spec(loaded.cfg.recipe.gpu_type)
    budget = run_budget_gib(loaded.cfg.recipe.memory_budget_gib, loaded.cfg.recipe.gpu_type)[0]
    out = [f"--- layouts ranked by the step ESTIMATE (recipe.plan_layouts; {loaded.world_size} x {spec.name}), "
           "fastest first ---"]  # fmt: skip
    rank = 0
    for r in rank_layouts(loaded, cp_method, dims, resolved, model, profile):
        mark = " <- this config" if r.current else ""
        if r.refused:
            out.append(f"  refused  {r.text} ({r.method}): {r.refused.splitlines()[0]}{mark}")
            continue
        rank += 1
        fit = f"fits {budget:g} GiB" if r.fits else f"does NOT fit {budget:g} GiB"
        out.append(
            f"  {rank:>2}. {r.text} ({r.method}): step {_fmt_s(r.step_s)}, {r.tokens_per_s_gpu:,.0f} tokens/s/GPU, "
            f"memory {r.memory_gib:.1f} GiB per rank ({fit}){mark}"
        )
    return out
