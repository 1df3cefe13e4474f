"""Which sparse-attention layers (DeepSeek Sparse Attention, DSA) each built-in CP method runs exactly (no torch
import: the profile and the config rules read it).

A DSA layer is multi-head latent attention whose keys are chosen per query by an *indexer*: a few light heads
score every earlier token of the query's document, and the query attends to the ``index_topk`` best only. Under
CP (:mod:`automodel.distributed.cp.layers.sparse_attention`) the queries stay on their rank; the small
per-token state the layer attends to, the compressed (latent) KV and the indexer keys, is all-gathered over the
CP group in global order, so that every rank scores its queries against exactly the keys one process scores,
selects the same top-k and attends to the same keys. The latent KV's gradient returns to its owners by
reduce-scatter; the indexer runs without gradient, as in transformers.

- ``ring``, ``thd``, ``thd_docs``, ``ulysses``: the latent KV and indexer keys all-gathered over the CP group
  (Ulysses' contiguous split is a sequence split like the others for this layer: no head all-to-all);
- ``usp``: all-gathered over the Ulysses sub-group, then over the ring sub-group.

Packed rows: each query's top-k is taken over its own document's tokens only (a row of the document's real
length, as the document alone has), so no selection crosses a document.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPRESSED_ATTENTION",
    "DSA_ATTENTION",
    "DSA_ROPE_BY_RELEASE",
    "DSA_ROPE_LAST",
    "DYNAMIC_MASK_ATTENTION",
    "KV_GATHER_ATTENTION",
    "QSA_ATTENTION",
    "SPARSE_ATTENTION",
    "SPARSE_METHODS",
    "sparse_attention_problem",
]

#: attention class -> the RoPE its indexer applies to its query and key (``"half"``: transformers'
#: ``apply_rotary_pos_emb``, the rotary dimensions split in two halves, DeepSeek-V3.2; ``"interleaved"``:
#: ``apply_rotary_pos_emb_interleave``, the dimensions in (even, odd) pairs, GLM-5 and dots3) and the function
#: of the modeling file that computes it (checked against the indexer's source when the kernel is installed)
DSA_ATTENTION: dict[str, str] = {
    "DeepseekV32Attention": "half",
    "AXK2Attention": "half",  # DeepSeek-V3.2's indexer; a fused q/gate projection and an output gate (token-local)
    "GlmMoeDsaAttention": "interleaved",
    "Dots3NoteTextAttention": "interleaved",
    "HYV4Attention": "interleaved",  # transformers >= 5.25; 5.17-5.24 rotate halves (DSA_ROPE_BY_RELEASE)
}

#: attention classes whose keys are chosen per query by a learned per-key score rather than an indexer (Doge's dynamic
#: mask attention: each key's bias ``exp(A_h * softplus(dt_proj(v_j)))``, added to its scores, and past
#: ``keep_window_size`` visible keys only the top ``keep_window_size`` by bias kept): the same placement, K and V
#: all-gathered instead of the latents (:mod:`~automodel.distributed.cp.layers.dynamic_mask`)
DYNAMIC_MASK_ATTENTION: frozenset[str] = frozenset({"DogeAttention"})

#: attention classes whose indexer's RoPE layout changed between transformers releases: the layout is the one
#: whose function the installed indexer's source calls (HY-V4: halves in 5.17-5.24, interleaved pairs from 5.25)
DSA_ROPE_BY_RELEASE: frozenset[str] = frozenset({"HYV4Attention"})

#: attention classes whose indexer rotates the LAST ``qk_rope_head_dim`` dimensions of its query and key (HY-V4's
#: "flipped" RoPE; the others rotate the first ones), normalises its key in the norm's own dtype (fp32) and applies
#: ``softmax_scale`` to the per-head weights instead of the scores (the same numbers: a positive factor through a
#: ReLU); their attention adds per-head sinks to the softmax (``s_aux``) and gates its output (token-local)
DSA_ROPE_LAST: frozenset[str] = frozenset({"HYV4Attention"})

#: attention classes of DeepSeek-V4's kind: a sliding window with sinks plus compressed KV entries (HCA), chosen by an
#: indexer on CSA layers (:mod:`~automodel.distributed.cp.layers.compressed_attention`): the window's K = V and the
#: compressors' per-token projections all-gathered, whole blocks pooled per document in global order
COMPRESSED_ATTENTION: frozenset[str] = frozenset({"DeepseekV4Attention"})

#: attention classes of Qwen4-Exp's QSA (query-sparse attention: ordinary K/V, no latent): its indexer scores each
#: query against the mean of every ``indexer_compress_ratio`` consecutive visible keys (RMS-normed, RoPE at the
#: block's first position) and keeps the tokens of the best ``indexer_budget / indexer_compress_ratio`` blocks plus
#: the incomplete last block. Under CP its K, V and raw indexer keys (and the RoPE of their positions) are
#: all-gathered, and the class's own selection (``_select_tokens``) runs for the local queries over the whole row
#: (:mod:`automodel.distributed.cp.layers.qsa`)
QSA_ATTENTION: frozenset[str] = frozenset({"Qwen4ExpTextAttention"})

#: sparse attention classes over ordinary K/V whose CP forward all-gathers K and V (queries local) and runs the
#: class's own selection for the local queries over the whole row: QSA, and Kolibri-1.1's indexed layers (a
#: weightless indexer: the ReLU scores of its first query heads against key head 0, both rounded to NVFP4; a pool of
#: key blocks chosen by the pool-source layers and passed on, the top-k of the pool plus sink and local tokens; NoPE;
#: K/V stored by one indexed layer and reused by later ones)
KV_GATHER_ATTENTION: frozenset[str] = QSA_ATTENTION | {"Kolibri1_1Attention"}

#: every sparse attention class with a CP kernel (the profile's ``sparse_attention`` layers)
SPARSE_ATTENTION: frozenset[str] = (
    frozenset(DSA_ATTENTION) | KV_GATHER_ATTENTION | DYNAMIC_MASK_ATTENTION | COMPRESSED_ATTENTION
)

#: method name -> how it runs a DSA layer (and every other class of :data:`SPARSE_ATTENTION`: the same gathers)
SPARSE_METHODS = {
    "ring": "latent KV and indexer keys all-gathered over the CP group; queries local",
    "thd": "latent KV and indexer keys all-gathered over the CP group; queries local; top-k per document",
    "thd_docs": "latent KV and indexer keys all-gathered over the CP group; queries local; top-k per document",
    "ulysses": "latent KV and indexer keys all-gathered over the CP group (a sequence split, no head all-to-all)",
    "usp": "latent KV and indexer keys all-gathered over the Ulysses sub-group, then the ring sub-group",
}


def sparse_attention_problem(method: str, layer: Any) -> str | None:
    """Why ``method`` does not compute the ``sparse_attention`` layer ``layer`` exactly (``None``: it does). A layer
    read from the config alone (``mixer`` empty: its class is not known yet) is judged again when the modules are
    read, before the first step."""
    if layer.mixer and layer.mixer not in SPARSE_ATTENTION:
        return (
            f"{layer.describe()}: the CP kernel knows the sparse attention of {', '.join(sorted(SPARSE_ATTENTION))} only"
        )
    if method in SPARSE_METHODS:
        return None
    if layer.mixer in COMPRESSED_ATTENTION:
        return (
            f"{layer.describe()} pools blocks of every earlier token of the document into the entries each query "
            f"attends, which {method} splits over the ranks without gathering the compressors' inputs (methods with "
            f"its kernel: {', '.join(SPARSE_METHODS)})"
        )
    return (
        f"{layer.describe()} selects each query's keys from the whole document, which {method} splits over the "
        f"ranks without gathering the indexer keys (methods with a DSA kernel: {', '.join(SPARSE_METHODS)})"
    )
