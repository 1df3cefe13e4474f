"""``recipe.plan_layouts``: the parallel layouts a dry run ranks by its step estimate.

Each entry is a string of ``.``-separated parts, each at most once: ``tp<N>`` (``distributed.tp_size``),
``cp<N>`` (``distributed.cp_size``) and optionally a registered CP method's name (``distributed.cp_method``;
default: the config's, or the one ``auto`` chose for the config's own layout). Left out, a size is 1. ``dp_shard`` takes the rest of the world,
``dp_replicate`` stays the config's, and a layout without TP turns the TP-only switches off. E.g. ``["cp8", "tp2.cp4", "cp8.ulysses"]`` on 8 GPUs. Checked here
with the rest of the config, before any model is built; the dry run then checks each layout against the
model (heads, layer kinds) and marks the ones the run would refuse instead of ranking them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from automodel.distributed.cp import AUTO, cp_methods

__all__ = ["PlanLayout", "parse_layout", "plan_layouts", "plan_layout_problems"]

_SIZE = re.compile(r"^(tp|cp)(\d+)$")


@dataclass(frozen=True)
class PlanLayout:
    """One layout of ``recipe.plan_layouts``: ``text`` as written, its sizes and CP method (``None``: the config's)."""

    text: str
    tp: int = 1
    cp: int = 1
    method: str | None = None

    def overrides(self, cp_method: str) -> dict[str, Any]:
        """The ``distributed.*`` values that select this layout (``cp_method``: the config's method). Without
        TP the TP-only switches (``enable_loss_parallel``, ``sequence_parallel``) are turned off."""
        out: dict[str, Any] = {"tp_size": self.tp, "cp_size": self.cp, "dp_shard": -1, "cp_method": self.method or cp_method}
        if self.tp == 1:
            out.update(enable_loss_parallel=False, sequence_parallel=False)
        return out


def parse_layout(text: str) -> PlanLayout:
    """``"tp2.cp4.ulysses"`` -> ``PlanLayout(tp=2, cp=4, method="ulysses")``.

    Raises:
        ValueError: an empty or repeated part, a size below 1, or a part that is neither ``tp<N>``, ``cp<N>``
            nor a registered CP method; the message names the part and the form.
    """
    form = "'.'-separated parts tp<N>, cp<N> and optionally a CP method, e.g. 'tp2.cp4' or 'cp8.ulysses'"
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a layout; write {form}")
    sizes: dict[str, int] = {}
    method: str | None = None
    for part in text.strip().split("."):
        m = _SIZE.match(part)
        if m:
            key, n = m.group(1), int(m.group(2))
            if key in sizes:
                raise ValueError(f"{text!r} names {key} twice; write each of tp<N> and cp<N> at most once")
            if n < 1:
                raise ValueError(f"{text!r}: {part} must be >= 1; write {key}1 or more (or leave it out: 1)")
            sizes[key] = n
        elif part in cp_methods():
            if method is not None:
                raise ValueError(f"{text!r} names two CP methods ({method}, {part}); name one")
            method = part
        else:
            known = sorted(cp_methods())
            hint = f"; {AUTO!r} is resolved per model: name one of {known}" if part == AUTO else ""
            raise ValueError(
                f"{text!r}: part {part!r} is neither tp<N>, cp<N> nor a CP method ({known}){hint}; write {form}"
            )
    return PlanLayout(text.strip(), sizes.get("tp", 1), sizes.get("cp", 1), method)


def plan_layouts(cfg: Any) -> list[PlanLayout]:
    """The parsed ``recipe.plan_layouts`` of a validated config (empty when unset)."""
    return [parse_layout(t) for t in cfg.recipe.plan_layouts or []]


def plan_layout_problems(cfg: Any, world_size: int) -> list[str]:
    """Problems of ``recipe.plan_layouts`` (``cfg``: a RecipeConfig): a bad entry, sizes that do not divide the
    world, a repeated layout, or no ``recipe.gpu_type`` to estimate with."""
    texts = cfg.recipe.plan_layouts
    if not texts:
        return []
    problems: list[str] = []
    if cfg.recipe.gpu_type is None:
        problems.append(
            "recipe.plan_layouts is set but recipe.gpu_type is not: the layouts are ranked by the step estimate "
            "on that GPU; set recipe.gpu_type (e.g. h100)"
        )
    seen: dict[tuple[int, int, str | None], str] = {}
    rep = max(1, cfg.distributed.dp_replicate)
    for i, text in enumerate(texts):
        try:
            layout = parse_layout(text)
        except ValueError as e:
            problems.append(f"recipe.plan_layouts[{i}]: {e}")
            continue
        ranks = layout.tp * layout.cp * rep
        if world_size % ranks:
            fits = [f"tp{t}.cp{c}" for t in (1, 2, 4, 8) for c in (8, 4, 2) if world_size % (t * c * rep) == 0]
            problems.append(
                f"recipe.plan_layouts[{i}]={text!r}: tp x cp x distributed.dp_replicate = {layout.tp} x {layout.cp} x "
                f"{rep} = {ranks} does not divide the planned world size {world_size}; use sizes whose product divides "
                f"it (e.g. {', '.join(fits[:4])})"
            )
        key = (layout.tp, layout.cp, layout.method)
        if key in seen:
            problems.append(f"recipe.plan_layouts[{i}]={text!r} repeats {seen[key]!r}; list each layout once")
        seen.setdefault(key, text)
    return problems
