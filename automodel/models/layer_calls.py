"""How often one forward of a model calls each of its decoder layers, where that is not once each.

Most causal LMs call each decoder layer once per forward. Looped (recurrent-depth) models run some layers again:

* **Dory** (``n_input_layers``, ``n_recurrent_layers``, ``n_output_layers``, ``n_recurrent_loops``): the input
  layers once, the recurrent slice ``n_recurrent_loops`` times, the output layers once, each slice taken as its
  forward takes it (``layers[:n_input]``, ``layers[n_input:n_input + n_recurrent]``, ``layers[L - n_output:]``: the
  slices overlap where the counts exceed the layers, as in a small config).
* **Inkling2-loop** (``loop_layer_index_start``, ``loop_layer_index_end``, ``loop_num_passes``): the layers before
  the loop once, ``layers[start:end]`` ``loop_num_passes`` times, the rest once.
* **HRM** (``H_cycles``, ``L_cycles``, ``L_bp_cycles``, ``num_layers_per_stack``): two stacks of
  ``num_layers_per_stack`` layers, the L stack's first. Each high cycle runs the L stack ``L_cycles`` times, only
  the last ``L_bp_cycles[h]`` of them with autograd (the list left-padded with 1s to ``H_cycles``; the others under
  ``torch.no_grad``), then the H stack once. Its ``num_hidden_layers`` counts the cache slots
  (``num_layers_per_stack H_cycles (L_cycles + 1)``), not the layers.

Every call autograd records saves that layer's activations again (or, checkpointed, its input) and costs its FLOPs
again; a call under ``no_grad`` saves nothing and costs a forward. The memory plan and the step estimate count the
calls (:class:`LayerCalls`) where :func:`layer_calls` knows the scheme. ``tests/test_layer_calls.py`` counts every
family's calls with forward hooks against it: a model that starts to loop its layers fails there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LayerCalls", "layer_calls"]


@dataclass(frozen=True)
class LayerCalls:
    """Per decoder layer (in :func:`automodel.models.parallelize.decoder_layers`' order), its calls in one forward."""

    grad: tuple[int, ...]  # calls autograd records (each saves the layer's activations)
    no_grad: tuple[int, ...]  # calls under torch.no_grad (HRM's early L cycles): a forward, nothing saved
    #: passes over a run of layers with autograd beyond the first: each keeps one more ``[N, h]`` outside the layers
    #: (the hidden state that starts or ends the pass: Dory's loop norm's input, HRM's stack output summed into the
    #: next cycle's input), measured with checkpointing on CPU (``tests/test_memory_plan_kinds.py``)
    restarts: int = 0

    @property
    def total(self) -> int:
        """Calls autograd records, over all layers."""
        return sum(self.grad)

    @property
    def total_no_grad(self) -> int:
        return sum(self.no_grad)


def _slice_counts(modules: int, *slices: tuple[slice, int]) -> tuple[int, ...]:
    counts = [0] * modules
    for where, times in slices:
        for i in range(modules)[where]:
            counts[i] += times
    return tuple(counts)


def _ints(config: Any, *keys: str) -> list[int] | None:
    values = [getattr(config, key, None) for key in keys]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        return values
    return None


def layer_calls(config: Any, modules: int) -> LayerCalls | None:
    """The calls of each of ``modules`` decoder layers in one training forward of a model with (text) ``config``;
    ``None`` where the model calls each layer once (or its scheme is not one of the module docstring's).

    Pure: reads ``config`` only. ``modules``: the decoder layers the model holds (``len(decoder_layers(model))``)."""
    if modules <= 0:
        return None
    dory = _ints(config, "n_input_layers", "n_recurrent_layers", "n_output_layers", "n_recurrent_loops",
                 "num_hidden_layers")  # fmt: skip
    if dory is not None:
        n_in, n_rec, n_out, loops, total = dory
        grad = _slice_counts(modules, (slice(None, n_in), 1), (slice(n_in, n_in + n_rec), loops),
                             (slice(total - n_out, None), 1))  # fmt: skip
        # each loop iteration renormalizes and sums the hidden state, whether its slice holds layers or not
        return _unless_once(grad, (0,) * modules, max(loops - 1, 0))
    inkling = _ints(config, "loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")
    if inkling is not None:
        start, end, passes = inkling
        grad = _slice_counts(modules, (slice(None, start), 1), (slice(start, end), passes), (slice(end, None), 1))
        return _unless_once(grad, (0,) * modules, _repeats(modules, slice(start, end), passes))
    hrm = _ints(config, "H_cycles", "L_cycles", "num_layers_per_stack")
    if hrm is not None and modules == 2 * hrm[2]:
        high, low, per_stack = hrm
        raw = list(getattr(config, "L_bp_cycles", None) or [])
        padded = [1] * max(0, high - len(raw)) + raw
        with_grad = sum(min(max(padded[h] if h < len(padded) else 1, 0), low) for h in range(high))
        grad = (with_grad,) * per_stack + (high,) * per_stack
        no_grad = (high * low - with_grad,) * per_stack + (0,) * per_stack
        return _unless_once(grad, no_grad, with_grad + high - 1)  # the stacks' passes with autograd, but the first
    return None


def _repeats(modules: int, where: slice, passes: int) -> int:
    """Passes over ``layers[where]`` beyond the first (0 where the slice holds no layer)."""
    return max(passes - 1, 0) if len(range(modules)[where]) else 0


def _unless_once(grad: tuple[int, ...], no_grad: tuple[int, ...], restarts: int) -> LayerCalls | None:
    if all(g == 1 for g in grad) and not any(no_grad):
        return None
    return LayerCalls(grad, no_grad, restarts)
