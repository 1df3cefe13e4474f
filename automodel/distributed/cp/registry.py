"""The CP method registry, and the one check of a model against a method.

``distributed.cp_method`` names a registered :class:`~automodel.distributed.cp.method.CPMethod`. The
built-in methods (ring, ulysses, thd) register themselves when :mod:`automodel.distributed.cp` is
imported; a new method is one module plus one :func:`register_cp_method` call.
"""

from __future__ import annotations

from typing import Any

from automodel.distributed.cp.method import CPMethod, profile_problems
from automodel.distributed.cp.profile import ModelProfile, profile_model
from automodel.errors import CPUnsupportedError, UserInputError

__all__ = [
    "register_cp_method",
    "unregister_cp_method",
    "get_cp_method",
    "cp_methods",
    "check_model_for_cp",
    "check_model_config_for_cp",
    "methods_that_run",
    "alternatives",
    "alternatives_fix",
    "method_reasons",
    "run_problems",
]

_REGISTRY: dict[str, CPMethod] = {}


def register_cp_method(method: CPMethod, *, replace: bool = False) -> CPMethod:
    """Make ``method`` selectable as ``distributed.cp_method=<method.name>``; returns it.

    Raises:
        ValueError: the name is empty or ``auto`` (reserved), or taken and ``replace`` is false.
    """
    if not method.name:
        raise ValueError(f"{type(method).__name__} has no name; set the class attribute `name`")
    if method.name == "auto":
        raise ValueError(
            f"{type(method).__name__} is named 'auto', which distributed.cp_method reserves for choosing a method; "
            "give it another name"
        )
    if method.name in _REGISTRY and not replace:
        raise ValueError(f"a CP method named {method.name!r} is already registered; pass replace=True")
    _REGISTRY[method.name] = method
    return method


def unregister_cp_method(name: str) -> None:
    """Remove a method (tests that register a toy method clean up with this)."""
    _REGISTRY.pop(name, None)


def cp_methods() -> dict[str, CPMethod]:
    """The registered methods by name, in registration order (a copy)."""
    return dict(_REGISTRY)


def get_cp_method(method: str | CPMethod, **options: Any) -> CPMethod:
    """The method named ``method`` (a :class:`CPMethod` is returned as is), with ``options`` bound
    (:meth:`~CPMethod.with_options`: the ``distributed.<key>`` values it reads, e.g. usp's ``ulysses_size``).

    Raises:
        ValueError: no such method (the message lists the registered ones), or an option it does not take.
    """
    if isinstance(method, CPMethod):
        return method.with_options(**options) if options else method
    if method == "auto":
        raise ValueError(
            "distributed.cp_method=auto names no method until the model is known: resolve it first "
            "(automodel.config.cp_auto.resolve_cp_method in the recipe; own loop: context_parallel(model, mesh, "
            "method='auto') or automodel.distributed.cp.choose_cp_method(profile, cp_size))"
        )
    if method not in _REGISTRY:
        raise ValueError(
            f"distributed.cp_method={method!r} is not one of {sorted(_REGISTRY)}; "
            f"set distributed.cp_method to one of {' | '.join(_REGISTRY)}"
        )
    return _REGISTRY[method].with_options(**options) if options else _REGISTRY[method]


def run_problems(
    method: CPMethod,
    profile: ModelProfile,
    *,
    cp_size: int | None = None,
    tp_size: int = 1,
    seq_len: int | None = None,
    packed: bool | None = False,
) -> list[str]:
    """Every reason ``method`` (its options bound) does not run ``profile``'s model exactly: the one list that
    every refusal and ``cp_method: auto`` read, so a method a refusal names as an alternative really runs.

    Args:
        cp_size: the CP group's size (``None``: not known; the heads are then not checked).
        tp_size: tensor parallelism, which divides the heads before CP does.
        seq_len: the (padded) row length (``None``: not known; windows are judged at the first attention call).
        packed: rows hold several documents (``None``: not known; not checked).

    Returns:
        reasons, grouped: packed rows without :attr:`~CPMethod.supports_packed`, a VLM without
        :attr:`~CPMethod.supports_vlm`, :meth:`~CPMethod.head_split_problem`, and
        :func:`~automodel.distributed.cp.method.profile_problems` (every layer kind and the attention
        implementation); empty: it runs the model exactly.
    """
    problems = []
    if packed and not method.supports_packed:
        problems.append(f"packed rows (several documents per row): {method.name} attends across the whole row")
    if profile.is_vlm and not method.supports_vlm:
        problems.append(
            f"a VLM ({profile.model_type}): {method.name} does not take merged image and text embeddings"
        )
    if cp_size is not None:
        head = method.head_split_problem(profile.num_attention_heads, cp_size, tp_size)
        if head is not None:
            problems.append(head)
    return problems + profile_problems(method, profile, seq_len)


def alternatives(
    profile: ModelProfile,
    *,
    exclude: str | None = None,
    cp_size: int | None = None,
    tp_size: int = 1,
    seq_len: int | None = None,
    packed: bool | None = False,
) -> list[tuple[CPMethod, dict[str, Any]]]:
    """The registered methods that run ``profile``'s model exactly under these conditions (:func:`run_problems`),
    each ``(method with its options bound, the distributed.<key> / context_parallel option values that select
    it)``: at a known ``cp_size`` the first of the method's :meth:`~CPMethod.auto_configs` that runs (usp:
    ``ulysses_size``), else the registered method as it is. ``exclude``: a method name left out (the one
    refused)."""
    out = []
    for name, method in _REGISTRY.items():
        if name == exclude:
            continue
        configs = method.auto_configs(cp_size, None) if cp_size is not None and cp_size > 1 else [(method, {})]
        for m, options in configs:
            problems = run_problems(m, profile, cp_size=cp_size, tp_size=tp_size, seq_len=seq_len, packed=packed)
            if not problems:
                out.append((m, dict(options)))
                break
    return out


def alternative_label(method: CPMethod, options: dict[str, Any]) -> str:
    """``usp (ulysses_size=2)``; the bare name without options."""
    opts = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"{method.name} ({opts})" if opts else method.name


def method_reasons(reasons: list[str]) -> str:
    """Each method's refusal (``label: why``) as one sentence, the sentences joined (``auto``'s refusals)."""
    return ". ".join(r.strip().rstrip(".") for r in reasons)


def methods_that_run(
    profile: ModelProfile,
    seq_len: int | None = None,
    *,
    cp_size: int | None = None,
    tp_size: int = 1,
    packed: bool | None = False,
) -> list[str]:
    """Names of the registered methods that compute ``profile``'s model exactly on ``seq_len``-token rows
    (:func:`alternatives`: at ``cp_size`` / ``tp_size`` when given, on packed rows when ``packed``)."""
    found = alternatives(profile, cp_size=cp_size, tp_size=tp_size, seq_len=seq_len, packed=packed)
    return [m.name for m, _ in found]


def alternatives_fix(
    profile: ModelProfile, *, key: str = "distributed.cp_method", **conditions: Any
) -> tuple[str, tuple[str, ...]]:
    """The advice of a refusal: ``(text, labels)``, the labels of :func:`alternatives` under ``conditions``
    (its keywords: ``exclude``, ``cp_size``, ``tp_size``, ``seq_len``, ``packed``; each label runs the model
    exactly under the same conditions). The text is an instruction (``set <key> to one of ...``), or, when no
    method runs the model, says so and what to change. ``packed=None`` (not known yet: the own loop before a
    batch): the methods that take one document per row only are marked so. ``key``: how the user selects a
    method."""
    found = alternatives(profile, **conditions)
    labels = tuple(alternative_label(m, o) for m, o in found)
    packed = conditions.get("packed", False)
    if not found:
        any_size = dict(conditions, cp_size=None, tp_size=1, packed=None)
        if alternatives(profile, **any_size):  # it is the sizes or the rows
            return (
                "no other CP method runs this model exactly at these sizes and rows: change distributed.cp_size / "
                "tp_size or the packing, or train it with distributed.cp_size=1"
            ), labels
        return "no CP method runs this model exactly yet: train it with distributed.cp_size=1", labels
    shown = [
        label + (" (one document per row)" if packed is None and not m.supports_packed else "")
        for label, (m, _) in zip(labels, found)
    ]
    return f"set {key} to one of the methods that run this model exactly: {' | '.join(shown)}", labels


def _refusal(error: type[UserInputError], message: str, labels: tuple[str, ...]) -> UserInputError:
    err = error(message)
    err.alternatives = labels
    return err


def check_model_for_cp(
    method: str | CPMethod,
    profile: ModelProfile,
    seq_len: int | None = None,
    *,
    cp_size: int | None = None,
    tp_size: int = 1,
    packed: bool | None = None,
) -> None:
    """Refuse a model that ``method`` would not compute exactly.

    Args:
        method: a registered method or its name.
        profile: :func:`~automodel.distributed.cp.profile.profile_model` of the model.
        seq_len: the row length (windows and chunks at least this long attend like full attention);
            ``None``: not known yet, windows and chunks are then judged at the first attention call.
        cp_size, tp_size, packed: the run's, for the methods the message names (:func:`alternatives_fix`);
            ``None``: not known.

    Raises:
        CPUnsupportedError: one message with the method, each offending layer kind and its layer
            indices, and the methods that would run the model exactly (also in its ``alternatives``).
    """
    m = get_cp_method(method)
    problems = profile_problems(m, profile, seq_len)
    if not problems:
        return
    fix, labels = alternatives_fix(
        profile, exclude=m.name, cp_size=cp_size, tp_size=tp_size, seq_len=seq_len, packed=packed
    )
    raise _refusal(
        CPUnsupportedError,
        f"distributed.cp_method={m.name} does not compute {profile.architecture} "
        f"(model_type={profile.model_type}) exactly: {'; '.join(problems)}. It would train with losses and "
        f"gradients that differ from one device, so it is refused; {fix}. See docs/support_matrix.md",
        labels,
    )


def check_model_config_for_cp(
    method: str | CPMethod,
    model: Any,
    cp_size: int,
    tp_size: int = 1,
    seq_len: int | None = None,
    packed: bool | None = None,
) -> ModelProfile | None:
    """Everything about a model that decides whether ``method`` runs it at ``cp_size``, before any weight loads.

    Args:
        model: a :class:`ModelProfile`, or what :func:`profile_model` takes (a config, or a model: the meta
            device is enough, and needed to see sinks and MLA head sizes).
        seq_len: the (padded) row length, for windows and chunks; ``None``: not known.
        packed: rows hold several documents (``None``: not known), for the methods a refusal names.

    Returns:
        the profile (``None`` at ``cp_size <= 1``: no CP, nothing to check).

    Raises:
        UserInputError: a VLM with a method that does not take merged embeddings; packed rows with a method
            that attends across the row; heads that the method cannot split over ``cp_size`` (after ``tp_size``).
            Every refusal names the methods that run the model under the same conditions (its ``alternatives``).
        CPUnsupportedError: a layer kind the method does not compute exactly (:func:`check_model_for_cp`).
    """
    if cp_size <= 1:
        return None
    m = get_cp_method(method)
    profile = model if isinstance(model, ModelProfile) else profile_model(model)
    where = dict(cp_size=cp_size, tp_size=tp_size, seq_len=seq_len, packed=packed)
    if profile.is_vlm and not m.supports_vlm:
        fix, labels = alternatives_fix(profile, exclude=m.name, **where)
        raise _refusal(
            UserInputError,
            f"distributed.cp_method={m.name} does not run VLMs ({profile.model_type}): their images are encoded "
            f"on each rank's share and merged before the text model, which {m.name} does not take; {fix}",
            labels,
        )
    if packed and not m.supports_packed:
        fix, labels = alternatives_fix(profile, exclude=m.name, **where)
        raise _refusal(
            UserInputError,
            f"distributed.cp_method={m.name} attends across the whole row and would mix the documents of packed "
            f"rows, so it is refused; {fix}; or give it one document per row (data.dataset.pack=false)",
            labels,
        )
    problem = m.head_split_problem(profile.num_attention_heads, cp_size, tp_size)
    if problem is not None:
        fix, labels = alternatives_fix(profile, exclude=m.name, **where)
        raise _refusal(UserInputError, f"{problem}; {'or ' if labels else ''}{fix}", labels)
    check_model_for_cp(m, profile, seq_len, cp_size=cp_size, tp_size=tp_size, packed=packed)
    return profile
