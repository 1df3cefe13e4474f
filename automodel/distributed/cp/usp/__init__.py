"""``distributed.cp_method: usp``: hybrid Ulysses x ring CP.

- :mod:`.method`: :class:`UspMethod`, the strategy (import-free: the config rules read it);
- :mod:`.groups`: this rank's Ulysses and ring process groups (the rank arithmetic is
  :mod:`automodel.distributed.cp.subgroups`);
- :mod:`.attention`: the attention registered as ``"usp"``: the Ulysses all-to-all
  (:mod:`automodel.distributed.sp.all_to_all`) composed with the shared gathered-K/V kernel
  (:mod:`automodel.distributed.cp.gathered_attention`) across the ring sub-group, its context and the
  batch function (``set_usp_attention``, ``make_usp_batch_and_ctx``).
"""

from automodel.distributed.cp.usp.method import UspMethod

__all__ = ["UspMethod"]
