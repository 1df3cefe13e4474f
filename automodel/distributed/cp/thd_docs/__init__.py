"""``distributed.cp_method: thd_docs``: packed documents placed whole by cost, only long ones split.

- :mod:`.method`: :class:`ThdDocsMethod`, the strategy, and :func:`model_cost` (import-free: the config
  rules read it);
- :mod:`.placement`: the placement planner (:func:`plan_documents`, a pure function of the lengths);
- :mod:`.attention`: the attention registered as ``"thd_docs"``, its context and the batch function
  (``set_doc_attention``, ``make_doc_batch_and_ctx``), on the shared block kernels
  (:mod:`automodel.distributed.cp.blocks`) and point-to-point exchange
  (:mod:`automodel.distributed.cp.exchange.p2p`).
"""

from automodel.distributed.cp.thd_docs.method import SAMPLE_MEDIAN, ThdDocsMethod, model_cost

__all__ = ["ThdDocsMethod", "SAMPLE_MEDIAN", "model_cost"]
