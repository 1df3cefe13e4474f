"""Compile-time bookkeeping for ``model.compile`` / compiled autograd, and fixed-length batches.

- :class:`CompileClock` reads torch's own counters: seconds spent compiling (dynamo frame compiles
  and compiled-autograd backward compiles) and graphs compiled. The trainer takes a reading per
  step, so ``compile_time_s`` is reported apart from ``step_time_s`` and every (re)compile is counted.
- :func:`pad_batch_to_length` right-pads a batch to one fixed length, so compiled code with static
  shapes is not recompiled for a shorter batch. Right padding with ``labels = -100`` is exact for
  causal attention (no real token attends to a later position; see :mod:`automodel.data.collator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CompileReading", "CompileClock", "pad_batch_to_length"]


@dataclass(frozen=True)
class CompileReading:
    """Totals since the process started: ``seconds`` compiling, ``graphs`` compiled (fwd + bwd)."""

    seconds: float
    graphs: int


class CompileClock:
    """``delta()`` returns the compile seconds and graphs since the previous call."""

    def __init__(self) -> None:
        self._last = self.read()

    @staticmethod
    def read() -> CompileReading:
        from automodel.distributed.compiled_autograd import compiled_autograd_compiles
        from automodel.distributed.torch_internals import dynamo_calculate_time_spent, dynamo_counters

        spent = dynamo_calculate_time_spent()
        graphs = int(dynamo_counters()["stats"]["unique_graphs"]) + compiled_autograd_compiles()
        return CompileReading(seconds=float(spent.get("total_wall_time", 0.0)), graphs=graphs)

    def delta(self) -> CompileReading:
        now = self.read()
        out = CompileReading(seconds=now.seconds - self._last.seconds, graphs=now.graphs - self._last.graphs)
        self._last = now
        return out


# key -> value written into the padding (position_ids continue the row: last + 1, last + 2, ...)
_PAD = {"input_ids": 0, "labels": -100, "loss_mask": 0, "attention_mask": 0, "position_ids": None}


def pad_batch_to_length(batch: dict[str, Any], length: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Right-pad the ``[B, S]`` tensors of ``batch`` to ``[B, length]``; return a new dict.

    ``input_ids`` get ``pad_token_id``, ``labels`` -100, ``loss_mask`` / ``attention_mask`` 0,
    ``position_ids`` continue from each row's last value. Packed rows (``seq_lens_padded`` ``[B, P]``,
    -1000 after the last document) count the padding in each row's last document's padded length,
    as the collator does. A batch already ``length`` long is returned unchanged.

    Raises:
        ValueError: the batch is longer than ``length``.
    """
    seq = batch["input_ids"].shape[1]
    if seq > length:
        raise ValueError(
            f"batch of sequence length {seq} is longer than the fixed compile length {length}; "
            f"set data.seq_len >= {seq}"
        )
    pad = length - seq
    if pad == 0:
        return batch
    out = dict(batch)
    for key, fill in _PAD.items():
        t = batch.get(key)
        if not isinstance(t, torch.Tensor) or t.ndim != 2:
            continue
        if key == "position_ids":
            tail = t[:, -1:] + torch.arange(1, pad + 1, dtype=t.dtype, device=t.device)
        else:
            tail = torch.full((t.shape[0], pad), pad_token_id if key == "input_ids" else fill, dtype=t.dtype,
                              device=t.device)  # fmt: skip
        out[key] = torch.cat([t, tail], dim=1)
    sp = batch.get("seq_lens_padded")
    if isinstance(sp, torch.Tensor):
        sp = sp.clone()
        last = (sp >= 0).sum(dim=1) - 1  # index of each row's last document
        rows = torch.arange(sp.shape[0], device=sp.device)
        sp[rows, last] += pad
        out["seq_lens_padded"] = sp
    return out
