"""Let torch's own ring attention run on CPU (gloo).

torch's ``context_parallel`` (2.11 .. 2.15) dispatches SDPA on sequence-sharded DTensors to its
ring attention (``_templated_ring_attention`` and its backward) only for the CUDA kernels (flash,
efficient, cuDNN). On CPU, ``F.scaled_dot_product_attention`` lowers to
``aten._scaled_dot_product_flash_attention_for_cpu``, which has no sharding strategy, so every
CPU run dies in DTensor sharding propagation.

This module registers that op and its backward with the *same* ring implementation:

- a sharding strategy (all-replicate, or everything ``Shard(2)`` = the sequence dim) so DTensor
  propagation accepts the sequence-sharded q/k/v that ``context_parallel`` produces;
- a custom DTensor handler that unwraps the local shards and calls
  ``_templated_ring_attention`` / ``_templated_ring_attention_backward`` with the CPU kernels.

Nothing is copied from torch's ring: the math (head-tail load balancing, LSE merging, the kv and
dkv rotation) is torch's. :func:`cpu_ring_attention` installs both pieces for the duration of a
``with`` block and must be entered *before* torch's ``context_parallel`` (which snapshots the
custom handlers on entry). :func:`automodel.distributed.cp.ring.batch.create_context_parallel_ctx`
does this automatically when the CP mesh is on CPU.

Communication: inside the ``with`` block the k/v and dk/dv rotation is *synchronous*. torch's
rotaters (``_AllGatherRotater`` / ``_AllToAllRotater``) issue asynchronous functional collectives
(``_c10d_functional.all_gather_into_tensor`` / ``all_to_all_single``, waited later through
``wait_tensor``), and the ring backward keeps two of them in flight at once on the same gloo group
(the k/v all-gather and the dk/dv all-to-all), each running on a gloo worker thread while the
Python thread allocates, computes and frees tensors. The buffers are owned by the gloo work objects
and the functional-collective registry, not by the ring's code, so whether every one of them stays
alive and untouched until its collective completes depends on that machinery; one run of the
default recipe in 18 died in the ring backward with ``malloc(): unaligned tcache chunk detected``
(issue 7). ``scripts/soak.sh`` reproduced it with torch's rotaters (1 of 21 runs under heavy load,
glibc malloc checks on): glibc found its heap already corrupted when ``_AllToAllRotater
.exchange_buffers`` (``permute_tensor`` -> ``_c10d_functional.all_to_all_single``) allocated in the
ring backward, i.e. memory had been written after it was freed while collectives were in flight.
:class:`_SyncRotater` removes the question: ``exchange_buffers`` runs a blocking
``dist.all_to_all_single`` (send to rank+1, receive from rank-1) whose input and output are Python
locals held by the call itself, and returns only after gloo has finished with both; no collective
is ever in flight while any other code runs, so no buffer can be freed, reused or read before its
collective completes. The math is unchanged (the same k/v block arrives at every ring step as with
either of torch's rotaters, for both ``set_rotate_method`` values). The cost is the lost overlap of
communication and compute: ``scripts/bench_ring_rotation.py`` (both rotations interleaved step by
step, 2 gloo ranks, ``[1, 8, S, 64]`` fp32 fwd+bwd, attention alone) measured sync / torch =
1.02-1.14 at S=2048, 1.04 at S=4096 and 1.02 at S=8192 on a heavily shared 2-core machine (load
17-45; issue 7's note); a training step also spends time outside attention, so costs less.

Precision: torch's ring upcasts each partial output and LSE to fp32 before merging
(``_cp_options.convert_to_f32``). That is right for bf16/fp16 but would silently *downcast* fp64
inputs, so for fp64 q/k/v the handler merges in fp64 instead.

This touches private torch symbols. They are resolved, per torch version, in
:mod:`automodel.distributed.torch_internals` (torch 2.11 .. 2.13 register the sharding rule as an op
strategy, 2.14+ as a single-dim strategy; the placements and the ring calls are the same); when one
is missing, :func:`check_cpu_ring_support` raises a ``RuntimeError`` naming the torch version and
the symbol.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from automodel.distributed.torch_internals import (
    cp_attention_module,
    cp_options,
    cpu_flash_attention_ops,
    dtensor_op_dispatcher,
    missing_torch_internals,
    require,
    seq_shard_strategy_context,
    templated_ring_attention,
    templated_ring_attention_backward,
)

__all__ = ["check_cpu_ring_support", "cpu_ring_attention", "cpu_ring_supported"]

_FEATURE = "ring context parallelism on CPU"
_SEQ_DIM = 2  # [B, H, S, D]


def cpu_ring_supported() -> bool:
    """True when this torch exposes every private symbol the CPU ring needs."""
    return not missing_torch_internals(_FEATURE)


def check_cpu_ring_support() -> None:
    """Raise ``RuntimeError`` naming the torch version and the missing symbols, if any."""
    require(_FEATURE)


# ---------------------------------------------------------------------------------------------
# sharding strategies: (out, lse, q, k, v) and (dq, dk, dv, grad_out, q, k, v, out, lse) are all
# replicated or all sharded on the sequence (torch_internals.seq_shard_strategy_context)
# ---------------------------------------------------------------------------------------------
_MASK_MESSAGE = (
    "ring context parallelism got an explicit attention mask (attn_mask); the ring computes plain "
    "causal attention only. Pass no attention_mask (padding at the end of a row with labels=-100 is "
    "exact for causal attention), or use the packed THD path (use_te=True) or Ulysses CP "
    "(distributed.cp_method=ulysses) for masks and packed documents"
)


# ---------------------------------------------------------------------------------------------
# the DTensor handler: unwrap, run torch's ring with the CPU kernels, wrap
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _merge_precision(dtype: torch.dtype) -> Iterator[None]:
    """Merge partial results in fp64 when the inputs are fp64 (torch's ring would use fp32)."""
    options = cp_options()
    old = options.convert_to_f32
    if dtype == torch.float64:
        options.convert_to_f32 = False
    try:
        yield
    finally:
        options.convert_to_f32 = old


def _run_ring(ring: Any, op: Any, mesh: Any, query: torch.Tensor, attn_mask: Any, **kwargs: Any) -> Any:
    """torch's ring function ``ring`` (forward or backward) over ``mesh`` with the CPU kernel ``op``."""
    if attn_mask is not None:
        raise ValueError(_MASK_MESSAGE)
    with _merge_precision(query.dtype):
        return ring(mesh.get_group(), _SEQ_DIM, op, query=query, dropout_p=0.0, **kwargs)


def _ring_forward(
    mesh: Any, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None
):
    if dropout_p and attn_mask is None:
        raise ValueError(
            f"ring context parallelism got attention dropout_p={dropout_p}; set attention dropout to 0"
        )
    return _run_ring(
        templated_ring_attention(), cpu_flash_attention_ops()[0], mesh, query, attn_mask,
        key=key, value=value, is_causal=is_causal, scale=scale,
    )


def _ring_backward(
    mesh: Any,
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    dropout_p,
    is_causal,
    *,
    attn_mask=None,
    scale=None,
):
    return _run_ring(
        templated_ring_attention_backward(), cpu_flash_attention_ops()[1].default, mesh, query, attn_mask,
        grad_out=grad_out, grad_out_name="grad_out", key=key, value=value, out=out, logsumexp=logsumexp,
        is_causal=is_causal, scale=scale,
    )


class _SyncRotater:
    """Blocking ring rotation: each call of :meth:`exchange_buffers` sends to rank+1, receives from rank-1.

    The protocol of torch's ``_RingRotater``: ``exchange_buffers(buf)`` hands this rank's flat
    buffer (k and v, or dk and dv, concatenated) to the next rank, ``next_buffer()`` returns the
    previous rank's. Here ``exchange_buffers`` completes the exchange before it returns
    (``dist.all_to_all_single`` with ``async_op=False``; on gloo/CPU its ``wait`` returns once the
    data is in ``recv``), so:

    - the send buffer is a local of this call, referenced until after the collective completed;
    - the receive buffer is allocated here and handed out only by :meth:`next_buffer`, after the
      collective completed (it is then owned by the caller, never touched again by this object);
    - nothing is in flight between calls, so freeing or reusing any tensor afterwards is safe.
    """

    def __init__(self, pg: Any, seq_dim: int) -> None:
        import torch.distributed as dist

        self._pg = pg
        self._seq_dim = seq_dim
        self._rank = dist.get_rank(pg)
        self._size = dist.get_world_size(pg)
        self._received: torch.Tensor | None = None

    def exchange_buffers(self, curr_buffer: torch.Tensor) -> None:
        """Send ``curr_buffer`` (flat, any dtype) to rank+1 and receive rank-1's into a new tensor. Blocks."""
        import torch.distributed as dist

        send = curr_buffer.contiguous()
        recv = torch.empty_like(send)
        n = send.numel()
        in_splits = [0] * self._size
        out_splits = [0] * self._size
        in_splits[(self._rank + 1) % self._size] = n
        out_splits[(self._rank - 1) % self._size] = n
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self._pg, async_op=False)
        self._received = recv

    def next_buffer(self) -> torch.Tensor:
        """The buffer received by the last :meth:`exchange_buffers` (complete; owned by the caller)."""
        if self._received is None:
            raise RuntimeError("ring rotation: next_buffer() called before exchange_buffers()")
        received, self._received = self._received, None
        return received


def _sync_create_rotater(pg: Any, seq_dim: int, method: Any = None) -> _SyncRotater:
    """Stands in for torch's ``_create_rotater`` inside :func:`cpu_ring_attention` (any ``method``)."""
    return _SyncRotater(pg, seq_dim)


def _handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    dispatcher = dtensor_op_dispatcher()
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise RuntimeError(
            f"ring context parallelism on CPU expected q/k/v sharded on the sequence dim for {op_call}; "
            "got a layout that needs redistribution"
        )
    fn = _ring_forward if op_call == cpu_flash_attention_ops()[0].default else _ring_backward
    local = fn(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(tuple(local), output_sharding.output_spec)


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """Route CPU SDPA on sequence-sharded DTensors to torch's ring attention, inside this block.

    Enter it *before* ``torch.distributed.tensor.experimental.context_parallel`` (which copies the
    custom op handlers when it starts). Re-entrant: nested uses are no-ops. Mutates torch's private
    CP handler table, DTensor's sharding-strategy registry and the ring's rotater factory
    (``_create_rotater``: synchronous rotation, see the module docstring); restores all three on exit.

    Raises:
        RuntimeError: this torch lacks a private symbol the CPU ring needs (see module docstring).
    """
    global _depth
    check_cpu_ring_support()
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return

    attn = cp_attention_module()
    fwd, bwd = (packet.default for packet in cpu_flash_attention_ops())

    def mask_error() -> Exception:
        return NotImplementedError(_MASK_MESSAGE)

    with contextlib.ExitStack() as stack:
        # (out, lse) from (q, k, v); dropout_p onwards is in the sharding cache key
        stack.enter_context(
            seq_shard_strategy_context(
                fwd,
                seq_dim=_SEQ_DIM,
                num_outputs=2,
                num_tensor_inputs=3,
                static_argnum=3,
                arity_error=mask_error,
            )
        )
        # (dq, dk, dv) from (grad_out, q, k, v, out, lse)
        stack.enter_context(
            seq_shard_strategy_context(
                bwd,
                seq_dim=_SEQ_DIM,
                num_outputs=3,
                num_tensor_inputs=6,
                static_argnum=6,
                arity_error=mask_error,
                validate_mesh=False,
            )
        )
        saved = {op: attn.custom_ops.get(op) for op in (fwd, bwd)}
        attn.custom_ops.update({fwd: _handler, bwd: _handler})
        saved_rotater = attn._create_rotater
        attn._create_rotater = _sync_create_rotater  # see "Communication" in the module docstring
        _depth = 1
        try:
            yield
        finally:
            _depth = 0
            attn._create_rotater = saved_rotater
            for op, old in saved.items():
                if old is None:
                    attn.custom_ops.pop(op, None)
                else:
                    attn.custom_ops[op] = old


_depth = 0
