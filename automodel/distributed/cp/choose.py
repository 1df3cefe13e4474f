"""``cp_method: auto``: the CP method that computes a model exactly and is expected to run fastest.

:func:`choose_cp_method` reads no table of its own. For every registered method, and every configuration
the method offers (:meth:`~automodel.distributed.cp.method.CPMethod.auto_configs`: usp's factorings of
``cp_size``), it asks the method's own checks why it would not run the model exactly:

- packed rows (several documents per row) and :attr:`~CPMethod.supports_packed`;
- a VLM and :attr:`~CPMethod.supports_vlm`;
- :meth:`~CPMethod.head_split_problem` (the heads over ``cp_size``, after ``tp_size``);
- :func:`~automodel.distributed.cp.method.profile_problems`: every layer's
  :meth:`~CPMethod.layer_problem` and the attention implementation's :meth:`~CPMethod.attn_problem`
  (rows of ``seq_len`` tokens; when the length is not known, rows of any length: a window is then
  shorter than the row, never left to the first attention call);
- ``extra_problems(method, options)``: what the caller adds (the recipe: the config rules of that method).

A method with any problem is refused; a method added or taught a new layer kind is picked up through
these checks with no change here. Among the methods that compute the model, the cheapest wins:

**The cost** is the one cost model of :func:`~automodel.distributed.cp.cost.exchange_cost`, which the dry
run's step estimate also reads: the bytes one rank sends per attention layer for a row of ``seq_len`` tokens
(:data:`NOMINAL_SEQ` when not known; bf16), inside a node and across nodes (``ranks_per_node``; ``None``: one
node), a byte across nodes weighing :data:`~automodel.distributed.cp.cost.INTER_NODE_WEIGHT` bytes inside one
(:attr:`~automodel.distributed.cp.cost.ExchangeCost.weighted_bytes`). Ties go to the method registered first.
What the model says, in short: Ulysses' all-to-all does not grow with ``cp_size`` while the K/V exchange of
ring and thd does, so Ulysses wins where its heads divide ``cp_size`` inside a node (with GQA, from
``cp_size`` 4 on); thd_docs sends only the K/V of documents split across ranks, so it wins on packed rows of
short documents; across nodes the all-to-all pays the network rate and usp (all-to-all inside a node, K/V
across) or the K/V methods win. Only attention's exchange is counted (a linear mixer's state hand-off is tiny;
Ulysses' head split of it is not counted), and windows are counted as full rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from automodel.distributed.cp.cost import INTER_NODE_WEIGHT, ExchangeCost, exchange_cost, span_inside_node
from automodel.distributed.cp.method import CPMethod, ExchangeTerm
from automodel.distributed.cp.profile import ModelProfile
from automodel.distributed.cp.registry import alternative_label, cp_methods, method_reasons, run_problems
from automodel.errors import CPUnsupportedError

__all__ = [
    "AUTO",
    "INTER_NODE_WEIGHT",
    "NOMINAL_SEQ",
    "Candidate",
    "Choice",
    "choose_cp_method",
    "method_line",
    "span_inside_node",
]

#: the value of ``distributed.cp_method`` / ``context_parallel(method=...)`` that picks a method
AUTO = "auto"
#: the row length the cost is computed for when it is not known (the own loop)
NOMINAL_SEQ = 4096
#: the row length the exactness checks use when it is not known: longer than any window or chunk
_ANY_LENGTH = 1 << 40


@dataclass(frozen=True)
class Candidate:
    """One configuration of one method, as :func:`choose_cp_method` judged it."""

    method: CPMethod  # its options bound (usp: ulysses_size)
    options: dict[str, Any]  # the distributed.<key> values that select it besides cp_method
    problems: tuple[str, ...]  # why it does not compute the model exactly (empty: it does)
    cost: float = 0.0  # weighted bytes per rank per attention layer (see the module docstring)
    exchange: ExchangeCost | None = None  # what it sends inside and across nodes (None: refused, not costed)

    @property
    def terms(self) -> tuple[ExchangeTerm, ...]:
        return self.exchange.terms if self.exchange is not None else ()

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def label(self) -> str:
        """``usp (ulysses_size=2)``; the bare name without options."""
        return alternative_label(self.method, self.options)

    @property
    def computes(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked: the method (options bound), the keys that select it, why, and every candidate."""

    method: CPMethod
    options: dict[str, Any]
    reason: str  # one line for the log and the dry run
    candidates: tuple[Candidate, ...] = field(default=())

    @property
    def name(self) -> str:
        return self.method.name


def _model_problems(
    m: CPMethod, profile: ModelProfile, cp_size: int, tp_size: int, seq_len: int | None, packed: bool
) -> list[str]:
    """Every reason ``m`` (options bound) does not run the model exactly: the registry's
    :func:`~automodel.distributed.cp.registry.run_problems`, the list every refusal reads; rows of any length
    when ``seq_len`` is not known (a window shorter than the row is judged now)."""
    if seq_len is not None:
        return run_problems(m, profile, cp_size=cp_size, tp_size=tp_size, seq_len=seq_len, packed=packed)
    rows = f"the rows ({_ANY_LENGTH} tokens)"
    found = run_problems(m, profile, cp_size=cp_size, tp_size=tp_size, seq_len=_ANY_LENGTH, packed=packed)
    return [p.replace(rows, "rows of any length") for p in found]


def _size(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _sent(c: Candidate) -> str:
    """What a candidate sends per rank per attention layer: ``"1.86 GiB (1.31 GiB of it across nodes)"``."""
    e = c.exchange
    if e is None:
        return _size(c.cost)
    across = f" ({_size(e.inter_node_bytes)} of it across nodes)" if e.inter_node_bytes else ""
    return _size(e.total_bytes) + across


def _short(problem: str, limit: int = 90) -> str:
    text = " ".join(problem.split())
    return text if len(text) <= limit else text[: text.rfind(" ", 0, limit)].rstrip(",;:") + " ..."


def choose_cp_method(
    profile: ModelProfile,
    cp_size: int,
    *,
    seq_len: int | None = None,
    packed: bool = False,
    tp_size: int = 1,
    ranks_per_node: int | None = None,
    extra_problems: Callable[[CPMethod, dict[str, Any]], list[str]] | None = None,
) -> Choice:
    """The method that computes ``profile``'s model exactly and is expected to run fastest (module docstring).

    Args:
        profile: :func:`~automodel.distributed.cp.profile.profile_model` of the model.
        cp_size: the CP group's size (``<= 1``: no CP; the method chosen at ``cp_size`` 2, else the first
            one without ``extra_problems``).
        seq_len: the (padded) row length; ``None``: not known (windows are then judged against any length).
        packed: rows hold several documents each (the dataset packs them, or the batches carry ``seq_lens``).
        tp_size: tensor parallelism (divides the heads before CP does).
        ranks_per_node: processes per node (``None``: every rank on one node).
        extra_problems: ``(method, options) -> reasons`` the caller adds (the recipe: that method's config rules).

    Returns:
        the :class:`Choice`: the method with its options bound, the ``distributed.<key>`` values that select
        it, a one-line reason and every candidate.

    Raises:
        CPUnsupportedError: no method computes the model exactly; the message gives each method's reasons.
    """
    if cp_size <= 1:  # no CP: the method auto picks at cp_size 2 (the same data and checks), so runs agree
        try:
            at2 = choose_cp_method(profile, 2, seq_len=seq_len, packed=packed, tp_size=tp_size,
                                   ranks_per_node=ranks_per_node, extra_problems=extra_problems)  # fmt: skip
        except CPUnsupportedError:
            pass  # every method runs the model as one process: the first the config allows
        else:
            reason = (
                f"cp_method auto: {at2.method.name} (cp_size 1: no context parallelism; the method auto picks for "
                "this model at cp_size 2)"
            )
            return Choice(at2.method, at2.options, reason, at2.candidates)
    seq = seq_len or NOMINAL_SEQ
    candidates: list[Candidate] = []
    empty: list[str] = []
    for name, method in cp_methods().items():
        configs = method.auto_configs(cp_size, ranks_per_node)
        if not configs:
            empty.append(f"{name}: no configuration at cp_size={cp_size}")
            continue
        for m, options in configs:
            problems = _model_problems(m, profile, cp_size, tp_size, seq_len, packed) if cp_size > 1 else []
            if extra_problems is not None:
                problems += extra_problems(m, options)
            exchange = None if problems else exchange_cost(
                m, profile, seq_len=seq, cp_size=cp_size, tp_size=tp_size, ranks_per_node=ranks_per_node,
                packed=packed,
            )  # fmt: skip
            cost = exchange.weighted_bytes if exchange is not None else 0.0
            candidates.append(Candidate(m, dict(options), tuple(problems), cost, exchange))
    running = sorted((c for c in candidates if c.computes), key=lambda c: c.cost)  # stable: registration order
    where = (
        f"cp_size {cp_size}" + (f" x tp_size {tp_size}" if tp_size > 1 else "")
        + (f", {ranks_per_node} ranks per node" if ranks_per_node else "")
        + f", {'packed rows' if packed else 'one document per row'}"
        + (f" of {seq_len} tokens" if seq_len else " of any length")
    )  # fmt: skip
    if not running:
        reasons = [f"{c.label}: {'; '.join(c.problems)}" for c in candidates] + empty
        raise CPUnsupportedError(
            f"distributed.cp_method=auto found no CP method that computes {profile.architecture} "
            f"(model_type={profile.model_type}) exactly at {where}. {method_reasons(reasons)}. Change what one "
            "method's reasons name (auto then picks that method), or train it with distributed.cp_size=1. See "
            "docs/support_matrix.md"
        )
    best = running[0]
    if cp_size <= 1:
        reason = f"cp_method auto: {best.label} (cp_size 1: no context parallelism, every method runs as one process)"
        return Choice(best.method, best.options, reason, tuple(candidates))
    sent = ", ".join(f"{t.what}, {t.group} ranks" for t in best.terms) or "nothing"
    others = [f"{c.label} {_sent(c)}" for c in running[1:]]
    weighed = any(c.exchange is not None and c.exchange.inter_node_bytes for c in running)
    refused = {}
    for c in candidates:  # one reason per method (its first configuration's)
        if not c.computes and c.name not in refused and c.name not in {r.name for r in running}:
            refused[c.name] = _short(c.problems[0])
    refused.update(e.split(": ", 1) for e in empty)
    reason = (
        f"cp_method auto: {best.label}, the cheapest method that computes every layer of {profile.architecture} "
        f"exactly at {where}: {_sent(best)} sent per rank per attention layer ({sent})"
        + (f"; costlier{f' (a byte across nodes weighing {INTER_NODE_WEIGHT:g})' if weighed else ''}: "
           f"{', '.join(others)}" if others else "")
        + (f"; refused: {'; '.join(f'{n} ({r})' for n, r in refused.items())}" if refused else "")
    )
    return Choice(best.method, best.options, reason, tuple(candidates))


def method_line(
    method: str,
    cp_size: int,
    choice: Choice | None = None,
    auto: Choice | None = None,
    config: Mapping[str, Any] | None = None,
) -> str:
    """The CP method of a run in one log line, with why it runs.

    Args:
        method: the method the run uses (``distributed.cp_method`` once ``auto`` is resolved).
        cp_size: the CP group's size.
        choice: ``auto``'s choice when the config says ``auto``: the line is its reason.
        auto: for a method named in the config, what ``auto`` would pick for the same run (``None``: not
            computed, or it refused): the line says whether it agrees and, if not, what each sends.
        config: the ``distributed`` keys (``ulysses_size``) that select the named method's configuration.

    Returns:
        e.g. ``"cp_method ring: named in the config; auto would pick ulysses (ring 1.50 MiB, ulysses 0.75 MiB sent
        per rank per attention layer; distributed.cp_method=auto picks it)"``. Pure.
    """
    if choice is not None:
        return choice.reason
    line = f"cp_method {method}: named in the config"
    if cp_size <= 1:
        return line + " (cp_size 1: no context parallelism)"
    if auto is None:
        return line
    values = dict(config or {})
    named = next(
        (c for c in auto.candidates if c.name == method and all(values.get(k) == v for k, v in c.options.items())),
        None,
    )
    picked = next((c for c in auto.candidates if c.method is auto.method), None)
    if named is not None and picked is not None and named.label == picked.label:
        return line + "; cp_method auto picks the same"
    label = picked.label if picked is not None else auto.name
    if named is None or not named.computes or picked is None:
        return line + f"; cp_method auto would pick {label}"
    return line + (
        f"; cp_method auto would pick {label} ({named.label} {_sent(named)}, {label} {_sent(picked)} sent per "
        "rank per attention layer; distributed.cp_method=auto picks it)"
    )
