"""``distributed.cp_method: thd``: packed documents in TE's partition, K/V all-gathered per layer.

- :mod:`.method`: :class:`ThdMethod`, the strategy (import-free: the config rules read it);
- :mod:`.attention`: the attention registered as ``"thd"``, its context and the batch function
  (``set_thd_attention``, ``make_thd_batch_and_ctx``), on the shared gathered-K/V kernel
  (:mod:`automodel.distributed.cp.gathered_attention`).
"""

from automodel.distributed.cp.thd.method import THD_CP_COMM_TYPES, THD_KERNELS, ThdMethod

__all__ = ["ThdMethod", "THD_KERNELS", "THD_CP_COMM_TYPES"]
