"""The public context-parallel (CP) API.

Names and signatures follow NVIDIA NeMo AutoModel's ``cp_utils`` so code written against them works
unchanged. Behaviour differs where the reference is unsafe, and the docstrings say so:

- a non-trivial ``attention_mask`` is a ``ValueError`` on the ring path (the reference drops it
  silently, which changes results);
- a sequence length not divisible by ``2 * cp_size`` is a ``ValueError`` (torch would silently
  turn load balancing off);
- packed multi-document rows are a ``ValueError`` on the ring path (ring attention would attend
  across documents); they belong to the THD path (``use_te=True``);
- with no CP the batch is returned untouched (a true no-op).

Typical use::

    train_ctx, batch = make_cp_batch_and_ctx(device_mesh, batch)
    with train_ctx():            # shards batch tensors in place on entry
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = token_loss_sum(logits, batch["labels"]) / global_label_tokens
        loss.backward()

The ring runs on CUDA (torch's flash / efficient / cuDNN kernels) and on CPU with gloo
(:mod:`automodel.distributed.cpu_ring`), so the same code path is tested in CI without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from automodel.distributed.cpu_ring import check_cpu_ring_support, cpu_ring_attention
from automodel.distributed.hf_causal_mask import no_packed_sequence_detection
from automodel.distributed.te_batch import _shard_thd_chunk_for_te, make_cp_batch_for_te

__all__ = [
    "_build_position_ids",
    "_shard_thd_chunk_for_te",
    "create_context_parallel_ctx",
    "get_cp_mesh",
    "get_train_context",
    "make_cp_batch_and_ctx",
    "make_cp_batch_for_te",
]

ROTATE_METHODS = ("allgather", "alltoall")
# Keys the ring path shards along the sequence. Everything else of shape [B, S] is an error.
_RING_SHARDED_KEYS = ("input_ids", "labels", "position_ids", "loss_mask", "padding_mask")


def get_cp_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The ``cp`` sub-mesh of ``device_mesh``, or ``None`` if there is no mesh or no ``cp`` dim."""
    if device_mesh is None:
        return None
    names = device_mesh.mesh_dim_names or ()
    if "cp" not in names:
        return None
    return device_mesh["cp"] if len(names) > 1 else device_mesh


def _build_position_ids(batch: dict[str, Any], device: torch.device | str) -> torch.Tensor:
    """Return ``batch["position_ids"]``, first setting it to ``arange(S)`` as ``[1, S]`` int64 if absent.

    Mutates ``batch`` (adds ``position_ids``) when it had none, like the reference.
    """
    if batch.get("position_ids") is None:
        seq_len = batch["input_ids"].shape[1]
        batch["position_ids"] = torch.arange(seq_len, device=device, dtype=torch.long).unsqueeze(0)
    return batch["position_ids"]


def get_train_context(
    enable_loss_parallel: bool,
    enable_compiled_autograd: bool,
    cp_context: contextlib.AbstractContextManager | None = None,
) -> Callable[[], contextlib.AbstractContextManager]:
    """Return a factory of the context every forward+backward runs in: ``with train_ctx(): ...``.

    Args:
        enable_loss_parallel: enter ``torch.distributed.tensor.parallel.loss_parallel()`` (TP with a
            sharded vocabulary).
        enable_compiled_autograd: enter compiled autograd (``torch._dynamo`` must be usable).
        cp_context: a context from :func:`create_context_parallel_ctx` (single use: each CP batch
            needs a fresh one, which :func:`make_cp_batch_and_ctx` provides).
    """

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if enable_loss_parallel:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if enable_compiled_autograd:
                from torch._dynamo.utils import maybe_enable_compiled_autograd

                stack.enter_context(maybe_enable_compiled_autograd(True))
            if cp_context is not None:
                stack.enter_context(cp_context)
            yield

    return context


def create_context_parallel_ctx(
    cp_mesh: DeviceMesh,
    cp_buffers: list[torch.Tensor],
    cp_seq_dims: list[int],
    cp_no_restore_buffers: set[torch.Tensor],
    cp_rotate_method: str | None = None,
) -> contextlib.AbstractContextManager:
    """A single-use context that shards ``cp_buffers`` in place and runs SDPA as ring attention.

    On entry every buffer is reordered head-tail (rank r keeps chunks r and 2W-1-r of 2W equal
    chunks, W = ``cp_mesh.size()``) and cut to this rank's ``S / W`` tokens along its
    ``cp_seq_dims`` entry — the tensors themselves are resized (mutated). Inside, SDPA calls are
    ring attention over ``cp_mesh``; on a CPU mesh the CPU kernels are registered
    (:mod:`automodel.distributed.cpu_ring`); transformers' packed-sequence detection is off
    (:mod:`automodel.distributed.hf_causal_mask`). On exit buffers not in
    ``cp_no_restore_buffers`` get their full contents back, and the rotate method is restored.

    Args:
        cp_mesh: 1-D CP mesh.
        cp_buffers: tensors to shard (not parameters, not requiring grad), all on one device.
        cp_seq_dims: the sequence dim of each buffer.
        cp_no_restore_buffers: subset of ``cp_buffers`` left sharded after the block.
        cp_rotate_method: ``"allgather"`` (default) or ``"alltoall"`` — how K/V shards travel.

    Raises:
        ValueError: unknown rotate method; mismatched lists; a buffer whose sequence length is not
            divisible by ``2 * cp_size`` (torch would silently disable load balancing).
    """
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    method = cp_rotate_method or "allgather"
    if method not in ROTATE_METHODS:
        raise ValueError(f"cp_rotate_method={cp_rotate_method!r} is not one of {ROTATE_METHODS}")
    if len(cp_buffers) != len(cp_seq_dims):
        raise ValueError(
            f"got {len(cp_buffers)} cp_buffers but {len(cp_seq_dims)} cp_seq_dims; give one dim per buffer"
        )
    cp_size = cp_mesh.size()
    for i, (buf, dim) in enumerate(zip(cp_buffers, cp_seq_dims)):
        if buf.shape[dim] % (2 * cp_size):
            raise ValueError(
                f"cp_buffers[{i}] has sequence length {buf.shape[dim]} (dim {dim}), not divisible by "
                f"2*cp_size={2 * cp_size}; pad the sequence to a multiple of {2 * cp_size} "
                f"(data.pad_to_multiple_of={2 * cp_size})"
            )
    on_cpu = cp_mesh.device_type == "cpu"
    if on_cpu:
        check_cpu_ring_support()

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        previous = _cp_options.rotate_method
        set_rotate_method(method)
        try:
            with contextlib.ExitStack() as stack:
                if on_cpu:
                    stack.enter_context(cpu_ring_attention())
                stack.enter_context(no_packed_sequence_detection())
                stack.enter_context(
                    context_parallel(
                        cp_mesh,
                        buffers=cp_buffers,
                        buffer_seq_dims=cp_seq_dims,
                        no_restore_buffers=cp_no_restore_buffers,
                    )
                )
                yield
        finally:
            _cp_options.rotate_method = previous

    return context()


def _validate_ring_batch(batch: dict[str, Any], cp_size: int) -> None:
    """Raise ``ValueError`` for anything the ring path cannot compute exactly."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        shape = getattr(input_ids, "shape", type(input_ids).__name__)
        raise ValueError(f"batch['input_ids'] must be a [B, S] tensor for ring CP; got {shape}")
    if "labels" not in batch:
        raise ValueError(
            "batch has no 'labels'; ring CP needs [B, S] labels (already shifted, -100 = ignore)"
        )
    bsz, seq_len = input_ids.shape
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp_size={2 * cp_size}; "
            f"set data.pad_to_multiple_of={2 * cp_size} (pad at the end of each row with labels=-100)"
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError(
            "ring context parallelism computes plain causal attention and cannot take an attention_mask "
            "with zeros; right-pad rows and set the padded labels to -100 (exact for causal attention) "
            "and drop the mask, or use the packed THD path (use_te=True) or Ulysses CP "
            "(distributed.cp_method=ulysses)"
        )
    seq_lens = batch.get("seq_lens")
    if isinstance(seq_lens, torch.Tensor) and seq_lens.ndim == 2 and bool(((seq_lens > 0).sum(-1) > 1).any()):
        raise ValueError(
            "batch has packed rows (several sequences per row in 'seq_lens'); ring CP would attend across "
            "documents. Use the THD path (make_cp_batch_and_ctx(..., use_te=True)) or Ulysses CP"
        )
    pos = batch.get("position_ids")
    if pos is not None and not (
        (pos.ndim == 2 and pos.shape[-1] == seq_len and pos.shape[0] in (1, bsz))
        or (pos.ndim == 3 and pos.shape[-1] == seq_len)
    ):
        raise ValueError(
            f"batch['position_ids'] has shape {tuple(pos.shape)}; expected [B, S], [1, S] or mRoPE "
            f"[3, B, S] with S={seq_len}"
        )
    for key, value in batch.items():
        if key in _RING_SHARDED_KEYS or key in ("attention_mask", "seq_lens", "seq_lens_padded"):
            continue
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (bsz, seq_len):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)} and looks sequence-shaped, but ring CP "
                f"only shards {_RING_SHARDED_KEYS}; remove it from the batch or shard it yourself"
            )


def make_cp_batch_and_ctx(
    device_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    use_te: bool = False,
    padding_token_id: int = 0,
    num_chunks: int = 1,
    seq_lens_padding_value: int = -1000,
    cp_rotate_method: str | None = None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]:
    """Prepare ``batch`` for context parallelism over ``device_mesh["cp"]``.

    Args:
        device_mesh: full mesh with a ``cp`` dim (or a 1-D ``cp`` mesh), or ``None``.
        batch: ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` int64 (already shifted,
            -100 ignored), optional ``position_ids`` (``[B, S]``/``[1, S]`` int64, or mRoPE
            ``[3, B, S]``), ``loss_mask`` / ``padding_mask`` ``[B, S]``, ``attention_mask`` ``[B, S]``
            (must be all ones on the ring path), ``seq_lens``/``seq_lens_padded`` ``[B, P]`` (THD).
        loss_mask: optional ``[B, S]`` mask sharded with the batch (reference signature).
        use_te: take the THD path (:func:`make_cp_batch_for_te`): the batch becomes flat THD
            tensors sharded with Transformer Engine's partition; the context is a no-op.
        padding_token_id, num_chunks, seq_lens_padding_value: THD path only.
        cp_rotate_method: ring path: ``"allgather"`` (default) or ``"alltoall"`` (an addition to
            the reference signature; see :func:`create_context_parallel_ctx`).

    Returns:
        ``(train_ctx, batch)``. Without CP (no mesh, no ``cp`` dim, cp size 1) and ``use_te=False``:
        ``(contextlib.nullcontext, batch)`` with ``batch`` the very same object, untouched.
        Ring path (cp > 1): a new dict with copies of the sequence tensors (``position_ids``
        ``[1, S]`` added if missing; an all-ones ``attention_mask`` dropped); the caller's batch
        and tensors are not modified. Entering ``with train_ctx():`` shards the returned
        ``input_ids``, ``labels``, ``position_ids``, ``loss_mask`` and ``padding_mask`` **in place**
        to this rank's ``S / cp`` tokens (head-tail order: chunks r and 2*cp-1-r of 2*cp) and they
        stay sharded after the block; the model's SDPA calls inside are ring attention.
        ``train_ctx`` is single use. Count label tokens for the loss normaliser *before* entering.

    Raises:
        ValueError: on the ring path, a sequence length not divisible by ``2 * cp_size``, an
            attention mask with zeros, packed rows, or an unknown sequence-shaped tensor.
    """
    cp_mesh = get_cp_mesh(device_mesh)
    if use_te:
        return contextlib.nullcontext, make_cp_batch_for_te(
            cp_mesh,
            batch,
            padding_token_id=padding_token_id,
            num_chunks=num_chunks,
            seq_lens_padding_value=seq_lens_padding_value,
        )
    if cp_mesh is None or cp_mesh.size() == 1:
        return contextlib.nullcontext, batch

    cp_size = cp_mesh.size()
    _validate_ring_batch(batch, cp_size)
    # Own copies: the context shards its buffers in place, the caller's tensors stay whole.
    batch = {
        k: (v.clone() if k in _RING_SHARDED_KEYS and isinstance(v, torch.Tensor) else v)
        for k, v in batch.items()
    }
    batch.pop("attention_mask", None)  # all ones (validated): plain causal attention
    input_ids = batch["input_ids"]
    position_ids = _build_position_ids(batch, input_ids.device)
    if not position_ids.is_contiguous():
        position_ids = batch["position_ids"] = position_ids.contiguous()
    if loss_mask is not None:
        batch["loss_mask"] = loss_mask

    buffers: list[torch.Tensor] = []
    seq_dims: list[int] = []
    seen: set[int] = set()
    for key in _RING_SHARDED_KEYS:
        tensor = batch.get(key)
        if tensor is None or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        buffers.append(tensor)
        seq_dims.append(2 if (key == "position_ids" and tensor.ndim == 3) else 1)
    ctx = create_context_parallel_ctx(
        cp_mesh=cp_mesh,
        cp_buffers=buffers,
        cp_seq_dims=seq_dims,
        cp_no_restore_buffers=set(buffers),
        cp_rotate_method=cp_rotate_method,
    )
    return get_train_context(False, False, ctx), batch
