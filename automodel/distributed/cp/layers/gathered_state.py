"""What a gathered-state attention kernel holds per layer: its declaration for the memory planner (no torch import).

A gathered-state kernel keeps its queries local and all-gathers a small per-token state of every token of the row
in global order (DeepSeek sparse attention: the latent KV and the indexer keys,
:mod:`~automodel.distributed.cp.layers.sparse_attention`; Doge's K and V with its dynamic mask; DeepSeek-V4's window
and compressor inputs; QSA's and Kolibri-1.1's K and V). What it allocates for one layer is declared here, per
layer kind, so that :mod:`automodel.training.layer_kind_memory` plans it without knowing the kernel: a kernel
added later (a compressed-attention or dynamic-mask kernel of another family) registers a function in
:data:`GATHERED_STATE` that reads its layer and config and returns a :class:`GatheredState`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GATHERED_STATE", "GatheredState", "gathered_state"]


@dataclass(frozen=True)
class GatheredState:
    """One layer's tensors over the gathered row of ``T`` tokens, for ``n`` local queries of each of ``B`` rows.

    Attributes:
        width: elements per token all-gathered (every token of the row, in the compute dtype).
        expanded: elements per gathered token the layer computes from the gathered state in its forward (DSA under
            transformers >= 5.25: every head's keys and values expanded from the latent KV), compute dtype.
        expanded_grad: elements per gathered token of those tensors' gradients in the backward.
        heads: query heads scored against every gathered token, one block of ``block`` queries at a time: the
            forward holds two ``[B, heads, block, T]`` fp32 score blocks (the scores and the softmax), the backward
            three (the probabilities, their gradient and the softmax's).
        block: queries per score block.
        mask_planes: ``[B, n, T]`` boolean planes the forward holds (which keys each local query may see, which it
            selected, both); the backward recomputes them and keeps one.
        index_slots: ``int64`` slots per local query, twice in the forward (the top-k indices and their cleaned
            copy); 0 for a kernel that selects nothing.
        bias_planes: ``[B, n, T]`` planes in the compute dtype the layer builds and keeps to its backward (Doge's
            dynamic mask ``[B, Hkv, n, T]``: ``Hkv`` planes, from learned weights, so autograd keeps it), each
            with a boolean twin (the keys dropped beyond the top-k) in the forward.
        bias_heads: ``[B, n, T]`` planes of that mask repeated to the query heads by the model (Doge's ``repeat_kv``),
            compute dtype, which the blocked attention keeps for its backward; in the backward their gradient too,
            made once from the blocks' (``dynamic_mask.dynamic_mask_attention`` splits the mask into its blocks).
        own_kernel: the score blocks are the CP kernel's own, under every attention implementation; ``False``: the
            layer runs the class's attention function (Kolibri-1.1), whose scores exist under ``eager`` only (SDPA's
            fused kernels hold none).
    """

    width: int
    expanded: int = 0
    expanded_grad: int = 0
    heads: int = 0
    block: int = 256
    mask_planes: int = 0
    index_slots: int = 0
    bias_planes: int = 0
    bias_heads: int = 0
    own_kernel: bool = True

    def row_bytes(self, batch: int, local: int, total: int, compute_bytes: int) -> float:
        """Bytes of the gathered row (``width`` per token of ``total``) and of the mask planes over ``local``
        queries: what the layer holds before its kernel's own tensors."""
        return batch * (total * self.width * compute_bytes + self.mask_planes * local * total)

    def forward_bytes(self, batch: int, local: int, total: int, compute_bytes: int, tp: int = 1,
                      eager: bool = False) -> float:  # fmt: skip
        """Bytes one layer's forward holds at its peak: ``batch`` rows of ``local`` queries over ``total`` tokens
        (``eager``: the run's attention implementation, for a layer that runs the class's own, :attr:`own_kernel`)."""
        scores = self.own_kernel or eager
        block, heads = min(self.block, local), (self.heads / tp if scores else 0.0)
        return self.row_bytes(batch, local, total, compute_bytes) + batch * (
            total * self.expanded / tp * compute_bytes
            + 2 * heads * block * total * 4
            + (block * total if scores else 0)  # the negated mask of the block
            + 2 * local * min(self.index_slots, total) * 8
            + self._bias_planes(compute_bytes, backward=False) * local * total
        )

    def backward_bytes(self, batch: int, local: int, total: int, compute_bytes: int, tp: int = 1,
                       eager: bool = False) -> float:  # fmt: skip
        """Bytes one layer's backward holds at its peak (a block's recomputed scores and their gradients)."""
        scores = self.own_kernel or eager
        block, heads = min(self.block, local), (self.heads / tp if scores else 0.0)
        planes = 1 if self.mask_planes else 0
        return batch * (
            total * (self.width + (self.expanded + self.expanded_grad) / tp) * compute_bytes
            + (2 if self.bias_heads else 3) * heads * block * total * 4  # the scores' gradient is the mask's block
            + (block * total if scores else 0)
            + planes * local * total
            + self._bias_planes(compute_bytes, backward=True) * local * total
        )

    def _bias_planes(self, compute_bytes: int, backward: bool) -> float:
        """Bytes per ``(query, token)`` of the bias mask at the layer's attention: the mask (compute dtype) and its
        boolean twin; where the model repeats it to the query heads (:attr:`bias_heads`), the repeated copy instead
        of the mask (freed once repeated) and, in the backward, the copy's gradient besides."""
        if not self.bias_heads:
            return self.bias_planes * (compute_bytes + (0 if backward else 1))
        return self.bias_heads * compute_bytes * (2 if backward else 1) + self.bias_planes


def _dsa(layer: Any, config: Any) -> GatheredState | None:
    """DeepSeek sparse attention (``sparse_attention.py``): the latent KV and the indexer keys gathered
    (``LayerSpec.sparse_widths``); transformers expands every head's keys (``qk_nope + qk_rope``) and the
    ``kv_b_proj`` output (``qk_nope + v``) for every gathered token, and the kernel's blocks of
    ``QUERY_BLOCK`` queries score the whole row; three ``[B, n, T]`` masks (the layout's, the selected keys',
    both) and the top-k indices with their ``-1``-cleaned copy."""
    widths = getattr(layer, "sparse_widths", None)
    if not widths:
        return None
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    rope = int(getattr(config, "qk_rope_head_dim", 0) or 0)
    nope = int(getattr(config, "qk_nope_head_dim", 0) or 0)
    v = int(getattr(config, "v_head_dim", 0) or 0) or (layer.v_head_dim or 0)
    qk = nope + rope or (layer.qk_head_dim or 0)
    from automodel.distributed.cp.layers.sparse_attention import QUERY_BLOCK

    return GatheredState(width=sum(widths), expanded=heads * (nope + v + qk), expanded_grad=heads * (qk + v),
                         heads=heads, block=QUERY_BLOCK, mask_planes=3,
                         index_slots=int(getattr(config, "index_topk", 0) or 0))  # fmt: skip


def _int(config: Any, name: str) -> int:
    return int(getattr(config, name, 0) or 0)


def _head_dim(layer: Any, config: Any) -> int:
    heads = _int(config, "num_attention_heads")
    return _int(config, "head_dim") or (layer.qk_head_dim or 0) or (_int(config, "hidden_size") // max(heads, 1))


def _dynamic_mask(layer: Any, config: Any) -> GatheredState | None:
    """Doge (``dynamic_mask.py``): K and V gathered (``2 * Hkv * D`` per token) and repeated to the query heads for
    the blocked attention, the dynamic mask ``[B, Hkv, n, T]`` in the compute dtype with its boolean top-k twin, the
    model's copy of it repeated to the query heads (kept for the backward: ``A`` and ``dt_proj`` learn through it; its
    gradient in the backward), blocks of ``QUERY_BLOCK`` queries, one mask plane. Measured
    (``scripts/bench_plan_families_cp.py``, hidden 256, 8 / 4 heads, 2048 tokens, ring cp 2): the repeated mask and
    its gradient, 64 MiB each, at the backward's peak."""
    widths = getattr(layer, "sparse_widths", None)
    if not widths:
        return None
    from automodel.distributed.cp.layers.dynamic_mask import QUERY_BLOCK

    heads, kv = _int(config, "num_attention_heads"), _int(config, "num_key_value_heads")
    kv = kv or heads
    dim = _head_dim(layer, config)
    return GatheredState(width=sum(widths), expanded=2 * heads * dim, expanded_grad=2 * heads * dim, heads=heads,
                         block=QUERY_BLOCK, mask_planes=1, bias_planes=kv, bias_heads=heads)  # fmt: skip


def _compressed(layer: Any, config: Any) -> GatheredState | None:
    """DeepSeek-V4 (``compressed_attention.py``): the window's K = V and the compressors' (and on CSA layers the
    indexer's) per-token projections gathered (``LayerSpec.sparse_widths``), every query head scored in blocks of
    ``QUERY_BLOCK`` queries over the keys a block reaches (counted over the whole row: an upper bound), one mask
    plane, the CSA top-k indices."""
    widths = getattr(layer, "sparse_widths", None)
    if not widths:
        return None
    from automodel.distributed.cp.layers.sparse_attention import QUERY_BLOCK

    return GatheredState(width=sum(widths), heads=_int(config, "num_attention_heads"), block=QUERY_BLOCK,
                         mask_planes=1, index_slots=_int(config, "index_topk"))  # fmt: skip


def _kv_gather(layer: Any, config: Any) -> GatheredState | None:
    """Qwen4-Exp's QSA and Kolibri-1.1 (``qsa.py``, ``kolibri_sparse.py``): K and V (and QSA's raw indexer keys)
    gathered and repeated to the query heads, the class's own selection as two ``[B, n, T]`` planes (the visible
    keys, the selected ones; Kolibri's one, the method's layout mask: its indexer's pool and selection are
    ``layer_kind_memory.indexer_bytes``). Both classes then call the attention function their ``_ConfigView`` names,
    the blocked QSA kernel (``sparse_attention.qsa_attention``): ``QUERY_BLOCK`` queries at a time against the row,
    under every attention implementation. Planned as the class's own SDPA call (no score blocks), Kolibri-1.1's
    tiny config read 15% to 18% under at cp 4 (``scripts/bench_plan_families_cp.py --cp 4``: three ``[1, 4, 256,
    2048]`` fp32 blocks at the recomputed layer's backward)."""
    widths = getattr(layer, "sparse_widths", None)
    if not widths:
        return None
    from automodel.distributed.cp.layers.sparse_attention import QUERY_BLOCK
    from automodel.distributed.cp.layers.sparse_support import QSA_ATTENTION

    heads = _int(config, "num_attention_heads")
    dim = _head_dim(layer, config)
    planes = 2 if layer.mixer in QSA_ATTENTION else 1
    return GatheredState(width=sum(widths), expanded=2 * heads * dim, expanded_grad=2 * heads * dim, heads=heads,
                         block=QUERY_BLOCK, mask_planes=planes)  # fmt: skip


def _sparse(layer: Any, config: Any) -> GatheredState | None:
    """The declaration of a ``sparse_attention`` layer, by the kernel its class runs."""
    from automodel.distributed.cp.layers.sparse_support import (
        COMPRESSED_ATTENTION,
        DYNAMIC_MASK_ATTENTION,
        KV_GATHER_ATTENTION,
    )

    mixer = getattr(layer, "mixer", "")
    if mixer in DYNAMIC_MASK_ATTENTION:
        return _dynamic_mask(layer, config)
    if mixer in COMPRESSED_ATTENTION:
        return _compressed(layer, config)
    if mixer in KV_GATHER_ATTENTION:
        return _kv_gather(layer, config)
    return _dsa(layer, config)


#: layer kind (``LayerSpec.kind``) -> its declaration from ``(layer, text config)`` (``None``: nothing declared)
GATHERED_STATE: dict[str, Callable[[Any, Any], GatheredState | None]] = {"sparse_attention": _sparse}


def gathered_state(layer: Any, config: Any) -> GatheredState | None:
    """The :class:`GatheredState` of ``layer`` (a ``LayerSpec``), or ``None`` for a layer of no such kernel."""
    declare = GATHERED_STATE.get(layer.kind)
    return declare(layer, config) if declare is not None else None
