"""The final transform some causal LMs apply to their LM head's output, as the chunked loss computes it per chunk.

Some models do not train on ``head(hidden)`` but on a transform of it, named in their (text) config:

* a soft-cap, ``cap * tanh(z / cap)``: Gemma 2, Gemma 3n, VaultGemma, NanoChat, Beam, Inkling 2
  (``final_logit_softcapping``), RecurrentGemma (``logits_soft_cap``);
* a scale, ``z * logit_scale``: Cohere, Cohere 2 (and its MoE);
* a divisor, ``z / logits_scaling``: Granite, GraniteMoE, Granite-4.0-H; MiniCPM3 divides its hidden states by its
  ``logits_scaling`` before a bias-free head, the same logits to round-off.

:func:`chunkable_transform` reads it from the model (meta tensors are fine). The chunked loss
(:mod:`automodel.training.chunked_loss`) applies it to each chunk's fp32 logits and its derivative in the backward,
so ``loss.chunk_tokens`` serves these models exactly (to round-off: the transform runs in fp32 where the model's own
forward runs it in its compute dtype). What it cannot compute is named and refused: a prediction head before the
output Linear (ModernBERT-decoder), a width scale named by ``dim_model_base`` / ``scale_width`` without
``logits_scaling``, any of these with a biased LM head (a divisor of the hidden states is not one of the logits
there). The run's check (:func:`automodel.training.step.check_model_for_chunked_loss`) then probes the model: its
logits must equal this transform of its head's output, or the chunked loss is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from automodel.distributed.cp.profile import text_config

__all__ = ["IDENTITY", "LogitTransform", "chunkable_transform", "named_transform"]

#: config attributes of a soft-cap of the logits
SOFTCAP_KEYS = ("final_logit_softcapping", "logits_soft_cap")
#: config attributes of a width scale the chunked loss does not compute (MiniCPM 1 / 2 style), unless
#: ``logits_scaling`` states the divisor they make (MiniCPM3)
WIDTH_KEYS = ("dim_model_base", "scale_width")
#: every config attribute of a known final transform, in the order :func:`named_transform` names them
TRANSFORM_KEYS = (*SOFTCAP_KEYS, "logit_scale", "logits_scaling", *WIDTH_KEYS)
#: the words for ModernBERT-decoder's structure: ``get_decoder()`` is the output Linear, after a prediction head
PREDICTION_HEAD = "a prediction head before its output Linear"


@dataclass(frozen=True)
class LogitTransform:
    """``softcap * tanh(z * scale / divisor / softcap)`` (no soft-cap: ``z * scale / divisor``) of the head's output
    ``z``; the identity by default."""

    scale: float = 1.0
    divisor: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.divisor == 1.0 and self.softcap is None

    def describe(self) -> str:
        """``"cap 30 * tanh(z / 30)"``, ``"z * 0.0625"``, ``"z / 8"``; ``"z"`` for the identity."""
        z = "z" + (f" * {self.scale:g}" if self.scale != 1.0 else "")
        z += f" / {self.divisor:g}" if self.divisor != 1.0 else ""
        if self.softcap is None:
            return z
        cap = f"{self.softcap:g}"
        return f"{cap} * tanh(({z}) / {cap})" if z != "z" else f"{cap} * tanh(z / {cap})"

    def apply_(self, logits: torch.Tensor, keep_tanh: bool = False) -> torch.Tensor | None:
        """Transform ``logits`` ``[N, V]`` (fp32 / fp64) in place. ``keep_tanh``: return the soft-cap's ``tanh``
        output, a copy (one more ``[N, V]``) for :meth:`chain_`; else (and without a soft-cap) ``None``."""
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.divisor != 1.0:
            logits.div_(self.divisor)
        if self.softcap is None:
            return None
        logits.div_(self.softcap).tanh_()
        tanh = logits.clone() if keep_tanh else None
        logits.mul_(self.softcap)
        return tanh

    def chain_(self, grad: torch.Tensor, tanh: torch.Tensor | None) -> torch.Tensor:
        """The gradient at the transform's output, ``grad`` ``[N, V]``, made the gradient at its input, in place
        (``tanh``, :meth:`apply_`'s, is overwritten too)."""
        if self.softcap is not None:
            grad.mul_(tanh.square_().neg_().add_(1.0))  # d/dz cap tanh(z / cap) = 1 - tanh^2
        if self.scale != 1.0:
            grad.mul_(self.scale)
        if self.divisor != 1.0:
            grad.div_(self.divisor)
        return grad

    def reference(self, logits: torch.Tensor) -> torch.Tensor:
        """The transform out of place (autograd through it): the tests' and the probe's plain form."""
        out = logits * self.scale if self.scale != 1.0 else logits
        out = out / self.divisor if self.divisor != 1.0 else out
        return torch.tanh(out / self.softcap) * self.softcap if self.softcap is not None else out


IDENTITY = LogitTransform()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _head_and_config(model: Any) -> tuple[Any, Any, bool]:
    """``(LM head, text config, whether a prediction head precedes the output Linear)`` of ``model``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    config = getattr(model, "config", None)
    return head, text_config(config) if config is not None else None, head is not None and decoder is head


def named_transform(model: Any) -> str:
    """Every final transform ``model``'s structure and (text) config name, in words (meta tensors are fine):
    ``"final_logit_softcapping=30.0"``, :data:`PREDICTION_HEAD`, or ``""`` where none is named."""
    _, config, prediction_head = _head_and_config(model)
    if prediction_head:
        return PREDICTION_HEAD
    named = (k for k in TRANSFORM_KEYS if getattr(config, k, None) not in (None, 1, 1.0))
    return ", ".join(f"{k}={getattr(config, k)}" for k in named)


def chunkable_transform(model: Any) -> tuple[LogitTransform, str]:
    """``(transform, refused)``: the final transform of ``model``'s logits the chunked loss computes (:data:`IDENTITY`
    where its config names none), and what it names that the chunked loss cannot compute (``""``: nothing).

    Reads the structure and the (text) config only; the probe of the run's check confirms it on the model."""
    head, config, prediction_head = _head_and_config(model)
    if prediction_head:
        return IDENTITY, PREDICTION_HEAD
    softcap = next((v for k in SOFTCAP_KEYS if (v := _number(getattr(config, k, None))) is not None), None)
    scale = _number(getattr(config, "logit_scale", None))
    divisor = _number(getattr(config, "logits_scaling", None))
    refused = []
    if divisor is None:  # MiniCPM3's logits_scaling states what its width keys make (1 where they cancel)
        refused += [f"{k}={getattr(config, k)}" for k in WIDTH_KEYS
                    if _number(getattr(config, k, None)) not in (None, 1.0)]  # fmt: skip
    for name, value in (("softcap", softcap), ("logit_scale", scale), ("logits_scaling", divisor)):
        if value is not None and (not math.isfinite(value) or value == 0.0):
            refused.append(f"{name}={value}")
    transform = LogitTransform(scale=scale if scale is not None else 1.0,
                               divisor=divisor if divisor is not None else 1.0, softcap=softcap)  # fmt: skip
    if not transform.identity and getattr(head, "bias", None) is not None:
        refused.append(f"{transform.describe()} with a biased LM head")
    return transform, ", ".join(refused)
