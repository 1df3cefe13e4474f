"""Which linear-attention / state-space mixers each built-in CP method runs exactly (no torch import).

A ``linear_mixer`` layer of the model profile names its mixer class (:attr:`LayerSpec.mixer`). Only the
classes listed here have a CP kernel (:mod:`automodel.distributed.cp.layers.linear_mixer`); every other mixer,
and every method without a kernel, stays refused.

- ``ulysses``: the mixer switches from a sequence shard to a head shard (all-to-all) and runs its
  unchanged recurrence on the whole row for its heads;
- ``thd``: the conv halo and the recurrent state are chained across the ranks in sequence order, reset at
  every document;
- ``ring``: the same chain over the head-tail chunks of every row (installed at the model's first forward
  inside the ring context);
- ``thd_docs``: a document whole on one rank runs there from zeros, no exchange; a split document chains
  its state among the ranks of its span;
- ``usp``: the head shard over the Ulysses sub-group, the chain across the ring sub-group.

A mixer that runs attention beside it in the same layer (Falcon-H1, Zamba2's hybrid layers) is exact where
the mixer is and that attention is plain causal attention (no window, chunk, sinks or softcap): it goes
through the method's own attention.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAINED_METHODS", "GATED_DELTANET_MIXERS", "LINEAR_METHODS", "MAMBA2_MIXERS", "STATE_MIXERS", "linear_mixer_problem"]

#: mixer class name -> how its projections are laid out (``"qkvz"``: Qwen3-Next's interleaved
#: ``in_proj_qkvz`` / ``in_proj_ba``; ``"split"``: Qwen3.5's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``;
#: ``"olmo"``: OLMo-Hybrid's ``q/k/v/a/b/g_proj``, ``o_norm`` / ``o_proj`` and beta in [0, 2])
GATED_DELTANET_MIXERS = {
    "Qwen3NextGatedDeltaNet": "qkvz",
    "Qwen3_5GatedDeltaNet": "split",
    "Qwen3_5MoeGatedDeltaNet": "split",
    "LaraMiniGatedDeltaNet": "split",  # Qwen3.5's class under another name (transformers 5.25's lara_mini)
    "Qwen4ExpTextGatedDeltaNet": "split",  # Qwen3.5's, its gated norm's activation from the config (in the model's norm)
    "OlmoHybridGatedDeltaNet": "olmo",
}

#: Mamba2 mixer classes (transformers' ``mamba2_chunk_scan`` family) -> the model type they come from
MAMBA2_MIXERS = {
    "NemotronHMamba2Mixer": "nemotron_h",
    "FalconH1Mixer": "falcon_h1",
    "GraniteMoeHybridMambaLayer": "granitemoehybrid",
    "BambaMixer": "bamba",
    "Zamba2MambaMixer": "zamba2",
    "Mamba2Mixer": "mamba2",
}

#: every mixer class with a CP kernel -> its kernel family (a new kernel module adds its classes here)
STATE_MIXERS: dict[str, str] = {
    **{name: "gated_deltanet" for name in GATED_DELTANET_MIXERS},
    **{name: "mamba2" for name in MAMBA2_MIXERS},
    "JambaMambaMixer": "mamba1",  # cp/layers/mamba1.py
    "MambaMixer": "mamba1",
    "FalconMambaMixer": "mamba1",
    "ZambaMambaMixer": "mamba1",
    "Lfm2ShortConv": "short_conv",  # cp/layers/short_conv.py
    "Lfm2MoeShortConv": "short_conv",
    "Lfm3ShortConv": "short_conv",
    "KimiLinearDeltaAttention": "kimi_delta",  # cp/layers/kimi_delta.py
    "BailingHybridDeltaAttention": "kimi_delta",
    "MiniMaxLightningAttention": "lightning",  # cp/layers/lightning.py
    "RecurrentGemmaRecurrentBlock": "rg_lru",  # cp/layers/rg_lru.py
    "RwkvSelfAttention": "rwkv",  # cp/layers/rwkv.py (and the token shift of RwkvFeedForward)
    "xLSTMLayer": "xlstm",  # cp/layers/xlstm.py
    "ZayaCCAProjection": "cca",  # cp/layers/cca.py: ZAYA's q/k convolutions and delayed values before its attention
}

#: method name -> how it runs a supported mixer
LINEAR_METHODS = {
    "ulysses": "head-sharded with an all-to-all: each rank runs the recurrence on the whole row for its heads",
    "thd": "the conv halo and the recurrent state chained across the ranks in sequence order",
    "ring": "the conv halo and the recurrent state chained across the ranks in sequence order (rows)",
    "thd_docs": "whole documents locally from zeros; a split document's state chained among the ranks of its span",
    "usp": "head-sharded over the Ulysses sub-group, the state chained across the ring sub-group",
}


#: the methods whose linear-mixer cores run in the state chain (``state_chain.ChainedCore``), which keeps every
#: layer's inner autograd graph outside activation checkpointing (a recomputation cannot stop half-way through the
#: chain on one rank): thd_docs for the documents it splits, usp across its ring sub-group
CHAINED_METHODS = ("thd", "ring", "thd_docs", "usp")


def linear_mixer_problem(method: str, layer: Any) -> str | None:
    """Why ``method`` does not compute the ``linear_mixer`` layer ``layer`` exactly (``None``: it does)."""
    supported = layer.mixer in STATE_MIXERS
    if supported and layer.hybrid_attention and not _plain_attention(layer):
        return (
            f"{layer.describe()} runs attention with a window, chunk, sinks or softcap beside its mixer, which no "
            f"CP kernel combines with the state hand-off"
        )
    if supported and method in LINEAR_METHODS:
        return None
    if supported:
        return (
            f"{layer.describe()} carries a state along the sequence, which {method} splits over the ranks without "
            "passing the state on"
        )
    return (
        f"{layer.describe()} carries a state along the sequence, which {method} splits over the ranks without "
        f"passing the state on (CP kernels exist for {', '.join(sorted(STATE_MIXERS))} only)"
    )


def _plain_attention(layer: Any) -> bool:
    return (getattr(layer, "window", None) is None and getattr(layer, "chunk", None) is None
            and not getattr(layer, "sinks", False) and getattr(layer, "softcap", None) is None)
