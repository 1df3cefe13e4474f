"""The own-loop check at a model's first forward inside a CP context.

Some own-loop entry points never see the model (ring's ``make_cp_batch_and_ctx(device_mesh, batch)``),
so the exactness check runs when the model is first called inside the context: a global forward
pre-hook fires on the first module call, profiles the transformers model found there (once per model
object; :func:`cached_profile`) and raises
:class:`~automodel.errors.CPUnsupportedError` before any of its layers runs. The hook removes itself at
that first model call, so the layers (and compiled blocks) run without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from automodel.distributed.cp.profile import ModelProfile, profile_model, text_config

__all__ = ["cached_profile", "check_on_first_forward"]

_PROFILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _is_hf_model(module: Any) -> bool:
    return hasattr(module, "config") and hasattr(module, "set_attn_implementation")


def cached_profile(model: Any) -> ModelProfile:
    """:func:`profile_model` of ``model``, computed once per model object; the attention implementation is
    read anew on every call (a method may have switched it)."""
    profile = _PROFILES.get(model)
    if profile is None:
        profile = profile_model(model)
        _PROFILES[model] = profile
    attn = getattr(text_config(model.config), "_attn_implementation", None) or getattr(
        model.config, "_attn_implementation", None
    )
    return dataclasses.replace(profile, attn_implementation=attn)


@contextlib.contextmanager
def check_on_first_forward(
    check: Callable[[ModelProfile], None], prepare: Callable[[Any, ModelProfile], None] | None = None
) -> Iterator[None]:
    """Inside the block, call ``check(profile)`` at the first forward of a transformers model.

    ``check`` raises to refuse the model; the forward then never starts. ``prepare(model, profile)``, if
    given, runs after a passing check (e.g. installs the ring's linear-mixer kernels; mutates the model).
    """
    from torch.nn.modules.module import register_module_forward_pre_hook

    handle = None

    def hook(module: Any, args: Any) -> None:
        nonlocal handle
        if not _is_hf_model(module):
            return
        if handle is not None:
            handle.remove()
            handle = None
        profile = cached_profile(module)
        check(profile)
        if prepare is not None:
            prepare(module, profile)

    handle = register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
