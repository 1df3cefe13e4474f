"""The one wrapper around each decoder block's ``forward`` that the per-block techniques share.

Activation checkpointing (``model.activation_checkpointing``), ``torch.compile`` of the blocks
(``model.compile``) and activation offload (``model.activation_offload``, in ``automodel.training``) all act
on a decoder block's call. They compose in one fixed order, whatever order they are applied in, whatever
FSDP2 does to the module's class and whatever transformers release is installed::

    block(...)                      nn.Module.__call__: the module hooks (FSDP2's unshard / reshard, TP's
                                    redistribution) run around everything below, once per call
      BlockCall.__call__            the instance's ``forward``
        outer context               activation offload's saved-tensor hooks (only what the checkpoint
                                    saves outside its own hooks reaches them: the block's input)
          group context             checkpoint groups' hooks (model.checkpoint_group_layers): the input
                                    kept (a group's first block, through the offload's hooks) or dropped
          checkpoint                torch.utils.checkpoint, non-reentrant (recomputes in the backward)
            inner forward           the compiled forward (model.compile), or the class's own ``forward``
                                    looked up on ``type(block)`` at call time

Why it is ours and not transformers': transformers checkpoints in a version-dependent place. Up to 5.2x
``GradientCheckpointingLayer.__call__`` checkpoints around the module hooks; from 5.25 the class's
``forward`` is wrapped per subclass and only the outermost wrapper checkpoints. A wrapper on the
instance's ``forward`` made before FSDP2 swaps the class for its ``FSDP<Block>`` subclass (compile,
offload) then calls the old class's ``forward``, which is no longer the outermost: nothing is checkpointed,
and offload's hooks see every activation of the block (issue 41). Here transformers' own flag stays off
(its wrappers pass straight through), and the checkpoint is ours.

Each block's :class:`BlockCounts` says what happened (calls, checkpointed calls, recomputations in the
backward): the run log reports them after the first step (``automodel.training.technique_report``), and
tests fail when a block is not recomputed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from automodel.distributed.cp.profile import text_config
from automodel.errors import UserInputError

__all__ = [
    "BlockCall",
    "BlockCounts",
    "apply_activation_checkpointing",
    "block_call",
    "block_calls",
    "decoder_layers",
    "layers_owner",
    "outermost_blocks",
]

logger = logging.getLogger(__name__)

_ATTR = "_automodel_block_call"
#: the keyword arguments transformers' layers take a KV cache under; a recomputed block must not write it twice
_CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")


@dataclass
class BlockCounts:
    """What one block's call did since the last :meth:`reset` (counts of calls)."""

    calls: int = 0  # forward calls (training and evaluation)
    checkpointed: int = 0  # calls run under the checkpoint (training mode, grad enabled)
    recomputed: int = 0  # recomputations of a checkpointed call in the backward
    input_tensors: int = 0  # tensors among the positional inputs of the checkpointed calls (what it keeps)

    def reset(self) -> None:
        self.calls = self.checkpointed = self.recomputed = self.input_tensors = 0


class BlockCall:
    """A decoder block's ``forward``: ``outer`` context ⊃ checkpoint ⊃ ``inner`` forward (see the module docstring).

    Attributes:
        block: the decoder block (an ``nn.Module``).
        inner: the forward to run (a compiled one), or ``None`` for ``type(block).forward`` at call time.
        checkpoint: recompute the block in the backward (non-reentrant) when training with grad enabled.
        outer: a factory of the context entered around the checkpointed call (activation offload), or ``None``.
        group: the block's place in a checkpoint group (``automodel.models.checkpoint_groups``), or ``None``.
        replaying: set while a checkpoint group runs the block forward again in the backward: the plain forward.
        counts: :class:`BlockCounts`.
    """

    def __init__(self, block: nn.Module):
        self.block = block
        self.inner: Callable[..., Any] | None = None
        self.checkpoint = False
        self.outer: Callable[[], contextlib.AbstractContextManager] | None = None
        self.group: Any = None  # a checkpoint_groups.GroupSlot
        self.replaying = False
        self.counts = BlockCounts()

    def _forward(self) -> Callable[..., Any]:
        if self.inner is not None:
            return self.inner
        block = self.block
        cls_forward = type(block).forward  # after FSDP2's class swap: its subclass's (same code)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return cls_forward(block, *args, **kwargs)

        return forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        counts = self.counts
        inner = self._forward()
        if self.replaying:  # a checkpoint group rebuilding the next layer's input in the backward
            return inner(*args, **kwargs)
        counts.calls += 1
        if not (self.checkpoint and self.block.training and torch.is_grad_enabled()):
            return inner(*args, **kwargs)
        kwargs = self._without_cache(kwargs)
        counts.checkpointed += 1
        counts.input_tensors += sum(isinstance(a, torch.Tensor) for a in args)
        runs = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal runs
            runs += 1
            if runs > 1:  # the checkpoint's recomputation, in the backward
                counts.recomputed += 1
            return inner(*a, **k)

        outer = self.outer() if self.outer is not None else contextlib.nullcontext()
        group = self.group.saving(self, args, kwargs) if self.group is not None else contextlib.nullcontext()
        with outer, group:
            out = checkpoint(run, *args, use_reentrant=False, **kwargs)
        if self.group is not None:
            self.group.finished(out)
        return out

    def _without_cache(self, kwargs: dict) -> dict:
        """A recomputed block must not update a KV cache a second time: the cache arguments dropped (as
        transformers does under its checkpointing), unless the block only reads the cache."""
        if getattr(self.block, "_can_checkpoint_with_cache", False):
            names: tuple[str, ...] = ()
        else:
            names = _CACHE_KWARGS
        dropped = [n for n in names if kwargs.get(n) is not None]
        if not dropped and not kwargs.get("use_cache"):
            return kwargs
        kwargs = {**kwargs, **{n: None for n in dropped}}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        return kwargs


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of ``model``, outermost only: modules whose class (or a base of it: FSDP2's
    ``FSDP<Block>`` made at run time) is named in ``_no_split_modules``, in ``model.modules()`` order.

    Some models name a block and a part of it (Mamba: ``MambaBlock`` and its ``MambaMixer``; Zamba: the hybrid
    layer and the Mamba layer inside it): the part is left out, since it belongs to its block (FSDP2 cannot shard
    a parameter that its block's ``fully_shard`` already made a ``DTensor``; one checkpoint per region).

    Raises:
        ValueError: no such modules are found (the model does not name its blocks).
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers: list[nn.Module] = []
    inside: set[int] = set()  # modules below a block already listed (modules() visits a block before its parts)
    for m in model.modules():
        if id(m) in inside:
            continue
        if any(c.__name__ in names for c in type(m).__mro__):
            layers.append(m)
            inside.update(id(s) for s in m.modules())
    if not layers:
        layers = _stack_of_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} declares no decoder block classes (_no_split_modules={sorted(names)}) and has "
            f"no single ModuleList of its config's num_hidden_layers layers; cannot wrap it layer by layer"
        )
    return layers


def layers_owner(model: nn.Module, layers: list[nn.Module]) -> tuple[nn.Module | None, str]:
    """The module whose ``ModuleList`` child holds ``layers[0]`` (from :func:`decoder_layers`: the text model,
    ``model.model`` or a VLM's ``language_model``) and that child's name; ``(None, "")`` where there is none."""
    if not layers:
        return None, ""
    for module in model.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child) and child[0] is layers[0]:
                return module, name
    return None, ""


def _stack_of_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model that names none in ``_no_split_modules`` (BioGPT, CTRL, OpenAI GPT, CPM-Ant): the one
    ``nn.ModuleList`` of ``config.num_hidden_layers`` modules outside vision / audio towers, or ``[]`` where there
    is none or more than one."""
    config = getattr(model, "config", None)
    config = text_config(config) if config is not None else None
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 0:
        return []
    stacks = [
        m for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == n and not any(w in name.lower() for w in ("vision", "visual", "audio"))
    ]  # fmt: skip
    return list(stacks[0]) if len(stacks) == 1 else []


def outermost_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks each technique wraps once: :func:`decoder_layers` (already outermost only)."""
    return decoder_layers(model)


def block_call(block: nn.Module) -> BlockCall:
    """``block``'s :class:`BlockCall`, installed as its ``forward`` on first use. Mutates ``block``.

    Where transformers' own checkpointing is on for the block, it is turned off and the block's call checkpoints
    instead (the same recomputation, in the place the module docstring gives).
    """
    existing = block.__dict__.get(_ATTR)
    if existing is not None:
        return existing
    if "forward" in block.__dict__:
        raise ValueError(
            f"{type(block).__name__}.forward is already replaced on the instance ({block.__dict__['forward']!r}); "
            f"apply checkpointing, compile and offload through automodel.models.block_call"
        )
    call = BlockCall(block)
    block.__dict__[_ATTR] = call
    block.forward = call
    if getattr(block, "gradient_checkpointing", False) is True:  # transformers' checkpointing on: ours instead
        block.gradient_checkpointing = False  # (its wrapper passes straight through)
        call.checkpoint = True
    return call


def block_calls(model: nn.Module) -> list[BlockCall]:
    """The :class:`BlockCall` of every (outermost) decoder block of ``model`` that has one, in order."""
    return [c for c in (b.__dict__.get(_ATTR) for b in outermost_blocks(model)) if c is not None]


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each decoder block in the backward (non-reentrant checkpoint). Mutates ``model``; idempotent.

    The checkpoint sits inside each block's :class:`BlockCall` (so FSDP2's and TP's module hooks stay outside
    it and run once per call), the same on every transformers release; parameter names and the model class are
    unchanged (checkpoints and the HF export see the same keys). transformers' own checkpointing, if a caller
    enabled it, is turned off (it would checkpoint a second time). Returns the number of blocks checkpointed.

    Raises:
        UserInputError: the model does not support gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserInputError(
            f"{type(model).__name__} does not support gradient checkpointing; set model.activation_checkpointing=false"
        )
    for module in model.modules():  # transformers' flags off everywhere: its wrappers pass straight through
        if getattr(module, "gradient_checkpointing", False) is True:
            module.gradient_checkpointing = False
    blocks = outermost_blocks(model)
    for block in blocks:
        block_call(block).checkpoint = True
    return len(blocks)
