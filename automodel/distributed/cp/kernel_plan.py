"""Which attention kernel each layer kind of a model runs on a GPU: the dry run's "attention kernels" lines.

For every distinct attention layer kind of a :class:`~automodel.distributed.cp.profile.ModelProfile` (full causal,
sliding window, chunked; with sinks, soft-capping, MLA head sizes, GQA), the blocks the CP methods hand the kernels
(the diagonal block: causal square; the off-diagonal blocks: full; head-tail chunks and halos: a causal rectangle,
where the method makes them; windows, chunks and documents inside a block: a mask) each go through
:func:`~automodel.distributed.cp.block_backend.select_kernel` for the planned GPU, torch release and cuDNN. Pure.
"""

from __future__ import annotations

import torch

from automodel.distributed.cp.block_backend import (
    CUDNN,
    EFFICIENT,
    FLASH,
    BlockSpec,
    GpuInfo,
    caps_for,
    packed_choice,
    pin_problem,
    select_kernel,
)
from automodel.distributed.cp.profile import CHUNKED, FULL, SLIDING, ModelProfile

__all__ = ["layer_kind_kernel_lines"]


def _kind_key(layer) -> tuple:  # noqa: ANN001 - a profile LayerSpec
    return (layer.kind, layer.sinks, bool(layer.softcap), layer.qk_head_dim, layer.v_head_dim)


def _kind_text(layer) -> str:  # noqa: ANN001
    text = {FULL: "full attention", SLIDING: f"sliding window {layer.window}", CHUNKED: f"chunked {layer.chunk}"}[layer.kind]
    extras = [e for e, on in (("sinks", layer.sinks), ("softcap", bool(layer.softcap)), ("MLA", layer.mla)) if on]
    return text + (f" ({', '.join(extras)})" if extras else "")


def layer_kind_kernel_lines(
    profile: ModelProfile, gpu: GpuInfo, torch_version: str, cudnn_version: int | None, *,
    dtype: torch.dtype = torch.bfloat16, pinned: str | None = None, packed: bool = False,
    packed_blocks: bool = True,
) -> list[str]:  # fmt: skip
    """One line per attention layer kind: the kernel of each block shape it produces on ``gpu``.

    Args:
        profile: the model's profile (layers, heads, head sizes).
        gpu / torch_version / cudnn_version: what :func:`select_kernel` plans for (``cudnn_version`` ``None``:
            unknown, e.g. a CPU-only torch planning for a GPU: cuDNN is then not assumed).
        dtype: the compute dtype; pinned: a ``model.attention_backend`` pin (a block kernel name) or ``None``.
        packed: rows pack documents (their blocks carry a document mask, or one varlen call takes the row).
        packed_blocks: ``model.cudnn_packed_blocks`` (``False``: thd's, thd_docs' and usp's block sets one call per
            block, said so where the packed-row calls would run).
    """
    heads, kv = profile.num_attention_heads or 1, profile.num_key_value_heads or profile.num_attention_heads or 1
    grouped = kv < heads
    seen: dict[tuple, object] = {}
    for layer in profile.layers:
        if layer.is_attention:
            seen.setdefault(_kind_key(layer), layer)
    out = []
    for layer in seen.values():
        d = layer.qk_head_dim or profile.head_dim or 128
        dv = layer.v_head_dim or d
        common = dict(dtype=dtype, head_dim=d, value_dim=dv, sinks=layer.sinks, softcap=bool(layer.softcap),
                      grouped=grouped)  # fmt: skip
        masked = layer.kind != FULL or packed
        shapes = [("masked blocks", BlockSpec(causal=True, masked=True, **common))] if masked else []
        if layer.kind == FULL:
            shapes += [("diagonal", BlockSpec(causal=True, **common)), ("off-diagonal", BlockSpec(**common)),
                       ("causal rectangle (head-tail chunks, halos, where a method makes them)",
                        BlockSpec(causal=True, square=False, **common))]  # fmt: skip
        parts = []
        grouped_to, repeated_for = set(), set()
        for what, spec in shapes:
            problem = pin_problem(pinned, spec, caps_for(gpu, torch_version, cudnn_version)) if pinned else None
            if problem:
                parts.append(f"{what} REFUSED: {problem}; a block like it raises")
                continue
            choice = select_kernel(gpu, torch_version, cudnn_version, spec, pinned=pinned)
            parts.append(f"{what} {choice.kernel}" + (" (cuDNN cannot take it)" if choice.fallback else ""))
            if grouped and choice.kernel in (CUDNN, FLASH, EFFICIENT):
                (repeated_for if choice.expand_kv else grouped_to).add(choice.kernel)
        if packed and layer.kind == FULL and not layer.sinks and not layer.softcap and pinned in (None, FLASH, CUDNN):
            docs = select_kernel(gpu, torch_version, cudnn_version, BlockSpec(causal=True, **common), varlen=True,
                                 pinned=pinned)  # fmt: skip
            if docs.varlen:
                kv_note = (", K/V repeated per query head" if docs.expand_kv else ", grouped K/V as they are") if grouped else ""
                parts.append(("whole documents: one varlen_attn call (flash)" if docs.kernel == FLASH else
                              "whole documents: one cuDNN varlen call (aten._cudnn_attention_forward)") + kv_note)  # fmt: skip
        if layer.kind == FULL and not layer.softcap and pinned in (None, CUDNN):
            caps = caps_for(gpu, torch_version, cudnn_version)
            sets = [what for what, causal in (("prefix", False), ("diagonal", True))
                    if packed_choice(BlockSpec(causal=causal, **common), caps, pinned, causal=causal, max_q=None)]
            if sets and packed_blocks:
                parts.append(f"thd / thd_docs / usp {' and '.join(sets)} blocks: one cuDNN packed-row call each per "
                             "layer (chunks past 128 tokens)")  # fmt: skip
            elif sets:
                parts.append("thd / thd_docs / usp blocks: one cuDNN call per block (model.cudnn_packed_blocks=false)")
        if grouped_to or repeated_for:
            gqa = [f"grouped K/V as they are to {', '.join(sorted(grouped_to))}"] if grouped_to else []
            gqa += [f"K/V repeated per query head for {', '.join(sorted(repeated_for))}"] if repeated_for else []
            parts.append("GQA: " + ", ".join(gqa))
        out.append(f"  {_kind_text(layer)}: " + "; ".join(parts))
    return out
