"""The kernel each attention layer runs under a CP method, chosen per layer from its LayerSpec.

A method's own kernel (``native``: torch's ring, thd's all-gather) computes plain causal attention over
the whole row or document. :func:`run_layer` reads the layer's kind at the call (the window and sinks
that transformers hands the attention function, the attention chunk from the config's layer types,
the head sizes from the tensors) and picks the cheapest exact kernel:

- a sliding window or attention chunk shorter than the longest document, or per-head sinks (or logit
  softcapping, where the method's reference applies it): :func:`~.masked_attention.halo_attention`,
  which exchanges only the keys the layer reaches (O(W) per rank for a window; nothing for chunks that
  align with the shards; the whole prefix for full attention with sinks);
- value heads of another size than query/key heads (MLA): the native kernel on V zero-padded to the
  query/key size (or q/k zero-padded to the value size), the padding stripped from the output, so its
  gradient never reaches V;
- anything else: the native kernel.

A method whose native kernel itself applies sinks, softcapping or unequal value heads on full layers
(thd_docs' document blocks: sinks in the log-sum-exp merge) says so with ``native_applies``
(:data:`NATIVE_SINKS`, :data:`NATIVE_SOFTCAP`, :data:`NATIVE_MLA`): those layers then run the native
kernel, called with ``sinks=`` and ``softcap=`` keywords, instead of the halo kernel or padded V.

Llama 4's NoPE layers scale their queries by a function of the position that transformers computes
from the LOCAL token index (``arange`` over the rank's shard); :func:`correct_query_temperature`
rescales each query to its position in its document.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from automodel.distributed.cp.layers.alibi import key_bias
from automodel.distributed.cp.layers.masked_attention import halo_attention
from automodel.distributed.cp.layout import TokenLayout
from automodel.distributed.cp.profile import CHUNKED, FULL, SLIDING, LayerSpec

__all__ = [
    "HALO",
    "NATIVE",
    "NATIVE_MLA",
    "NATIVE_SINKS",
    "NATIVE_SOFTCAP",
    "PAD_V",
    "call_spec",
    "choose_kernel",
    "config_chunk",
    "correct_query_temperature",
    "run_layer",
]

NATIVE, PAD_V, HALO = "native", "pad_v", "halo"
#: what a native kernel may apply itself on full layers (``run_layer(native_applies=...)``)
NATIVE_SINKS, NATIVE_SOFTCAP, NATIVE_MLA = "sinks", "softcap", "mla"
Native = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def config_chunk(module: Any) -> int | None:
    """The attention chunk of ``module``'s layer from its config (``layer_types`` / ``attention_chunk_size``)."""
    config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if not chunk or idx is None or not isinstance(types, (list, tuple)) or idx >= len(types):
        return None
    return int(chunk) if types[idx] == "chunked_attention" else None


def call_spec(module: Any, query: torch.Tensor, value: torch.Tensor, kwargs: dict[str, Any]) -> tuple[LayerSpec, Any]:
    """The :class:`LayerSpec` of the layer being called, and its sink logits (``[Hq]`` or ``None``)."""
    window = kwargs.get("sliding_window")
    chunk = config_chunk(module) if window is None else None
    sinks = kwargs.get("s_aux")
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        sinks = module.sinks
    kind = SLIDING if window else CHUNKED if chunk else FULL
    spec = LayerSpec(
        index=int(getattr(module, "layer_idx", None) or 0),
        kind=kind,
        window=int(window) if window else None,
        chunk=chunk,
        sinks=sinks is not None,
        softcap=kwargs.get("softcap") or None,
        qk_head_dim=query.shape[-1],
        v_head_dim=value.shape[-1],
        rope=bool(getattr(module, "use_rope", True)),
        position_scaled=bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True),
        alibi=kwargs.get("alibi_slopes") is not None,
    )
    return spec, sinks


def choose_kernel(
    spec: LayerSpec, longest: int, apply_softcap: bool = False, native_applies: frozenset[str] = frozenset()
) -> str:
    """``HALO``, ``PAD_V`` or ``NATIVE`` for ``spec`` on documents of at most ``longest`` tokens; the native
    kernel takes full layers with what ``native_applies`` names (sinks, softcap, MLA)."""
    if spec.alibi or not spec.attends_like_full(longest):  # ALiBi: the halo kernel's key bias, full prefix
        return HALO
    if spec.sinks and NATIVE_SINKS not in native_applies:
        return HALO
    if apply_softcap and spec.softcap and NATIVE_SOFTCAP not in native_applies:
        return HALO
    if spec.mla and NATIVE_MLA not in native_applies:
        return PAD_V
    return NATIVE


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def pad_value_heads(
    native: Native, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """``native`` on equal head sizes: zero columns added to V (or to q and k, which leaves every score
    unchanged) and stripped from the ``[B, n, H, Dv]`` output; ``scale`` stays the unpadded one."""
    dqk, dv = query.shape[-1], value.shape[-1]
    size = max(dqk, dv)
    out = native(_pad_last(query, size), _pad_last(key, size), _pad_last(value, size), scale)
    return out[..., :dv].contiguous()


def _temperature(module: Any, positions: torch.Tensor) -> torch.Tensor:
    """The temperature as transformers computes it (in fp32, whatever the model's dtype)."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def correct_query_temperature(
    module: Any, query: torch.Tensor, positions: torch.Tensor, local_index: torch.Tensor | None = None
) -> torch.Tensor:
    """Llama 4's NoPE query temperature at ``positions`` (``[n]`` or ``[B, n]`` int64, in-document) instead
    of the local index transformers used: ``query [B, H, n, D]`` times ``t(positions) / t(local_index)``, the
    temperatures in fp32 as transformers takes them and their ratio in fp64 (so an fp64 model gets the
    reference's ``q * t(positions)`` to fp64 round-off).

    ``local_index`` ``[n]`` int64: the index transformers took each query's temperature at (default
    ``arange(n)``; usp's queries, gathered from ``U`` Ulysses ranks of ``n / U`` tokens each, took theirs at
    ``arange(n / U)`` repeated ``U`` times)."""
    n = query.shape[2]
    local = torch.arange(n, device=positions.device) if local_index is None else local_index.to(positions.device)
    ratio = (_temperature(module, positions).double() / _temperature(module, local).double()).to(
        query.device, query.dtype
    )
    return query * ratio.reshape(-1, 1, n, 1)


def run_layer(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    *,
    layout: TokenLayout,
    native: Native,
    method: str,
    scaling: float | None,
    dropout: float = 0.0,
    apply_softcap: bool = False,
    native_applies: frozenset[str] = frozenset(),
    local_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention layer under CP with the kernel :func:`choose_kernel` picks; returns ``[B, n, Hq, Dv]``.

    Args:
        module, kwargs: the attention module and the keyword arguments transformers passed its kernel.
        query / key / value: ``[B, Hq, n, Dqk]`` / ``[B, Hkv, n, Dqk]`` / ``[B, Hkv, n, Dv]`` local tokens.
        layout: the method's token placement; native: the method's kernel ``(q, k, v, scale) -> [B, n, Hq, D]``.
        method: the method's name (for messages); scaling: the softmax scale transformers passed.
        apply_softcap: the reference implementation applies logit softcapping (eager), so the halo
            kernel applies it too; otherwise the native kernel decides (transformers' sdpa refuses it).
        native_applies: what ``native`` applies itself on full layers (:data:`NATIVE_SINKS`,
            :data:`NATIVE_SOFTCAP`, :data:`NATIVE_MLA`); when not empty, ``native`` is called as
            ``native(q, k, v, scale, sinks=[Hq] | None, softcap=float | None)``.
        local_index: ``[n]`` the index transformers computed each query's position-dependent scale at
            (:func:`correct_query_temperature`; default ``arange(n)``).
    """
    spec, sinks = call_spec(module, query, value, kwargs)
    if spec.position_scaled:
        query = correct_query_temperature(module, query, layout.positions(), local_index)
    kernel = choose_kernel(spec, layout.longest_document(), apply_softcap, native_applies)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kernel == NATIVE and native_applies:
        softcap = spec.softcap if apply_softcap else None
        return native(query, key, value, scale, sinks=sinks, softcap=softcap)
    if kernel == NATIVE:
        return native(query, key, value, scale)
    if kernel == PAD_V:
        return pad_value_heads(native, query, key, value, scale)
    if spec.softcap and not apply_softcap:
        from automodel.errors import CPUnsupportedError

        raise CPUnsupportedError(
            f"distributed.cp_method={method}: {type(module).__name__} soft-caps its attention logits, which "
            f"{method} does not apply with this attention implementation; set model.attn_implementation=eager "
            "(ring, ulysses, thd, thd_docs and usp then apply the cap)"
        )
    if dropout:
        raise ValueError(
            f"distributed.cp_method={method}: attention dropout ({dropout}) is not implemented by the "
            f"{spec.describe()} kernel; set the model's attention_dropout to 0"
        )
    bias = None
    if spec.alibi:  # slope_h * the key's position in its document (cp/layers/alibi.py), every row alike
        bias = key_bias(kwargs["alibi_slopes"], layout.positions()[None], query.dtype,
                        kwargs.get("falcon_alibi_divisor")).expand(query.shape[0], -1, -1)  # fmt: skip
    return halo_attention(
        query,
        key,
        value,
        layout,
        window=spec.window if spec.kind == SLIDING else None,
        chunk=spec.chunk if spec.kind == CHUNKED else None,
        sinks=sinks,
        softcap=spec.softcap if apply_softcap else None,
        scale=scale,
        key_bias=bias,
    )
