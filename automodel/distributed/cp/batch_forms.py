"""Which CP method computes which batch form exactly: the one table, the classifier, the one refusal.

A *batch form* is a property of an own-loop batch that changes the numbers a model computes: position_ids
that restart (documents packed transformers-style), ``seq_lens`` (packed rows), an ``attention_mask`` with
zeros (right padding, left padding, a hidden real token), a ``loss_mask``, mRoPE positions. Each CP method
either computes a form exactly as transformers does in one process, or refuses it
(``docs/batch_forms.md``; the matrix of ``tests/test_batch_forms.py`` runs every method on every form
and checks :data:`COMPUTES` against what actually happens).

Every own-loop batch function calls :func:`check_batch_forms` first::

    check_batch_forms("ring", batch)   # ValueError naming the method, the form and the methods that compute it

The reference semantics are transformers' (5.x, ``masking_utils``): a row's documents are where
``position_ids`` do not increase by exactly 1, but only when no ``attention_mask`` is given (with a mask,
transformers attends across the restarts); ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` (``-1000``
padding) describe documents explicitly, and each document is computed as if alone; ``attention_mask``
zeros hide keys; 3-D ``position_ids`` ``[3, B, S]`` are mRoPE positions that never mark documents, and
``[4, B, S]`` carry text positions in row 0 (whose restarts do mark documents, as in Qwen2-VL).

Pure torch (and :mod:`automodel.errors`): every method package and batch function may import it.
"""

from __future__ import annotations

from typing import Any

import torch

from automodel.errors import UserInputError

__all__ = [
    "BATCH_FORMS",
    "COMPUTES",
    "METHOD_ORDER",
    "OWN_LOOP_FUNCTIONS",
    "BatchFormError",
    "batch_form_problem",
    "check_batch_forms",
    "classify_batch",
    "methods_computing",
]

#: Every batch form, in the order refusals and tables list them: name -> what the batch has (completes
#: "the batch ..."), and how to make it computable when a method refuses it (``{form}``: the methods that
#: compute that form).
BATCH_FORMS: dict[str, tuple[str, str]] = {
    "plain": ("has one sequence per row and no mask", ""),
    "restarts": (
        "has position_ids that restart inside a row (documents packed transformers-style) and no seq_lens "
        "describing those documents",
        "or pass seq_lens / seq_lens_padded [B, P] that describe the documents (computed by {seq_lens})",
    ),
    "seq_lens": ("has packed rows (several documents per row in seq_lens / seq_lens_padded [B, P])", ""),
    "seq_lens_only": (
        "has packed rows given by seq_lens [B, P] (or cu_seqlens) alone (several documents per row, no "
        "seq_lens_padded)",
        "or pass seq_lens_padded too, equal to seq_lens where documents carry no padding ({seq_lens})",
    ),
    "right_padding": (
        "has an attention_mask with zeros after a row's last real token (right padding)",
        "or drop the attention_mask and set the padded labels to -100 (exact under causal attention)",
    ),
    "left_padding": (
        "has left padding: its attention_mask has a padding slot before a real token at the start of a row",
        "or pad on the right (the collators do)",
    ),
    "masked_token": ("has an attention_mask that hides a real token between real tokens", ""),
    "loss_mask": ("has a loss_mask [B, S]", ""),
    "restarts_and_mask": (
        "has position_ids that restart inside a row together with an attention_mask (transformers then "
        "ignores the restarts and attends across them; without the mask it takes them as document boundaries)",
        "or drop the attention_mask (the restarts then mark documents: {restarts}) or pass seq_lens / "
        "seq_lens_padded [B, P] ({seq_lens})",
    ),
    "mrope": ("has mRoPE position_ids [3, B, S]", ""),
    "mrope_text": (
        "has position_ids [4, B, S] (text positions in row 0, whose restarts mark documents, then mRoPE)",
        "or, when every row is one document, pass only the mRoPE rows position_ids[1:] [3, B, S] ({mrope})",
    ),
}

#: The registered built-in methods, in the order refusals name them.
METHOD_ORDER: tuple[str, ...] = ("ring", "ulysses", "thd", "thd_docs", "usp")

#: Each method's own-loop batch function (the name a user calls; its module may move, the name stays).
OWN_LOOP_FUNCTIONS: dict[str, str] = {
    "ring": "make_cp_batch_and_ctx",
    "ulysses": "make_ulysses_batch_and_ctx",
    "thd": "make_thd_batch_and_ctx",
    "thd_docs": "make_doc_batch_and_ctx",
    "usp": "make_usp_batch_and_ctx",
}

_THD_FORMS = ("plain", "seq_lens", "right_padding", "loss_mask", "restarts_and_mask", "mrope", "mrope_text")

#: THE table: the batch forms each method computes exactly (against transformers in one process). Every
#: other form is refused by :func:`check_batch_forms`. tests/test_batch_forms.py runs each cell.
COMPUTES: dict[str, frozenset[str]] = {
    # ring attention is plain causal over the whole row: no masks, no documents
    "ring": frozenset({"plain", "loss_mask", "restarts_and_mask", "mrope"}),
    # the inner kernel runs on the whole row with the global mask: documents, padding, any hole
    "ulysses": frozenset(
        {
            "plain", "restarts", "seq_lens", "seq_lens_only", "right_padding", "left_padding", "masked_token",
            "loss_mask", "mrope",
        }
    ),
    # per-document causal attention from seq_lens_padded; a mask may only cut each row's tail
    # (mRoPE rows go with their tokens; the documents come from seq_lens, never from a mask)
    "thd": frozenset(_THD_FORMS),
    "thd_docs": frozenset(_THD_FORMS),
    "usp": frozenset(_THD_FORMS),
}


class BatchFormError(UserInputError):
    """A batch form the chosen CP method would compute differently from one process (a ``ValueError``; the
    recipe prints it as one ``error:`` line)."""


def _restarts(pos: torch.Tensor, doc_starts: torch.Tensor | None) -> bool:
    """Whether ``pos`` ``[B|1, S]`` restarts (a step other than +1) anywhere but at ``doc_starts`` ``[B, S]``."""
    if pos.shape[-1] < 2:
        return False
    new = torch.diff(pos.long(), dim=-1) != 1  # [B, S-1]: token j+1 starts a new document
    if doc_starts is not None:
        new = new & ~doc_starts[..., 1:].to(new.device)
    return bool(new.any())


def _document_starts(seq_lens: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """``[B, S]`` bool: True where a document of ``seq_lens`` ``[B, P]`` starts; ``None`` if malformed."""
    lens = seq_lens.long().clamp(min=0)
    ends = lens.cumsum(-1)
    starts = torch.zeros(lens.shape[0], seq_len + 1, dtype=torch.bool, device=lens.device)
    first = (ends - lens).clamp(max=seq_len)
    starts.scatter_(1, first.masked_fill(lens == 0, seq_len), True)  # empty documents write the spare column
    return starts[:, :seq_len]


def _packing_slack(batch: dict[str, Any], shape: torch.Size, device: torch.device) -> torch.Tensor | None:
    """``[B, S]`` bool: each packed document's padding ``[seq_len, seq_len_padded)``; ``None`` without both
    ``seq_lens`` and ``seq_lens_padded`` (or when they do not fit ``shape``)."""
    lens, padded = batch.get("seq_lens"), batch.get("seq_lens_padded")
    if not (isinstance(lens, torch.Tensor) and isinstance(padded, torch.Tensor)):
        return None
    if lens.dim() != 2 or lens.shape != padded.shape or lens.shape[0] != shape[0]:
        return None
    slack = torch.zeros(shape, dtype=torch.bool)
    for b in range(shape[0]):
        at = 0
        for n, p in zip(lens[b].tolist(), padded[b].tolist()):
            if p <= 0:
                continue
            slack[b, at + max(n, 0) : at + p] = True
            at += p
    return slack.to(device)


def classify_batch(batch: dict[str, Any]) -> list[str]:
    """The batch forms of an own-loop ``batch`` (in :data:`BATCH_FORMS` order; ``["plain"]`` when none).

    Reads, never mutates: ``position_ids`` (``[B|1, S]``, mRoPE ``[3|4, B, S]``), ``seq_lens`` /
    ``seq_lens_padded`` ``[B, P]`` (entries <= 0 are padding), ``attention_mask`` ``[B, S]``, ``loss_mask``.
    Malformed entries are skipped: the method's own validation reports them.
    """
    forms: set[str] = set()
    pos = batch.get("position_ids")
    mask = batch.get("attention_mask")
    lens = batch.get("seq_lens_padded")
    if not isinstance(lens, torch.Tensor):
        lens = batch.get("seq_lens")
    cu = batch.get("cu_seqlens")
    if not isinstance(lens, torch.Tensor) and isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() > 1:
        lens = torch.diff(cu.long())[None]  # one packed row (Ulysses' cu_seqlens)
    doc_starts = None
    if isinstance(lens, torch.Tensor) and lens.dim() == 2:
        if bool(((lens > 0).sum(-1) > 1).any()):
            forms.add("seq_lens" if isinstance(batch.get("seq_lens_padded"), torch.Tensor) else "seq_lens_only")
        seq_len = pos.shape[-1] if isinstance(pos, torch.Tensor) and pos.dim() >= 2 else int(lens.clamp(min=0).sum(-1).max())
        doc_starts = _document_starts(lens, seq_len)
    if isinstance(pos, torch.Tensor):
        text = None
        if pos.dim() == 3 and pos.shape[0] == 3:
            forms.add("mrope")
        elif pos.dim() == 3 and pos.shape[0] == 4:
            forms.add("mrope_text")
            text = pos[0]
        elif pos.dim() == 2:
            text = pos
        if text is not None and doc_starts is not None and doc_starts.shape[-1] != text.shape[-1]:
            doc_starts = None
        if text is not None and _restarts(text, doc_starts):
            forms.add("restarts_and_mask" if isinstance(mask, torch.Tensor) else "restarts")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.bool().all()):
        real = mask.bool()
        slack = _packing_slack(batch, real.shape, real.device)
        if slack is not None and bool((~real & slack).any()):
            forms.add("right_padding")  # zeros on a packed document's own tail padding
            real = real | slack
        idx = torch.arange(real.shape[1], device=real.device).expand_as(real)
        any_real = real.any(-1, keepdim=True)
        first = torch.where(real, idx, real.shape[1]).min(-1, keepdim=True).values
        last = torch.where(real, idx, -1).max(-1, keepdim=True).values
        hole = ~real & any_real
        if bool((hole & (idx < first)).any()):
            forms.add("left_padding")
        if bool((hole & (idx > last)).any()) or bool((~any_real).any()):
            forms.add("right_padding")
        if bool((hole & (idx > first) & (idx < last)).any()):
            forms.add("masked_token")
    if isinstance(batch.get("loss_mask"), torch.Tensor):
        forms.add("loss_mask")
    return [f for f in BATCH_FORMS if f in forms] or ["plain"]


def methods_computing(form: str) -> list[str]:
    """The methods of :data:`COMPUTES` that compute ``form`` exactly, in :data:`METHOD_ORDER`."""
    return [m for m in METHOD_ORDER if form in COMPUTES.get(m, frozenset())]


def batch_form_problem(method: str, form: str) -> str:
    """The refusal of ``form`` by ``method``: the method, the form, the methods that compute it, the fix."""
    what, fix = BATCH_FORMS[form]
    fix = fix.format(**{f: " | ".join(methods_computing(f)) for f in BATCH_FORMS})
    others = [m for m in methods_computing(form) if m != method]
    if others:
        run = (
            f"methods that compute it: {' | '.join(others)} (distributed.cp_method=...; own loop: "
            f"{', '.join(OWN_LOOP_FUNCTIONS[m] for m in others)})"
        )
    else:
        run = "no CP method computes it"
    return (
        f"cp_method {method} ({OWN_LOOP_FUNCTIONS.get(method, 'its batch function')}) does not compute this batch "
        f"exactly: the batch {what}. It would train with numbers that differ from one process, so it is refused; "
        f"{run}{'; ' + fix if fix else ''}. See docs/batch_forms.md"
    )


def check_batch_forms(method: str, batch: dict[str, Any]) -> list[str]:
    """Refuse ``batch`` if ``method`` does not compute one of its forms exactly; return the forms.

    Args:
        method: a name of :data:`COMPUTES` (an unknown name computes only ``plain``).
        batch: the own-loop batch, as the user gave it (not mutated).

    Raises:
        BatchFormError: (a :class:`~automodel.errors.UserInputError`, a ``ValueError``) the first form ``method`` does not compute, with the methods that do.
    """
    forms = classify_batch(batch)
    computes = COMPUTES.get(method, frozenset({"plain"}))
    for form in forms:
        if form not in computes:
            raise BatchFormError(batch_form_problem(method, form))
    return forms
