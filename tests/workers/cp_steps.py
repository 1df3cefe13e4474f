"""Data, one-process references and gradient sums shared by the CP parity workers.

- :func:`packed_documents`: random documents and their packed row (each padded to a multiple of ``2 * world``,
  ``seq_lens`` / ``seq_lens_padded``), and :func:`documents_reference`: each document run alone;
- :func:`unpacked_rows` and :func:`rows_reference`: plain rows and their one-process step;
- :func:`sum_ce`, :func:`take_grads`: the summed token cross-entropy (fp64) and the gradients taken off a model;
- :func:`reduce_flat` (one fp64 all-reduce of every gradient and the loss) and :func:`reduce_over_group`
  (loss and gradients summed in their own dtype, one all-reduce per parameter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy in fp64 of ``logits [..., V]`` against ``labels [...]`` (``-100`` ignored)."""
    return F.cross_entropy(logits.double().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")


def take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient as fp64 copies; zeroes the model's gradients (``set_to_none``)."""
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def packed_documents(
    lengths: Sequence[int], vocab: int, world: int, seed: int = 7
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Documents of ``lengths`` real tokens (ids ``[L + 1]`` int64, the last one the next-token label) and their
    packed row ``[1, T]``, every document padded to a multiple of ``2 * world`` (pad labels ``-100``)."""
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, vocab, (n + 1,), generator=gen) for n in lengths]
    multiple = 2 * world
    ids, labels, pos, lens, padded = [], [], [], [], []
    for d in docs:
        n = len(d) - 1
        p = -(-n // multiple) * multiple
        ids.append(torch.cat([d[:-1], torch.zeros(p - n, dtype=torch.long)]))
        labels.append(torch.cat([d[1:], torch.full((p - n,), -100)]))
        pos.append(torch.arange(p))
        lens.append(n)
        padded.append(p)
    row = {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None], "position_ids": torch.cat(pos)[None],
           "seq_lens": torch.tensor([lens]), "seq_lens_padded": torch.tensor([padded])}
    return docs, row


def documents_reference(model: torch.nn.Module, docs: list[torch.Tensor]) -> tuple[float, dict]:
    """One process, each document alone: the loss (sum over every document / all their labels) and the
    gradients (:func:`take_grads`)."""
    count = sum(len(d) - 1 for d in docs)
    total = 0.0
    for d in docs:
        logits = model(input_ids=d[None, :-1], position_ids=torch.arange(len(d) - 1)[None], use_cache=False).logits
        loss = sum_ce(logits, d[None, 1:]) / count
        loss.backward()
        total += loss.item()
    return total, take_grads(model)


def unpacked_rows(vocab: int, seed: int = 11) -> dict[str, torch.Tensor]:
    """Two unpacked rows of 24 tokens (``input_ids`` / ``labels`` ``[2, 24]`` int64): 2*cp chunks of 6 (cp=2)
    or 3 (cp=4)."""
    ids = torch.randint(3, vocab, (2, 25), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()}


def rows_reference(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> tuple[float, dict]:
    """One process on ``rows``: the loss (sum / label count) and the gradients (:func:`take_grads`)."""
    count = int((rows["labels"] != -100).sum())
    loss = sum_ce(model(input_ids=rows["input_ids"], use_cache=False).logits, rows["labels"]) / count
    loss.backward()
    return loss.item(), take_grads(model)


def reduce_flat(model: torch.nn.Module, loss: torch.Tensor, group) -> tuple[float, dict]:
    """The loss and every gradient (zeros where a parameter has none) summed over ``group`` in ONE fp64
    all-reduce."""
    params = list(model.named_parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten() for _, p in params]
                     + [loss.detach().double().reshape(1)])
    dist.all_reduce(flat, group=group)
    grads, at = {}, 0
    for n, p in params:
        grads[n] = flat[at : at + p.numel()].view(p.shape)
        at += p.numel()
    return flat[-1].item(), grads


def sum_over_group(tensors: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor]:
    """Each tensor of ``tensors`` summed over ``group`` (``None``: the default group), in its own dtype, as new
    tensors (the inputs are not changed): one all-reduce per dtype over the tensors concatenated. One all-reduce
    per tensor cost ~2 ms of gloo latency each, a third of a layer-kinds launch's time."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for n, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(n)
    out = {}
    for names in by_dtype.values():
        flat = torch.cat([tensors[n].detach().reshape(-1) for n in names])
        dist.all_reduce(flat, group=group)
        for n, part in zip(names, flat.split([tensors[n].numel() for n in names]), strict=True):
            out[n] = part.view(tensors[n].shape)
    return {n: out[n] for n in tensors}


def reduce_over_group(model: torch.nn.Module, loss_sum: torch.Tensor, group) -> tuple[torch.Tensor, dict]:
    """``loss_sum`` and every gradient (zeros where a parameter has none) summed over ``group``, each in its own
    dtype (:func:`sum_over_group`); the model's gradients are not changed."""
    loss = loss_sum.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    return loss, sum_over_group(grads, group)
