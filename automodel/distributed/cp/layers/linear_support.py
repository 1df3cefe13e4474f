"""Which linear-attention / state-space mixers each built-in CP method runs exactly (no torch import).

A ``linear_mixer`` layer of the model profile names its mixer class (:attr:`LayerSpec.mixer`). Only the
classes listed here have a CP kernel (:mod:`automodel.distributed.cp.layers.linear_mixer`); every other mixer,
and every method without a kernel, stays refused.

- ``ulysses``: the mixer switches from a sequence shard to a head shard (all-to-all) and runs its
  unchanged recurrence on the whole row for its heads;
- ``thd``: the conv halo and the recurrent state are chained across the ranks in sequence order, reset at
  every document;
- ``ring``: the same chain over the head-tail chunks of every row (installed at the model's first forward
  inside the ring context).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GATED_DELTANET_MIXERS", "LINEAR_METHODS", "linear_mixer_problem"]

#: mixer class name -> how its projections are laid out (``"qkvz"``: Qwen3-Next's interleaved
#: ``in_proj_qkvz`` / ``in_proj_ba``; ``"split"``: Qwen3.5's ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``;
#: ``"olmo"``: OLMo-Hybrid's ``q/k/v/a/b/g_proj``, ``o_norm`` / ``o_proj`` and beta in [0, 2])
GATED_DELTANET_MIXERS = {
    "Qwen3NextGatedDeltaNet": "qkvz",
    "Qwen3_5GatedDeltaNet": "split",
    "Qwen3_5MoeGatedDeltaNet": "split",
    "OlmoHybridGatedDeltaNet": "olmo",
}

#: method name -> how it runs a supported mixer
LINEAR_METHODS = {
    "ulysses": "head-sharded with an all-to-all: each rank runs the recurrence on the whole row for its heads",
    "thd": "the conv halo and the recurrent state chained across the ranks in sequence order",
    "ring": "the conv halo and the recurrent state chained across the ranks in sequence order (rows)",
}


def linear_mixer_problem(method: str, layer: Any) -> str | None:
    """Why ``method`` does not compute the ``linear_mixer`` layer ``layer`` exactly (``None``: it does)."""
    supported = layer.mixer in GATED_DELTANET_MIXERS and not layer.hybrid_attention
    if supported and method in LINEAR_METHODS:
        return None
    if supported:
        return (
            f"{layer.describe()} carries a state along the sequence, which {method} splits over the ranks without "
            "passing the state on"
        )
    return (
        f"{layer.describe()} carries a state along the sequence, which {method} splits over the ranks without "
        f"passing the state on (CP kernels exist for {', '.join(sorted(GATED_DELTANET_MIXERS))} only)"
    )
