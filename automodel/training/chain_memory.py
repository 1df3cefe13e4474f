"""The memory planner's view of linear-mixer cores (the gated delta rules, the Mamba scans, a short convolution, ...):
what the state chain keeps per rank through the whole step under ring, thd, thd_docs and usp, and what a core keeps
and holds at its peaks outside the chain, measured on the meta device.

Under these methods a linear mixer's sequence core runs in
:class:`~automodel.distributed.cp.layers.state_chain.ChainedCore`, which keeps its inner autograd graph outside
activation checkpointing's saved-tensor hooks: a recomputation must not stop half-way through the chain on one rank
while its peer waits for a message. So, with checkpointing on, every chained layer keeps the core's saved tensors,
its inputs, the pieces' outputs and the states from its forward to its backward, beside the layer inputs that
checkpointing keeps. The plan counted none of it (it named the layers in its note): OLMo-Hybrid's step was planned
38% under its measured peak under ring at cp 2, Qwen3-Next's 30%, ZAYA's 20% (``scripts/bench_plan_families_cp.py``,
hidden 256, 2048 tokens). Outside the chain (one process, Ulysses' head shard, no checkpointing) the plan counted the
layers as attention layers of the model's heads, while transformers' torch fallbacks keep far more: Kimi Linear and
Bailing-hybrid read -93% to -98% under Ulysses.

:func:`chain_kept` measures both: a copy of the first mixer of each class is made on the meta device (its parameters
replaced by meta tensors of the same shapes; nothing is allocated and the model is untouched), its
:class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel` projects a zero row, and, at two row lengths (what
grows with the tokens and what does not):

- :func:`~automodel.distributed.cp.layers.state_chain.kept_bytes` runs the chain on it and counts the distinct
  storages its backward holds;
- :func:`~automodel.training.mlp_memory.live_moments` counts what the core saves and holds at its forward's and its
  backward's peaks run as one of two Ulysses ranks runs it (``state_chain.run_documents`` on the whole row for half
  the heads, the inputs the all-to-all hands it made in the forward); one process runs the same bytes per token.

The core is the model module's own function on this machine: transformers' torch code, or the kernel package's (fla,
mamba-ssm) where it is installed and takes the device; on the meta device the packages decline, so the torch code is
what is measured. It keeps more than those packages' CUDA kernels do, so on a GPU with them installed the plan is
above what runs under the chain; outside it the plan counts the cores only where their torch code runs
(:func:`torch_code_on_gpu`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ChainKept", "chain_kept", "torch_code_on_gpu"]

#: the chunk the delta rules' torch code pads each call to (a kernel family -> tokens; the mixers that name theirs and
#: those that run token by token: :func:`_lengths`)
_CHUNKS = {"gated_deltanet": 64, "kimi_delta": 64}
#: rows of this many and twice as many chunks: the pieces are whole chunks, and long enough that what a row keeps is a
#: straight line through the two (at two and four chunks the delta rule's line over-counts 1536 tokens by 8%)
_ROW_CHUNKS = 8
_CACHE: dict[tuple, Any] = {}
#: the probe's figures of one layer, in this order, each a (per token, per row) line of bytes (:func:`_lines_on_meta`)
_FIGURES = ("kept", "saved", "forward", "backward")


@dataclass(frozen=True)
class ChainKept:
    """Linear-mixer cores measured on the meta device; each figure ``(fp32, bf16)``: the model in that dtype.

    Attributes:
        per_token: bytes per token of a rank's row that the chain keeps through the step, all the chained layers
            together (the core's saved tensors, its inputs, the pieces' outputs, the states).
        per_row: the same per row, whatever its length (the states at the pieces' ends).
        layers: the chained layers measured (every one: a class that cannot run on the meta device makes the
            whole measurement ``None``).
        saved: bytes per token (of the rank's share of the row) one layer's core saves outside the chain, run as one
            of two Ulysses ranks runs it, its inputs included where it saves them (the classes' largest).
        forward: bytes per token at that core's forward's peak, its output included.
        backward: bytes per token at that core's backward's peak, what it saved included. What the chain holds in
            flight beyond what it keeps is bounded by the whole row's ``forward - saved`` and ``backward - saved``
            (its pieces are shorter).
    """

    per_token: tuple[float, float]
    per_row: tuple[float, float]
    layers: int
    saved: tuple[float, float] = (0.0, 0.0)
    forward: tuple[float, float] = (0.0, 0.0)
    backward: tuple[float, float] = (0.0, 0.0)


def chain_kept(layers: list[tuple[int, torch.nn.Module]], hidden: int) -> ChainKept | None:
    """:class:`ChainKept` of the chained layers ``layers`` (``(layer index, mixer module)`` per layer; the mixer a
    class of ``linear_support.STATE_MIXERS``) of a model of hidden size ``hidden``; each class measured once, on a meta
    copy of its first layer's mixer. ``None`` where there are none or one class cannot be measured (the plan's note
    then names the layers as not counted)."""
    if not layers:
        return None
    by_class: dict[type, list[torch.nn.Module]] = {}
    for _, mixer in layers:
        by_class.setdefault(type(mixer), []).append(mixer)
    per_token, per_row = [0.0, 0.0], [0.0, 0.0]
    largest = {name: [0.0, 0.0] for name in _FIGURES[1:]}
    for mixers in by_class.values():
        measured = _measured(mixers[0], hidden)
        if measured is None:
            return None
        for i, lines in enumerate(measured):  # fp32, bf16
            figures = dict(zip(_FIGURES, lines))
            per_token[i] += figures["kept"][0] * len(mixers)
            per_row[i] += figures["kept"][1] * len(mixers)
            for name in largest:
                largest[name][i] = max(largest[name][i], figures[name][0])
    return ChainKept((per_token[0], per_token[1]), (per_row[0], per_row[1]), len(layers),
                     **{name: (v[0], v[1]) for name, v in largest.items()})  # fmt: skip


#: the package whose CUDA kernels transformers runs in place of a kernel family's torch code where it is installed
#: (``use_kernel_func_from_hub_with_fallback``): the delta rules' fla, the Mamba scans' mamba-ssm, the short
#: convolution's causal-conv1d
_PACKAGES = {"gated_deltanet": "fla", "kimi_delta": "fla", "mamba2": "mamba_ssm", "mamba1": "mamba_ssm",
             "short_conv": "causal_conv1d"}  # fmt: skip


def torch_code_on_gpu(mixer: torch.nn.Module) -> bool:
    """Whether ``mixer``'s core runs transformers' torch code on a GPU of this environment: its modeling file names no
    kernel package (:func:`~automodel.training.attention_memory.torch_only`: MiniMax's lightning attention, the
    RG-LRU, xLSTM, RWKV), or the package of its kernel family (:data:`_PACKAGES`) is not installed here."""
    import importlib.util

    from automodel.distributed.cp.layers.linear_support import STATE_MIXERS
    from automodel.training.attention_memory import torch_only

    package = _PACKAGES.get(STATE_MIXERS.get(type(mixer).__name__, ""))
    return torch_only(mixer) or package is None or importlib.util.find_spec(package) is None


def _measured(mixer: torch.nn.Module, hidden: int) -> tuple[tuple[tuple[float, float], ...], ...] | None:
    """:func:`_lines_on_meta` in fp32 and in bf16, cached per class and shapes; where only the bf16 run fails (xLSTM's
    kernel mixes dtypes in bf16, and its bf16 training fails alike), its fp32 figures, which are the larger."""
    shapes = tuple((name, tuple(t.shape)) for name, t in itertools.chain(mixer.named_parameters(), mixer.named_buffers()))
    key = (type(mixer), hidden, shapes)
    if key not in _CACHE:
        _CACHE[key] = None
        try:
            # the probe makes its index tensors (the head shard's) on the CPU whatever the caller's default device
            with torch.device("cpu"):
                fp32 = _lines_on_meta(mixer, hidden, torch.float32)
                try:
                    bf16 = _lines_on_meta(mixer, hidden, torch.bfloat16)
                except Exception:  # noqa: BLE001 - the model's own bf16 failure: the fp32 figures bound it
                    bf16 = fp32
            _CACHE[key] = (fp32, bf16)
        except Exception:  # noqa: BLE001 - a core that cannot run on the meta device: not counted, and the note says so
            pass
    return _CACHE[key]


def _lines_on_meta(mixer: torch.nn.Module, hidden: int, dtype: torch.dtype) -> tuple[tuple[float, float], ...]:
    """One layer's :data:`_FIGURES` with the model in ``dtype``, each ``(per token, per row)`` bytes: a straight line
    through the figures at the two lengths of :func:`_lengths` (per row: at least 0)."""
    from automodel.distributed.cp.layers import linear_mixer  # noqa: F401 - registers every kernel
    from automodel.distributed.cp.layers.mixer_kernel import HeadShard, kernel_for
    from automodel.distributed.cp.layers.state_chain import kept_bytes, run_documents
    from automodel.training.mlp_memory import live_moments

    kernel = kernel_for(mixer)
    if kernel is None:
        raise ValueError(f"{type(mixer).__name__} has no CP kernel")
    copy_ = _meta_copy(mixer, dtype)
    # outside the chain, as one of two Ulysses ranks runs it: the whole row (twice the rank's tokens) for half the heads,
    # groups repeated in place where they do not divide (Falcon-H1's B and C then picked per head), the inputs the
    # all-to-all hands it made in the forward; without a head split where the mixer's heads do not divide by two
    shard = HeadShard(0, 2) if kernel.problem(copy_, "ulysses", 2) is None else None
    heads = kernel.seq_heads(copy_)
    at: list[tuple[float, ...]] = []
    lengths = _lengths(copy_)
    for tokens in lengths:
        with torch.no_grad():
            seq = kernel.project(copy_, torch.zeros(1, tokens, hidden, dtype=dtype, device="meta")).seq

        def shard_inputs(seq: dict = seq) -> dict[str, torch.Tensor]:
            if shard is None:
                return {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in seq.items()}
            out = {}
            for k, v in seq.items():
                b, n, h, *rest = v.shape
                local = h * shard.factor(heads.get(k, 1)) // shard.world
                out[k] = torch.empty(b, n * shard.world, local, *rest, dtype=v.dtype, device="meta")
                out[k].requires_grad_(v.is_floating_point())
            return out

        # the chain keeps (kept_bytes: a middle rank's two chunks); the core outside it, its inputs made in its forward
        saved, fwd, bwd = live_moments(
            lambda: run_documents(kernel, copy_, kernel.core_params(copy_, shard), shard_inputs(), None, shard))
        at.append((kept_bytes(kernel, copy_, seq), saved, fwd, bwd))
    (n0, n1), out = lengths, []
    for a, b in zip(*at):
        grows = (b - a) / (n1 - n0)
        out.append((grows, max(0.0, a - grows * n0)))
    return tuple(out)


def _lengths(mixer: torch.nn.Module) -> tuple[int, int]:
    """Rows of :data:`_ROW_CHUNKS` and twice as many chunks: the chunk the mixer names (the Mamba2 scan's
    ``chunk_size``, lightning attention's ``block_size``, xLSTM's config's ``chunk_size``) or its kernel family's
    (:data:`_CHUNKS`); a core that pads nothing (a scan, a recurrence or a convolution token by token) has chunks of
    4 tokens: short rows, because the torch cores of Mamba, RWKV and the RG-LRU loop over the tokens in Python (even
    on the meta device each step costs its ops' dispatch)."""
    from automodel.distributed.cp.layers.linear_support import STATE_MIXERS

    named = [getattr(x, k, None) for x in (mixer, getattr(mixer, "config", None)) for k in ("chunk_size", "block_size")]
    family = _CHUNKS.get(STATE_MIXERS.get(type(mixer).__name__, ""), 4)
    chunk = max([family, *(v for v in named if isinstance(v, int) and v > 0)])
    return _ROW_CHUNKS * chunk, 2 * _ROW_CHUNKS * chunk


def _meta_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A shallow copy of ``module`` and of each of its submodules whose parameters and buffers are meta tensors of
    their (global) shapes, floating ones in ``dtype`` (an FSDP2 shard's DTensor gives its whole shape), and which carry
    no hooks (FSDP2's, activation checkpointing's): nothing of the model is copied or changed. A deep copy is refused
    by FSDP2 once the model is sharded; the copy shares the other attributes (the config, the sizes), which the
    kernel only reads."""
    new = copy.copy(module)
    new.__dict__ = dict(module.__dict__)
    for name, value in module.__dict__.items():
        if name.endswith("hooks") and isinstance(value, dict):
            new.__dict__[name] = type(value)()
    new._parameters = {name: None if p is None else torch.nn.Parameter(_meta(p, dtype), requires_grad=p.requires_grad)
                       for name, p in module._parameters.items()}  # fmt: skip
    new._buffers = {name: None if b is None else _meta(b, dtype) for name, b in module._buffers.items()}
    new._modules = {name: None if m is None else _meta_copy(m, dtype) for name, m in module._modules.items()}
    return new


def _meta(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
