"""Kolibri-1.1's indexed attention layers (``Kolibri1_1Attention`` in an ``indexed_attention`` layer) under CP: the
checks before its K/V-gathering forward is installed (:mod:`automodel.distributed.cp.layers.sparse_attention`).

transformers' indexed layer, on a row of tokens (no cache): q/k RMS-normed, no RoPE (NoPE); its weightless indexer
(``Kolibri1_1Indexer``, no gradient) scores each query against the keys its attention mask shows: the ReLU of the
logits of the first ``index_num_heads`` query heads against key head 0, both rounded to NVFP4, averaged over the
heads. A *pool-source* layer (``index_layers``) picks, per query, the blocks of ``index_compression`` keys (from the
query's first visible key) whose NVFP4 mean scores highest (``index_pool_size`` keys); the following indexed layers
reuse that pool (passed along the decoder stack). Each indexed layer attends to the ``index_topk`` best keys of the
pool plus the first ``index_num_sink_tokens`` and last ``index_num_local_tokens`` visible keys, over K and V rounded
to NVFP4 (straight-through). A ``store`` layer keeps its K/V for later ``reuse`` layers (``kv_sharing_modes``).

Every one of these reads, for a query, only the keys of its own row of the mask, whole blocks from the document's
first key, and per-token roundings: so with K and V of every token all-gathered in global order (queries local)
and the method's layout mask, the class's own forward selects for the local queries exactly what one process
selects, from the same numbers. The pool it passes on is ``[B, n local queries, T]``, as every later indexed layer
of the same step expects. What the gather does not cover is refused here: a K/V share between an indexed layer
(whose K/V under CP are the whole row's) and a sliding-window layer (whose K/V are the rank's own tokens).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from automodel.errors import CPUnsupportedError

__all__ = ["check_kolibri_attention"]

#: what the installed forward relies on in the class's ``forward``: K/V through the cache's ``update`` (a gather
#: under CP), the indexer over the (gathered) keys and the mask, the share of the stored K/V
_FORWARD_NEEDS = ("cache.update(key_states, value_states", "self.indexer(query_states, key_states, attention_mask",
                  "shared_kv_states[", "is_kv_shared_layer")


def check_kolibri_attention(module: torch.nn.Module, sparse: dict[int, str]) -> None:
    """Refuse a Kolibri-1.1 indexed layer the K/V-gathering forward does not compute: a changed ``forward`` (a
    transformers release), or a K/V share with a layer that is not indexed. ``sparse``: layer index -> class name of
    the profile's ``sparse_attention`` layers."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    missing = [word for word in _FORWARD_NEEDS if word not in source]
    if missing:
        import transformers

        raise CPUnsupportedError(
            f"{type(module).__name__} (transformers {transformers.__version__}) does not compute what the CP kernel "
            f"for Kolibri-1.1's indexed attention expects (missing {', '.join(missing)}); open an issue with the "
            "class name and your transformers version"
        )
    config: Any = module.config
    idx = module.layer_idx
    modes = list(getattr(config, "kv_sharing_modes", None) or [])
    sources = list(getattr(config, "kv_source_layers", None) or [])
    partners = []
    if getattr(module, "is_kv_shared_layer", False):
        partners.append(int(module.kv_source_layer))
    if getattr(module, "store_full_length_kv", False):
        partners += [j for j, (mode, src) in enumerate(zip(modes, sources)) if mode == "reuse" and src == idx]
    others = [j for j in partners if j not in sparse]
    if others:
        raise CPUnsupportedError(
            f"{type(module).__name__} layer {idx} (indexed attention) shares its K/V with layer(s) "
            f"{', '.join(map(str, others))}, which are not indexed: under CP an indexed layer holds the K/V of the "
            "whole row (all-gathered) and a sliding-window layer those of its rank's tokens, so the shared tensor "
            "cannot be both"
        )
