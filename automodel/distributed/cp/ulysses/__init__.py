"""``distributed.cp_method: ulysses``: all-to-all around the model's own attention kernel, one package.

- :mod:`.method`: :class:`UlyssesMethod`, the strategy;
- :mod:`.attention`: the attention function, its context and the batch function
  (``set_ulysses_attention``, ``make_ulysses_batch_and_ctx``);
- :mod:`.doc_blocks`: packed / padded rows one document block at a time (no ``[S, S]`` mask).

Importing this package imports only :mod:`.method` (no torch.distributed, no transformers).
"""

from automodel.distributed.cp.ulysses.method import UlyssesMethod

__all__ = ["UlyssesMethod"]
