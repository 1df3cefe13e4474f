"""How long the collator pads rows: the config's value, else the CP method's row multiple."""

from __future__ import annotations

from automodel.config.schema import RecipeConfig
from automodel.distributed.cp import get_cp_method

__all__ = ["pad_multiple"]


def pad_multiple(cfg: RecipeConfig) -> int:
    """The collator's ``pad_to_multiple_of``: ``data.pad_to_multiple_of``, else the method's row multiple.

    :meth:`automodel.distributed.cp.CPMethod.row_multiple`: ``k*cp_size`` with ``k`` the CP method's
    ``chunks_per_rank`` (ring: 2 head-tail chunks per rank; ulysses: 1 contiguous slice), times
    ``tp_size`` with sequence parallelism, so every rank gets an equal share of each row; 1 without.
    """
    if cfg.data.pad_to_multiple_of is not None:
        return cfg.data.pad_to_multiple_of
    d = cfg.distributed
    return get_cp_method(d.cp_method).row_multiple(d.cp_size, d.tp_size, d.sequence_parallel)[0]
