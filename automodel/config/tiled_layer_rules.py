"""``model.tiled_layer``: the values that type-check but cannot run (checked before any model loads).

The model-dependent checks (every decoder layer one of the structures the tiled layer is proven for, no random
draws inside a layer) run on the meta-device model before any weight loads:
:func:`automodel.models.tiled_layer.check_tiled_layer_for_model`.
"""

from __future__ import annotations

from automodel.config.schema import RecipeConfig

__all__ = ["tiled_layer_problems"]


def tiled_layer_problems(cfg: RecipeConfig) -> list[str]:
    """Problems of ``cfg.model.tiled_layer`` (empty list: fine)."""
    value = cfg.model.tiled_layer
    if value is False:
        return []
    if value is not True and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return [
            f"model.tiled_layer={value!r} must be false, true (tiles of at most hidden tokens) or the tokens per "
            f"tile, an integer >= 1 (e.g. 4096)"
        ]
    if cfg.distributed.tp_size > 1:
        return [
            f"model.tiled_layer with distributed.tp_size={cfg.distributed.tp_size}: the tiled layer runs on plain "
            f"tensors and tensor parallelism splits the projections into DTensors; set distributed.tp_size=1 or "
            f"model.tiled_layer=false"
        ]
    return []
