"""THD context parallelism for unmodified Hugging Face models: packed documents, exact, on any device.

Each CP rank holds its Transformer Engine partition of the packed token stream (for every document
of padded length ``L`` and chunk ``c = L / (2W)``, rank ``r`` holds chunks ``r`` and ``2W-1-r``) and
feeds it to the model as ONE row ``[1, T/W]`` with the tokens' global per-document ``position_ids``, so
RoPE is right. Everything outside attention is token-local and runs unchanged. The attention
registered here (:data:`THD_ATTN_NAME` in transformers' ``AttentionInterface``) makes every local query
attend to exactly the keys of its own document at earlier or equal positions, with the shared
gathered-K/V kernel (:mod:`automodel.distributed.cp.gathered_attention`: ``portable`` on every device,
``flash_attn`` / ``te`` on CUDA).

Usage::

    set_thd_attention(model)                                  # once
    ctx_factory, batch = make_thd_batch_and_ctx(device_mesh, batch)
    with ctx_factory():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = token_ce_sum(logits, batch["labels"]) / global_label_count
        loss.backward()
    # then all-reduce (SUM) the parameter gradients over the CP group
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from automodel.distributed.cp import active, hf_attention
from automodel.distributed.cp.batch_forms import check_batch_forms
from automodel.distributed.cp.gathered_attention import THDPlan, gathered_layer, shard_batch
from automodel.distributed.cp.group import resolve_cp_group

__all__ = [
    "THD_ATTN_NAME",
    "current_thd_plan",
    "thd_context",
    "thd_attention_forward",
    "register_thd_attention",
    "set_thd_attention",
    "make_thd_batch_and_ctx",
]

#: The name under which THD attention is registered in transformers' ``AttentionInterface``.
THD_ATTN_NAME = "thd"
_METHOD = "thd"


def current_thd_plan() -> THDPlan | None:
    """The innermost active :class:`THDPlan`, or ``None``."""
    return active.current(_METHOD)


def thd_context(plan: THDPlan, *, require_attention: bool = True) -> contextlib.AbstractContextManager[THDPlan]:
    """Make ``plan`` active for THD attention calls inside the block.

    With ``require_attention`` (default) a block that ran no THD attention call raises ``RuntimeError``
    on exit: the model was not switched (:func:`set_thd_attention`) and each rank attended only within
    its own tokens.
    """
    return active.activate(
        _METHOD, plan, require_attention=require_attention,
        message=active.not_switched_message("THD", "set_thd_attention", THD_ATTN_NAME),
    )


def _thd_call(call: hf_attention.AttentionCall) -> tuple[torch.Tensor, None]:
    """THD attention with transformers' attention-function signature (registered as ``"thd"``).

    ``query`` ``[1, Hq, T/W, D]``, ``key``/``value`` ``[1, Hkv, T/W, D]``; returns ``([1, T/W, Hq, D], None)``.
    ``attention_mask`` must be ``None`` (what transformers passes for this implementation: document
    boundaries come from the active :class:`THDPlan`).
    """
    plan = hf_attention.enter_call(_METHOD, THD_ATTN_NAME, "a THD context", "make_thd_batch_and_ctx")
    return gathered_layer(call, plan), None


thd_attention_forward = hf_attention.hf_attention_function(_thd_call, "thd_attention_forward")


def register_thd_attention(name: str = THD_ATTN_NAME) -> str:
    """Register :func:`thd_attention_forward` in transformers' ``AttentionInterface`` (idempotent).

    Deliberately not registered as a mask implementation: transformers then builds no (local, wrong) mask
    and passes ``attention_mask=None``. Returns ``name``.
    """
    return hf_attention.register_attention(name, thd_attention_forward)


def set_thd_attention(model: torch.nn.Module, device_mesh: Any = None) -> str:
    """Switch an HF model to THD attention (mutates the model); returns the previous implementation name.

    Raises:
        CPUnsupportedError: a layer kind THD attention does not compute exactly (the message names the
            layers and the methods that would); a sliding window is checked at the first attention call.
        ValueError: the model's attention cannot be swapped (not a transformers ``PreTrainedModel``, or it
            does not dispatch attention through ``AttentionInterface``); the message names the model class.
    """
    del device_mesh  # the CP group comes with every batch (make_thd_batch_and_ctx)
    hf_attention.require_hf_model(
        model,
        f", so its attention cannot be swapped for THD attention ({THD_ATTN_NAME!r} in transformers' "
        "AttentionInterface); use a transformers causal LM, or call "
        "automodel.distributed.cp.thd.attention.thd_attention from your own attention module",
    )
    # exact or refused: every layer kind of the model against what THD computes (a sliding window is
    # judged against the longest document at the first attention call)
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp("thd", cached_profile(model), seq_len=None)
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
    from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention

    install_linear_mixers(model, cached_profile(model), "thd")  # docs/linear_mixers.md
    install_sparse_attention(model, cached_profile(model))  # DSA: latent KV and indexer keys gathered
    from automodel.distributed.cp.layers.alibi import dispatch_alibi_layers

    if dispatch_alibi_layers(model, {_METHOD: THD_ATTN_NAME}):  # BLOOM, MPT: their ALiBi layers, inside a THD context
        hf_attention.register_attention(THD_ATTN_NAME, thd_attention_forward)
        return model.config._attn_implementation
    return hf_attention.switch_attention(
        model, THD_ATTN_NAME, thd_attention_forward, "thd", alternative=": use distributed.cp_method=ring (unpacked rows)"
    )


def make_thd_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    kernel: str = "portable",
    cp_comm_type: str = "p2p",
    inner_attn: str | None = None,
    seq_lens_padding_value: int = -1000,
) -> tuple[Callable[[], contextlib.AbstractContextManager[THDPlan]], dict[str, Any]]:
    """Shard a BSHD batch (packed or not) for THD CP and build the context its attention calls need.

    Args:
        device_mesh: DeviceMesh with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None``.
        batch: identical on every CP rank: ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` (already
            shifted, -100 = ignore), packed rows add ``position_ids`` ``[B, S]`` (restarting per
            document) and ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` (``-1000`` = unused); every padded
            length must be a multiple of ``2*cp_size``. Without ``seq_lens`` each row is one document
            (``attention_mask`` ``[B, S]``, if given, marks its real tokens, right-padded).
            Optional ``loss_mask`` ``[B, S]``.
        kernel: ``portable`` | ``flash_attn`` | ``te`` (:mod:`automodel.distributed.cp.gathered_attention`).
        cp_comm_type: Transformer Engine's CP communication (``te`` kernel only).
        inner_attn: accepted (the recipe binds the model's previous implementation) and unused.
        seq_lens_padding_value: sentinel of unused ``seq_lens`` entries.

    Returns:
        ``(ctx_factory, local)``. ``local`` holds ``input_ids``, ``labels``, ``position_ids`` (global
        per-document positions; mRoPE ``[n_rope, 1, T/W]``), ``loss_mask`` if given, each ``[1, T/W]``:
        this rank's tokens of the flattened batch in TE's partition order; and ``padding_mask``,
        ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen`` as ``make_cp_batch_for_te`` returns
        them. ``batch`` is not mutated. Inside ``ctx_factory()`` a model switched with
        :func:`set_thd_attention` computes exact per-document causal attention.

    Raises:
        ValueError: a document not padded to a multiple of ``2*cp_size``, inconsistent ``seq_lens`` /
            ``seq_lens_padded``, an unavailable kernel, anything ``make_cp_batch_for_te`` rejects.
    """
    check_batch_forms("thd", batch)  # refuse what thd does not compute exactly (docs/batch_forms.md)
    del inner_attn
    if not isinstance(batch.get("input_ids"), torch.Tensor) or batch["input_ids"].dim() != 2:
        raise ValueError(f"the batch needs 'input_ids' [B, S]; got keys {sorted(batch)}")
    group, world, rank = resolve_cp_group(device_mesh)
    plan, local = shard_batch(group, world, rank, batch, kernel, cp_comm_type, seq_lens_padding_value)

    def ctx_factory() -> contextlib.AbstractContextManager[THDPlan]:
        return thd_context(plan)

    return ctx_factory, local
