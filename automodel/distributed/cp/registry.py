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


def get_cp_method(method: str | CPMethod) -> CPMethod:
    """The method named ``method`` (a :class:`CPMethod` is returned as is).

    Raises:
        ValueError: no such method; the message lists the registered ones.
    """
    if isinstance(method, CPMethod):
        return method
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
    return _REGISTRY[method]


def methods_that_run(profile: ModelProfile, seq_len: int | None = None) -> list[str]:
    """Names of the registered methods that compute ``profile``'s model exactly on ``seq_len``-token rows."""
    return [name for name, m in _REGISTRY.items() if not profile_problems(m, profile, seq_len)]


def check_model_for_cp(method: str | CPMethod, profile: ModelProfile, seq_len: int | None = None) -> None:
    """Refuse a model that ``method`` would not compute exactly.

    Args:
        method: a registered method or its name.
        profile: :func:`~automodel.distributed.cp.profile.profile_model` of the model.
        seq_len: the row length (windows and chunks at least this long attend like full attention);
            ``None``: not known yet, windows and chunks are then judged at the first attention call.

    Raises:
        CPUnsupportedError: one message with the method, each offending layer kind and its layer
            indices, and the methods that would run the model exactly.
    """
    m = get_cp_method(method)
    problems = profile_problems(m, profile, seq_len)
    if not problems:
        return
    others = [name for name in methods_that_run(profile, seq_len) if name != m.name]
    fix = (
        f"methods that run this model exactly: {' | '.join(others)} (distributed.cp_method=...)"
        if others
        else "no CP method runs this model exactly yet: train it with distributed.cp_size=1"
    )
    raise CPUnsupportedError(
        f"distributed.cp_method={m.name} does not compute {profile.architecture} "
        f"(model_type={profile.model_type}) exactly: {'; '.join(problems)}. It would train with losses and "
        f"gradients that differ from one device, so it is refused; {fix}. See docs/support_matrix.md"
    )


def check_model_config_for_cp(
    method: str | CPMethod, model: Any, cp_size: int, tp_size: int = 1, seq_len: int | None = None
) -> ModelProfile | None:
    """Everything about a model that decides whether ``method`` runs it at ``cp_size``, before any weight loads.

    Args:
        model: a :class:`ModelProfile`, or what :func:`profile_model` takes (a config, or a model: the meta
            device is enough, and needed to see sinks and MLA head sizes).
        seq_len: the (padded) row length, for windows and chunks; ``None``: not known.

    Returns:
        the profile (``None`` at ``cp_size <= 1``: no CP, nothing to check).

    Raises:
        UserInputError: a VLM with a method that does not take merged embeddings; heads that the method
            cannot split over ``cp_size`` (after ``tp_size``).
        CPUnsupportedError: a layer kind the method does not compute exactly (:func:`check_model_for_cp`).
    """
    if cp_size <= 1:
        return None
    m = get_cp_method(method)
    profile = model if isinstance(model, ModelProfile) else profile_model(model)
    if profile.is_vlm and not m.supports_vlm:
        vlm_methods = [name for name, other in _REGISTRY.items() if other.supports_vlm]
        raise UserInputError(
            f"distributed.cp_method={m.name} does not run VLMs ({profile.model_type}): their images are encoded on "
            f"each rank's share and merged before the text model, which only {' and '.join(vlm_methods)} take; "
            f"set distributed.cp_method={vlm_methods[0] if vlm_methods else 'ring'}"
        )
    problem = m.head_split_problem(profile.num_attention_heads, cp_size, tp_size)
    if problem is not None:
        raise UserInputError(problem)
    check_model_for_cp(m, profile, seq_len)
    return profile
