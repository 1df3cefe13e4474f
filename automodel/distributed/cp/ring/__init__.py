"""``distributed.cp_method: ring``: torch's ring attention around SDPA, one package.

- :mod:`.method`: :class:`RingMethod`, the strategy (what ring computes exactly, memory, dry run);
- :mod:`.batch`: the batch path (``make_cp_batch_and_ctx`` and NeMo AutoModel's ``cp_utils`` names,
  re-exported by :mod:`automodel.distributed.cp_utils`);
- :mod:`.cpu_ring`: torch's ring attention on CPU (gloo);
- :mod:`.causal_mask`: transformers' packed-sequence detection off under ring;
- :mod:`.router`: transformers' ``sdpa`` (and an eager model's attention, switched inside the context)
  routed per layer to the shared per-layer kernels (:mod:`automodel.distributed.cp.layers`).

Importing this package imports only :mod:`.method` (no torch.distributed, no transformers).
"""

from automodel.distributed.cp.ring.method import RingMethod

__all__ = ["RingMethod"]
