"""The one place where ``distributed.cp_method`` picks the batch/context function.

Each method is a function with the signature of
:func:`automodel.distributed.cp_utils.make_cp_batch_and_ctx`::

    fn(device_mesh, batch) -> (train_ctx_factory, batch)

that prepares a ``[B, S]`` batch (labels already shifted) for this rank and returns a factory of
the context the forward, the loss and the backward run in. The recipe reads the capabilities
below to validate a config before anything is built, so adding a method is one entry here (and
its module): e.g. ``"ulysses": CPMethod("ulysses", "automodel.distributed.ulysses:<fn>", ...)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CPMethod", "CP_METHODS", "get_cp_batch_fn"]


@dataclass(frozen=True)
class CPMethod:
    """A context-parallel method and what it can compute exactly.

    Attributes:
        name: the value of ``distributed.cp_method``.
        function: ``"module:function"`` with the signature of ``make_cp_batch_and_ctx``.
        attn_implementations: attention implementations the method works with (``None``: any).
        supports_packed: whether rows may hold several documents (``data.packed_sequences``).
    """

    name: str
    function: str
    attn_implementations: tuple[str, ...] | None
    supports_packed: bool


CP_METHODS: dict[str, CPMethod] = {
    "ring": CPMethod(
        name="ring",
        function="automodel.distributed.cp_utils:make_cp_batch_and_ctx",
        attn_implementations=("sdpa",),  # torch's context_parallel replaces SDPA with ring attention
        supports_packed=False,  # ring attention is causal over the whole row
    ),
}


def get_cp_batch_fn(method: str) -> Callable:
    """The batch/context function of ``method`` (imported on first use).

    Raises:
        ValueError: ``method`` is not in :data:`CP_METHODS`.
    """
    if method not in CP_METHODS:
        raise ValueError(
            f"distributed.cp_method={method!r} is not one of {sorted(CP_METHODS)}; "
            f"set distributed.cp_method={next(iter(CP_METHODS))}"
        )
    module_name, fn_name = CP_METHODS[method].function.split(":")
    return getattr(importlib.import_module(module_name), fn_name)
