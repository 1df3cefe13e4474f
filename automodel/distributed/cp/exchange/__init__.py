"""K/V exchange among CP ranks, each with its gradient's way back (autograd-correct).

- :mod:`.gather`: all-gather of token-major K/V over the CP group, reduce-scatter of dK/dV;
- :mod:`.p2p`: point-to-point lend of pieces among the ranks a document spans, and their gradients'
  return.
"""

from automodel.distributed.cp.exchange.gather import (
    GatherKV,
    TokenGather,
    all_gather_tokens,
    gather_kv,
    reduce_scatter_tokens,
)
from automodel.distributed.cp.exchange.p2p import LendTable, batch_p2p, give_back, lend

__all__ = [
    "GatherKV",
    "LendTable",
    "TokenGather",
    "all_gather_tokens",
    "batch_p2p",
    "gather_kv",
    "give_back",
    "lend",
    "reduce_scatter_tokens",
]
