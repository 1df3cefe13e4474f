"""One batched point-to-point exchange with shape headers, acknowledgements and a timeout.

Every message travels in (up to) three phases, each one ``batch_isend_irecv`` over all of this rank's peers:

1. **headers**: a fixed-size int64 header (dtype, the activation's global shape, its original ndim);
2. **acks**: each receiver validates every header it got (``resolve``) and answers 0 (accept) or 1
   (reject) to each sender; a rejecting receiver raises ``ValueError`` with the reason, and each of its
   senders raises ``ValueError`` naming the receiver, so a mismatch fails fast on both sides
   instead of hanging in a receive of the wrong size. A message whose header equals the one both
   ends remember accepting (``known``, kept by the caller from ``delivered`` messages) skips this
   round: in the steady state of a training loop an exchange is two rounds, not three;
3. **payloads**: the tensors themselves, sized by the plan both sides computed from the header.
   A rank that raises still sends what was accepted and drains what it could not refuse, so no
   peer is left waiting.

Every wait has a timeout (``TimeoutError`` names the peers). Messages to oneself never reach this
function's wire: the caller pre-fills their header and ``local`` tensor.
Both sides of a pair must post the same messages in the same exchange (as with Megatron's
``send_forward_recv_backward`` paired with ``send_backward_recv_forward``): gloo and NCCL sends wait
for the matching receive. Works with gloo (CPU tensors) and NCCL (CUDA tensors: pass ``device``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["HEADER_LEN", "Incoming", "Outgoing", "decode_header", "encode_header", "exchange"]

_MAGIC = 0x4D4D5050  # "MMPP"
_MAX_DIMS = 8
HEADER_LEN = 4 + _MAX_DIMS
_DTYPES = [
    torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool, torch.uint8,
]  # fmt: skip


def encode_header(global_shape: tuple[int, ...], dtype: torch.dtype, orig_ndim: int) -> list[int]:
    """Header ints: magic, dtype code, original ndim, ndim, then the global shape padded with -1."""
    if dtype not in _DTYPES:
        raise TypeError(f"pipeline activations must be one of {_DTYPES}, got {dtype}")
    if len(global_shape) > _MAX_DIMS:
        raise ValueError(f"pipeline activations may have at most {_MAX_DIMS} dims, got shape {global_shape}")
    shape = [int(s) for s in global_shape]
    return [_MAGIC, _DTYPES.index(dtype), orig_ndim, len(shape), *shape, *[-1] * (_MAX_DIMS - len(shape))]


def decode_header(values: list[int]) -> tuple[tuple[int, ...], torch.dtype, int]:
    """``(global_shape, dtype, orig_ndim)`` from :func:`encode_header`'s ints. ``ValueError`` on garbage."""
    if len(values) != HEADER_LEN or values[0] != _MAGIC or not 0 <= values[1] < len(_DTYPES):
        raise ValueError(f"corrupt pipeline header {values}: the peers disagree on the message order")
    nd = values[3]
    return tuple(values[4 : 4 + nd]), _DTYPES[values[1]], values[2]


@dataclass
class Outgoing:
    """A message this rank sends: ``header`` ints now, ``payload`` (or ``None``: nothing to send) after acks."""

    peer: int
    header: list[int]
    payload: torch.Tensor | None
    what: str  # e.g. "activation of 'vision' -> 'llm'", for error messages
    known: list[int] | None = None  # the header this peer accepted for this message last time
    delivered: bool = False  # set once the payload has gone


@dataclass
class Incoming:
    """A message this rank receives; ``header`` and ``payload`` are filled in by :func:`exchange`."""

    peer: int
    what: str
    header: list[int] | None = None
    payload: torch.Tensor | None = None
    local: torch.Tensor | None = None  # a message from this rank to itself: pre-filled header and tensor
    known: list[int] | None = None  # the header accepted for this message last time ...
    known_spec: tuple[tuple[int, ...], torch.dtype] | None = None  # ... and its payload shape and dtype
    delivered: bool = False  # set once the payload has arrived


#: ``resolve(incoming)`` checks the received headers and returns ``(problems, payload_specs)``:
#: one ``(shape, dtype)`` per incoming message, in order, when there are no problems.
Resolver = Callable[[list[Incoming]], tuple[list[str], list[tuple[tuple[int, ...], torch.dtype]]]]


def _tags(peers: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    tags = []
    for p in peers:
        tags.append(seen.get(p, 0))
        seen[p] = tags[-1] + 1
    return tags


def _run(ops: list[tuple], timeout: float, me: int, phase: str, group: dist.ProcessGroup | None) -> None:
    """Post (isend/irecv, tensor, global peer rank, tag) ops as one batch and wait for all of them."""
    if not ops:
        return
    p2p = [dist.P2POp(fn, t, peer, group=group, tag=tag) for fn, t, peer, tag in ops]
    works = dist.batch_isend_irecv(p2p)
    peers = sorted({peer for _, _, peer, _ in ops})
    try:
        for w in works:
            w.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise TimeoutError(
            f"rank {me}: the pipeline {phase} exchange with rank(s) {peers} did not complete within {timeout:.0f}s "
            f"({e}); a peer failed, is in another call, or posted different messages (pair combined calls "
            "send_forward_recv_backward <-> send_backward_recv_forward)"
        ) from e


def exchange(
    outgoing: list[Outgoing],
    incoming: list[Incoming],
    resolve: Resolver,
    *,
    device: torch.device,
    timeout: float,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Run the phases for ``outgoing`` and ``incoming``; fills every ``Incoming.payload``.

    Mutates ``incoming`` (``header``, ``payload``) and sets ``delivered`` on every message that moved. Raises ``ValueError`` when ``resolve`` finds a
    problem (after rejecting the senders) or when a receiver rejected one of ``outgoing``; raises
    ``TimeoutError`` when a phase does not finish in ``timeout`` seconds. Peers are global ranks;
    ``group`` (default: the default group) carries the messages.
    """
    me = dist.get_rank()
    if any(m.peer == me for m in outgoing):
        raise RuntimeError(f"rank {me}: messages to itself must be delivered by the caller, not sent")
    remote_out = outgoing
    remote_in = [m for m in incoming if m.peer != me]
    local_in = [m for m in incoming if m.peer == me]

    # phase 1: headers
    out_tags = _tags([m.peer for m in remote_out])
    in_tags = _tags([m.peer for m in remote_in])
    hdr_bufs = [torch.zeros(HEADER_LEN, dtype=torch.int64, device=device) for _ in remote_in]
    ops = [
        (dist.isend, torch.tensor(m.header, dtype=torch.int64, device=device), m.peer, tag)
        for m, tag in zip(remote_out, out_tags)
    ] + [(dist.irecv, buf, m.peer, tag) for m, buf, tag in zip(remote_in, hdr_bufs, in_tags)]
    _run(ops, timeout, me, "header", group)
    for m, buf in zip(remote_in, hdr_bufs):
        m.header = [int(v) for v in buf.tolist()]
    problems, specs = resolve(incoming)

    # phase 2: acks (0 = accepted, 1 = rejected), only for messages whose header differs from the one
    # accepted last time; both ends of a message see the same header and the same memory of it
    fast_out = [m.known is not None and m.header == m.known for m in remote_out]
    fast_in = [m.known is not None and m.header == m.known for m in remote_in]
    slow_out = [m for m, f in zip(remote_out, fast_out) if not f]
    slow_in = [m for m, f in zip(remote_in, fast_in) if not f]
    verdict = 1 if problems else 0
    ack_in = [torch.zeros(1, dtype=torch.int64, device=device) for _ in slow_out]
    ack_out_tags, ack_in_tags = _tags([m.peer for m in slow_in]), _tags([m.peer for m in slow_out])
    ops = [
        (dist.isend, torch.full((1,), verdict, dtype=torch.int64, device=device), m.peer, tag)
        for m, tag in zip(slow_in, ack_out_tags)
    ] + [(dist.irecv, buf, m.peer, tag) for m, buf, tag in zip(slow_out, ack_in, ack_in_tags)]
    _run(ops, timeout, me, "acknowledgement", group)
    acks = iter(ack_in)
    send_ok = [True if f else int(next(acks).item()) == 0 for f in fast_out]
    rejected = [m for m, ok in zip(remote_out, send_ok) if not ok]

    # phase 3: payloads; on a problem, still send what was accepted and drain what cannot be refused
    # (an unchanged header is never acknowledged), so no peer is left waiting
    if not problems:
        for m, (shape, dtype) in zip(incoming, specs):
            m.payload = torch.empty(shape, dtype=dtype, device=device)
    recv_ok = [not problems or f for f in fast_in]
    for m, ok in zip(remote_in, recv_ok):
        if ok and m.payload is None:
            shape, dtype = m.known_spec  # type: ignore[misc]
            m.payload = torch.empty(shape, dtype=dtype, device=device)
    sends = [(m, tag) for m, tag, ok in zip(remote_out, out_tags, send_ok) if ok]
    missing = [m.what for m, _ in sends if m.payload is None]
    if missing:
        raise RuntimeError(f"rank {me}: receivers accepted {missing} but there is no payload to send")
    recvs = [(m, tag) for m, tag, ok in zip(remote_in, in_tags, recv_ok) if ok]
    ops = [(dist.isend, m.payload.contiguous(), m.peer, tag) for m, tag in sends] + [
        (dist.irecv, m.payload, m.peer, tag) for m, tag in recvs
    ]
    _run(ops, timeout, me, "payload", group)
    for m, _ in sends + recvs:  # type: ignore[operator]
        m.delivered = True
    if problems:
        raise ValueError(f"rank {me} rejected what it received: " + "; ".join(problems))
    if rejected:
        shapes = ", ".join(f"{m.what} to rank {m.peer} (global shape {decode_header(m.header)[0]})" for m in rejected)
        raise ValueError(f"rank {me}: the receiver rejected {shapes}; the receiving rank's error names the reason")
    for m in local_in:
        if tuple(m.payload.shape) != tuple(m.local.shape):
            raise RuntimeError(
                f"rank {me}: local message {m.what} has shape {tuple(m.local.shape)}, "
                f"the plan expects {tuple(m.payload.shape)}"
            )
        m.payload.copy_(m.local)
