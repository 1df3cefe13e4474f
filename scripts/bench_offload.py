#!/usr/bin/env python
"""What activation offload and optimizer offload take off the device, measured on CPU (issue 35).

On a CPU the "device" and the host are the same memory, so RSS cannot show what moved. This script tracks
allocations instead: a ``TorchDispatchMode`` counts the bytes of every storage an op creates until it is
freed (the way a device allocator would), and what the offload code allocates on the host (the store's
pool, filled by a warm-up step before tracking starts; the host optimizer's step) is not counted. Figures
per sequence length, one process, a Llama-shaped model with activation checkpointing:

- ``peak``: the tracked peak of one training step (forward, loss, backward, two AdamW steps), with
  checkpointing alone, with activation offload, with activation offload and ``fsdp.offload=optimizer``;
- ``held``: tracked bytes held after the forward (what the backward needs);
- ``planner``: the memory planner's terms these techniques remove:
  activation offload ``(L - 2) * B * S * H * bytes`` from the peak (all checkpointed layer inputs but the one
  being recomputed and the one prefetched), optimizer offload the AdamW state ``2 * P * bytes``;
- ``host``: the host bytes each needs (the pool of layer-input buffers; the host parameter copies, gradient
  buffers and optimizer state).

    nice python scripts/bench_offload.py
    nice python scripts/bench_offload.py --seq-lens 512 1024 --layers 4
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.training.activation_offload import apply_activation_offload  # noqa: E402
from automodel.training.optimizer_offload import HostOffloadOptimizer  # noqa: E402

MIB = 2**20


class AllocationTracker(TorchDispatchMode):
    """Bytes of the live storages that ops create while active (``current``, ``peak``): an output sharing an
    input's storage (a view, an in-place op) is not new memory. :meth:`host` pauses it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        self.paused = False

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = {id(t.untyped_storage()) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if (
                    key not in self.live and key not in inputs
                ):  # new memory (not a view or an in-place result)
                    self.live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out

    @contextlib.contextmanager
    def host(self):  # noqa: ANN201
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


def _model(layers: int, hidden: int, seq: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, vocab_size=512,
                      max_position_embeddings=seq)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def measure(seq: int, layers: int, hidden: int, act_offload: bool, opt_offload: bool) -> dict:
    """One configuration: a warm-up forward + backward (untracked: the store's pool fills), then a tracked
    forward + backward and a tracked first optimizer step (the step that creates the optimizer state)."""
    model = _model(layers, hidden, seq)
    store = apply_activation_offload(model) if act_offload else None

    def adamw(params: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-4)

    params = list(model.parameters())
    opt = HostOffloadOptimizer(params, adamw) if opt_offload else adamw(params)
    ids = torch.randint(0, 512, (1, seq), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    model.zero_grad(set_to_none=True)
    tracker = AllocationTracker()
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        held = tracker.current  # what the backward needs (the logits' and the loss's included)
        loss.backward()
        del loss
    step_tracker = AllocationTracker()
    with step_tracker:
        if opt_offload:
            with step_tracker.host():  # the host optimizer's allocations are host memory
                opt.step()
        else:
            opt.step()
    return {
        "peak": tracker.peak,  # forward + backward, gradients included
        "held": held,
        "state": step_tracker.current,  # device bytes the optimizer step left allocated: its state
        "host": (store.peak_host_bytes() if store else 0) + (opt.host_bytes() if opt_offload else 0),
        "params": sum(p.numel() * p.element_size() for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L, H = args.layers, args.hidden  # noqa: N806
    print(f"Llama-shaped, {L} layers, hidden {H}, fp32, batch 1, activation checkpointing on; MiB")
    print(f"{'seq':>6} | {'fwd+bwd peak':>12} {'with act':>8} {'removed':>8} {'planner':>8} {'host':>6} {'held':>6} {'with act':>8} | "
          f"{'opt state':>9} {'with opt':>8} {'planner':>8} {'host':>6}")  # fmt: skip
    for seq in args.seq_lens:
        base = measure(seq, L, H, False, False)
        both = measure(seq, L, H, True, True)
        act_plan = (L - 2) * seq * H * 4
        print(
            f"{seq:>6} | {base['peak'] / MIB:12.1f} {both['peak'] / MIB:8.1f} {(base['peak'] - both['peak']) / MIB:8.1f} "
            f"{act_plan / MIB:8.1f} {both['host'] / MIB - 4 * both['params'] / MIB:6.1f} {base['held'] / MIB:6.1f} {both['held'] / MIB:8.1f} | "
            f"{base['state'] / MIB:9.1f} "
            f"{both['state'] / MIB:8.1f} {2 * base['params'] / MIB:8.1f} {4 * both['params'] / MIB:6.1f}"
        )


if __name__ == "__main__":
    main()
