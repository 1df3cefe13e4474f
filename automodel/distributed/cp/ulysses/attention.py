"""Ulysses context parallelism for Hugging Face models: all-to-all around an unchanged attention kernel.

Every CP rank holds a contiguous slice of the sequence (rank ``r`` of ``W`` holds tokens
``[offset_r, offset_r + n_r)``, near-even sizes with the remainder on the first ranks, see
:func:`automodel.distributed.sp.all_to_all.even_split_sizes`). Everything outside attention is
token-local, so it runs on the slice unchanged. In each attention layer q/k/v go from
sequence-sharded ``[B, H, S/W, D]`` to head-sharded ``[B, H/W, S, D]`` with one all-to-all each, an
ordinary attention kernel (``sdpa``, ``eager`` or ``flex_attention``: the *inner* implementation) runs
on the whole sequence for ``H/W`` heads, and a last all-to-all brings the output back to
``[B, S/W, H, D]``. Any mask works, because the inner kernel sees the whole sequence.

The mask. HF models build their attention mask from the tensors they are given, i.e. from the LOCAL
slice, which is wrong for a kernel that sees the whole sequence. So the attention implementation
registered here (:data:`ULYSSES_ATTN_NAME`) is deliberately NOT registered in transformers'
``AttentionMaskInterface``: for such a name ``create_causal_mask`` returns ``None`` without building
anything. The GLOBAL mask (causal + padding + document boundaries [+ the layer's sliding window]) is
built instead, once per step and per distinct layer kind, from the global ``attention_mask`` /
``position_ids`` / packed-sequence lengths held by a :class:`UlyssesContext`, with transformers' own
mask builders for the inner implementation, so it is exactly the mask the single-process run uses.

Usage (see docs/ulysses.md)::

    set_ulysses_attention(model, device_mesh)                 # once
    ctx_factory, batch = make_ulysses_batch_and_ctx(device_mesh, batch, inner_attn="sdpa")
    with ctx_factory():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        loss = token_ce_sum(logits, batch["labels"]) / global_label_count
        loss.backward()
    # then all-reduce (SUM) the parameter gradients over the CP group

GQA: when the number of kv heads is not divisible by ``W`` (e.g. 1 or 2 kv heads at ``W=4``), each kv
head is replicated ``W / gcd(Hkv, W)`` times before the all-to-all so that every rank receives the kv
heads its query heads use; gradients of the copies are summed back by autograd.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed import ProcessGroup

from automodel.distributed.cp import hf_attention as hf
from automodel.distributed.cp.active import activate, current, not_switched_message
from automodel.distributed.cp.attention_kernels import sdpa_dispatch_choice
from automodel.distributed.cp.batch_forms import check_batch_forms
from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.cp.head_chunks import head_chunks_problem, run_head_groups
from automodel.distributed.cp.layers.alibi import dispatch_alibi_layers, key_bias
from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers
from automodel.distributed.cp.layers.sparse_layers import install_sparse_attention
from automodel.distributed.cp.layers.strategy import call_spec, config_chunk, correct_query_temperature
from automodel.distributed.cp.ulysses.doc_blocks import Segment, document_block_attention, document_segments
from automodel.distributed.sp.all_to_all import all_to_all, even_split_sizes
from automodel.errors import CPUnsupportedError

__all__ = [
    "ULYSSES_ATTN_NAME",
    "INNER_ATTN_IMPLEMENTATIONS",
    "UlyssesContext",
    "ulysses_context",
    "current_ulysses_context",
    "ulysses_attention_forward",
    "register_ulysses_attention",
    "set_ulysses_attention",
    "make_ulysses_batch_and_ctx",
    "document_ids_from_seq_lens",
    "document_ids_from_cu_seqlens",
]

#: The name under which Ulysses attention is registered in transformers' ``AttentionInterface``.
ULYSSES_ATTN_NAME = "ulysses"
#: Inner attention implementations Ulysses can wrap.
INNER_ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
#: Keys of a packed batch that describe document boundaries; consumed by the context, not sharded.
_PACKING_KEYS = ("seq_lens_padded", "seq_lens", "cu_seqlens")
#: A whole-row ``sdpa`` / ``eager`` mask is built in blocks of query rows of about this many scores, each written into
#: the one ``[B, 1, S, S]`` result: the mask functions' comparisons and their ``&`` make ``[B, 1, q, S]`` bools per
#: block, not per row (built in one call, 3 to 4 bytes per score at once: 48 GiB beside a 16 GiB mask at 128K tokens)
MASK_BLOCK_SCORES = 2**26


# ---------------------------------------------------------------------------------------------------------
# document boundaries


def document_ids_from_seq_lens(seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document index of every token of packed rows.

    Args:
        seq_lens: ``[B, P]`` int, per row the lengths of its documents in order; negative entries
            (the ``-1000`` sentinel) are padding. Use the padded lengths when documents are padded.
        seq_len: ``S``, the row length; every row's lengths must sum to at most ``S``.

    Returns:
        ``[B, S]`` int64; tokens after a row's last document form one more (trailing) document.
    """
    if seq_lens.dim() != 2:
        raise ValueError(f"seq_lens must be [B, P], got shape {tuple(seq_lens.shape)}")
    lens = seq_lens.long().clamp(min=0)
    ends = lens.cumsum(-1)  # [B, P]
    if (ends[:, -1] > seq_len).any():
        raise ValueError(
            f"packed documents cover {ends[:, -1].tolist()} tokens per row, more than the row length {seq_len}"
        )
    tokens = torch.arange(seq_len, device=seq_lens.device)
    # number of (non-empty) documents that end at or before each token = that token's document index
    ended = (ends[:, None, :] <= tokens[None, :, None]) & (lens[:, None, :] > 0)
    return ended.sum(-1)


def real_tokens_of(seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[B, S]`` bool (CPU): True at the tokens inside their document's real length. ``seq_lens`` /
    ``seq_lens_padded``: ``[B, P]`` real and padded document lengths (``-1000`` sentinel: none); tokens after
    a row's last padded document are not real."""
    padded = seq_lens_padded.long().cpu().clamp(min=0)
    real = seq_lens.long().cpu().clamp(min=0)
    ids = document_ids_from_seq_lens(padded, seq_len)  # [B, S]
    starts = torch.cat([torch.zeros_like(padded[:, :1]), padded.cumsum(-1)], dim=1)  # [B, P+1]
    at = ids.clamp(max=padded.shape[1] - 1)
    position = torch.arange(seq_len)[None, :] - starts.gather(1, at)
    return (ids < padded.shape[1]) & (position < real.gather(1, at))


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[1, S]`` document index of every token of ONE packed row from ``[P+1]`` cumulative lengths."""
    cu = cu_seqlens.reshape(-1).long()
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()}")
    return document_ids_from_seq_lens(torch.diff(cu).unsqueeze(0), seq_len)


def _document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    # transformers' own rule (a new document wherever position_ids does not increase by exactly 1), so the
    # boundaries are the ones the single-process HF model infers.
    from automodel.distributed.torch_internals import find_packed_sequence_indices

    return find_packed_sequence_indices(position_ids)


# ---------------------------------------------------------------------------------------------------------
# context


@dataclass
class UlyssesContext:
    """Everything Ulysses attention needs that the sharded layer inputs no longer carry.

    Attributes:
        group: the CP process group (``None`` when ``world_size == 1``).
        world_size, rank: CP size and this rank's index in the group.
        inner_attn: ``"sdpa"``, ``"eager"`` or ``"flex_attention"``.
        position_ids: ``[B, S]`` int64 GLOBAL position ids.
        padding_mask: ``[B, S]`` bool GLOBAL padding mask (True = real token) or ``None``.
        document_ids: ``[B, S]`` int64 document index per token for packed rows, or ``None``.
        calls: how many attention calls ran under this context (for the forgotten-switch check).
        head_chunks: head groups per attention call, run one at a time (``distributed.ulysses_head_chunks``).
    """

    group: ProcessGroup | None
    world_size: int
    rank: int
    inner_attn: str
    position_ids: torch.Tensor
    padding_mask: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    calls: int = 0
    #: ``[B, S]`` bool (CPU), True at the tokens inside their document's real length (``seq_lens`` within
    #: ``seq_lens_padded``), ``None`` when the batch gave no padded lengths: the DSA kernel's top-k row is the
    #: document's real length (:mod:`automodel.distributed.cp.layers.sparse_attention`)
    real_tokens: torch.Tensor | None = None
    #: where attention chunks count from: ``"document"`` (each document's first token: packed rows of
    #: seq_lens, each document alone), ``"position"`` (the tokens' position_ids: transformers 5.23+ on rows
    #: packed by restarting position_ids) or ``"row"`` (the row start: transformers < 5.23 there;
    #: torch_internals.transformers_chunks_per_document)
    chunk_origin: str = "document"
    #: distributed.ulysses_head_chunks: the head groups each attention call runs one after another
    #: (:mod:`automodel.distributed.cp.head_chunks`; 1: all heads at once)
    head_chunks: int = 1
    #: head groups run so far (forward, and again where the backward recomputes one): observably chunked
    head_group_runs: int = 0
    _masks: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.inner_attn not in INNER_ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"inner_attn={self.inner_attn!r} is not supported by Ulysses; use one of {INNER_ATTN_IMPLEMENTATIONS}"
            )
        if self.position_ids.dim() != 2:
            raise ValueError(f"position_ids must be [B, S], got shape {tuple(self.position_ids.shape)}")
        for name in ("padding_mask", "document_ids"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != tuple(self.position_ids.shape):
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected {tuple(self.position_ids.shape)} like position_ids"
                )
        if self.seq_len < self.world_size:
            raise ValueError(
                f"sequence length {self.seq_len} is shorter than the CP size {self.world_size}; "
                "every CP rank needs at least one token"
            )

    @property
    def batch_size(self) -> int:
        return self.position_ids.size(0)

    @property
    def seq_len(self) -> int:
        """Global sequence length ``S``."""
        return self.position_ids.size(1)

    @property
    def shard_sizes(self) -> list[int]:
        """Tokens per rank, in rank order (near-even, remainder on the first ranks)."""
        return even_split_sizes(self.seq_len, self.world_size)

    @property
    def shard_offset(self) -> int:
        """Index of this rank's first token in the global sequence."""
        return sum(self.shard_sizes[: self.rank])

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's contiguous slice of a global tensor along ``dim`` (a view, no autograd hooks)."""
        if x.size(dim) != self.seq_len:
            raise ValueError(
                f"cannot shard a tensor of size {x.size(dim)} along dim {dim}; expected {self.seq_len}"
            )
        return x.narrow(dim, self.shard_offset, self.shard_sizes[self.rank])

    def global_mask(
        self,
        *,
        is_causal: bool,
        sliding_window: int | None,
        dtype: torch.dtype,
        device: torch.device,
        config: Any = None,
        chunk: int | None = None,
    ) -> Any:
        """The inner implementation's mask for the whole sequence (cached per layer kind).

        ``sdpa``: ``[B, 1, S, S]`` bool or ``None`` (plain causal, no padding: the kernel's ``is_causal``);
        ``eager``: ``[B, 1, S, S]`` float additive; ``flex_attention``: a ``BlockMask``.
        """
        key = (is_causal, sliding_window, chunk, dtype, str(device))
        if key not in self._masks:
            self._masks[key] = self._build_mask(is_causal, sliding_window, dtype, device, config, chunk)
        return self._masks[key]

    def document_positions(self) -> torch.Tensor:
        """``[B, S]`` int64: each token's index inside its document (its row index without documents)."""
        index = torch.arange(self.seq_len).expand(self.batch_size, -1)
        if self.document_ids is None:
            return index
        ids = self.document_ids.cpu()
        first = torch.ones_like(ids, dtype=torch.bool)
        first[:, 1:] = ids[:, 1:] != ids[:, :-1]
        return index - (index * first).cummax(dim=1).values

    def document_blocks(self) -> list[list[Segment]] | None:
        """Per row, its document segments for block attention (cached); ``None``: plain causal rows (no
        documents, no padding: the kernel's ``is_causal`` needs no mask) or a layout only a dense mask
        expresses (see :mod:`automodel.distributed.cp.ulysses.doc_blocks`)."""
        if "blocks" not in self._masks:
            blocks = None
            if self.document_ids is not None or self.padding_mask is not None:
                blocks = document_segments(self.document_ids, self.padding_mask, self.batch_size, self.seq_len)
            self._masks["blocks"] = blocks
        return self._masks["blocks"]

    def _build_mask(self, is_causal, sliding_window, dtype, device, config, chunk=None):
        from automodel.distributed.torch_internals import (
            ALL_MASK_ATTENTION_FUNCTIONS,
            and_masks,
            bidirectional_mask_function,
            causal_mask_function,
            sliding_window_overlay,
        )

        mask_fn = causal_mask_function if is_causal else bidirectional_mask_function
        plain = True
        if sliding_window is not None:
            mask_fn = and_masks(sliding_window_overlay(sliding_window), mask_fn)
            plain = False
        if chunk is not None:  # attention chunks counted from each document's start
            index = torch.arange(self.seq_len)
            start = (index - self.document_positions()).to(device)
            if self.chunk_origin == "row":  # as transformers < 5.23 computes it (same_document still applies)
                start = torch.zeros_like(start)
            elif self.chunk_origin == "position":  # chunk = position_ids // chunk within a document
                start = (index - self.position_ids.cpu()).to(device)

            # [B, S] int64: the first index of each query's chunk. (kv - s) // c == (q - s) // c holds exactly where
            # lo <= kv < lo + c, lo = s + (q - s) // c * c: two [B, 1, S, S] bool comparisons, where the division of
            # the [B, 1, S, S] key offsets made int64 copies of the whole mask (8 bytes per score: 32 MiB at 2048
            # tokens, 128 GiB at 128K, on every rank)
            lo = start + (index.to(device) - start).div(chunk, rounding_mode="floor") * chunk

            def same_chunk(batch_idx, head_idx, q_idx, kv_idx):
                first = lo[batch_idx, q_idx]
                return (kv_idx >= first) & (kv_idx < first + chunk)

            mask_fn = and_masks(same_chunk, mask_fn)
            plain = False
        if self.document_ids is not None:
            docs = self.document_ids.to(device)

            def same_document(batch_idx, head_idx, q_idx, kv_idx):
                return docs[batch_idx, q_idx] == docs[batch_idx, kv_idx]

            mask_fn = and_masks(same_document, mask_fn)
            plain = False
        padding = None if self.padding_mask is None else self.padding_mask.to(device)
        build = functools.partial(
            ALL_MASK_ATTENTION_FUNCTIONS[self.inner_attn],
            batch_size=self.batch_size,
            kv_length=self.seq_len,
            kv_offset=0,
            mask_function=mask_fn,
            attention_mask=padding,
            allow_is_causal_skip=plain and is_causal,
            allow_is_bidirectional_skip=plain and not is_causal,
            dtype=dtype,
            config=config,
            use_vmap=False,
            device=device,
        )
        s = self.seq_len
        rows = max(1, MASK_BLOCK_SCORES // (self.batch_size * s))
        if plain or self.inner_attn == "flex_attention" or rows >= s:  # a BlockMask, or the whole row in one block
            return build(q_length=s, q_offset=0)
        # the skips are off for a mask that is not plain: every block is a [B, 1, q, S] tensor (bool, or eager's
        # float); one the same for every row (no documents, no padding) is a view expanded over the batch, kept so
        mask, shared = None, False
        for first in range(0, s, rows):
            block = build(q_length=min(rows, s - first), q_offset=first)
            if mask is None:
                shared = block.size(0) > 1 and block.stride(0) == 0
                mask = block.new_empty(1 if shared else block.size(0), 1, s, s)
            mask[:, :, first : first + block.size(2)] = block[:1] if shared else block
        return mask.expand(self.batch_size, -1, -1, -1) if shared else mask


def current_ulysses_context() -> UlyssesContext | None:
    """The innermost active :class:`UlyssesContext` (:mod:`automodel.distributed.cp.active`), or ``None``."""
    return current("ulysses")


@contextlib.contextmanager
def ulysses_context(ctx: UlyssesContext, *, require_attention: bool = True) -> Iterator[UlyssesContext]:
    """Make ``ctx`` the active context for Ulysses attention calls inside the block.

    With ``require_attention`` (default), a block that ran no Ulysses attention call at all raises
    ``RuntimeError`` on exit: that almost always means the model was not switched with
    :func:`set_ulysses_attention` and silently attended within each rank's slice only. On exit the masks the block
    built for the whole row (cached per layer kind on ``ctx``: ``[B, 1, S, S]`` each) are dropped (mutates ``ctx``).
    """
    message = not_switched_message("Ulysses", "set_ulysses_attention", ULYSSES_ATTN_NAME, "slice of the sequence")
    try:
        with activate("ulysses", ctx, require_attention=require_attention, message=message):
            yield ctx
    finally:
        # the whole-row masks (``[B, 1, S, S]`` per layer kind) are freed with the block, not with ``ctx``: a loop that
        # keeps the context factory through its optimizer step must not hold them there (a backward inside the block
        # has run; one outside it gets them from autograd, or rebuilds the same masks on re-entry)
        ctx._masks.clear()


# ---------------------------------------------------------------------------------------------------------
# the attention function


class _KVGroupsOverride:
    """Attribute proxy for an attention module with a different ``num_key_value_groups`` (and, for a
    module with per-head sinks, this rank's share of them)."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int, **overrides: Any) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "num_key_value_groups", num_key_value_groups)
        for name, value in overrides.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_module"), name)


def _inner_function(name: str, module: torch.nn.Module) -> Callable:
    if name == "eager":
        # The model's own eager function (models differ: softcapping, sinks, ...), as HF would pick it.
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None and hasattr(module, "_automodel_alibi_impls"):
            # a layer made to dispatch by cp/layers/alibi.py (GPT-Neo) has no eager function of its own: the same
            # softmax(q k^T * scaling + mask) v over the global mask, in transformers' sdpa
            name = "sdpa"
        elif fn is None:
            raise ValueError(
                f"{type(module).__name__} defines no eager_attention_forward in {type(module).__module__}; "
                "use inner_attn='sdpa'"
            )
        else:
            return fn
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _ulysses_attention(call: hf.AttentionCall) -> tuple[torch.Tensor, None]:
    """Ulysses attention with transformers' attention-function signature (registered as ``"ulysses"``).

    Args:
        module: the HF attention module (``num_key_value_groups``, ``is_causal``, ``config`` are read).
        query: ``[B, Hq, n_r, D]`` for this rank's ``n_r`` tokens; key/value: ``[B, Hkv, n_r, D]``.
        attention_mask: must be ``None`` (what HF passes for this implementation; the global mask comes
            from the active :class:`UlyssesContext`), or a GLOBAL ``[B|1, 1, S, S]`` mask built by the
            caller, which is then used as is.
        dropout, scaling, is_causal, kwargs: forwarded to the inner implementation.

    Returns:
        ``([B, n_r, Hq, D], None)``: attention output for this rank's tokens (attention weights are not
        returned: they are head-sharded over the whole sequence).
    """
    ctx = hf.enter_call("ulysses", ULYSSES_ATTN_NAME, "a Ulysses context", "make_ulysses_batch_and_ctx")
    module, query, key, value = call.module, call.query, call.key, call.value
    attention_mask, dropout, scaling, is_causal = call.attention_mask, call.dropout, call.scaling, call.is_causal
    kwargs = dict(call.kwargs)
    slopes = kwargs.pop("alibi_slopes", None)  # [H] fp32: an ALiBi layer (automodel.distributed.cp.layers.alibi)
    falcon_divisor = kwargs.pop("falcon_alibi_divisor", None)  # Falcon's bf16 ALiBi (cp/layers/alibi.py key_bias)
    world, seq_len = ctx.world_size, ctx.seq_len
    bsz, n_q, n_local, head_dim = query.shape
    n_kv = key.shape[1]
    expected = ctx.shard_sizes[ctx.rank]
    if n_local != expected or bsz != ctx.batch_size:
        raise ValueError(
            f"Ulysses attention got [B={bsz}, S_local={n_local}] on CP rank {ctx.rank}, but the context expects "
            f"[B={ctx.batch_size}, S_local={expected}] (global S={seq_len} over {world} ranks); feed the model the "
            "batch returned by make_ulysses_batch_and_ctx"
        )
    if kwargs.get("position_bias") is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method=ulysses: {type(module).__name__} uses per-head attention biases, which "
            "Ulysses would have to shard by head; it does not, so this model is refused (docs/support_matrix.md)"
        )
    if n_q % world != 0:
        raise ValueError(
            f"Ulysses CP splits attention heads across the CP group: {n_q} query heads are not divisible by "
            f"cp_size={world}; choose a cp_size that divides {n_q}, or use ring CP"
        )
    if n_q % n_kv != 0:
        raise ValueError(f"query heads ({n_q}) must be a multiple of key/value heads ({n_kv})")

    causal = call.causal()
    chunk = config_chunk(module) if kwargs.get("sliding_window") is None else None
    spec, sinks = call_spec(module, query, value, kwargs)
    if spec.position_scaled:  # Llama 4's temperature at the tokens' in-document positions
        query = correct_query_temperature(module, query, ctx.shard(ctx.document_positions(), dim=1))
    # Packed / padded rows with sdpa or eager: one kernel call per document block, no [S, S] mask.
    blocks = None
    if slopes is not None:
        attention_mask = _no_mask(attention_mask)
    elif (
        attention_mask is None
        and kwargs.get("sliding_window") is None
        and chunk is None
        and ctx.inner_attn in ("sdpa", "eager")
    ):
        blocks = ctx.document_blocks()
    if blocks is not None or slopes is not None:
        mask = None
    elif attention_mask is None:
        mask = ctx.global_mask(
            is_causal=causal,
            sliding_window=kwargs.get("sliding_window"),
            chunk=chunk,
            dtype=query.dtype,
            device=query.device,
            config=getattr(module, "config", None),
        )
    elif (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 4
        and (tuple(attention_mask.shape[-2:]) == (seq_len, seq_len) and attention_mask.size(1) == 1)
    ):
        mask = attention_mask
    else:
        shape = (
            tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        )
        raise ValueError(
            f"Ulysses attention received a mask of shape {shape}: a mask built from the local slice of the "
            "sequence, which would be wrong for the whole-sequence kernel. Do not pass attention_mask to the "
            "model (the padding mask lives in the Ulysses context), or pass a global [B, 1, S, S] mask"
        )

    groups = n_q // n_kv
    if world > 1 and n_kv % world != 0:
        # Replicate each kv head f times (f divides groups because world | n_q), so that rank r's
        # query heads find their kv heads among the ones it receives.
        f = world // math.gcd(n_kv, world)
        key = key.repeat_interleave(f, dim=1)
        value = value.repeat_interleave(f, dim=1)
        groups //= f
    chunks = ctx.head_chunks
    problem = head_chunks_problem(chunks, n_q, n_kv, world, f"cp_size={world}")
    if problem is not None:
        raise ValueError(problem)

    rank_sinks = None
    if sinks is not None and (world > 1 or chunks > 1):  # per-head sinks are sharded with the heads
        local_heads = n_q // world
        rank_sinks = sinks[ctx.rank * local_heads : (ctx.rank + 1) * local_heads]
    rank_slopes = None  # [Hq / W] fp32: this rank's ALiBi slopes
    if slopes is not None:
        local_heads = n_q // max(world, 1)
        rank_slopes = slopes[ctx.rank * local_heads : (ctx.rank + 1) * local_heads] if world > 1 else slopes
    if "position_ids" in kwargs:
        kwargs["position_ids"] = ctx.position_ids.to(query.device)
    if is_causal is not None:
        kwargs["is_causal"] = is_causal
    # ALiBi layers (their own code) have no inner function of their module: _alibi_attention instead
    inner = _inner_function(ctx.inner_attn, module) if slopes is None else None

    def heads_attention(g: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # group g (all heads when chunks == 1): q [B, W*h_g, n_r, D] -> [B, h_g, S, D], the inner kernel, and back
        call_kwargs = dict(kwargs)
        ctx.head_group_runs += 1
        if world > 1:
            group = ctx.group
            query = all_to_all(query, group, scatter_dim=1, gather_dim=2, gather_size=seq_len)
            key = all_to_all(key, group, scatter_dim=1, gather_dim=2, gather_size=seq_len)
            value = all_to_all(value, group, scatter_dim=1, gather_dim=2, gather_size=seq_len)
        inner_module = module
        if rank_sinks is not None:
            own = rank_sinks.narrow(0, g * (rank_sinks.shape[0] // chunks), rank_sinks.shape[0] // chunks)
            if call_kwargs.get("s_aux") is not None:
                call_kwargs["s_aux"] = own
            inner_module = _KVGroupsOverride(module, groups, **({"sinks": own} if hasattr(module, "sinks") else {}))
        elif getattr(module, "num_key_value_groups", groups) != groups:
            inner_module = _KVGroupsOverride(module, groups)
        if rank_slopes is not None:  # ALiBi: this rank's slopes of group g's heads
            h_g = rank_slopes.shape[0] // chunks
            out = _alibi_attention(ctx, query, key, value, rank_slopes.narrow(0, g * h_g, h_g), scaling, groups, dropout,
                                   falcon_divisor)
        elif blocks is not None:
            block_kwargs = {k: v for k, v in call_kwargs.items() if k not in ("is_causal", "position_ids")}
            # sdpa: the shared blocks (what transformers' sdpa computes per block); eager: the model's own function
            block_fn = None if ctx.inner_attn == "sdpa" and not dropout else inner
            out = document_block_attention(
                block_fn,
                inner_module,
                query,
                key,
                value,
                blocks,
                is_causal=causal,
                needs_mask=ctx.inner_attn == "eager",
                dropout=dropout,
                scaling=scaling,
                **block_kwargs,
            )
        else:
            if ctx.inner_attn == "sdpa":
                _log_inner_kernel(query, key, value, mask, dropout, call_kwargs.get("is_causal"), scaling)
            out, _ = inner(inner_module, query, key, value, mask, dropout=dropout, scaling=scaling, **call_kwargs)
        # out: [B, S, h_g, D] (HF attention functions return sequence-major outputs)
        if world > 1:
            out = all_to_all(out, ctx.group, scatter_dim=1, gather_dim=2)
        return out

    # distributed.ulysses_head_chunks: one head group at a time, the backward too (head_chunks.py)
    return run_head_groups(heads_attention, query, key, value, max(world, 1), chunks), None


_INNER_LOGGED: set[tuple] = set()


def _log_inner_kernel(query, key, value, mask, dropout: float, is_causal, scaling) -> None:  # noqa: ANN001
    """One INFO line per (device, dtype, head size, masked or causal, kernel): the kernel torch's SDPA runs for
    Ulysses' inner ``sdpa`` call (``attention_kernels.sdpa_dispatch_choice`` on the call's own tensors, under the
    ``model.attention_backend`` pin / priority the train context entered), so the run log names the kernel that
    ran. Logger ``automodel.distributed.cp.blocks``, with the block kernels' lines. Nothing under ``torch.compile``
    tracing (no graph break) or with INFO off."""
    log = logging.getLogger("automodel.distributed.cp.blocks")
    if not log.isEnabledFor(logging.INFO) or torch.compiler.is_compiling():
        return
    causal = mask is None and (is_causal is None or bool(is_causal)) and query.shape[2] > 1
    kernel = sdpa_dispatch_choice(query, key, value, mask, dropout, causal, scaling)
    what = "masked" if mask is not None else ("causal" if causal else "full")
    key_ = (query.device.type, query.dtype, query.shape[-1], what, kernel)
    if key_ in _INNER_LOGGED:
        return
    _INNER_LOGGED.add(key_)
    where = "" if query.device.type == "cuda" else f" ({query.device.type}: torch's {query.device.type} kernels)"
    log.info(
        "Ulysses' inner sdpa attention (%s, %s, head size %d, %s%s): torch's SDPA runs %s%s",
        query.device.type, query.dtype, query.shape[-1], what,
        ", grouped K/V" if key.shape[1] != query.shape[1] else "", kernel or "an unreported kernel", where,
    )


def _no_mask(attention_mask: Any) -> None:
    if attention_mask is not None:
        raise ValueError("Ulysses attention with ALiBi builds its own mask; the layer must pass attention_mask=None")
    return None


def _alibi_attention(ctx: UlyssesContext, query, key, value, slopes, scaling, groups: int, dropout: float,
                     falcon_divisor: float | None = None):  # fmt: skip
    """``[B, S, Hl, D]``: causal attention over whole rows for this rank's ``Hl`` heads with ALiBi's bias
    ``slopes[h] * position(j)`` (``position``: the key's index in its document, as each document alone; the
    query's own term is a constant per row, which the softmax cancels), documents and padding masked.

    ``query`` ``[B, Hl, S, D]``, ``key`` / ``value`` ``[B, Hl / groups, S, D]`` after the all-to-all; ``slopes``
    ``[Hl]`` fp32, this rank's heads. One fused SDPA call with the bias as a float mask ``[B, Hl, S, S]`` (the
    memory of the eager kernel the model itself runs)."""
    if dropout:
        raise ValueError(f"Ulysses attention with ALiBi does not apply attention dropout ({dropout}); set it to 0")
    device, seq = query.device, ctx.seq_len
    bias = key_bias(slopes, ctx.document_positions().to(device), query.dtype, falcon_divisor)  # [B, Hl, S]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()[None]
    if ctx.document_ids is not None:
        ids = ctx.document_ids.to(device)
        allowed = allowed & (ids[:, :, None] == ids[:, None, :])
    if ctx.padding_mask is not None:
        allowed = allowed & ctx.padding_mask.to(device)[:, None, :]
    mask = bias[:, :, None, :].masked_fill(~allowed[:, None], torch.finfo(query.dtype).min)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)


ulysses_attention_forward = hf.hf_attention_function(_ulysses_attention, "ulysses_attention_forward")


def register_ulysses_attention(name: str = ULYSSES_ATTN_NAME) -> str:
    """Register :func:`ulysses_attention_forward` in transformers' ``AttentionInterface`` (idempotent).

    It is deliberately not registered in ``AttentionMaskInterface``: HF then skips building its (local,
    wrong) mask and passes ``attention_mask=None``. Returns ``name``.
    """
    return hf.register_attention(name, ulysses_attention_forward)


# ---------------------------------------------------------------------------------------------------------
# mesh / batch / model helpers


def _resolve_cp(device_mesh: Any) -> tuple[ProcessGroup | None, int, int]:
    """(group, world_size, rank) of the CP dimension of a DeviceMesh / 1-D mesh / ProcessGroup / None."""
    return resolve_cp_group(device_mesh)


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def set_ulysses_attention(model: torch.nn.Module, device_mesh: Any = None) -> str:
    """Switch an HF model to Ulysses attention; returns the previous implementation name (to restore).

    Registers the implementation if needed and calls ``model.set_attn_implementation("ulysses")``
    (transformers >= 5; sub-models follow). With ``device_mesh`` given, checks up front that the
    attention heads split over the CP size. Raises
    :class:`~automodel.errors.CPUnsupportedError` for a model with a layer kind Ulysses does not compute
    exactly (chunked attention, sinks, linear / state-space mixers: :mod:`automodel.distributed.cp`). The inner kernel is chosen per step in
    :func:`make_ulysses_batch_and_ctx`.
    """
    hf.require_hf_model(model, "; Ulysses attention plugs into transformers' AttentionInterface", TypeError)
    if device_mesh is not None:
        _, world, _ = _resolve_cp(device_mesh)
        heads = getattr(_text_config(model.config), "num_attention_heads", None)
        if heads is not None and heads % world != 0:
            raise ValueError(
                f"Ulysses CP splits attention heads across the CP group: num_attention_heads={heads} is not "
                f"divisible by cp_size={world}; choose a cp_size that divides {heads}, or use ring CP"
            )
    # exact or refused: every layer kind of the model against what Ulysses computes (sliding windows are
    # exact; a chunk is refused here, as the row length is not known yet)
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp("ulysses", cached_profile(model), seq_len=None)
    install_linear_mixers(model, cached_profile(model), "ulysses")  # docs/linear_mixers.md
    install_sparse_attention(model, cached_profile(model))  # DSA: latent KV and indexer keys gathered
    if dispatch_alibi_layers(model, {"ulysses": ULYSSES_ATTN_NAME}):
        # BLOOM, MPT: inside a Ulysses context their ALiBi layers hand q, k, v to Ulysses' attention; their
        # classes dispatch nothing, so the model keeps its implementation (the inner kernel is not used)
        hf.register_attention(ULYSSES_ATTN_NAME, ulysses_attention_forward)
        return model.config._attn_implementation
    return hf.switch_attention(model, ULYSSES_ATTN_NAME, ulysses_attention_forward, "ulysses", catch=False)


def _primary_sequence_tensor(batch: dict[str, Any]) -> torch.Tensor:
    """``input_ids [B, S]`` or ``inputs_embeds [B, S, H]``: exactly one must be given."""
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if (ids is None) == (embeds is None):
        given = "both" if ids is not None else "neither"
        raise ValueError(
            f"the batch has {given} of 'input_ids' and 'inputs_embeds'; give exactly one: input_ids [B, S], or "
            "inputs_embeds [B, S, H] for a model fed embeddings (e.g. a VLM with vision embeddings merged in)"
        )
    if ids is not None and ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
    if embeds is not None and embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must be [B, S, H], got shape {tuple(embeds.shape)}")
    return ids if ids is not None else embeds


def _check_mrope_position_ids(position_ids: torch.Tensor, bsz: int, seq_len: int) -> torch.Tensor:
    """mRoPE positions ``[3, B|1, S]`` (temporal, height, width) -> ``[3, B, S]`` int64."""
    if position_ids.size(0) != 3 or position_ids.size(2) != seq_len or position_ids.size(1) not in (1, bsz):
        raise ValueError(
            f"3-D position_ids must be mRoPE positions [3, B, S] = [3, {bsz}, {seq_len}], got shape "
            f"{tuple(position_ids.shape)}; compute them on the whole sequence (e.g. the model's get_rope_index)"
        )
    return position_ids.long().expand(3, bsz, seq_len)


def make_ulysses_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    inner_attn: str = "sdpa",
    head_chunks: int = 1,
) -> tuple[Callable[[], contextlib.AbstractContextManager[UlyssesContext]], dict[str, Any]]:
    """Shard a BSHD batch for Ulysses CP and build the context its attention calls need.

    Args:
        device_mesh: a DeviceMesh with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None``
            (no CP: nothing is sharded, attention runs the inner kernel on the whole sequence).
        batch: dict of ``[B, S]`` tensors, identical on every CP rank: exactly one of ``input_ids``
            ``[B, S]`` and ``inputs_embeds`` ``[B, S, H]`` (e.g. text embeddings with vision embeddings
            merged in; sharded on dim 1 with autograd, so its gradient flows back to whatever produced
            it), ``labels`` (already shifted, -100 = ignore), optional ``position_ids`` (default
            ``arange(S)``; a reset to a non-consecutive value starts a new document, as in transformers;
            or mRoPE ``[3, B, S]``, sharded on dim 2, which never marks documents), ``attention_mask``
            (padding, 1 = keep), ``loss_mask``; packed rows may add ``seq_lens_padded`` / ``seq_lens``
            (``[B, P]``, ``-1000`` = no document) or ``cu_seqlens`` (``[P+1]``, only for ``B == 1``),
            which define document boundaries and take precedence over ``position_ids``.
        inner_attn: ``"sdpa"``, ``"eager"`` or ``"flex_attention"``.
        head_chunks: ``distributed.ulysses_head_chunks``: each attention call runs its heads in this many groups,
            one after another, forward and backward (:mod:`automodel.distributed.cp.head_chunks`; exact). It must
            divide the KV heads a rank holds after the all-to-all (checked at the first attention call).

    Returns:
        ``(ctx_factory, local_batch)``. ``local_batch`` holds this rank's contiguous slice (near-even
        sizes, remainder on the first ranks) of every ``[B, S, ...]`` tensor of ``batch`` plus
        ``position_ids`` (always present, global positions); ``attention_mask`` and the packing keys
        are consumed by the context and removed; other entries are passed through. ``batch`` is not
        mutated. ``ctx_factory()`` returns a context manager inside which a model switched with
        :func:`set_ulysses_attention` computes exact whole-sequence attention.

    Raises:
        ValueError: not exactly one of ``input_ids`` / ``inputs_embeds``, inconsistent shapes, ``S`` smaller than the CP size, or
        an unsupported ``inner_attn``.
    """
    check_batch_forms("ulysses", batch)  # refuse what ulysses does not compute exactly (docs/batch_forms.md)
    primary = _primary_sequence_tensor(batch)
    bsz, seq_len = primary.shape[:2]
    device = primary.device
    group, world, rank = _resolve_cp(device_mesh)

    position_ids = batch.get("position_ids")
    mrope_position_ids = None
    if position_ids is not None and position_ids.dim() == 3:
        mrope_position_ids = _check_mrope_position_ids(position_ids, bsz, seq_len)
        position_ids = None  # 3-D positions never mark documents (as in transformers' Qwen2-VL)
    for k, v in batch.items():
        if k in ("labels", "position_ids", "attention_mask", "loss_mask") and v is not None:
            if k == "position_ids" and mrope_position_ids is not None:
                continue
            if tuple(v.shape[:2]) != (bsz, seq_len) and not (
                k == "position_ids" and tuple(v.shape) == (1, seq_len)
            ):
                raise ValueError(
                    f"batch[{k!r}] has shape {tuple(v.shape)}, expected [B, S] = [{bsz}, {seq_len}]"
                )

    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).unsqueeze(0)
    position_ids = position_ids.long().expand(bsz, seq_len)

    padding_mask = batch.get("attention_mask")
    if padding_mask is not None:
        padding_mask = padding_mask.to(torch.bool)

    from_restarts = False
    if batch.get("seq_lens_padded") is not None:
        document_ids = document_ids_from_seq_lens(batch["seq_lens_padded"], seq_len)
    elif batch.get("seq_lens") is not None:
        document_ids = document_ids_from_seq_lens(batch["seq_lens"], seq_len)
    elif batch.get("cu_seqlens") is not None:
        if bsz != 1:
            raise ValueError(
                f"cu_seqlens describes one packed row but the batch has B={bsz} rows; pass seq_lens [B, P] instead"
            )
        document_ids = document_ids_from_cu_seqlens(batch["cu_seqlens"], seq_len)
    elif mrope_position_ids is None:
        document_ids = _document_ids_from_position_ids(position_ids)
        from_restarts = document_ids is not None
    else:
        document_ids = None

    documents = document_ids.to(device) if document_ids is not None else None
    problem = head_chunks_problem(head_chunks, None, None, world)
    if problem is not None or head_chunks == "auto":
        raise ValueError(problem or "head_chunks='auto' is resolved by the recipe from the plan; pass an integer")
    ctx = UlyssesContext(group, world, rank, inner_attn, position_ids, padding_mask, documents, head_chunks=head_chunks)
    if batch.get("seq_lens_padded") is not None and batch.get("seq_lens") is not None:
        ctx.real_tokens = real_tokens_of(batch["seq_lens"], batch["seq_lens_padded"], seq_len)
    if from_restarts:  # documents as transformers finds them: its chunks too (torch_internals)
        from automodel.distributed.torch_internals import transformers_chunks_per_document

        ctx.chunk_origin = "position" if transformers_chunks_per_document() else "row"

    local: dict[str, Any] = {}
    for k, v in batch.items():
        if k == "attention_mask" or k in _PACKING_KEYS:
            continue
        if k == "position_ids":
            continue
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.size(0) == bsz and v.size(1) == seq_len:
            local[k] = ctx.shard(v, 1).contiguous()
        else:
            local[k] = v
    if mrope_position_ids is None:
        local["position_ids"] = ctx.shard(position_ids, 1).contiguous()
    else:
        local["position_ids"] = ctx.shard(mrope_position_ids, 2).contiguous()

    def ctx_factory() -> contextlib.AbstractContextManager[UlyssesContext]:
        return ulysses_context(ctx)

    return ctx_factory, local
