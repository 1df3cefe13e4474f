"""The one place where ``distributed.cp_method`` picks the batch/context function.

Each method is a function with the signature of
:func:`automodel.distributed.cp_utils.make_cp_batch_and_ctx`::

    fn(device_mesh, batch) -> (train_ctx_factory, batch)

that prepares a ``[B, S]`` batch (labels already shifted) for this rank and returns a factory of
the context the forward, the loss and the backward run in. A method may also need the model to be
switched once before training (:attr:`CPMethod.switch_model`, e.g. Ulysses registers its own
attention implementation); its batch function then receives the model's previous (inner) attention
implementation as ``inner_attn=``. The recipe reads the capabilities below to validate a config
before anything is built (:mod:`automodel.config.rules`), so adding a method (e.g. a packed-THD
one) is one entry here plus its module.

At ``cp_size == 1`` no method runs (:func:`bind_cp_method` returns :func:`no_cp_batch_and_ctx`):
the model keeps ``model.attn_implementation`` and transformers' own masks, so every method's
cp=1 run is the plain single-device computation, the reference its cp>1 runs are tested against.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from automodel.errors import UserInputError

__all__ = [
    "CPMethod",
    "CP_METHODS",
    "get_cp_method",
    "get_cp_batch_fn",
    "head_split_problem",
    "check_model_config_for_cp",
    "no_cp_batch_and_ctx",
    "bind_cp_method",
    "token_ranges",
    "row_multiple",
]


@dataclass(frozen=True)
class CPMethod:
    """A context-parallel method and what it can compute exactly.

    Attributes:
        name: the value of ``distributed.cp_method``.
        function: ``"module:function"`` with the signature of ``make_cp_batch_and_ctx``.
        attn_implementations: ``model.attn_implementation`` values the method works with (``None``: any).
        supports_packed: whether rows may hold several documents (``data.dataset.pack: true``) with
            document boundaries respected.
        chunks_per_rank: each rank holds this many equal chunks of every row, so the row length must
            be a multiple of ``chunks_per_rank * cp_size * tp_size`` (ring: 2, head-tail load balancing).
        layout: how a row is split over the CP ranks: ``"head_tail"`` (rank r gets chunks r and
            2W-1-r of 2W) or ``"contiguous"`` (rank r gets the r-th of W contiguous slices).
        splits_heads: attention heads are divided over the CP ranks, so ``num_attention_heads`` must
            be divisible by ``cp_size``.
        switch_model: ``"module:function"`` called once as ``fn(model, device_mesh) -> inner_attn``
            before training (``None``: the model is used as built); the batch function is then
            called with ``inner_attn=<that value>``.
        applies_sliding_window: the method computes each layer's sliding window exactly (the inner
            kernel sees the window mask), so sliding-window models may train on rows longer than
            the window. Ring attention is plain causal over the row and cannot.
        summary: one line for logs and the dry run.
    """

    name: str
    function: str
    attn_implementations: tuple[str, ...] | None
    supports_packed: bool
    chunks_per_rank: int = 2
    layout: Literal["head_tail", "contiguous"] = "head_tail"
    splits_heads: bool = False
    switch_model: str | None = None
    applies_sliding_window: bool = False
    summary: str = ""


CP_METHODS: dict[str, CPMethod] = {
    "ring": CPMethod(
        name="ring",
        function="automodel.distributed.cp_utils:make_cp_batch_and_ctx",
        attn_implementations=("sdpa",),  # torch's context_parallel replaces SDPA with ring attention
        supports_packed=False,  # ring attention is causal over the whole row
        chunks_per_rank=2,
        layout="head_tail",
        summary="torch ring attention: k/v shards rotate around the CP ranks (plain causal SDPA only)",
    ),
    "ulysses": CPMethod(
        name="ulysses",
        function="automodel.distributed.ulysses:make_ulysses_batch_and_ctx",
        attn_implementations=("sdpa", "eager", "flex_attention"),  # the inner kernel, on the whole row
        supports_packed=True,  # the global mask keeps document boundaries
        chunks_per_rank=1,
        layout="contiguous",
        splits_heads=True,
        switch_model="automodel.distributed.ulysses:set_ulysses_attention",
        applies_sliding_window=True,  # the global mask is built per layer kind, window included
        summary="all-to-all: each rank runs the unchanged attention kernel on the whole row for H/cp heads",
    ),
    "thd": CPMethod(
        name="thd",
        function="automodel.distributed.thd_attention:make_thd_batch_and_ctx",
        attn_implementations=("sdpa", "eager"),  # the cp=1 reference; at cp>1 the model runs THD attention
        supports_packed=True,  # per-document causal attention from seq_lens_padded
        chunks_per_rank=2,  # TE's partition: chunks r and 2W-1-r of EVERY document (padded to 2*cp)
        layout="head_tail",
        switch_model="automodel.distributed.thd_attention:set_thd_attention",
        summary="packed documents (TE partition per document), K/V all-gathered, exact per-document causal attention",
    ),
}


def _import(path: str) -> Callable:
    module_name, fn_name = path.split(":")
    return getattr(importlib.import_module(module_name), fn_name)


def _allowed() -> str:
    return " | ".join(CP_METHODS)


def get_cp_method(method: str) -> CPMethod:
    """The :class:`CPMethod` named ``method``.

    Raises:
        ValueError: ``method`` is not in :data:`CP_METHODS` (the message lists the allowed values).
    """
    if method not in CP_METHODS:
        raise ValueError(
            f"distributed.cp_method={method!r} is not one of {sorted(CP_METHODS)}; "
            f"set distributed.cp_method to one of {_allowed()}"
        )
    return CP_METHODS[method]


def get_cp_batch_fn(method: str) -> Callable:
    """The batch/context function of ``method`` (imported on first use), unbound.

    Raises:
        ValueError: ``method`` is not in :data:`CP_METHODS`.
    """
    return _import(get_cp_method(method).function)


def head_split_problem(method: str, num_attention_heads: int | None, cp_size: int, tp_size: int = 1) -> str | None:
    """Why ``method`` cannot split ``num_attention_heads`` over ``cp_size`` ranks, or ``None`` if it can.

    With tensor parallelism each TP rank already holds ``num_attention_heads / tp_size`` heads, and a
    head-splitting method divides those again over CP: ``num_attention_heads % (tp_size * cp_size) == 0``.
    (A head count not divisible by ``tp_size`` is TP's own problem, reported by
    :func:`automodel.distributed.tensor_parallel.tp_config_problems`.)
    """
    m = get_cp_method(method)
    tp_size = max(1, tp_size)
    if (
        not m.splits_heads
        or cp_size <= 1
        or num_attention_heads is None
        or num_attention_heads % tp_size
        or (num_attention_heads // tp_size) % cp_size == 0
    ):
        return None
    local = num_attention_heads // tp_size  # the heads one TP rank holds
    divisors = [d for d in range(2, local + 1) if local % d == 0]
    per_tp = f", {local} per TP rank (distributed.tp_size={tp_size})," if tp_size > 1 else ","
    return (
        f"distributed.cp_method={m.name} splits the attention heads over the CP ranks, but the model has "
        f"num_attention_heads={num_attention_heads}{per_tp} which is not divisible by "
        f"distributed.cp_size={cp_size}; set distributed.cp_size to a divisor of {local} ({divisors}), "
        + ("a smaller distributed.tp_size, " if tp_size > 1 else "")
        + "or use distributed.cp_method=ring"
    )


def check_model_config_for_cp(method: str, model_config: Any, cp_size: int, tp_size: int = 1) -> None:
    """Check a transformers config against the method's limits before any weight is loaded.

    Raises:
        ValueError: the method splits heads and ``num_attention_heads`` (of the text config) is not
            divisible by ``cp_size``; the message names the heads, the CP size and the fix. A VLM with a
            method its vision path does not support (``thd``).
    """
    from automodel.models.vlm_cp import VLM_CP_METHODS, is_vlm

    if cp_size > 1 and is_vlm(model_config) and method not in VLM_CP_METHODS:
        raise UserInputError(
            f"distributed.cp_method={method} does not run VLMs ({getattr(model_config, 'model_type', None)}): "
            f"their images are encoded on each rank's share and merged before the text model, which only "
            f"{' and '.join(VLM_CP_METHODS)} take; set distributed.cp_method={VLM_CP_METHODS[0]}"
        )
    get_text = getattr(model_config, "get_text_config", None)
    text = get_text() if callable(get_text) else model_config
    problem = head_split_problem(method, getattr(text, "num_attention_heads", None), cp_size, tp_size)
    if problem is not None:
        raise UserInputError(problem)


def no_cp_batch_and_ctx(device_mesh: Any, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
    """The ``cp_size == 1`` batch function of every method: ``(contextlib.nullcontext, batch)``, untouched."""
    return contextlib.nullcontext, batch


def bind_cp_method(
    method: str, model: Any, device_mesh: Any, cp_size: int, **batch_kwargs: Any
) -> tuple[Callable, str | None]:
    """Prepare ``model`` for ``method`` (once) and return ``(cp_fn, inner_attn)``.

    ``cp_fn(device_mesh, batch) -> (train_ctx_factory, batch)`` is what the loop calls for every
    micro-batch (training and validation). At ``cp_size == 1`` it is :func:`no_cp_batch_and_ctx`
    and the model is left as built. Otherwise, for a method with :attr:`CPMethod.switch_model`, the
    model is switched (mutated: its attention implementation changes) and the batch function is
    bound to ``inner_attn=<the previous implementation>``, which is returned (``None`` otherwise).
    Call it after the model is built, before or after FSDP wrapping. ``batch_kwargs`` (e.g. THD's
    ``kernel=``) are bound to the batch function.
    """
    m = get_cp_method(method)
    if cp_size <= 1:
        return no_cp_batch_and_ctx, None
    fn = _import(m.function)
    if batch_kwargs:
        fn = functools.partial(fn, **batch_kwargs)
    if m.switch_model is None:
        return fn, None
    inner = _import(m.switch_model)(model, device_mesh)
    return functools.partial(fn, inner_attn=inner), inner


def token_ranges(method: str, seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
    """Token ranges ``[start, end)`` of a ``seq_len`` row that CP rank ``cp_rank`` holds under ``method``."""
    m = get_cp_method(method)
    if cp_size <= 1:
        return [(0, seq_len)]
    if m.layout == "head_tail":
        c = seq_len // (2 * cp_size)
        return [
            (cp_rank * c, (cp_rank + 1) * c),
            ((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c),
        ]
    base, extra = divmod(seq_len, cp_size)  # near-even, remainder on the first ranks (even_split_sizes)
    start = cp_rank * base + min(cp_rank, extra)
    return [(start, start + base + (1 if cp_rank < extra else 0))]


def row_multiple(method: str, cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> tuple[int, str]:
    """The multiple a row's length must be so that ``method`` splits it evenly, and the rule in words.

    Every CP rank gets ``chunks_per_rank`` equal chunks of each row (ring and thd: 2, head-tail;
    ulysses: 1 contiguous slice); with TP sequence parallelism each TP rank gets an equal share of
    those tokens too. TP without sequence parallelism puts no constraint on the length (every TP rank
    holds all of the rank's tokens). For head-tail methods this is
    :func:`automodel.distributed.padding.get_padding_multiple` ``(cp_size, tp_size, has_sp)``.

    Returns:
        ``(multiple, description)``, e.g. ``(8, "2*cp_size*tp_size = 2*2*2 = 8 (sequence parallel)")``.
    """
    m = get_cp_method(method)
    chunks = m.chunks_per_rank if cp_size > 1 else 1
    sp = sequence_parallel and tp_size > 1
    factors = [(chunks, str(chunks))] if chunks > 1 else []
    if cp_size > 1:
        factors.append((cp_size, "cp_size"))
    if sp:
        factors.append((tp_size, "tp_size"))
    multiple = 1
    for value, _ in factors:
        multiple *= value
    if not factors:
        return 1, "1"
    names = "*".join(name for _, name in factors)
    values = "*".join(str(value) for value, _ in factors)
    what = f"{names} = {multiple}" if len(factors) == 1 else f"{names} = {values} = {multiple}"
    return multiple, what + (" (sequence parallel)" if sp else "")
