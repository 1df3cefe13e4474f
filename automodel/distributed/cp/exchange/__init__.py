"""How CP ranks exchange tokens and states, each exchange written once with its gradient's way back
(autograd-correct).

- :mod:`.gather`: all-gather of token-major K/V over the CP group, reduce-scatter of dK/dV;
- :mod:`.p2p`: point-to-point lend of pieces among the ranks a document spans, and their gradients'
  return;
- :mod:`.halo`: the halo exchange: only the K/V rows a rank's queries reach and another rank holds
  (``all_to_all_single`` with per-peer splits, from a :class:`~.halo.HaloPlan`); the backward returns the
  halo's dK/dV to their owners;
- :mod:`.state`: the recurrent-state hand-off of linear mixers (conv halo and state, rank to rank in
  sequence order).
"""

from automodel.distributed.cp.exchange.gather import (
    GatherKV,
    TokenGather,
    all_gather_tokens,
    gather_kv,
    reduce_scatter_tokens,
)
from automodel.distributed.cp.exchange.halo import HaloPlan, QueryBlock, halo_exchange, lower_bounds
from automodel.distributed.cp.exchange.p2p import LendTable, batch_p2p, give_back, lend
from automodel.distributed.cp.exchange.state import per_document, recv_state, send_state

__all__ = [
    "GatherKV",
    "HaloPlan",
    "LendTable",
    "QueryBlock",
    "TokenGather",
    "all_gather_tokens",
    "batch_p2p",
    "gather_kv",
    "give_back",
    "halo_exchange",
    "lend",
    "lower_bounds",
    "per_document",
    "recv_state",
    "reduce_scatter_tokens",
    "send_state",
]
