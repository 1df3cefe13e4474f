"""Vision-language models under context parallelism: stock Hugging Face Qwen2-VL / Qwen2.5-VL.

One training step of a VLM under CP (every rank of a CP group holds the same batch):

1. **Vision on each rank's share.** The packed ``pixel_values`` (and ``pixel_values_videos``) are
   split across the CP ranks with whole images per rank, balanced by patch count
   (:func:`automodel.distributed.multimodal.cp.split_to_context_parallel_ranks_dynamic_res`); each
   rank runs the vision tower on its share only.
2. **Gather and merge.** The embeddings are all-gathered (reduce-scatter in the backward) and
   scattered into the token embeddings at the image / video placeholder tokens: ``inputs_embeds
   [B, S, H]`` for the whole sequence on every rank.
3. **mRoPE on the whole sequence.** ``position_ids [3, B, S]`` come from the model's own
   ``get_rope_index`` on the global ``input_ids`` (they depend on every image's grid before a token).
4. **The language model under CP.** ``inputs_embeds`` and the mRoPE positions are sharded like any
   other sequence tensor (ring: load-balanced chunks through
   :func:`automodel.distributed.cp_utils.make_cp_batch_and_ctx`; Ulysses: contiguous slices through
   :func:`automodel.distributed.cp.ulysses.attention.make_ulysses_batch_and_ctx`), with autograd, so each rank's
   token loss sends its gradient back through the gather into the vision tower.

Only the language model's attention runs as CP attention: the vision tower runs before the ring
context is entered, and Ulysses is switched on the text sub-model only.

Usage::

    prepare_vlm_for_cp(model, mesh, cp_method)            # once (Ulysses: switch the text attention)
    ctx_factory, local = make_vlm_cp_batch_and_ctx(model, mesh, batch, cp_method="ring")
    with ctx_factory():
        logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"],
                       use_cache=False).logits
        loss = token_ce_sum(logits, local["labels"]) / global_label_count
        loss.backward()
    # then SUM the parameter gradients over the CP group (FSDP over dp_shard_cp does it)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from automodel.distributed.cp import CPMethod, PreparedModel, cp_methods, get_cp_method
from automodel.distributed.multimodal.cp import (
    gather_from_context_parallel_ranks_dynamic_res,
    resolve_group,
    split_to_context_parallel_ranks_dynamic_res,
)
from automodel.distributed.multimodal.dynamic_res import check_grid

__all__ = [
    "VLM_MODEL_TYPES",
    "VLMParts",
    "is_vlm",
    "vlm_parts",
    "prepare_vlm_for_cp",
    "vision_embeddings_cp",
    "build_vlm_inputs",
    "make_vlm_cp_batch_and_ctx",
    "VLM_BATCH_KEYS",
    "vlm_fsdp_units",
    "init_fsdp_root",
    "bind_vlm_cp",
    "vlm_model_class",
    "auto_model_class",
    "check_data_for_model",
]

#: HF ``model_type`` values this path supports (the Qwen2-VL layout: packed patches + grid_thw).
VLM_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
#: Batch keys consumed by :func:`build_vlm_inputs` (they never reach the language model).
VLM_BATCH_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
)


@dataclass
class VLMParts:
    """The pieces of a stock HF VLM that CP drives separately."""

    visual: torch.nn.Module
    language_model: torch.nn.Module
    embed_tokens: torch.nn.Module
    rope_owner: torch.nn.Module  # has get_rope_index
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int


def is_vlm(model_or_config: Any) -> bool:
    """Whether a model (its profile, :func:`~automodel.distributed.cp.guard.cached_profile`) or a config is one
    of :data:`VLM_MODEL_TYPES`."""
    if hasattr(model_or_config, "config") and hasattr(model_or_config, "named_modules"):
        from automodel.distributed.cp.guard import cached_profile

        return cached_profile(model_or_config).model_type in VLM_MODEL_TYPES
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "model_type", None) in VLM_MODEL_TYPES


def vlm_model_class(config: Any) -> type | None:
    """The ``AutoModelForImageTextToText`` class of a supported VLM config, else ``None``."""
    if not is_vlm(config):
        return None
    from automodel.distributed.torch_internals import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)


def auto_model_class(config: Any) -> type:
    """``AutoModelForImageTextToText`` for a supported VLM config, ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm(config) else AutoModelForCausalLM


def vlm_parts(model: torch.nn.Module) -> VLMParts:
    """Find the vision tower, the text model and the token embedding of a Qwen2-VL-style model."""
    if not is_vlm(model):
        raise TypeError(
            f"{type(model).__name__} (model_type={getattr(getattr(model, 'config', None), 'model_type', None)!r}) "
            f"is not a supported VLM; supported model types: {VLM_MODEL_TYPES}"
        )
    from automodel.distributed.cp.guard import cached_profile

    inner = model.model if hasattr(model, "model") and hasattr(model.model, "visual") else model
    profile = cached_profile(model)  # the token ids and the spatial merge, read once with the model
    return VLMParts(
        visual=inner.visual,
        language_model=inner.language_model,
        embed_tokens=inner.get_input_embeddings(),
        rope_owner=inner,
        image_token_id=int(profile.image_token_id),
        video_token_id=int(profile.video_token_id),
        spatial_merge_size=int(profile.spatial_merge_size),
    )


def vision_embeddings_cp(
    model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor, device_mesh: Any = None
) -> torch.Tensor:
    """The vision tower's merged embeddings of ALL media, computing only this rank's share.

    Args:
        pixel_values: ``[P, D]`` packed patches (the processor's layout), identical on every rank.
        grid_thw: ``[N, 3]`` int64 ``(t, h, w)`` per medium.
        device_mesh: the CP group (DeviceMesh with a ``"cp"`` dim, or a ProcessGroup); ``None``: no CP,
            the whole batch is encoded here.

    Returns:
        ``[sum(t*h*w) / m**2, H]`` in the model dtype, identical on every rank; differentiable (the
        backward reduce-scatters into this rank's vision-tower activations).
    """
    parts = vlm_parts(model)
    visual = parts.visual
    group, world, _ = resolve_group(device_mesh) if device_mesh is not None else (None, 1, 0)
    if world == 1:
        check_grid(pixel_values, grid_thw, parts.spatial_merge_size)
        return _pooled(visual(pixel_values.to(visual.dtype), grid_thw=grid_thw))
    local, split = split_to_context_parallel_ranks_dynamic_res(
        pixel_values, grid_thw, group=group, spatial_merge_size=parts.spatial_merge_size
    )
    embeds = _pooled(visual(local.to(visual.dtype), grid_thw=split.local_grid_thw))
    return gather_from_context_parallel_ranks_dynamic_res(embeds, split, group)


def _pooled(out: Any) -> torch.Tensor:
    return out.pooler_output if hasattr(out, "pooler_output") else out


def _merge(inputs_embeds, input_ids, token_id, embeds, what):
    mask = input_ids == token_id
    n = int(mask.sum())
    if n != embeds.size(0):
        raise ValueError(
            f"the batch has {n} {what} placeholder tokens (id {token_id}) but the vision tower produced "
            f"{embeds.size(0)} {what} embeddings from the grid_thw; every {what} needs exactly t*h*w/merge**2 "
            "placeholder tokens (use the processor that produced pixel_values)"
        )
    return inputs_embeds.masked_scatter(mask.unsqueeze(-1), embeds.to(inputs_embeds.dtype))


def build_vlm_inputs(model: torch.nn.Module, batch: dict[str, Any], device_mesh: Any = None) -> dict[str, Any]:
    """Turn a VLM batch into a language-model batch for the whole sequence (vision computed with CP).

    Args:
        batch: ``input_ids [B, S]``, ``labels [B, S]`` (already shifted, -100 = ignore), optional
            ``pixel_values [P, D]`` + ``image_grid_thw [N, 3]``, ``pixel_values_videos`` +
            ``video_grid_thw``, ``mm_token_type_ids [B, S]`` (derived from the placeholder ids when
            absent), ``attention_mask``, ``loss_mask``; identical on every CP rank. Not mutated.

    Returns:
        ``{"inputs_embeds": [B, S, H], "position_ids": [3, B, S] int64 (mRoPE), "labels", ...}``: the
        other ``[B, S]`` entries are passed through; the vision keys and ``input_ids`` are consumed.
    """
    parts = vlm_parts(model)
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    for pv_key, grid_key in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if (batch.get(pv_key) is None) != (batch.get(grid_key) is None):
            raise ValueError(f"batch has {pv_key!r} without {grid_key!r} (or the reverse); give both or neither")

    inputs_embeds = parts.embed_tokens(input_ids)
    if batch.get("pixel_values") is not None:
        image = vision_embeddings_cp(model, batch["pixel_values"], batch["image_grid_thw"], device_mesh)
        inputs_embeds = _merge(inputs_embeds, input_ids, parts.image_token_id, image, "image")
    if batch.get("pixel_values_videos") is not None:
        video = vision_embeddings_cp(model, batch["pixel_values_videos"], batch["video_grid_thw"], device_mesh)
        inputs_embeds = _merge(inputs_embeds, input_ids, parts.video_token_id, video, "video")

    mm = batch.get("mm_token_type_ids")
    if mm is None:
        mm = (input_ids == parts.image_token_id).long() + 2 * (input_ids == parts.video_token_id).long()
    if batch.get("image_grid_thw") is None and batch.get("video_grid_thw") is None:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand(3, *input_ids.shape)
    else:
        extra = {}
        if batch.get("second_per_grid_ts") is not None:
            extra["second_per_grid_ts"] = batch["second_per_grid_ts"]
        position_ids, _ = parts.rope_owner.get_rope_index(
            input_ids,
            mm_token_type_ids=mm,
            image_grid_thw=batch.get("image_grid_thw"),
            video_grid_thw=batch.get("video_grid_thw"),
            attention_mask=batch.get("attention_mask"),
            **extra,
        )
    out = {k: v for k, v in batch.items() if k not in VLM_BATCH_KEYS and k not in ("input_ids", "position_ids")}
    out["inputs_embeds"] = inputs_embeds
    out["position_ids"] = position_ids.long()
    return out


def prepare_vlm_for_cp(model: torch.nn.Module, device_mesh: Any, cp_method: str | CPMethod) -> PreparedModel:
    """One-time preparation before CP steps, on the TEXT model only (the vision tower keeps its own
    kernel): e.g. Ulysses switches the text attention; ring needs nothing (its context is entered after
    the vision tower). Returns what was done, to undo it (the CP self-check). Mutates the model."""
    return _vlm_method(cp_method).prepare_model(vlm_parts(model).language_model, device_mesh)


def make_vlm_cp_batch_and_ctx(
    model: torch.nn.Module,
    device_mesh: Any,
    batch: dict[str, Any],
    cp_method: str | CPMethod = "ring",
    inner_attn: str = "sdpa",
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]:
    """Vision on this rank's share, gather + merge, mRoPE on the whole sequence, then shard for CP.

    Args:
        model: a Qwen2-VL-style model (:func:`prepare_vlm_for_cp` already called).
        device_mesh: a DeviceMesh with a ``"cp"`` dim (or ``None``: no CP, the whole sequence).
        batch: as for :func:`build_vlm_inputs`.
        cp_method: a CP method that takes merged ``inputs_embeds`` (``supports_vlm``: ring, ulysses) or its
            name; inner_attn: the text model's own attention implementation (the inner kernel of a method
            that switched it, e.g. Ulysses).

    Returns:
        ``(ctx_factory, local)``: ``local`` holds this rank's ``inputs_embeds [B, S_r, H]`` (autograd
        back to the vision tower and the embedding), ``position_ids [3, B, S_r]`` and ``labels``; run
        ``model(inputs_embeds=..., position_ids=..., use_cache=False)`` inside ``ctx_factory()``.
    """
    method = _vlm_method(cp_method)
    lm_batch = build_vlm_inputs(model, batch, device_mesh)
    if device_mesh is None:
        return contextlib.nullcontext, lm_batch
    prepared = PreparedModel(module=vlm_parts(model).language_model, previous_attn=inner_attn)
    return method.batch_function(prepared)(device_mesh, lm_batch)


def _vlm_method(cp_method: str | CPMethod) -> CPMethod:
    method = get_cp_method(cp_method)
    if not method.supports_vlm:
        vlm = [name for name, m in cp_methods().items() if m.supports_vlm]
        raise ValueError(f"cp_method={method.name!r} is not supported for VLMs; use one of {vlm}")
    return method


# ---------------------------------------------------------------------------------------------------------
# FSDP2 and the recipe


def vlm_fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of a VLM that must be their own FSDP2 units (after the blocks, before the root).

    The vision tower and the token embedding run OUTSIDE the root's forward (before the CP context is
    entered). As their own units they unshard themselves in their own forward and reduce their
    gradients at the end of the backward; left to the root, their gradients would be reduced when
    the gradient reaches ``inputs_embeds``, before the vision backward has produced them.
    Returns ``[]`` for models that are not VLMs.
    """
    if not is_vlm(model):
        return []
    parts = vlm_parts(model)
    return [parts.visual, parts.embed_tokens]


def init_fsdp_root(model: torch.nn.Module) -> None:
    """Make the FSDP2 root initialise before a sub-unit runs outside the root's forward (no-op otherwise).

    FSDP2 picks as root the first unit that runs forward; the VLM step runs the vision tower and the
    embedding first, so the root model's lazy initialisation is triggered here explicitly.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return
    state = model._get_fsdp_state()
    if not hasattr(state, "_lazy_init"):
        raise RuntimeError(
            "this torch's FSDP2 has no FSDPState._lazy_init, which the VLM CP step needs to run the vision "
            "tower before the root forward; use the torch version pinned in pyproject.toml"
        )
    state._lazy_init()


def bind_vlm_cp(
    model: torch.nn.Module, device_mesh: Any, cp_method: str | CPMethod, cp_size: int, inner_attn: str = "sdpa"
) -> tuple[Callable[[Any, dict[str, Any]], tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]], PreparedModel]:
    """The recipe's ``(cp_fn, prepared)`` for a VLM: ``cp_fn(device_mesh, batch) -> (ctx_factory, local_batch)``.

    Prepares the text model once for the method (``cp_size > 1``; e.g. Ulysses switches its attention).
    The returned function runs the vision tower on this rank's share (the whole batch at ``cp_size ==
    1``), merges, computes mRoPE on the whole sequence and shards for CP; ``local_batch`` holds
    ``inputs_embeds``, ``position_ids`` and ``labels`` (read ``inputs_embeds`` inside the context: ring
    replaces it by its shard on entry). ``prepared`` undoes the preparation (the CP self-check).
    """
    prepared = prepare_vlm_for_cp(model, device_mesh, cp_method) if cp_size > 1 else PreparedModel()

    def cp_fn(mesh: Any, batch: dict[str, Any]):
        init_fsdp_root(model)
        # evaluation (model.eval()): no graph through the vision tower and the embedding
        with contextlib.nullcontext() if model.training else torch.no_grad():
            return make_vlm_cp_batch_and_ctx(
                model, mesh if cp_size > 1 else None, batch, cp_method=cp_method, inner_attn=inner_attn
            )

    return cp_fn, prepared


def check_data_for_model(dataset: Any, model_config: Any) -> None:
    """Refuse image-text data for a model that cannot see images (it would silently train on text only).

    Raises:
        automodel.errors.UserInputError: ``dataset`` yields images (it has ``image_token_id``) but
            ``model_config`` is not a supported VLM.
    """
    if getattr(dataset, "image_token_id", None) is not None and not is_vlm(model_config):
        from automodel.errors import UserInputError

        raise UserInputError(
            f"data.dataset ({type(dataset).__name__}) yields images, but the model "
            f"({type(model_config).__name__}, model_type={getattr(model_config, 'model_type', None)!r}) is not a "
            f"VLM this recipe supports ({', '.join(VLM_MODEL_TYPES)}); its images would be dropped. Use a VLM "
            "config (configs/vlm_cp.yaml) or a text dataset"
        )
