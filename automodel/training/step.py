"""One micro-batch: prepare the batch, CP-shard it, forward + loss + backward inside the train context.

The contract with :mod:`automodel.distributed.cp_utils` (and every other CP method of
:mod:`automodel.distributed.cp`):

1. the label tokens are counted on the whole, unsharded batch (the caller does this for all
   micro-batches of a step and all-reduces over dp, giving ``num_label_tokens``);
2. ``cp_fn(device_mesh, batch)`` returns ``(train_ctx_factory, batch)``; entering the context
   shards the batch tensors in place (ring CP), so ``labels`` are taken out of the dict *after*
   the call but used *inside* the context;
3. forward, loss and backward all run inside
   ``get_train_context(enable_loss_parallel, enable_compiled_autograd, train_ctx_factory())``;
4. ``labels`` are already shifted, so they are not passed to the model (it would shift again):
   the model returns logits and :func:`token_cross_entropy_sum` computes the loss; or, with
   ``chunk_tokens`` (``loss.chunk_tokens``), the model returns its final hidden states only (no
   logits are computed: ``logits_to_keep`` is empty) and
   :func:`automodel.training.chunked_loss.chunked_linear_cross_entropy_sum` applies the LM head and
   the loss chunk by chunk. Training, validation and the CP self-check all go through here, so they
   use the same loss.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from automodel.training.chunked_loss import chunked_linear_cross_entropy_sum
from automodel.training.logit_transform import IDENTITY, LogitTransform, chunkable_transform, named_transform
from automodel.training.loss import IGNORE_INDEX, token_cross_entropy_sum

__all__ = [
    "MODEL_INPUT_KEYS",
    "base_decoder",
    "check_model_for_chunked_loss",
    "forward_loss_sum",
    "logit_transform_of",
    "logits_are_head_of_hidden",
    "prepare_batch",
    "run_micro_batch",
]

# What the model sees. seq_lens / seq_lens_padded (packed rows) are metadata for the CP method;
# at cp_size=1 the model's own forward reads document boundaries from the restarting position_ids where a
# probe shows that it does (else a method's document-aware attention runs: automodel.distributed.cp.bind).
MODEL_INPUT_KEYS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask")


def prepare_batch(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move ``batch`` to ``device``; fold ``loss_mask`` into ``labels``; drop a right-padding mask.

    A ``[B, S]`` ``attention_mask`` that only marks right padding whose labels are all -100 is
    dropped: under causal attention no real token attends to later padding, so every real
    position's output and loss are unchanged, and ring CP (which takes no mask) and cp_size=1 run
    the very same computation. Returns a new dict; ``batch`` is not modified.

    Raises:
        ValueError: an attention mask with left padding or holes, or padding with real labels.
    """
    out = {
        k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()
    }
    loss_mask = out.pop("loss_mask", None)
    if loss_mask is not None:
        out["labels"] = out["labels"].masked_fill(loss_mask == 0, IGNORE_INDEX)
    mask = out.get("attention_mask")
    if mask is not None:
        if not bool((mask != 0).all()):
            m = mask != 0
            right_padded = bool((m[:, 1:] <= m[:, :-1]).all())
            if not right_padded:
                raise ValueError(
                    "attention_mask has left padding or holes; this recipe trains causal LMs on right-padded "
                    "rows (padding after the real tokens, labels -100); fix the collator"
                )
            if bool((out["labels"][~m] != IGNORE_INDEX).any()):
                raise ValueError(
                    "padding positions (attention_mask == 0) have labels != -100; set them to -100"
                )
        out.pop("attention_mask")
    return out


def base_decoder(model: nn.Module) -> nn.Module | None:
    """The base model whose first output is the causal LM's final hidden states ``[B, S, H]``: transformers'
    ``get_decoder()``, except where that returns the causal LM itself (Llama 4's text model: its
    ``base_model_prefix`` ``"language_model"`` names no attribute, so transformers 5.x falls back to ``self``) or a
    ``Linear`` (ModernBERT-decoder's output ``decoder``): then the module under ``model``. What it returns is checked
    by the chunked loss's probe (:func:`logits_are_head_of_hidden`) before a run uses it. ``None`` for a module with
    neither."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or decoder is model or decoder is head or isinstance(decoder, nn.Linear):
        inner = getattr(model, "model", None)
        if isinstance(inner, nn.Module) and inner is not head and not isinstance(inner, nn.Linear):
            return inner
    return decoder


#: the models :func:`check_model_for_chunked_loss` passed, with the final transform of their logits the probe
#: confirmed: :func:`forward_loss_sum` reads it here, not per micro-batch
_CHUNKED_LOSS_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_model_for_chunked_loss(model: nn.Module) -> None:
    """``ValueError`` unless ``model``'s loss can be computed chunk by chunk from its final hidden states
    (``loss.chunk_tokens``), exactly.

    Needs a base model whose first output is the final hidden states (:func:`base_decoder`: transformers'
    ``get_decoder()`` where it names one), ``get_output_embeddings()`` (the LM head, a ``Linear``) and a
    ``logits_to_keep`` argument, and the model's logits must be that head applied to those hidden states, or the
    final transform its config names that the chunked loss computes too
    (:func:`automodel.training.logit_transform.chunkable_transform`: Gemma 2's logit soft-capping, Cohere's
    ``logit_scale``, Granite's ``logits_scaling``, MiniCPM3's hidden-state divisor), and nothing else: a probe
    (:func:`logits_are_head_of_hidden`) runs the model once on a few tokens and compares. A transform the chunked loss
    does not compute (ModernBERT-decoder's prediction head, a width scale without ``logits_scaling``) or logits that
    differ from the named transform are refused, naming it. Records the transform for :func:`forward_loss_sum`. Does
    not modify ``model`` (its train/eval mode and the RNG state are restored).
    """
    import inspect

    name = type(model).__name__
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = base_decoder(model)
    takes_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
    if not isinstance(head, nn.Linear) or decoder is None or decoder is model or decoder is head or not takes_keep:
        raise ValueError(
            f"loss.chunk_tokens needs a causal LM with a Linear LM head (get_output_embeddings), a base model "
            f"(get_decoder) and a logits_to_keep argument; {name} lacks one (head={type(head).__name__}, "
            f"decoder={type(decoder).__name__}, logits_to_keep={takes_keep}); set loss.chunk_tokens=null"
        )
    transform, refused = chunkable_transform(model)
    why = f"a final transform the chunked loss does not compute ({refused})" if refused else None
    if why is None:
        why = logits_are_head_of_hidden(model, transform=transform)
    if why is not None:
        raise ValueError(
            "loss.chunk_tokens computes the logits as the LM head of the base model's final hidden states"
            + ("" if transform.identity else f" and their transform {transform.describe()}")
            + f", but {name}'s logits are not that: {why}; the chunked loss would train another loss; set "
            f"loss.chunk_tokens=null (or auto, which keeps the plain loss for this model)"
        )
    _CHUNKED_LOSS_CHECKED[model] = transform


def logit_transform_of(model: nn.Module) -> str:
    """The final transform a causal LM applies to its LM head's output, in words, read from its structure and config
    (meta tensors are fine): ``"final_logit_softcapping=30.0"``, ``"a prediction head"`` or ``""`` for none known
    (:func:`automodel.training.logit_transform.named_transform`). Which of them the chunked loss computes:
    :func:`~automodel.training.logit_transform.chunkable_transform`; the run's check is the probe
    (:func:`logits_are_head_of_hidden`)."""
    return named_transform(model)


class _NotHidden(Exception):
    pass


def logits_are_head_of_hidden(model: nn.Module, n_tokens: int = 8, transform: LogitTransform = IDENTITY) -> str | None:
    """``None`` when ``model(input_ids).logits`` equals ``transform`` of its LM head (``get_output_embeddings()``)
    applied to its base model's (:func:`base_decoder`) first output, else the reason.

    The probe runs the model once under ``torch.no_grad`` in eval mode on ``n_tokens`` token ids, with the base
    model's output hidden states ``[1, n, H]`` scaled so that the head's logits reach about 100 in magnitude: a
    soft-cap, a logit scale or any extra layer then changes them by far more than round-off, where random
    initial weights alone would give logits too small to show a soft-cap. Does not modify ``model``: the
    scaling lives in a forward hook removed afterwards, the train/eval mode and the RNG state are restored.
    A model on the meta device is not probed (``None``).
    """
    head = model.get_output_embeddings()
    decoder = base_decoder(model)
    if head.weight.device.type == "meta":
        return None
    seen: dict[str, torch.Tensor] = {}

    def scale_hidden(module: nn.Module, args: Any, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", None)
        if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.in_features:
            raise _NotHidden(type(hidden).__name__ if not isinstance(hidden, torch.Tensor) else str(tuple(hidden.shape)))
        peak = float(nn.functional.linear(hidden, head.weight, head.bias).abs().max())
        scaled = hidden * (100.0 / peak if peak > 0 else 1.0)
        seen["hidden"] = scaled
        if isinstance(output, tuple):
            return (scaled, *output[1:])
        output.last_hidden_state = scaled
        return output

    vocab = head.out_features
    ids = (torch.arange(n_tokens, device=head.weight.device) * 7 + 3) % vocab
    training = model.training
    handle = decoder.register_forward_hook(scale_hidden)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model.eval()
            logits = model(input_ids=ids[None], use_cache=False).logits
    except _NotHidden as e:
        return f"its base model's ({type(decoder).__name__}) first output is not hidden states of width {head.in_features} ({e})"
    except Exception as e:  # noqa: BLE001 - any failure: the loss cannot be shown to be the head's
        return f"the probe forward on {n_tokens} tokens failed ({type(e).__name__}: {str(e)[:200]})"
    finally:
        handle.remove()
        model.train(training)
    if "hidden" not in seen:
        return f"its base model ({type(decoder).__name__}) did not run in the model's forward"
    with torch.no_grad():
        expected = transform.reference(nn.functional.linear(seen["hidden"], head.weight, head.bias).float())
    logits = logits.float()
    if logits.shape != expected.shape:
        return f"its logits {tuple(logits.shape)} are not the head's {tuple(expected.shape)}"
    err = float((logits - expected).abs().max()) / max(float(expected.abs().max()), 1e-30)
    tol = 2e-2 if head.weight.dtype in (torch.float16, torch.bfloat16) else 1e-3  # the same product, maybe recast
    if err <= tol:
        return None
    named = logit_transform_of(model)
    what = "the head of the hidden states" if transform.identity else f"{transform.describe()} of the head's output z"
    return (f"they differ from {what} by {err:.2g} of their largest value (a final transform"
            + (f": {named}" if named else ", e.g. soft-capping, a logit scale or a prediction head") + ")")


def forward_loss_sum(
    model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Forward ``model`` on ``inputs`` and return the CE sum over ``labels`` (``[B, S]``, shifted).

    ``chunk_tokens=None``: the model's logits ``[B, S, V]`` and :func:`token_cross_entropy_sum`.
    Otherwise the model is asked for no logits (``logits_to_keep`` empty), its final hidden states
    ``[B, S, H]`` are taken from the base model's output (:func:`base_decoder`), and the LM head and the loss run
    ``chunk_tokens`` tokens at a time, with the final transform of the logits that
    :func:`check_model_for_chunked_loss` confirmed for ``model`` (the recipe probes every model first); a model not
    checked whose config names a transform raises ``ValueError`` (check it first). The head's weight
    is read after the forward: under FSDP2 the root's parameters are still unsharded then (gathered once per
    micro-batch, not per chunk).
    """
    if chunk_tokens is None:
        ce = token_cross_entropy_sum(model(**inputs).logits, labels)
        # loss parallel (TP): the logits were a vocabulary-sharded DTensor and the CE sum is a replicated
        # 0-dim DTensor; its local value is the full sum (differentiable back into the sharded logits)
        return ce.to_local() if hasattr(ce, "to_local") else ce
    transform = _CHUNKED_LOSS_CHECKED.get(model)
    if transform is None:  # the run's check (check_model_for_chunked_loss) probes; a caller of this function alone:
        named = logit_transform_of(model)
        if named:
            raise ValueError(
                f"loss.chunk_tokens={chunk_tokens}: {type(model).__name__}'s logits are not its LM head of its final "
                f"hidden states ({named}); call automodel.training.step.check_model_for_chunked_loss(model) first "
                f"(it probes the model for a transform the chunked loss computes too), or set loss.chunk_tokens=null"
            )
        transform = IDENTITY
    captured: list[torch.Tensor] = []

    def keep_hidden(module: nn.Module, args: Any, output: Any) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = base_decoder(model).register_forward_hook(keep_hidden)
    try:
        model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=labels.device))
    finally:
        handle.remove()
    head = model.get_output_embeddings()
    return chunked_linear_cross_entropy_sum(captured[-1], head.weight, labels, chunk_tokens, bias=head.bias,
                                            transform=transform)  # fmt: skip


def run_micro_batch(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    device_mesh: Any,
    cp_fn: Callable,
    train_context: Callable[[Any], Callable[[], Any]],
    num_label_tokens: torch.Tensor | float,
    backward: bool = True,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Forward (and backward) one prepared micro-batch; return this rank's CE sum (detached, fp32).

    Args:
        model: the (FSDP2) causal LM.
        batch: from :func:`prepare_batch`: ``input_ids``/``labels`` ``[B, S]`` int64, optional
            ``position_ids``, packed-row metadata. Consumed (the CP method may shard it in place).
        device_mesh: the full mesh (the CP method uses its ``cp`` dim).
        cp_fn: the method's batch/context function (:meth:`automodel.distributed.cp.CPMethod.batch_function`).
        train_context: ``cp_ctx -> factory`` (``get_train_context`` with the run's flags bound).
        num_label_tokens: label tokens of the whole global batch (all micro-batches, all dp ranks).
        backward: back-propagate ``CE sum / num_label_tokens`` (False for validation: no graph).
        chunk_tokens: ``loss.chunk_tokens`` (see :func:`forward_loss_sum`); None: the plain loss.

    Returns:
        0-dim fp32: sum of CE over this rank's label tokens (its CP shard of the rows).
    """
    ctx_factory, batch = cp_fn(device_mesh, batch)
    labels = batch.pop("labels")  # the same tensor object the CP context shards in place
    grad = torch.enable_grad() if backward else torch.no_grad()
    with grad, train_context(ctx_factory())():
        inputs = {k: batch[k] for k in MODEL_INPUT_KEYS if batch.get(k) is not None}  # after the shard
        ce_sum = forward_loss_sum(model, inputs, labels, chunk_tokens)
        if backward:
            (ce_sum / num_label_tokens).backward()
    return ce_sum.detach()
