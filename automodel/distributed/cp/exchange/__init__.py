"""How CP ranks exchange tokens and states, each exchange written once (autograd-correct).

- :mod:`.halo`: the halo exchange: only the K/V rows a rank's queries reach and another rank holds
  (``all_to_all_single`` with per-peer splits, from a :class:`~.halo.HaloPlan`); the backward returns the
  halo's dK/dV to their owners;
- :mod:`.state`: the recurrent-state hand-off of linear mixers (conv halo and state, rank to rank in
  sequence order).
"""

from automodel.distributed.cp.exchange.halo import HaloPlan, QueryBlock, halo_exchange, lower_bounds
from automodel.distributed.cp.exchange.state import per_document, recv_state, send_state

__all__ = [
    "HaloPlan",
    "QueryBlock",
    "halo_exchange",
    "lower_bounds",
    "per_document",
    "recv_state",
    "send_state",
]
