"""A toy CP method, registered by a test: proves that a new method is one module plus one registry entry.

``toy_ring_a2a`` is ring attention with the all-to-all K/V rotation, declared from scratch on the
:class:`~automodel.distributed.cp.CPMethod` interface (it does not subclass the ring method). Nothing
outside this file and the :func:`~automodel.distributed.cp.register_cp_method` call knows it: the
config rules, the trainer, the self-check, the dry run and the memory planner run it through the
interface (tests/test_recipe_parity.py).
"""

from __future__ import annotations

import functools
from typing import Any

from automodel.distributed.cp import CPMethod, LayerSpec, register_cp_method
from automodel.distributed.cp.method import standard_problem

NAME = "toy_ring_a2a"


class ToyRingAllToAll(CPMethod):
    name = NAME
    summary = "toy: ring attention with all-to-all K/V rotation"
    attn_implementations = ("sdpa",)
    chunks_per_rank = 2
    layout = "head_tail"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(self.name, layer, seq_len)

    def _batch_function(self):  # noqa: ANN202
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        return functools.partial(make_cp_batch_and_ctx, cp_rotate_method="alltoall")

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        kv = d.kv_heads * d.head_dim / r.tp
        return r.local_tokens * 6 * kv * r.compute_bytes, "toy: K/V blocks in flight"


def register() -> CPMethod:
    """Register the toy method (idempotent: a worker process may call it for several runs)."""
    return register_cp_method(ToyRingAllToAll(), replace=True)
