"""``recipe.plan_layouts``: the parallel layouts a dry run ranks by its step estimate.

Each entry is a string of ``.``-separated parts, each at most once: ``tp<N>`` (``distributed.tp_size``),
``cp<N>`` (``distributed.cp_size``) and optionally a CP method: a registered method's name, with the number
its :attr:`~automodel.distributed.cp.method.CPMethod.layout_option` takes (``usp8``: usp with
``ulysses_size=8``), or ``auto``. Left out, a size is 1. E.g. ``["cp64.usp8", "cp64.ring", "tp2.cp4.ulysses",
"cp64"]`` on 64 GPUs.

A layout that names a method runs it whatever the config's ``distributed.cp_method`` and method keys say:
the keys only other methods read (``ulysses_size`` for a ``ring`` layout) are unset, and a method named
without its number takes the config's value, else the one ``auto`` ranks cheapest for that layout
(``cp64.usp``). A layout without a method runs the config's method, or, under ``cp_method: auto`` (or
``.auto``), the method ``auto`` picks for that layout. ``dp_shard`` takes the rest of the world,
``dp_replicate`` stays the config's, and a layout without TP turns the TP-only switches off. Checked here
with the rest of the config, before any model is built; the dry run then checks each layout against the
model (heads, layer kinds) and marks the ones the run would refuse instead of ranking them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from automodel.distributed.cp import AUTO, cp_methods

__all__ = ["PlanLayout", "parse_layout", "plan_layouts", "plan_layout_problems"]

_SIZE = re.compile(r"^(tp|cp)(\d+)$")
_METHOD_N = re.compile(r"^([a-z_]+?)(\d+)$")


@dataclass(frozen=True)
class PlanLayout:
    """One layout of ``recipe.plan_layouts``: ``text`` as written, its sizes, its CP method (``None``: the
    config's; ``"auto"``: ``auto``'s pick) and the method's options written in it (``usp8``: ulysses_size 8)."""

    text: str
    tp: int = 1
    cp: int = 1
    method: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """The method and its options as written: ``"usp, ulysses_size=8"`` (``""``: none named)."""
        return ", ".join([self.method or "", *(f"{k}={v}" for k, v in self.options)]).strip(", ")

    def overrides(self, cp_method: str, current: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``distributed.*`` values that select this layout.

        Args:
            cp_method: the config's method as written (``auto`` included).
            current: the config's ``distributed`` keys (a method named without its number takes the config's
                value of it).

        Returns:
            ``tp_size``, ``cp_size``, ``dp_shard=-1``, ``cp_method``; for a named method, every other method's
            option keys unset (``None``) and its own from the layout, else the config's; ``cp_method: auto``
            when a named method's layout option has no value (auto then picks it, restricted to that method:
            :attr:`chooses_options`). Without TP the TP-only switches (``enable_loss_parallel``,
            ``sequence_parallel``) are turned off.
        """
        out: dict[str, Any] = {"tp_size": self.tp, "cp_size": self.cp, "dp_shard": -1,
                               "cp_method": cp_method if self.method is None else self.method}  # fmt: skip
        if self.method is not None and self.method != AUTO:
            method = cp_methods()[self.method]
            values = dict(current or {})
            for other in cp_methods().values():
                for key in other.option_keys:
                    if key not in method.option_keys:
                        out[key] = None
            out.update(self.options)
            if self.chooses_options(values):
                out["cp_method"] = AUTO  # the method's number: auto's, among the method's configurations
        if self.tp == 1:
            out.update(enable_loss_parallel=False, sequence_parallel=False)
        return out

    def chooses_options(self, current: Mapping[str, Any] | None = None) -> bool:
        """The layout names a method whose layout option (usp's ``ulysses_size``) neither it nor the config
        (``current``: its ``distributed`` keys) sets: ``auto`` picks it for the layout."""
        if self.method is None or self.method == AUTO:
            return False
        key = cp_methods()[self.method].layout_option
        return key is not None and key not in dict(self.options) and (current or {}).get(key) is None


def _method_part(part: str) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
    """``"usp8"`` -> ``("usp", (("ulysses_size", 8),))``; ``"ring"`` -> ``("ring", ())``; else ``None``."""
    if part == AUTO or part in cp_methods():
        return part, ()
    m = _METHOD_N.match(part)
    if m and m.group(1) in cp_methods():
        key = cp_methods()[m.group(1)].layout_option
        if key is not None:
            return m.group(1), ((key, int(m.group(2))),)
    return None


def parse_layout(text: str) -> PlanLayout:
    """``"tp2.cp4.ulysses"`` -> ``PlanLayout(tp=2, cp=4, method="ulysses")``; ``"cp64.usp8"`` ->
    ``PlanLayout(cp=64, method="usp", options=(("ulysses_size", 8),))``.

    Raises:
        ValueError: an empty or repeated part, a size below 1, or a part that is neither ``tp<N>``, ``cp<N>``,
            ``auto`` nor a registered CP method (with its number where it takes one); the message names the
            part and the form.
    """
    numbered = [f"{n}<N>" for n, m in cp_methods().items() if m.layout_option]
    form = (
        "'.'-separated parts tp<N>, cp<N> and optionally a CP method (or auto"
        + (f"; {', '.join(numbered)} with its {' / '.join(sorted({m.layout_option for m in cp_methods().values() if m.layout_option}))}" if numbered else "")
        + "), e.g. 'tp2.cp4', 'cp8.ulysses'"
        + (f" or 'cp64.{numbered[0].replace('<N>', '8')}'" if numbered else "")
    )  # fmt: skip
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{text!r} is not a layout; write {form}")
    sizes: dict[str, int] = {}
    method: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    for part in text.strip().split("."):
        m = _SIZE.match(part)
        named = None if m else _method_part(part)
        if m:
            key, n = m.group(1), int(m.group(2))
            if key in sizes:
                raise ValueError(f"{text!r} names {key} twice; write each of tp<N> and cp<N> at most once")
            if n < 1:
                raise ValueError(f"{text!r}: {part} must be >= 1; write {key}1 or more (or leave it out: 1)")
            sizes[key] = n
        elif named is not None:
            if method is not None:
                raise ValueError(f"{text!r} names two CP methods ({method}, {named[0]}); name one")
            method, options = named
            if options and options[0][1] < 1:
                raise ValueError(f"{text!r}: {part} sets {options[0][0]}={options[0][1]}; it must be >= 1")
        else:
            known = sorted(cp_methods())
            raise ValueError(
                f"{text!r}: part {part!r} is neither tp<N>, cp<N>, auto nor a CP method ({known}); write {form}"
            )
    return PlanLayout(text.strip(), sizes.get("tp", 1), sizes.get("cp", 1), method, options)


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
    seen: dict[tuple[Any, ...], str] = {}
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
        key = (layout.tp, layout.cp, layout.method, layout.options)
        if key in seen:
            problems.append(f"recipe.plan_layouts[{i}]={text!r} repeats {seen[key]!r}; list each layout once")
        seen.setdefault(key, text)
    return problems
