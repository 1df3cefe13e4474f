"""The interface every linear / state-space mixer implements to run under CP, and the registry of them.

A mixer that carries a state along the sequence (Gated DeltaNet, Mamba2, Mamba, a short convolution, ...)
is split into three parts (docs/linear_mixers.md):

1. :meth:`MixerKernel.project`: token-local work before the sequence core (input projections). It
   returns the core's inputs, every one shaped ``[B, n, H_i, d_i]`` (sequence on dim 1, a head / channel
   group dim 2, so that Ulysses can shard them), and whatever the output part needs (``local``).
2. :meth:`MixerKernel.core`: the only part that reads other tokens. It runs on one contiguous piece of
   ONE document (``[B, n, ...]``), started from ``state`` (``None``: a document start, i.e. zeros) and
   returns the piece's output and the state after it. The state is a list of tensors and includes the
   conv tail (the last ``K-1`` conv inputs) where the mixer has a causal conv. A zero state must compute
   exactly what ``None`` computes (a document start).
3. :meth:`MixerKernel.finish`: token-local work after the core (gated norm, output projection).

:mod:`automodel.distributed.cp.layers.state_chain` runs every registered kernel under every method:
the chain (ring / thd / thd_docs / usp's ring sub-group: states passed in sequence order, gradients of the
states returned in the backward), the per-document loop (a document whole on one rank) and the Ulysses
head shard (all-to-all from a sequence shard to a head shard and back).

**Head shard (Ulysses, usp).** :meth:`MixerKernel.seq_heads` gives the head count ``c`` of each core input
(dim 2). The shared path repeats each head ``f = W / gcd(c, W)`` times in place when ``c`` is not a
multiple of ``W`` (Mamba2's B/C groups, KV-like heads; autograd sums the copies' gradients) and then
all-to-alls it, so rank ``u`` of ``W`` holds heads ``[u*c*f/W, (u+1)*c*f/W)`` of the repeated tensor
(:meth:`HeadShard.held`: the original head of each local copy). :meth:`MixerKernel.core_params` returns
the parameters the core reads for the rank's heads (``shard``); :meth:`MixerKernel.core` then sees the
rank's heads only. The core's output heads (:meth:`MixerKernel.out_heads`) must divide by ``W``.

**Parameters.** The chain is a ``torch.autograd.Function``: the core may read module parameters only
through the tensors :meth:`MixerKernel.core_params` returns (they are the function's inputs and get their
gradients through it); everything else the core reads must be a constant (a config number).

A kernel is registered by the mixer's class name (:func:`register`); :func:`kernel_for` finds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "HeadShard",
    "MixerKernel",
    "Projected",
    "StateLike",
    "kernel_for",
    "register",
    "registered",
]

#: the shape and dtype of each tensor of a state, in order
StateLike = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank of a Ulysses (sub-)group of ``world`` ranks holds: rank ``rank``."""

    rank: int
    world: int

    def factor(self, count: int) -> int:
        """How many in-place copies of each of ``count`` heads the head shard makes (``W / gcd(count, W)``)."""
        return self.world // math.gcd(count, self.world)

    def slice(self, count: int) -> slice:
        """This rank's heads of ``count`` heads (``count % world == 0``)."""
        if count % self.world:
            raise ValueError(f"{count} heads do not divide over {self.world} ranks")
        per = count // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def held(self, count: int) -> torch.Tensor:
        """``[local copies]`` int64: the original head (of ``count``) of each head copy this rank holds
        after the shared path repeated the heads :meth:`factor` times and all-to-all'ed them."""
        f = self.factor(count)
        per = count * f // self.world
        return torch.arange(self.rank * per, (self.rank + 1) * per) // f

    def group_of_heads(self, heads: int, groups: int) -> torch.Tensor:
        """``[heads / world]`` int64: for each of this rank's heads (of ``heads``, split evenly), the index
        among this rank's :meth:`held` copies of ``groups`` groups of the group that head reads (head
        ``h`` reads group ``h * groups // heads``)."""
        mine = torch.arange(self.slice(heads).start, self.slice(heads).stop)
        wanted = mine * groups // heads
        held = self.held(groups)
        return torch.stack([torch.nonzero(held == g)[0, 0] for g in wanted.tolist()]) if len(mine) else mine


@dataclass
class Projected:
    """What :meth:`MixerKernel.project` returns.

    Attributes:
        seq: the core's inputs by name, each ``[B, n, H_i, d_i]`` (``n`` tokens on dim 1, heads on dim 2),
            in the order :meth:`MixerKernel.seq_heads` lists them.
        local: anything token-local :meth:`MixerKernel.finish` needs (tensors ``[B, n, ...]``), opaque here.
    """

    seq: dict[str, torch.Tensor]
    local: Any


class MixerKernel:
    """How one family of mixer modules runs under CP (module docstring). Subclass and :func:`register` it.

    Every method takes the mixer module itself (its config numbers and parameters are read from it).
    ``shard`` is ``None`` when the core sees all heads (chain, one process), a :class:`HeadShard` under a
    head split.
    """

    #: a short name for messages and docs ("Gated DeltaNet", "Mamba2", ...)
    name: str = "mixer"
    #: the class also zeroes padded tokens after its conv (Mamba2's ``apply_mask_to_padding_states``): with a
    #: padding mask, the shared code then adds ``seq["mask"]`` ``[B, n, 1, 1]`` (1 = real token) to the core's
    #: inputs (it travels like a 1-head input), and :meth:`core` must apply it where the class does
    masks_after_conv: bool = False

    def problem(self, mixer: torch.nn.Module, method: str, heads_world: int) -> str | None:
        """Why ``mixer`` cannot run under ``method`` with a head split over ``heads_world`` ranks (1: no head
        split), or ``None``. The default: the output heads must divide by ``heads_world``."""
        heads = self.out_heads(mixer)
        if heads_world > 1 and heads % heads_world:
            return (
                f"{type(mixer).__name__} has {heads} {self.name} heads, not divisible by the {heads_world} ranks "
                f"that {method} splits heads over: choose a CP (Ulysses) size that divides {heads}, or a method "
                "that chains the state (thd, thd_docs, ring)"
            )
        return None

    def project(self, mixer: torch.nn.Module, hidden: torch.Tensor) -> Projected:
        """Token-local input work on ``hidden [B, n, D]`` (any float dtype)."""
        raise NotImplementedError

    def seq_heads(self, mixer: torch.nn.Module) -> dict[str, int]:
        """The head count (dim 2) of every core input, by name, in :attr:`Projected.seq` order."""
        raise NotImplementedError

    def out_heads(self, mixer: torch.nn.Module) -> int:
        """The head count (dim 2) of the core's output ``[B, n, H, d]``."""
        raise NotImplementedError

    def core_params(self, mixer: torch.nn.Module, shard: HeadShard | None) -> dict[str, torch.Tensor | None]:
        """The parameters the core reads, restricted to ``shard``'s heads (views / index_selects of the
        module's parameters, so that gradients flow back to them); ``None`` entries for absent ones."""
        raise NotImplementedError

    def core(
        self,
        mixer: torch.nn.Module,
        params: dict[str, torch.Tensor | None],
        seq: dict[str, torch.Tensor],
        state: list[torch.Tensor] | None,
        shard: HeadShard | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The sequence core on one piece ``[B, n, ...]`` of one document, from ``state`` (``None``: a
        document start). Returns ``(out [B, n, H_out, d], state after the piece)``; mutates nothing. Must
        accept ``n == 0`` only if it says so; the shared code never calls it on empty pieces."""
        raise NotImplementedError

    def state_like(
        self, mixer: torch.nn.Module, params: dict[str, torch.Tensor | None], batch: int, dtype: torch.dtype,
        shard: HeadShard | None,
    ) -> StateLike:
        """Shapes and dtypes of the state :meth:`core` returns for ``batch`` rows (inputs of ``dtype``)."""
        raise NotImplementedError

    def finish(self, mixer: torch.nn.Module, out: torch.Tensor, local: Any) -> torch.Tensor:
        """Token-local output work: ``out [B, n, H_out, d]`` and ``local`` -> ``[B, n, D]``."""
        raise NotImplementedError

    def contiguous_shard(
        self, mixer: torch.nn.Module, hidden: torch.Tensor, group: Any, rank: int, world: int,
        starts: torch.Tensor,
    ) -> torch.Tensor | None:
        """Ulysses' alternative to the head shard: the whole forward on this rank's contiguous slice ``hidden
        [B, n, D]`` of the row (rank ``rank`` of ``world`` over ``group``, slices in rank order), with
        ``starts [B, n]`` bool marking the tokens that start a document. A kernel that needs only a few tokens
        of the slice before it (RWKV's one-token shift) exchanges those and returns ``[B, n, D]``; the default
        ``None`` means: use the head shard."""
        return None

    def state_numbers(self, mixer: torch.nn.Module) -> int:
        """Numbers in one document's state for all heads and one row (the chain's message size per document
        and hop; the benchmark's byte formula). Default: from :meth:`state_like` with all heads."""
        like = self.state_like(mixer, self.core_params(mixer, None), 1, torch.float32, None)
        return sum(int(torch.Size(shape).numel()) for shape, _ in like)


_REGISTRY: dict[str, MixerKernel] = {}


def register(class_names: list[str] | tuple[str, ...], kernel: MixerKernel) -> MixerKernel:
    """Make ``kernel`` the CP kernel of the mixer classes named ``class_names`` (mutates the registry)."""
    for name in class_names:
        _REGISTRY[name] = kernel
    return kernel


def kernel_for(mixer: torch.nn.Module | str) -> MixerKernel | None:
    """The registered kernel of ``mixer`` (a module or its class name), or ``None``."""
    name = mixer if isinstance(mixer, str) else type(mixer).__name__
    return _REGISTRY.get(name)


def registered() -> dict[str, MixerKernel]:
    """Class name -> kernel of every registered mixer (a copy)."""
    return dict(_REGISTRY)
