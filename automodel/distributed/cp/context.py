"""The one own-loop entry point of every CP method: ``context_parallel(model, mesh, method=...)``.

::

    cp = context_parallel(model, mesh, method="thd_docs")   # once: checks and prepares the model
    for batch in loader:                                     # the same [B, S] batch dict for every method
        ctx, local = cp.shard(batch)
        with ctx():
            loss = model(**local).loss                       # this rank's share of the batch loss
            loss.backward()
        cp.reduce_gradients()                                # sum over the CP group (FSDP does it for you)
        optimizer.step(); optimizer.zero_grad()
    cp.restore()                                             # the model's own attention again

:func:`context_parallel` checks the model with the registry's exactness check
(:func:`~automodel.distributed.cp.registry.check_model_config_for_cp`) and prepares it through
:func:`~automodel.distributed.cp.bind.bind_cp_method`; it never looks at a method's name: what a method
needs of a batch is read from its :class:`~automodel.distributed.cp.method.CPMethod` declaration
(:attr:`~CPMethod.supports_packed`, :meth:`~CPMethod.row_multiple`).

**The batch**, the same for every method (``[B, S]`` tensors, identical on every CP rank): ``input_ids``,
``labels`` (already shifted, -100 = ignore), optional ``position_ids``, ``loss_mask`` and
``attention_mask`` (right padding); packed rows add ``seq_lens`` (``[B, P]`` real document lengths,
-1000 = no document; optionally ``seq_lens_padded``, each document's slot) or give only ``position_ids``
that restart at every document (transformers' rule: a new document wherever the position does not grow
by exactly 1). :meth:`ContextParallel.shard` turns it, exactly, into the form the method shards:

- ``loss_mask`` zeros become -100 labels; an all-ones ``attention_mask`` is dropped, and right padding
  whose slots carry no loss is left out (no real token attends to a later slot under causal attention);
- every document is padded (labels -100, positions continuing) to the method's multiple and the rows to
  a common length that is a multiple of it, so a user never pads documents to ``2 * cp_size``;
- what cannot be made exact is refused with a ``ValueError`` naming the value, the rule and the fix:
  packed rows under a method that attends across the whole row (with the methods that run them), left or
  inner padding, padding slots that carry a label, ``position_ids`` that disagree with ``seq_lens``.

**At CP size 1** (``mesh=None``, a CP group of 1) rows may be packed too, and are computed per document:
the model's own forward where a probe shows that it keeps a packed row's documents apart
(:func:`~automodel.distributed.cp.separation.document_separation`), else the method's document-aware attention
on the one rank; a method that attends across the row (ring) then refuses packed batches with the reason.
:func:`context_parallel` turns the model's cache off (:meth:`ContextParallel.restore` turns it back on): with a
cache transformers masks no documents.

**The local batch** holds only model arguments: ``input_ids``, ``position_ids``, ``labels`` and
``shift_labels`` (this rank's labels: transformers then does not shift them again) and
``num_items_in_batch`` (the label count of the whole batch), so ``model(**local).loss`` is this rank's
sum of token cross-entropies divided by the whole batch's label count: the CP group's losses and
gradients add up to the one-process ones (:meth:`ContextParallel.reduce_loss`,
:meth:`ContextParallel.reduce_gradients`).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from automodel.distributed.cp.bind import bind_cp_method
from automodel.distributed.cp.choose import AUTO, Choice, choose_cp_method
from automodel.distributed.cp.group import resolve_cp_group
from automodel.distributed.cp.guard import cached_profile
from automodel.distributed.cp.method import BatchFn, CPMethod, PreparedModel
from automodel.distributed.cp.registry import (
    alternative_label,
    alternatives,
    check_model_config_for_cp,
    get_cp_method,
)
from automodel.distributed.cp.separation import cache_off

__all__ = ["BATCH_KEYS", "ContextParallel", "context_parallel", "canonical_batch"]

_log = logging.getLogger(__name__)

#: the keys :meth:`ContextParallel.shard` takes
BATCH_KEYS = ("input_ids", "labels", "position_ids", "loss_mask", "attention_mask", "seq_lens", "seq_lens_padded")
#: the sentinel of unused ``seq_lens`` entries
SENTINEL = -1000
#: the keys of a method's local batch that the model takes
_MODEL_KEYS = ("input_ids", "position_ids", "labels")


class _Options:
    """A duck-typed ``cfg`` whose ``distributed.<key>`` are the keyword options (``None`` when not given), for
    :meth:`CPMethod.configured` (e.g. usp's ``ulysses_size``)."""

    def __init__(self, cp_size: int, options: dict[str, Any]) -> None:
        self.distributed = _Namespace({"cp_size": cp_size, **options})


class _Namespace:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # only reached for keys not given
        return None


def _accepted_options(method: CPMethod) -> tuple[set[str] | None, str]:
    """The keyword options ``method``'s batch function takes (``None``: any) and its qualified name."""
    fn = method._batch_function()
    name = getattr(getattr(fn, "func", fn), "__qualname__", repr(fn))
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None, name
    skip = {"device_mesh", "batch", "inner_attn"}
    return {p.name for p in params if p.name not in skip and p.kind is not inspect.Parameter.VAR_POSITIONAL}, name


# --------------------------------------------------------------------------------------------- the batch


@dataclass
class _Row:
    """One row's documents: ``(start, real)`` token ranges in the caller's row, in order."""

    docs: list[tuple[int, int]]


def _int_tensor(batch: dict[str, Any], key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    t = batch.get(key)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"batch[{key!r}] is a {type(t).__name__}; give a tensor (see BATCH_KEYS)")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"batch[{key!r}] has shape {tuple(t.shape)}; expected [B, S] = {list(shape)} like input_ids")
    return t


def _restarts(pos: torch.Tensor) -> torch.Tensor:
    """``[S]`` bool: where a new document starts (transformers' rule: the position does not grow by exactly 1)."""
    out = torch.ones_like(pos, dtype=torch.bool)
    out[1:] = pos[1:] != pos[:-1] + 1
    return out


def _real_lengths(batch: dict[str, Any], bsz: int, seq: int) -> list[int]:
    """Each row's real tokens: ``attention_mask``'s ones (right padding only), else ``S``."""
    mask = _int_tensor(batch, "attention_mask", (bsz, seq))
    if mask is None:
        return [seq] * bsz
    m = mask.bool()
    if bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError(
            "batch['attention_mask'] has a padding slot (0) before a real token (left or inner padding); "
            "context_parallel computes causal attention, where only right padding is exact: pad on the right, "
            "or pack the rows (seq_lens) instead of masking"
        )
    return [int(n) for n in m.sum(1).tolist()]


def _docs_from_seq_lens(real: list[int], slots: list[int], b: int, row_end: int) -> list[tuple[int, int]]:
    """``(start, real)`` of one row's documents from its ``seq_lens`` / ``seq_lens_padded`` entries."""
    docs, at = [], 0
    for n, p in zip(real, slots):
        if n == SENTINEL and p == SENTINEL:
            continue
        if n < 0 or p < n:
            raise ValueError(
                f"row {b}: seq_lens {real} / seq_lens_padded {slots}: every used entry needs "
                "0 <= seq_len <= seq_len_padded (-1000 marks an unused entry in both)"
            )
        if n:
            docs.append((at, n))
        at += p
    if at > row_end or (docs and docs[-1][0] + docs[-1][1] > row_end):
        raise ValueError(
            f"row {b}: the documents of seq_lens {real} cover {at} tokens, beyond the row's {row_end} real tokens "
            "(S, attention_mask); fix seq_lens or the mask"
        )
    return docs


def _rows(batch: dict[str, Any], bsz: int, seq: int, pos: torch.Tensor | None) -> list[_Row]:
    """Every row's documents, from ``seq_lens`` (and ``seq_lens_padded``), else ``position_ids`` restarts,
    else one document per row; the real tokens end where ``attention_mask`` (right padding) ends."""
    real_len = _real_lengths(batch, bsz, seq)
    lens, padded = _int_tensor(batch, "seq_lens"), _int_tensor(batch, "seq_lens_padded")
    if padded is not None and lens is None:
        raise ValueError("batch has 'seq_lens_padded' but no 'seq_lens'; give the real lengths as seq_lens [B, P]")
    if lens is not None:
        if lens.dim() != 2 or lens.shape[0] != bsz or (padded is not None and padded.shape != lens.shape):
            shapes = f"{tuple(lens.shape)}" + (f" / seq_lens_padded {tuple(padded.shape)}" if padded is not None else "")
            raise ValueError(f"batch['seq_lens'] has shape {shapes}; expected [B, P] with B={bsz} (both the same)")
        return [
            _Row(_docs_from_seq_lens(lens[b].tolist(), (padded if padded is not None else lens)[b].tolist(), b, real_len[b]))
            for b in range(bsz)
        ]
    rows = []
    for b in range(bsz):
        if pos is not None:
            starts = torch.nonzero(_restarts(pos[b, : real_len[b]])).flatten().tolist() + [real_len[b]]
            rows.append(_Row([(s, e - s) for s, e in zip(starts[:-1], starts[1:])]))
        else:
            rows.append(_Row([(0, real_len[b])] if real_len[b] else []))
    return rows


def _check_positions(rows: list[_Row], pos: torch.Tensor) -> None:
    """The one-process model reads documents from ``position_ids`` restarts: they must agree with ``seq_lens``."""
    for b, row in enumerate(rows):
        for start, n in row.docs:
            restarts = _restarts(pos[b, start : start + n])
            if bool(restarts[1:].any()) or (start > 0 and not bool(_restarts(pos[b, start - 1 : start + 1])[1])):
                raise ValueError(
                    f"row {b}: the document of seq_lens at tokens [{start}, {start + n}) does not match position_ids "
                    f"(they must restart at every document start and grow by 1 inside it, as transformers reads "
                    "documents in one process); fix position_ids or leave them out (then they restart per document)"
                )


def _check_pads_carry_no_loss(rows: list[_Row], labels: torch.Tensor) -> None:
    """Every token outside the documents (padding) must carry no label: it is left out."""
    covered = torch.zeros(labels.shape, dtype=torch.bool)
    for b, row in enumerate(rows):
        for start, n in row.docs:
            covered[b, start : start + n] = True
    stray = (labels != -100) & ~covered.to(labels.device)
    if bool(stray.any()):
        b, t = (int(i) for i in torch.nonzero(stray)[0])
        raise ValueError(
            f"batch['labels'][{b}, {t}] = {int(labels[b, t])} lies in a padding slot (outside every document of "
            "seq_lens / attention_mask), which the one-process model would also predict from; set the labels of "
            "padding slots to -100 (or loss_mask 0)"
        )


def _inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(input_ids, labels with loss_mask folded in, position_ids [B, S] or None)``, validated."""
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise ValueError(
            f"batch keys {unknown} are not taken by context_parallel's shard (it takes {list(BATCH_KEYS)}); remove "
            "them, or shard them yourself with the method's own batch function"
        )
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"batch['input_ids'] must be a [B, S] tensor; got {shape}")
    bsz, seq = ids.shape
    labels = _int_tensor(batch, "labels", (bsz, seq))
    if labels is None:
        raise ValueError("batch has no 'labels'; give [B, S] labels, already shifted (-100 = ignore)")
    loss_mask = _int_tensor(batch, "loss_mask", (bsz, seq))
    if loss_mask is not None:
        labels = labels.masked_fill(~loss_mask.bool(), -100)
    pos = batch.get("position_ids")
    if pos is not None:
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] != seq or pos.shape[0] not in (1, bsz):
            shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise ValueError(
                f"batch['position_ids'] has shape {shape}; context_parallel takes [B, S] or [1, S] = [{bsz}, {seq}] "
                "(for mRoPE [3, B, S] positions use the method's own batch function)"
            )
        pos = pos.expand(bsz, seq)
    return ids, labels, pos


def _lay_out(
    ids: torch.Tensor, labels: torch.Tensor, pos: torch.Tensor | None, rows: list[_Row], multiple: int, packed: bool
) -> dict[str, Any]:
    """The new rows: every document (packed) or row's real tokens padded to ``multiple``, rows of equal length."""

    def pad(n: int) -> int:
        return -(-n // multiple) * multiple

    bsz = ids.shape[0]
    docs = [row.docs if packed else [(row.docs[0][0], row.docs[0][1]) if row.docs else (0, 0)] for row in rows]
    slots = [[pad(n) for _, n in row] for row in docs]
    length = max(max(sum(s) for s in slots), multiple)
    out_ids = torch.zeros(bsz, length, dtype=ids.dtype, device=ids.device)
    out_labels = torch.full((bsz, length), -100, dtype=labels.dtype, device=labels.device)
    out_pos = torch.zeros(bsz, length, dtype=torch.long, device=ids.device)
    n_docs = max(len(s) for s in slots)
    seq_lens = torch.full((bsz, n_docs), SENTINEL, dtype=torch.long)
    seq_lens_padded = torch.full((bsz, n_docs), SENTINEL, dtype=torch.long)
    for b in range(bsz):
        at = 0
        for i, ((start, n), slot) in enumerate(zip(docs[b], slots[b])):
            if i == len(docs[b]) - 1:
                slot += length - sum(slots[b])  # the row's trailing padding joins its last document
            out_ids[b, at : at + n] = ids[b, start : start + n]
            out_labels[b, at : at + n] = labels[b, start : start + n]
            first = int(pos[b, start]) if pos is not None and n else 0
            out_pos[b, at : at + slot] = torch.arange(first, first + slot)  # pads continue the positions
            if pos is not None and n:
                out_pos[b, at : at + n] = pos[b, start : start + n]
            seq_lens[b, i], seq_lens_padded[b, i] = n, slot
            at += slot
    out = {"input_ids": out_ids, "labels": out_labels, "position_ids": out_pos}
    if packed:
        out["seq_lens"], out["seq_lens_padded"] = seq_lens.to(ids.device), seq_lens_padded.to(ids.device)
    return out


def canonical_batch(
    batch: dict[str, Any], multiple: int, packed_ok: bool, packed_fix: str = ""
) -> tuple[dict[str, Any], bool]:
    """The exact form a method shards: ``(batch, packed)``; ``batch`` is not mutated.

    Args:
        batch: the caller's batch (see the module docstring).
        multiple: every document (packed rows) or row (else) is padded to a multiple of it.
        packed_ok: the method keeps document boundaries; else packed rows raise ``ValueError``.
        packed_fix: the fix named when packed rows are refused (e.g. the methods that run them).

    Returns:
        ``input_ids``, ``labels`` (``loss_mask`` folded in), ``position_ids``, each ``[B, L]`` with ``L`` the
        longest row after padding (a multiple of ``multiple``); packed rows (some row holds several documents)
        add ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` (-1000 = unused; the row's trailing padding belongs
        to its last document). Pad slots hold token 0, label -100 and continuing positions.

    Raises:
        ValueError: unknown keys, bad shapes, left or inner padding, a label in a padding slot, ``position_ids``
            that disagree with ``seq_lens``, packed rows where ``packed_ok`` is false.
    """
    ids, labels, pos = _inputs(batch)
    bsz, seq = ids.shape
    rows = _rows(batch, bsz, seq, pos)
    if batch.get("seq_lens") is not None and pos is not None:
        _check_positions(rows, pos)
    _check_pads_carry_no_loss(rows, labels)
    packed = any(len(row.docs) > 1 for row in rows)
    if packed and not packed_ok:
        raise ValueError(f"the batch has packed rows (several documents in a row); {packed_fix}")
    return _lay_out(ids, labels, pos, rows, multiple, packed), packed


# --------------------------------------------------------------------------------------------- the handle


class ContextParallel:
    """What :func:`context_parallel` set up: shard batches, reduce over the CP group, describe, restore."""

    def __init__(
        self,
        model: Any,
        mesh: Any,
        method: CPMethod,
        cp_size: int,
        group: Any,
        batch_fn: BatchFn,
        prepared: PreparedModel,
        options: dict[str, Any],
    ) -> None:
        self.model, self.mesh, self.method, self.cp_size = model, mesh, method, cp_size
        self.group, self.options = group, options
        self._batch_fn, self._prepared, self._restored = batch_fn, prepared, False
        #: ``(config, its use_cache before)`` for :meth:`restore` (:func:`context_parallel` turns the cache off)
        self._use_cache: list[tuple[Any, Any]] = []
        #: what ``method="auto"`` chose and why (``None`` when a method was named)
        self.choice: Choice | None = None

    def shard(self, batch: dict[str, Any]) -> tuple[Callable[[], Any], dict[str, Any]]:
        """``(ctx, local)`` for one micro-batch: ``with ctx(): loss = model(**local).loss``.

        Args:
            batch: identical on every CP rank (see the module docstring); not mutated.

        Returns:
            ``ctx``: a factory of the (single-use) context inside which the model runs the method; ``local``:
            this rank's ``input_ids``, ``position_ids``, ``labels`` / ``shift_labels`` and the batch's
            ``num_items_in_batch`` (the label count of this batch; replace it by the count over all
            micro-batches and data-parallel ranks when accumulating gradients). For the ring method the token
            tensors are cut to this rank's share when ``ctx()`` is entered.

        Raises:
            ValueError: a batch the method cannot compute exactly (the message names the rule and the fix).
            RuntimeError: called after :meth:`restore`.
        """
        if self._restored:
            raise RuntimeError(
                "this context_parallel handle was restored (the model runs its own attention again); call "
                "context_parallel(model, mesh, method=...) again to shard more batches"
            )
        m = self.method
        multiple = m.row_multiple(self.cp_size)[0]
        refusal = self._prepared.packed_refusal  # CP size 1: a model that mixes documents, no method for them
        packed_ok = m.supports_packed or (self.cp_size <= 1 and not refusal)
        canonical, packed = canonical_batch(batch, multiple, packed_ok, refusal or self._packed_fix())
        n_items = int((canonical["labels"] != -100).sum())
        ctx, local = self._batch_fn(self.mesh, canonical)
        local = {k: local[k] for k in _MODEL_KEYS if k in local}
        local["shift_labels"] = local["labels"]  # the same tensor: a ring context shards it in place
        local["num_items_in_batch"] = n_items
        return ctx, local

    def _packed_fix(self) -> str:
        found = alternatives(cached_profile(self.model), exclude=self.method.name, cp_size=self.cp_size, packed=True)
        others = [alternative_label(m, o) for m, o in found]
        fix = (
            f"pass context_parallel(model, mesh, method=...) one of the methods that run packed rows of this "
            f"model: {' | '.join(others)}; or give it one document per row"
            if others
            else "no other method runs packed rows of this model: give it one document per row"
        )
        return (
            f"method={self.method.name} attends across the whole row and would mix the documents, so it is "
            f"refused; {fix}"
        )

    def reduce_gradients(self) -> None:
        """Sum every parameter gradient of the model over the CP group (each rank holds its tokens' share).
        Mutates ``.grad``; skip it when FSDP over a mesh that includes ``cp`` already reduces them."""
        if self.group is None:
            return
        import torch.distributed as dist

        for p in self.model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss: ``loss`` (this rank's share) summed over the CP group (detached copy)."""
        total = loss.detach().clone()
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(total, group=self.group)
        return total

    def restore(self) -> None:
        """Put the model's own attention (and ``use_cache``) back (undo the preparation; mutates the model).
        Idempotent."""
        if not self._restored:
            self._prepared.undo()
            for config, value in self._use_cache:
                config.use_cache = value
            self._restored = True

    def describe(self) -> str:
        """A short text of what was set up: method, CP size, the model's layer kinds, the options."""
        profile = cached_profile(self.model)
        opts = ", ".join(f"{k}={_short(v)}" for k, v in sorted(self.options.items())) or "none"
        p = self._prepared
        if self._restored:
            attn = f"restored: the model runs {p.previous_attn!r} again" if p.switched else "restored"
        elif p.switched:
            attn = f"attention {p.previous_attn!r} -> {p.current_attn!r}"
        else:
            attn = "attention unchanged" + (" (cp_size 1: no context parallelism)" if self.cp_size <= 1 else "")
        if p.single_rank:
            attn += f"; packed rows: {p.single_rank}"
        elif p.packed_refusal:
            attn += "; packed rows refused (the model's own forward mixes their documents)"
        chosen = f" ({self.choice.reason})" if self.choice is not None else ""
        return (
            f"context_parallel: method {self.method.name}{chosen} ({self.method.summary}); cp_size {self.cp_size}; "
            f"{profile.architecture}: {profile.summary()}; options: {opts}; {attn}"
        )

    def __repr__(self) -> str:
        return f"<ContextParallel {self.method.name} cp_size={self.cp_size}>"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choose(model: Any, mesh: Any, options: dict[str, Any]) -> tuple[CPMethod, Choice]:
    """``method="auto"``: the chosen method (its options bound) and the :class:`Choice`; pops auto's own
    options (``packed``, ``seq_len``, ``ranks_per_node``) from ``options`` and adds the chosen keys to it."""
    packed = bool(options.pop("packed", False))
    seq_len = options.pop("seq_len", None)
    node = options.pop("ranks_per_node", None)
    if node is None and os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        node = int(os.environ["LOCAL_WORLD_SIZE"])  # torchrun's processes per node
    _, cp_size, _ = resolve_cp_group(mesh)

    def option_problems(m: CPMethod, chosen: dict[str, Any]) -> list[str]:
        accepted, fn_name = _accepted_options(m)
        unknown = sorted(set(options) - accepted) if accepted is not None else []
        return [f"{fn_name} takes no option {unknown}"] if unknown else []

    choice = choose_cp_method(
        cached_profile(model), cp_size, seq_len=seq_len, packed=packed, ranks_per_node=node,
        extra_problems=option_problems,
    )  # fmt: skip
    options.update(choice.options)
    _log.info("%s", choice.reason)
    return choice.method, choice


def _refuse_sdpa_without_softcap(model: Any) -> None:
    """Refuse a model whose attention soft-caps its logits but runs SDPA (Gemma 2 on transformers 5.17 .. 5.24, which
    let it pick SDPA and drop the cap there): every CP method applies the cap, the one-device model does not, so
    the two would differ. The recipe refuses the same config before loading (``models/loader.py``)."""
    from automodel.errors import UserInputError

    profile = cached_profile(model)
    caps = sorted({layer.softcap for layer in profile.layers if layer.softcap})
    if profile.attn_implementation == "sdpa" and caps:
        raise UserInputError(
            f"{profile.architecture} soft-caps its attention logits (attn_logit_softcapping={caps[0]}) but runs "
            f"attn_implementation='sdpa', which drops the cap on this transformers; load the model with "
            f"attn_implementation='eager'"
        )


def context_parallel(model: Any, mesh: Any, method: str | CPMethod = "thd_docs", **options: Any) -> ContextParallel:
    """Check ``model`` against a CP method and prepare it (once); returns the handle that shards batches.

    Args:
        model: a transformers causal LM (mutated: its attention is switched to the method's).
        mesh: a ``DeviceMesh`` with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None`` (no CP).
        method: a registered method's name (``ring``, ``ulysses``, ``thd``, ``thd_docs``, ``usp``, ...), a
            :class:`CPMethod`, or ``"auto"``: the method that computes every layer of ``model`` exactly and is
            expected to run fastest (:func:`~automodel.distributed.cp.choose.choose_cp_method`; the handle's
            :attr:`ContextParallel.choice` says which and why). ``auto`` takes three options of its own:
            ``packed=True`` when rows hold several documents (default ``False``: a method that attends across
            the row may be chosen, and packed batches are then refused), ``seq_len=`` the row length (default:
            any length, so a window shorter than the row is never left to the first attention call) and
            ``ranks_per_node=`` (default ``$LOCAL_WORLD_SIZE``, else one node).
        options: the method's batch options, e.g. ``kernel=`` (thd), ``cost=`` (thd_docs: the placement's
            cost model, default the model's), ``ulysses_size=`` (usp), ``cp_rotate_method=`` (ring).

    Raises:
        ValueError: an unknown method, or an option its batch function does not take.
        UserInputError / CPUnsupportedError: a model the method does not compute exactly (the registry's
            check: the layers, the reason and the methods that would run it); with ``auto``: a model that no
            method computes exactly (each method's reasons).
    """
    _refuse_sdpa_without_softcap(model)
    choice = None
    if isinstance(method, str) and method == AUTO:
        options = dict(options)
        method, choice = _choose(model, mesh, options)
    m = get_cp_method(method)
    accepted, fn_name = _accepted_options(m)
    if accepted is not None:
        unknown = sorted(set(options) - accepted)
        if unknown:
            raise ValueError(
                f"context_parallel(method={m.name!r}) got options {unknown}, which {fn_name} does not take; "
                f"its options are {sorted(accepted) or 'none'}: drop the others"
            )
    group, cp_size, _ = resolve_cp_group(mesh)
    m = m.configured(_Options(cp_size, options))
    check_model_config_for_cp(m, cached_profile(model), cp_size)
    use_cache = cache_off(model)  # a cache turns transformers' per-document masks off (and CP runs no cache)
    # CP size 1: rows may be packed; the model's own forward runs them only where it keeps documents apart
    batch_fn, prepared = bind_cp_method(m, model, mesh, cp_size, packed=None if cp_size <= 1 else False, **options)
    handle = ContextParallel(model, mesh, m, cp_size, group, batch_fn, prepared, options)
    handle._use_cache = use_cache
    handle.choice = choice
    return handle

