"""How long the collator pads rows (the config's value, else the CP method's row multiple), and the run log's line
for a method that pads every packed document in the data."""

from __future__ import annotations

from automodel.config.schema import RecipeConfig
from automodel.distributed.cp import get_cp_method

__all__ = ["document_padding_line", "pad_multiple"]


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


def document_padding_line(cfg: RecipeConfig, multiple: int, key: str = "dataset") -> str:
    """The run log's line when the CP method pads every packed document to ``multiple`` tokens in the data
    (:meth:`automodel.distributed.cp.CPMethod.dataset_options`; thd: ``2*cp_size``): the rows then hold other
    documents than a ``cp_size=1`` run's, so its losses are another data order's, not a CP error. It names the
    overrides that give a ``cp_size=1`` run the same rows, and the method whose rows do not depend on ``cp_size``."""
    d = cfg.distributed
    return (
        f"data: cp_method={d.cp_method} pads every packed document to a multiple of {multiple} tokens "
        f"(data.{key}.seq_pad_multiple is unset: the method's multiple), so rows hold other documents than at cp_size=1 and the "
        f"losses differ from a cp_size=1 run's; the same rows at cp_size=1: "
        f"+data.{key}.seq_pad_multiple={multiple} data.pad_to_multiple_of={multiple}; cp_method=thd_docs pads no "
        "document (the same rows at every cp_size)"
    )
