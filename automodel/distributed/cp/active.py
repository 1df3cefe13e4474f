"""The one stack of active CP contexts, with the "no attention ran inside the context" check.

Every CP method makes a per-step object (a plan, a context) active for the attention calls of one
forward/backward: the attention function the method installed finds it with :func:`current`, and the
linear mixers find whichever method is active with :func:`innermost`.

The stack is a plain module-level list, not a ``ContextVar``: autograd may run the backward (and
activation-checkpoint recomputation) on another thread, which must still see the active context.

An active object counts its attention calls in an integer attribute ``calls``; a block that ran none
raises on exit, since the model was then not switched to the method's attention and every rank
attended only within its own tokens (a silently wrong result).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["activate", "current", "innermost", "not_switched_message"]

_STACK: list[tuple[str, Any]] = []


def current(method: str) -> Any | None:
    """The innermost active object of ``method`` (e.g. ``"thd"``), or ``None``."""
    for name, obj in reversed(_STACK):
        if name == method:
            return obj
    return None


def innermost() -> tuple[str, Any] | None:
    """``(method, object)`` of the innermost active context of any method, or ``None``."""
    return _STACK[-1] if _STACK else None


def not_switched_message(label: str, setter: str, attn_name: str, scope: str = "tokens") -> str:
    """The error text for a context in which no attention of the method ran."""
    return (
        f"no {label} attention ran inside the {label} context: the model still uses another attention "
        f"implementation, so each CP rank attended only within its own {scope}. Call {setter}(model) (attn "
        f"implementation {attn_name!r}) before the forward pass"
    )


@contextlib.contextmanager
def activate(method: str, obj: Any, *, require_attention: bool = True, message: str = "") -> Iterator[Any]:
    """Make ``obj`` the active context of ``method`` inside the block (mutates the module stack).

    Args:
        method: the CP method's name (the key :func:`current` looks up).
        obj: the per-step object; it must have an integer ``calls`` attribute that the method's
            attention function increments.
        require_attention: raise ``RuntimeError(message)`` on a normal exit when ``obj.calls`` did not
            change inside the block.
        message: the error text (see :func:`not_switched_message`).
    """
    start = obj.calls
    entry = (method, obj)
    _STACK.append(entry)
    try:
        yield obj
    finally:
        # remove this entry (not the last one): contexts of two models may close out of order
        for i in range(len(_STACK) - 1, -1, -1):
            if _STACK[i] is entry:
                del _STACK[i]
                break
    if require_attention and obj.calls == start:
        raise RuntimeError(message or f"no {method} attention ran inside the {method} context")
