"""The one adapter between CP attention and transformers' attention-function interface.

transformers calls an attention implementation as
``fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs)``
and expects ``(output [B, S, Hq, Dv], weights or None)``. A CP method writes its attention as a
function of one :class:`AttentionCall` and gets that signature from :func:`hf_attention_function`;
:func:`enter_call` finds the method's active context (:mod:`.active`) and counts the call;
:func:`register_attention` and :func:`switch_attention` register it (``AttentionInterface``, never as a
mask implementation, so transformers builds no local mask and passes ``attention_mask=None``) and
switch a model to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from automodel.distributed.cp.active import current as _current_context
from automodel.errors import CPUnsupportedError

__all__ = [
    "AttentionCall",
    "check_local_row",
    "enter_call",
    "hf_attention_function",
    "register_attention",
    "require_hf_model",
    "switch_attention",
]

#: the positional arguments of a transformers attention function, in order
_POSITIONAL = ("module", "query", "key", "value", "attention_mask")


@dataclass
class AttentionCall:
    """One call of an attention function, as transformers made it.

    Attributes:
        module: the model's attention module (``is_causal``, ``num_key_value_groups``, ``sinks``, ...).
        query: ``[B, Hq, n, D]``; key: ``[B, Hkv, m, D]``; value: ``[B, Hkv, m, Dv]``.
        attention_mask: what transformers passed (``None`` for an implementation that is no mask one).
        dropout, scaling, is_causal: the named arguments (``scaling`` ``None``: ``D ** -0.5``).
        kwargs: every other keyword (``sliding_window``, ``s_aux``, ``softcap``, ``position_bias``, ...).
    """

    module: torch.nn.Module
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: Any = None
    dropout: float = 0.0
    scaling: float | None = None
    is_causal: bool | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def module_name(self) -> str:
        return type(self.module).__name__

    def causal(self) -> bool:
        """Whether the call is causal: ``is_causal`` if given, else the module's ``is_causal`` (default True)."""
        if self.is_causal is not None:
            return self.is_causal
        return getattr(self.module, "is_causal", True)

    def replace(self, **changes: Any) -> AttentionCall:
        """A copy with ``changes`` (e.g. the tensors after an all-to-all); the kwargs dict is copied."""
        changes.setdefault("kwargs", dict(self.kwargs))
        return dataclasses.replace(self, **changes)

    def run(self, fn: Callable[..., Any], **changes: Any) -> Any:
        """Call the transformers attention function ``fn`` with this call's arguments, ``changes`` applied.

        ``changes`` may replace ``module``, ``query``, ``key``, ``value``, ``attention_mask`` and ``scaling``;
        any other key is added to the keyword arguments. ``is_causal`` is passed as a keyword when it was
        given. Returns what ``fn`` returns.
        """
        args = [changes.pop(name, getattr(self, name)) for name in _POSITIONAL]
        scaling = changes.pop("scaling", self.scaling)
        extra = dict(self.kwargs)
        if self.is_causal is not None:
            extra.setdefault("is_causal", self.is_causal)
        extra.update(changes)
        return fn(*args, dropout=self.dropout, scaling=scaling, **extra)


def hf_attention_function(
    impl: Callable[[AttentionCall], tuple[torch.Tensor, Any]], name: str | None = None
) -> Callable[..., tuple[torch.Tensor, Any]]:
    """``impl`` with transformers' attention-function signature (the one place that signature is written).

    The returned function takes ``(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
    is_causal=None, **kwargs)``, packs them into an :class:`AttentionCall` and returns ``impl(call)``. It
    carries ``impl``'s docstring and ``name`` (default ``impl.__name__``) as its ``__name__``.
    """

    def attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        return impl(AttentionCall(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs))

    attention_forward.__name__ = attention_forward.__qualname__ = name or impl.__name__
    attention_forward.__doc__ = impl.__doc__
    attention_forward.__wrapped__ = impl  # type: ignore[attr-defined]
    return attention_forward


def enter_call(method: str, attn_name: str, where: str, batch_fn: str) -> Any:
    """The active context of ``method`` (:func:`.active.current`), its ``calls`` counted (mutated).

    Raises:
        RuntimeError: no context of ``method`` is active: the message says the implementation ``attn_name``
            was called outside ``where`` and names the batch function ``batch_fn`` whose context to use.
    """
    ctx = _current_context(method)
    if ctx is None:
        raise RuntimeError(
            f"attention implementation {attn_name!r} was called outside {where}; run the model inside "
            f"`with ctx_factory():` from {batch_fn}, or switch the model back "
            "(model.set_attn_implementation('sdpa')) for runs without CP"
        )
    ctx.calls += 1
    return ctx


def check_local_row(query: torch.Tensor, key: torch.Tensor, tokens: int, label: str, batch_fn: str) -> None:
    """``ValueError`` unless ``query`` is this rank's ``tokens`` tokens as one row ``[1, Hq, tokens, D]`` and its
    heads are a multiple of ``key``'s (``label`` names the attention, ``batch_fn`` the batch function to use)."""
    if query.shape[0] != 1 or query.shape[2] != tokens:
        raise ValueError(
            f"{label} expects this rank's {tokens} tokens as one row [1, H, {tokens}, D], got query "
            f"{tuple(query.shape)}; feed the model the batch returned by {batch_fn}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
        )


def register_attention(name: str, forward: Callable[..., Any]) -> str:
    """Register ``forward`` as attention implementation ``name`` in transformers' ``AttentionInterface``
    (idempotent; global). Deliberately not a mask implementation. Returns ``name``.

    Raises:
        ValueError: ``name`` is one of transformers' mask implementation names.
    """
    from transformers import AttentionInterface

    from automodel.distributed.torch_internals import ALL_MASK_ATTENTION_FUNCTIONS

    if name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ValueError(f"{name!r} is a mask implementation name in transformers; pick another name")
    AttentionInterface.register(name, forward)
    return name


def require_hf_model(model: Any, message: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(f"{class} is not a transformers PreTrainedModel{message}")`` unless ``model`` has
    ``set_attn_implementation`` and ``config`` (its attention can be swapped)."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise error(f"{type(model).__name__} is not a transformers PreTrainedModel{message}")


def _no_attention(model: Any) -> bool:
    """Whether ``model`` has no attention layer at all: every layer of its profile is a linear / state-space
    mixer alone (RWKV, xLSTM) or token-local. Such a model may refuse an attention implementation (RWKV's
    ``RwkvSelfAttention`` is named like attention, so transformers will not switch it); nothing in it would
    call one, so the switch is not needed."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.profile import LINEAR, MLP_ONLY

    layers = cached_profile(model).layers
    return bool(layers) and all(
        (layer.kind == LINEAR and not layer.hybrid_attention) or layer.kind == MLP_ONLY for layer in layers)


def switch_attention(
    model: Any, name: str, forward: Callable[..., Any], method: str, *, alternative: str = "", catch: bool = True
) -> str:
    """Register ``forward`` as ``name`` and switch ``model`` to it (mutates the model and its sub-models).

    Args:
        model: a transformers ``PreTrainedModel`` (check with :func:`require_hf_model` first).
        name: the attention implementation name; forward: its function (transformers' signature).
        method: the CP method, for the messages (``distributed.cp_method=...``).
        alternative: text appended to the refusals, e.g. ``": use distributed.cp_method=ring"``.
        catch: turn the model's own refusal (``ValueError``, ``TypeError``, ``KeyError``,
            ``NotImplementedError`` from ``set_attn_implementation``) into :class:`CPUnsupportedError`.

    Returns:
        The model's previous attention implementation name (to restore it).

    Raises:
        CPUnsupportedError: the model refused ``name`` or kept another implementation (its attention is
            not dispatched through ``AttentionInterface``). A model without any attention layer (RWKV) keeps its
            implementation instead: nothing in it calls one.
    """
    previous = model.config._attn_implementation
    register_attention(name, forward)
    cls = type(model).__name__
    try:
        model.set_attn_implementation(name)
    except (ValueError, TypeError, KeyError, NotImplementedError) as err:
        if _no_attention(model):
            return previous
        if not catch:
            raise
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {cls} refused attn_implementation={name!r} ({err}); its attention "
            f"cannot be swapped, so distributed.cp_method={method} cannot run it{alternative}"
        ) from err
    if model.config._attn_implementation != name and not _no_attention(model):
        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {cls} did not accept attn_implementation={name!r} (its attention is "
            f"not dispatched through transformers' AttentionInterface); distributed.cp_method={method} cannot run "
            f"it{alternative}"
        )
    return previous
