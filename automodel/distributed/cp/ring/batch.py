"""The public context-parallel (CP) API: ring CP's batch path (re-exported by ``automodel.distributed.cp_utils``).

Names and signatures follow NVIDIA NeMo AutoModel's ``cp_utils`` so code written against them works
unchanged. Behaviour differs where the reference is unsafe, and the docstrings say so:

- a non-trivial ``attention_mask`` is a ``ValueError`` on the ring path (the reference drops it
  silently, which changes results);
- a sequence length not divisible by ``2 * cp_size`` is padded at the end of each row, exactly
  (as NeMo AutoModel 0.5+ does; older releases and torch itself silently turned load balancing
  off instead);
- ``inputs_embeds [B, S, H]`` may replace ``input_ids`` (as in NeMo AutoModel 0.5+), sharded with
  autograd so its gradient reaches whatever produced it (a vision tower, the embedding);
- packed multi-document rows are a ``ValueError`` on the ring path (ring attention would attend
  across documents); they belong to the THD path (``use_te=True``);
- with no CP the batch is returned untouched; on packed rows (restarting ``position_ids``, ``seq_lens``)
  the context then probes the model at its first forward and refuses one whose own forward mixes the
  documents (:func:`~automodel.distributed.cp.separation.own_forward_on_packed_rows`); with CP a new dict
  holding its own copies is returned and the caller's batch is never modified;
- :func:`_build_position_ids` returns the batch, as the reference does.

Typical use::

    train_ctx, batch = make_cp_batch_and_ctx(device_mesh, batch)
    with train_ctx():            # shards the returned batch's tensors on entry
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = token_loss_sum(logits, batch["labels"]) / global_label_tokens
        loss.backward()

The ring runs on CUDA (torch's flash / efficient / cuDNN kernels) and on CPU with gloo
(:mod:`automodel.distributed.cp.ring.cpu_ring`), so the same code path is tested in CI without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from automodel.distributed.cp.batch_forms import check_batch_forms, classify_batch
from automodel.distributed.cp.group import get_cp_mesh as _get_cp_mesh
from automodel.distributed.cp.guard import check_on_first_forward
from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention
from automodel.distributed.cp.layout import head_tail_indices
from automodel.distributed.cp.ring.causal_mask import no_packed_sequence_detection
from automodel.distributed.cp.ring.cpu_ring import check_cpu_ring_support, cpu_ring_attention
from automodel.distributed.cp.ring.router import eager_models_routed, install_ring_router, ring_layer_kernels
from automodel.distributed.cp.separation import PACKED_FORMS, own_forward_on_packed_rows
from automodel.distributed.cp.te_batch import _shard_thd_chunk_for_te, make_cp_batch_for_te
from automodel.distributed.train_context import get_train_context

__all__ = [
    "_build_position_ids",
    "_shard_thd_chunk_for_te",
    "CP_PAD_VALUES",
    "cp_padded_seq_len",
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
    return _get_cp_mesh(device_mesh)


@contextlib.contextmanager
def _refuse_inexact_models(
    cp_context: contextlib.AbstractContextManager, seq_len: int, cp_mesh: DeviceMesh, real_length: int | None = None
) -> Iterator[None]:
    """``cp_context``, plus the ring method's exactness check at the model's first forward inside it
    (:mod:`automodel.distributed.cp.guard`): a flex model, a layer kind ring does not compute (an
    unsupported linear mixer, a window only the mask sees) raise
    :class:`~automodel.errors.CPUnsupportedError` instead of attending within each rank's shard; and
    each layer's kernel (:mod:`automodel.distributed.cp.ring.router`: windows, chunks, sinks, MLA, and an
    eager model's softcapping, the model switched to the routed eager attention until the context exits;
    :mod:`automodel.distributed.cp.layers.linear_mixer`: Gated DeltaNet's state chain, installed at that
    first forward; both read the ring's token layout, active inside)."""
    from automodel.distributed.cp.registry import check_model_for_cp

    with eager_models_routed() as route_eager:

        def install(model: Any, profile: Any) -> None:
            install_linear_mixers(model, profile, "ring")  # Gated DeltaNet: the state chain (docs/linear_mixers.md)
            install_sparse_attention(model, profile)  # DSA: latent KV and indexer keys gathered
            route_eager(model, profile)  # an eager model: its layers routed as sdpa's are (router.py)

        with (
            check_on_first_forward(lambda profile: check_model_for_cp("ring", profile, seq_len), install),
            ring_layer_kernels(cp_mesh, seq_len, real_length),
            cp_context,
        ):
            yield


def _build_position_ids(batch: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Add ``position_ids = arange(S)`` as ``[1, S]`` int64 to ``batch`` if it has none; return ``batch``.

    ``S`` is ``input_ids.shape[1]``, or ``inputs_embeds.shape[1]`` when there are no ``input_ids``.
    Mutates ``batch`` (adds the key) and returns the same dict, like NeMo AutoModel's
    ``batch = _build_position_ids(batch, device)``. Given ``position_ids`` are left as they are.
    """
    if batch.get("position_ids") is None:
        primary = batch.get("input_ids")
        if primary is None:
            primary = batch["inputs_embeds"]
        seq_len = primary.shape[1]
        batch["position_ids"] = torch.arange(seq_len, device=device, dtype=torch.long).unsqueeze(0)
    return batch


def cp_padded_seq_len(seq_len: int, cp_size: int) -> int:
    """The length :func:`make_cp_batch_and_ctx` pads a row of ``seq_len`` tokens to: the next multiple of
    ``2 * cp_size`` (head-tail load balancing cuts every row into ``2 * cp_size`` equal chunks)."""
    multiple = 2 * cp_size
    return -(-seq_len // multiple) * multiple


# What each sequence tensor is padded with at the end of a row (the ring path's auto-padding).
# ``position_ids`` continue (last + 1, last + 2, ...); ``input_ids`` take ``padding_token_id``.
CP_PAD_VALUES: dict[str, Any] = {
    "input_ids": "padding_token_id",
    "labels": -100,
    "position_ids": "continue",
    "loss_mask": 0,
    "padding_mask": True,
    "inputs_embeds": 0.0,
}


def _pad_for_cp(batch: dict[str, Any], padded_len: int, padding_token_id: int) -> dict[str, Any]:
    """Return a copy of ``batch`` whose sequence tensors are right-padded to ``padded_len`` (see
    :data:`CP_PAD_VALUES`). Out of place: ``inputs_embeds`` stays connected to its autograd graph."""
    out = dict(batch)
    for key, fill in CP_PAD_VALUES.items():
        t = batch.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        dim = 2 if (key == "position_ids" and t.ndim == 3) else 1
        pad = padded_len - t.shape[dim]
        if pad <= 0:
            continue
        if key == "position_ids":
            step = torch.arange(1, pad + 1, device=t.device, dtype=t.dtype)
            tail = t.narrow(dim, t.shape[dim] - 1, 1) + step  # broadcasts over every leading dim
        else:
            value = padding_token_id if fill == "padding_token_id" else fill
            shape = list(t.shape)
            shape[dim] = pad
            tail = torch.full(shape, value, dtype=t.dtype, device=t.device)
        out[key] = torch.cat([t, tail], dim=dim)
    return out


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
    (:mod:`automodel.distributed.cp.ring.cpu_ring`); transformers' packed-sequence detection is off
    (:mod:`automodel.distributed.cp.ring.causal_mask`). On exit buffers not in
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
    # torch's context_parallel, through torch_internals: on torch < 2.13 it is made to undo its SDPA
    # patch and buffer sharding when the block raises, as 2.13+ does itself
    from automodel.distributed.torch_internals import context_parallel, cp_options, set_rotate_method

    _cp_options = cp_options()

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


def _primary_sequence_tensor(batch: dict[str, Any]) -> tuple[str, torch.Tensor]:
    """``("input_ids", [B, S])`` or ``("inputs_embeds", [B, S, H])``; ``ValueError`` if both or neither."""
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if ids is not None and embeds is not None:
        raise ValueError(
            "batch has both 'input_ids' and 'inputs_embeds'; give exactly one (the model takes one or the "
            "other): drop 'input_ids' after embedding them"
        )
    if ids is None and embeds is None:
        raise ValueError(
            f"batch has neither 'input_ids' nor 'inputs_embeds' (keys: {sorted(batch)}); give [B, S] "
            "input_ids or [B, S, H] inputs_embeds"
        )
    if ids is not None:
        if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"batch['input_ids'] must be a [B, S] tensor for ring CP; got {shape}")
        return "input_ids", ids
    if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3:
        shape = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise ValueError(f"batch['inputs_embeds'] must be a [B, S, H] tensor for ring CP; got {shape}")
    return "inputs_embeds", embeds


def _validate_ring_batch(batch: dict[str, Any]) -> None:
    """Raise ``ValueError`` for malformed shapes (before any padding). The batch forms ring does not
    compute (mask zeros, packed rows, restarts) were refused before, by ``check_batch_forms``."""
    primary_key, primary = _primary_sequence_tensor(batch)
    if not isinstance(batch.get("labels"), torch.Tensor):
        raise ValueError(
            "batch has no 'labels' tensor; ring CP needs [B, S] labels (already shifted, -100 = ignore)"
        )
    bsz, seq_len = primary.shape[:2]
    for key in _RING_SHARDED_KEYS:
        t = batch.get(key)
        if key in ("input_ids", "position_ids") or t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (bsz, seq_len):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"batch[{key!r}] has shape {shape}; expected [B, S] = {(bsz, seq_len)} like batch[{primary_key!r}]"
            )
    pos = batch.get("position_ids")
    if pos is not None and not (
        (pos.ndim == 2 and pos.shape[-1] == seq_len and pos.shape[0] in (1, bsz))
        or (pos.ndim == 3 and pos.shape[0] == 3 and pos.shape[1] in (1, bsz) and pos.shape[-1] == seq_len)
    ):
        raise ValueError(
            f"batch['position_ids'] has shape {tuple(pos.shape)}; expected [B, S], [1, S] or mRoPE "
            f"[3, B, S] with S={seq_len}"
        )
    for key, value in batch.items():
        if key in _RING_SHARDED_KEYS or key in ("inputs_embeds", "attention_mask", "seq_lens", "seq_lens_padded"):
            continue
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == (bsz, seq_len):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)} and looks sequence-shaped, but ring CP "
                f"only shards {(*_RING_SHARDED_KEYS, 'inputs_embeds')}; remove it from the batch or shard it "
                "yourself"
            )


@contextlib.contextmanager
def _shard_embeds_on_entry(
    cp_context: contextlib.AbstractContextManager, batch: dict[str, Any], index: torch.Tensor
) -> Iterator[None]:
    """Enter ``cp_context``, then replace ``batch["inputs_embeds"]`` by its rows ``index`` along dim 1.

    ``index_select`` keeps the autograd graph: each rank's backward sends the gradient of its own tokens
    into the full-length tensor it was given, and summing parameter gradients over the CP group (as for
    every other parameter) gives the whole-sequence gradient of whatever produced the embeddings.
    """
    with cp_context:
        batch["inputs_embeds"] = batch["inputs_embeds"].index_select(1, index)
        yield


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
        batch: exactly one of ``input_ids`` ``[B, S]`` int64 or ``inputs_embeds`` ``[B, S, H]`` float
            (may require grad); ``labels`` ``[B, S]`` int64 (already shifted, -100 ignored); optional
            ``position_ids`` (``[B, S]``/``[1, S]`` int64, or mRoPE ``[3, B, S]``), ``loss_mask`` /
            ``padding_mask`` ``[B, S]``, ``attention_mask`` ``[B, S]`` (must be all ones on the ring
            path), ``seq_lens``/``seq_lens_padded`` ``[B, P]`` (THD).
        loss_mask: optional ``[B, S]`` mask sharded with the batch (reference signature).
        use_te: take the THD path (:func:`make_cp_batch_for_te`): the batch becomes flat THD
            tensors sharded with Transformer Engine's partition; the context is a no-op.
        padding_token_id: the ``input_ids`` value of auto-padding (ring path) and of THD padding.
        num_chunks, seq_lens_padding_value: THD path only.
        cp_rotate_method: ring path: ``"allgather"`` (default) or ``"alltoall"`` (an addition to
            the reference signature; see :func:`create_context_parallel_ctx`).

    Returns:
        ``(train_ctx, batch)``. Without CP (no mesh, no ``cp`` dim, cp size 1) and ``use_te=False``:
        ``(contextlib.nullcontext, batch)`` with ``batch`` the very same object, untouched; on packed rows
        ``train_ctx`` instead probes the model at its first forward inside it and raises
        ``CPUnsupportedError`` if the model's own forward mixes the documents (its cache is off inside).

        Ring path (cp > 1): a **new dict holding its own copies** of the sequence tensors; the
        caller's batch and tensors are never modified. Rows whose length ``S`` is not a multiple of
        ``2 * cp_size`` are **padded at the end** to ``S' =`` :func:`cp_padded_seq_len` ``(S, cp_size)``
        (NeMo AutoModel 0.5+ pads too; before, this was a ``ValueError``): ``input_ids`` with
        ``padding_token_id``, ``labels`` with -100, ``position_ids`` continuing (``[1, S]``, ``[B, S]``
        and mRoPE ``[3, B, S]``), ``loss_mask`` with 0, ``padding_mask`` with True, ``inputs_embeds``
        with zeros (:data:`CP_PAD_VALUES`). This is exact for causal attention: no real token attends
        to a later pad, and pads carry no label. The caller learns ``S'`` from the returned
        ``input_ids`` (or ``inputs_embeds``) ``.shape[1]`` before entering the context. The loss
        normaliser is unchanged: count label tokens on the caller's batch (before padding or
        sharding); pads add none. ``position_ids`` ``[1, S']`` are added if missing and an
        all-ones ``attention_mask`` is dropped.

        Entering ``with train_ctx():`` shards the returned ``input_ids``, ``labels``,
        ``position_ids``, ``loss_mask`` and ``padding_mask`` **in place** to this rank's ``S' / cp``
        tokens (head-tail order: chunks r and 2*cp-1-r of 2*cp), and replaces ``inputs_embeds`` by its
        shard through ``index_select`` (autograd: the gradient flows back to the full tensor; sum
        parameter gradients over the CP group). They stay sharded after the block; the model's SDPA
        calls inside are ring attention. ``train_ctx`` is single use.

    Raises:
        ValueError: on the ring path, both or neither of ``input_ids``/``inputs_embeds``, an
            attention mask with zeros, packed rows (padding cannot make these exact), bad shapes, or
            an unknown sequence-shaped tensor.
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
        _primary_sequence_tensor(batch)  # both / neither is an error with or without CP
        if PACKED_FORMS.isdisjoint(classify_batch(batch)):
            return contextlib.nullcontext, batch
        # packed rows run by the model's own forward: probed at its first call, refused if it mixes documents
        return functools.partial(own_forward_on_packed_rows, "make_cp_batch_and_ctx"), batch
    check_batch_forms("ring", batch)  # refuse what ring does not compute exactly (docs/batch_forms.md)

    cp_size = cp_mesh.size()
    if loss_mask is not None:
        batch = {**batch, "loss_mask": loss_mask}
    _validate_ring_batch(batch)
    primary_key, primary = _primary_sequence_tensor(batch)
    padded_len = cp_padded_seq_len(primary.shape[1], cp_size)
    padded = _pad_for_cp(batch, padded_len, padding_token_id)
    # Own copies: the context shards its buffers in place, the caller's tensors stay whole.
    batch = {
        k: (v.clone() if k in _RING_SHARDED_KEYS and v is batch.get(k) and isinstance(v, torch.Tensor) else v)
        for k, v in padded.items()
    }
    batch.pop("attention_mask", None)  # all ones (check_batch_forms refused zeros): plain causal attention
    device = primary.device
    _build_position_ids(batch, device)
    if not batch["position_ids"].is_contiguous():
        batch["position_ids"] = batch["position_ids"].contiguous()

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
    install_ring_router()  # now, before a trainer wraps the attention (router.py)
    ctx = create_context_parallel_ctx(
        cp_mesh=cp_mesh,
        cp_buffers=buffers,
        cp_seq_dims=seq_dims,
        cp_no_restore_buffers=set(buffers),
        cp_rotate_method=cp_rotate_method,
    )
    if primary_key == "inputs_embeds":
        row = torch.tensor([0, padded_len], device=device)
        index = head_tail_indices(row, cp_size, cp_mesh.get_local_rank())
        ctx = _shard_embeds_on_entry(ctx, batch, index)
    real_length = primary.shape[1]  # before the right padding
    return get_train_context(False, False, _refuse_inexact_models(ctx, padded_len, cp_mesh, real_length)), batch
