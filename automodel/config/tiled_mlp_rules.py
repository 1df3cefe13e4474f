"""``model.tiled_mlp``: the values that type-check but cannot run (checked before any model loads).

The model-dependent checks (an MLP module found in the decoder layers, none that mixes tokens, no random
draws inside an MLP, no router logits recorded for an auxiliary loss) run on the meta-device model before
any weight loads: :func:`automodel.models.tiled_mlp.check_tiled_mlp_for_model`.
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["tiled_mlp_problems"]


def tiled_mlp_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.model.tiled_mlp`` (empty list: fine)."""
    value = cfg.model.tiled_mlp
    if isinstance(value, bool):
        return []
    if not isinstance(value, int) or value < 1:
        return [
            f"model.tiled_mlp={value!r} must be false, true (tile size picked from the hidden and MLP sizes) or "
            f"the tokens per tile, an integer >= 1 (e.g. 1024)"
        ]
    return []
