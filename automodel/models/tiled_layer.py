"""A decoder layer tiled end to end (``model.tiled_layer``): everything but the attention core runs over token tiles.

A Llama-like decoder layer is ``h1 = h + o_proj(attn(qkv(norm1(h))))``, ``out = h1 + mlp(norm2(h1))``. Everything
in it but the attention core works on each token alone: the input norm, the q/k/v projections (with Qwen3's q/k
norms and the rotary embedding of the token's position), the output projection, the post-attention norm, the MLP
and both residual adds. Without tiling a recomputed layer holds about 13 ``[tokens, hidden]``-sized tensors
(the norms and their fp32 copies, q/k/v, the attention output, the output projection, the residuals and their
gradients); with it the layer runs in three parts and holds a few:

1. **pre** (one ``torch.autograd.Function``, tile by tile): the layer's own ``forward`` runs on each tile of its
   input up to the attention call, where a capture function (registered in transformers' ``AttentionInterface``
   under :data:`CAPTURE`, switched in for the tile) takes the projected q/k/v and stops the forward. The tiles'
   q/k/v are written into the full ``[B, H, S, D]`` q/k/v the attention core needs. Saved: the layer input.
2. **core**: the attention function the model runs (the CP method's: ring, Ulysses with its head groups, thd,
   thd_docs, usp; or the plain one) called once on the whole local rows, with exactly the arguments the layer's
   attention module passed to it (captured from the tiles, checked identical across tiles).
3. **post** (one Function, tile by tile): ``h1 = h + o_proj(a)``, ``out = h1 + mlp(post_attention_layernorm(h1))``.
   Saved: the attention output and the layer input (the same tensor as pre's).

Backward: each Function recomputes one tile at a time with gradients on and back-propagates that tile's slice of
the output gradient (``torch.autograd.grad``): the input gradients are written per tile, the parameter gradients
summed over tiles and returned once (parameters are inputs of the Functions, so FSDP2's reduce-scatter and LoRA's
frozen weights see ordinary gradient flow). With activation checkpointing the layer is recomputed as a whole
(pre, core, post) and then back-propagated: it holds its input, q/k/v, the attention output (and what the core
saves), the output gradient, the gradients of the attention output and of q/k/v, and one tile's intermediates.

Which layers (exact or refused): the decoder layer classes whose ``forward`` is the structure above, read in
transformers 5.17 to 5.25: :data:`SUPPORTED_LAYERS` (Llama, Mistral, Qwen2, Qwen3: GQA, q/k norms, sliding
windows). Every other class is refused with its name before any weight loads. At each layer's first call (real
weights) a probe checks the decomposition on the first tokens of the real input: the layer's own ``forward`` and
the tiled one, both with a local token-mixing stand-in for the attention core, must give the same output and the
same gradients to the input and every trainable parameter (dtype round-off), and the output may depend on no
trainable tensor other than the layer's parameters. Random draws inside the layer (dropout, LoRA dropout) are
refused (per tile they would draw other masks). Tensor parallelism is refused by the config rules (the projections
would see DTensors split on heads or tokens).

Tile size (:func:`resolve_layer_tile_tokens`, the rule the memory planner uses too): ``true`` cuts the ``B * S``
tokens of a call into equal tiles of at most ``hidden`` tokens (one tile's ``[t, intermediate]`` MLP intermediate
is no larger than one MLP weight); an int is tokens per tile. Tiles run along the sequence with all rows of the
batch (``t // B`` positions each). The tiled layer is a ``torch._dynamo.disable`` region: under ``model.compile``
the layer runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel.errors import UserInputError
from automodel.models.tile_backward import check_same_parameters, tile_gradients
from automodel.models.tiled_mlp import layer_tile_scope

__all__ = [
    "CAPTURE",
    "SUPPORTED_ATTENTION",
    "SUPPORTED_LAYERS",
    "TiledLayerCounts",
    "apply_tiled_layer",
    "check_tiled_layer_for_model",
    "check_tiled_layer_for_model_config",
    "is_tiled_layer",
    "layer_tile_counts",
    "remove_tiled_layer",
    "resolve_layer_tile_tokens",
]

logger = logging.getLogger(__name__)

#: decoder layer classes whose forward is ``h + o_proj(attn(qkv(input_layernorm(h))))`` then
#: ``h1 + mlp(post_attention_layernorm(h1))`` (read in transformers 5.17 .. 5.25)
SUPPORTED_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
#: their attention classes: project q/k/v (with q/k norms), rotate, call the attention function once, ``o_proj``
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
#: the attention implementation name the pre part switches in to take q/k/v
CAPTURE = "automodel_tiled_layer_capture"
_PROBE = "automodel_tiled_layer_probe"
_MARK = "_automodel_tiled_layer"
PROBE_TOKENS = 8
_PROBE_TILE = 3


def resolve_layer_tile_tokens(tiled_layer: bool | int | None, hidden: int, tokens: int) -> int | None:
    """Tokens per tile of one tiled-layer call of ``tokens`` (``B * S_local``) tokens; ``None`` when off.

    ``True``: equal tiles of at most ``hidden`` tokens, ``ceil(tokens / ceil(tokens / hidden))``; an int: itself.
    The result is at most ``tokens`` (one tile: the layer runs in its three parts without cutting).

    Raises:
        ValueError: an int < 1, or ``True`` with ``hidden < 1``.
    """
    if tiled_layer is None or tiled_layer is False:
        return None
    tokens = max(int(tokens), 1)
    if tiled_layer is True:
        if hidden < 1:
            raise ValueError(f"model.tiled_layer=true needs a positive hidden size, got {hidden}")
        tiles = -(-tokens // hidden)
        tile = -(-tokens // tiles)
    else:
        tile = int(tiled_layer)
        if tile < 1:
            raise ValueError(f"model.tiled_layer={tiled_layer} must be >= 1 tokens per tile, true or false")
    return min(tile, tokens)


@dataclass
class TiledLayerCounts:
    """What one tiled layer did since :meth:`reset` (the run log reports it after the first step)."""

    calls: int = 0  # forward calls (a checkpointed layer's recomputation calls it again)
    tiles: int = 0  # tiles run by the forwards (each pre and post)
    backward_tiles: int = 0  # tiles recomputed by the backwards (pre and post)
    max_tile_tokens: int = 0
    max_tokens: int = 0
    untiled_calls: int = 0  # calls with a KV cache (generation): the layer's own forward

    def reset(self) -> None:
        self.calls = self.tiles = self.backward_tiles = self.max_tile_tokens = self.max_tokens = 0
        self.untiled_calls = 0


@dataclass
class _State:
    setting: bool | int
    hidden: int
    probed: bool = False
    counts: TiledLayerCounts = field(default_factory=TiledLayerCounts)


# ------------------------------------------------------------------ checks before work


def _random_draws(layer: nn.Module) -> str | None:
    for name, sub in layer.named_modules():
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            return f"{name or 'the layer'} is a dropout with p={sub.p}"
        for key, value in vars(sub).items():
            if isinstance(value, float) and value > 0 and "dropout" in key:
                return f"{name + '.' if name else ''}{key}={value}"
    return None


def layer_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot be tiled end to end (``None``: it can, subject to the first-call probe)."""
    cls = _untiled_class(type(layer))
    forward = getattr(cls, "forward", None)
    owner = getattr(forward, "__qualname__", "").rpartition(".")[0]  # the class whose forward the layer runs
    if owner not in SUPPORTED_LAYERS:
        return (
            f"{cls.__name__} is not a decoder layer structure the tiled layer is proven for ({', '.join(SUPPORTED_LAYERS)}: "
            f"norm, attention with q/k/v/o_proj, residual, norm, MLP, residual); set model.tiled_layer=false"
        )
    missing = [p for p in _LAYER_PARTS if not isinstance(getattr(layer, p, None), nn.Module)]
    attn = getattr(layer, "self_attn", None)
    missing += [f"self_attn.{p}" for p in _ATTENTION_PARTS if not isinstance(getattr(attn, p, None), nn.Module)]
    if missing:
        return f"{cls.__name__} has no {', '.join(missing)}; set model.tiled_layer=false"
    attn_owner = getattr(type(attn).forward, "__qualname__", "").rpartition(".")[0]
    if attn_owner not in SUPPORTED_ATTENTION:
        return (
            f"{cls.__name__}'s attention {type(attn).__name__} runs a forward the tiled layer is not proven for "
            f"({', '.join(SUPPORTED_ATTENTION)}); set model.tiled_layer=false"
        )
    if not hasattr(getattr(attn, "config", None), "_attn_implementation"):
        return f"{cls.__name__}'s attention holds no config naming its attention function; set model.tiled_layer=false"
    draws = _random_draws(layer)
    if draws is not None:
        return (
            f"{draws} in {cls.__name__}: random draws per tile differ from the whole row's; set it to 0 "
            f"(model.config_overrides, peft.dropout) or model.tiled_layer=false"
        )
    return None


def check_tiled_layer_for_model(model: nn.Module, tiled_layer: bool | int) -> list[nn.Module]:
    """Refuse ``model`` for ``model.tiled_layer`` before work (a meta-device model works); return its layers.

    Raises:
        UserInputError: a bad value, no decoder layers, or a layer :func:`layer_problem` refuses (one reason).
    """
    from automodel.models.block_call import decoder_layers

    if tiled_layer is not True and (isinstance(tiled_layer, bool) or not isinstance(tiled_layer, int) or tiled_layer < 1):
        raise UserInputError(
            f"model.tiled_layer={tiled_layer!r} must be false, true (tiles of at most hidden tokens) or tokens per tile >= 1"
        )
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise UserInputError(f"model.tiled_layer: {e}; set model.tiled_layer=false") from None
    for layer in layers:
        why = layer_problem(layer)
        if why is not None:
            raise UserInputError(f"model.tiled_layer: {why}")
    return layers


def check_tiled_layer_for_model_config(model_cfg: Any, resolved: Any, *, attn_implementation: str, seed: int) -> None:
    """The recipe's check of ``model.tiled_layer`` before any weight loads (the model built on the meta device)."""
    if model_cfg.tiled_layer is False:
        return
    from automodel.models.loader import build_model

    model = build_model(model_cfg, resolved, attn_implementation=attn_implementation, seed=seed, meta=True)
    check_tiled_layer_for_model(model, model_cfg.tiled_layer)


# ------------------------------------------------------------------ the attention functions switched in


class _Captured(Exception):
    """Raised by the capture function: the projected q/k/v and the other arguments of the attention call."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: tuple, kwargs: dict):
        super().__init__("captured")
        self.q, self.k, self.v, self.args, self.kwargs = q, k, v, args, kwargs


def _capture(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise _Captured(query, key, value, args, kwargs)


def _probe_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """A local, token-mixing stand-in for the attention core: ``[B, H, n, D]`` q, ``[B, Hkv, n, D]`` k/v ->
    ``[B, n, H, Dv]``: a causal running mean of ``sigmoid(q . k) v`` (GQA: k/v repeated to the query heads)."""
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, 1)
    v = value.repeat_interleave(rep, 1)
    w = torch.sigmoid((query * k).sum(-1, keepdim=True))
    n = query.shape[2]
    steps = torch.arange(1, n + 1, device=query.device, dtype=query.dtype).view(1, 1, n, 1)
    return ((w * v).cumsum(2) / steps).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CAPTURE, _capture)
    AttentionInterface.register(_PROBE, _probe_attention)


@contextlib.contextmanager
def _attention_named(config: Any, name: str):  # noqa: ANN202
    """Switch ``config``'s attention implementation to ``name`` (the internal field, no sub-config propagation)."""
    before = config._attn_implementation_internal
    config._attn_implementation_internal = name
    try:
        yield
    finally:
        config._attn_implementation_internal = before


def _core_function(attn: nn.Module, name: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    default = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    if name in (None, "eager") and default is None:
        raise ValueError(
            f"model.tiled_layer: {type(attn).__name__} runs eager attention but its module defines no "
            f"eager_attention_forward; set model.tiled_layer=false"
        )
    return ALL_ATTENTION_FUNCTIONS.get_interface(name, default)


# ------------------------------------------------------------------ tiles


def _replay_state(device: torch.device) -> tuple[Any, ...]:
    kind = device.type
    return (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))


class _Tiles:
    """One tiled part of a layer call: ``fn(start, *tiles) -> list of outputs`` over ``bounds`` of the sequence dim.

    ``in_dims``/``out_dims``: the sequence dim of each input/output; ``params``: the trainable parameters."""

    def __init__(self, layer: nn.Module, fn: Callable[..., list[torch.Tensor]], bounds: list[tuple[int, int]],
                 in_dims: list[int], out_dims: list[int], counts: TiledLayerCounts):  # fmt: skip
        self.layer, self.fn, self.bounds, self.in_dims, self.out_dims = layer, fn, bounds, in_dims, out_dims
        self.counts = counts
        self.autocast: tuple[Any, ...] | None = None

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.layer.parameters() if p.requires_grad]

    def forward_all(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        outs: list[torch.Tensor] | None = None
        total = xs[0].shape[self.in_dims[0]]
        for a, b in self.bounds:
            got = self.fn(a, *[x.narrow(d, a, b - a) for x, d in zip(xs, self.in_dims, strict=True)])
            if outs is None:
                outs = []
                for o, d in zip(got, self.out_dims, strict=True):
                    shape = list(o.shape)
                    shape[d] = total
                    outs.append(o.new_empty(shape))
            for full, o, d in zip(outs, got, self.out_dims, strict=True):
                full.narrow(d, a, b - a).copy_(o)
        self.counts.tiles += len(self.bounds)
        assert outs is not None
        return outs


class _TiledFunction(torch.autograd.Function):
    """``outputs = part(*inputs)`` tile by tile; the trainable ``params`` get their gradients through this node."""

    @staticmethod
    def forward(ctx: Any, tiles: _Tiles, n_inputs: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        xs, params = list(tensors[:n_inputs]), tensors[n_inputs:]
        tiles.autocast = _replay_state(xs[0].device)
        outs = tiles.forward_all(xs)
        ctx.tiles, ctx.n_inputs, ctx.params = tiles, n_inputs, params
        ctx.save_for_backward(*xs)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        tiles: _Tiles = ctx.tiles
        xs = list(ctx.saved_tensors)
        params = list(ctx.params)
        check_same_parameters("model.tiled_layer", tiles.layer, tiles.trainable(), params)
        k = ctx.n_inputs
        needs_x = list(ctx.needs_input_grad[2 : 2 + k])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[2 + k :]) if need]
        assert tiles.autocast is not None
        kind, enabled, dtype = tiles.autocast
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            tiles.counts.backward_tiles += len(tiles.bounds)
            grad_xs, sums = tile_gradients(
                tiles.bounds, xs, grads, needs_x, params, wanted,
                cut_input=lambda x, k, a, b: x.narrow(tiles.in_dims[k], a, b - a),
                cut_output=lambda g, j, a, b: g.narrow(tiles.out_dims[j], a, b - a),
                run=lambda a, leaves: tiles.fn(a, *leaves),
            )  # fmt: skip
        return (None, None, *grad_xs, *sums)


def _apply_tiled(tiles: _Tiles, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    params = tiles.trainable()
    if torch.is_grad_enabled() and (any(x.requires_grad for x in xs) or params):
        return list(_TiledFunction.apply(tiles, len(xs), *xs, *params))
    with torch.no_grad():
        return tiles.forward_all(xs)


# ------------------------------------------------------------------ the tiled forward


def _untiled_class(cls: type) -> type:
    for c in cls.__mro__:
        base = c.__dict__.get("_automodel_untiled_layer_class")
        if base is not None:
            return base
    return cls


def _slice_embeddings(pe: Any, a: int, b: int, seq: int) -> Any:
    if pe is None:
        return None
    items = list(pe) if isinstance(pe, (tuple, list)) else [pe]
    out = []
    for t in items:
        if not isinstance(t, torch.Tensor) or t.ndim < 2 or t.shape[1] != seq:
            raise ValueError(
                f"model.tiled_layer: a position embedding of shape {getattr(t, 'shape', None)} has no sequence dim 1 "
                f"of {seq} positions; this layer cannot be tiled (set model.tiled_layer=false)"
            )
        out.append(t[:, a:b])
    return type(pe)(out) if isinstance(pe, (tuple, list)) else out[0]


def _run_tiled(
    layer: nn.Module, hidden: torch.Tensor, kwargs: dict, tile_positions: int, core: Callable[..., Any] | None,
    counts: TiledLayerCounts,
) -> torch.Tensor:  # fmt: skip
    """The layer's forward in its three parts over tiles of ``tile_positions`` positions (see the module docstring).
    ``core``: the attention function to run on the whole rows (``None``: the one the model's config names)."""
    base = _untiled_class(type(layer))
    attn = layer.self_attn
    config = attn.config
    seq = hidden.shape[1]
    bounds = [(a, min(a + tile_positions, seq)) for a in range(0, seq, tile_positions)]
    pe = kwargs.get("position_embeddings")
    if core is None:
        core = _core_function(attn, config._attn_implementation)
    captured: list[_Captured] = []

    def pre(start: int, h: torch.Tensor) -> list[torch.Tensor]:
        kw = dict(kwargs)
        kw["position_embeddings"] = _slice_embeddings(pe, start, start + h.shape[1], seq)
        try:
            with _attention_named(config, CAPTURE):
                base.forward(layer, h, **kw)
        except _Captured as got:
            for t in (got.q, got.k, got.v):
                if t.ndim != 4 or t.shape[2] != h.shape[1] or t.shape[0] != h.shape[0]:
                    raise ValueError(
                        f"model.tiled_layer: {type(attn).__name__} passed q/k/v of shape {tuple(t.shape)} to its "
                        f"attention; expected [B, heads, {h.shape[1]}, D] (set model.tiled_layer=false)"
                    ) from None
            if not captured:  # the arguments only: the tile's q/k/v are not kept
                captured.append(_Captured(None, None, None, got.args, got.kwargs))  # type: ignore[arg-type]
            elif not _same_arguments(got, captured[0]):
                raise ValueError(
                    f"model.tiled_layer: {type(attn).__name__} passed its attention other arguments for two tiles; "
                    f"this layer cannot be tiled (set model.tiled_layer=false)"
                ) from None
            return [got.q, got.k, got.v]
        raise ValueError(
            f"model.tiled_layer: {base.__name__}'s forward returned without calling its attention function; this "
            f"layer cannot be tiled (set model.tiled_layer=false)"
        )

    pre_tiles = _Tiles(layer, pre, bounds, [1], [2, 2, 2], counts)
    q, k, v = _apply_tiled(pre_tiles, [hidden])
    first = captured[0]
    out, _ = core(attn, q, k, v, *first.args, **first.kwargs)
    a = out.reshape(hidden.shape[0], seq, -1)

    def post(start: int, at: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        h1 = h + attn.o_proj(at)
        with layer_tile_scope():  # a tiled MLP of one tile runs its own forward: this Function recomputes the tile
            return [h1 + layer.mlp(layer.post_attention_layernorm(h1))]

    post_tiles = _Tiles(layer, post, bounds, [1, 1], [1], counts)
    (result,) = _apply_tiled(post_tiles, [a, hidden])
    return result


def _same_arguments(got: _Captured, first: _Captured) -> bool:
    """Whether two tiles passed their attention call the same arguments besides q/k/v (the same objects, or equal
    scalars)."""
    if len(got.args) != len(first.args) or got.kwargs.keys() != first.kwargs.keys():
        return False
    pairs = zip([*got.args, *got.kwargs.values()], [*first.args, *[first.kwargs[k] for k in got.kwargs]], strict=True)
    scalar = (int, float, bool, str, type(None))
    return all(x is y or (isinstance(x, scalar) and isinstance(y, scalar) and x == y) for x, y in pairs)


def _graph_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    from automodel.models.tiled_mlp import _graph_leaves as leaves

    return list(leaves(outputs))


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 5e-2)


def _probe(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> None:
    """Refuse ``layer`` unless its own forward and the tiled one agree on its first tokens (output, gradients to the
    input and every trainable parameter), both with :func:`_probe_attention` as the core, and its output depends
    on no trainable tensor but its own parameters."""
    n = min(PROBE_TOKENS, hidden.shape[1])
    if n < 2 or not hidden.is_floating_point():
        return
    base = _untiled_class(type(layer))
    name = base.__name__
    kw = dict(kwargs)
    kw["position_embeddings"] = _slice_embeddings(kwargs.get("position_embeddings"), 0, n, hidden.shape[1])
    x = hidden[:, :n].detach().clone().requires_grad_(True)
    params = [p for p in layer.parameters() if p.requires_grad]
    devices = [hidden.device] if hidden.device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=devices),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),  # not the checkpoint's or offload's
    ):
        with _attention_named(layer.self_attn.config, _PROBE):
            ref = base.forward(layer, x, **kw)
        if isinstance(ref, (tuple, list)):
            ref = ref[0]
        got = _run_tiled(layer, x, kw, _PROBE_TILE, _probe_attention, TiledLayerCounts())
        own = {id(p) for p in layer.parameters()} | {id(x)}
        foreign = [t for t in _graph_leaves([ref]) if id(t) not in own and t.requires_grad]
        if foreign:
            raise UserInputError(
                f"model.tiled_layer: {name}'s output depends on {len(foreign)} trainable tensor(s) that are not its "
                f"own parameters (shapes {[tuple(t.shape) for t in foreign[:3]]}); their gradients would be lost in "
                f"the tiled backward; set model.tiled_layer=false"
            )
        cot = ref.detach()
        inputs = [x, *params]
        want = [torch.autograd.grad(ref, inputs, cot, retain_graph=False, allow_unused=True)]
        want.append(torch.autograd.grad(got, inputs, cot, allow_unused=True))
    tol = _tolerance(hidden.dtype)
    pairs = [("the output", ref.detach(), got.detach())]
    names = ["the input gradient"] + [f"a parameter gradient of shape {tuple(p.shape)}" for p in params]
    for label, a, b in zip(names, want[0], want[1], strict=True):
        if (a is None) != (b is None):
            raise UserInputError(f"model.tiled_layer: {name}: {label} is missing in one of the two forwards; set model.tiled_layer=false")
        if a is not None:
            pairs.append((label, a, b))
    for label, a, b in pairs:
        scale = float(a.abs().max()) or 1.0
        err = float((a - b).abs().max()) / scale
        if not err <= tol:
            raise UserInputError(
                f"model.tiled_layer: {name}'s forward is not the structure the tiled layer computes ({label} differs "
                f"by {err:.2e} relative on a probe of {n} tokens); set model.tiled_layer=false"
            )


@torch._dynamo.disable(reason="automodel: the tiled layer runs its tiles eagerly")
def _tiled_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``forward`` of a tiled decoder layer (see the module docstring)."""
    import inspect

    from torch.distributed.tensor import DTensor

    state: _State = getattr(self, _MARK)
    base = _untiled_class(type(self))
    if args:  # the positional arguments by the layer's own signature
        bound = inspect.signature(base.forward).bind(self, hidden_states, *args, **kwargs)
        kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "hidden_states", "kwargs")}
        kwargs.update(bound.arguments.get("kwargs", {}))
    cache = next((kwargs.get(k) for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None), None)
    if cache is not None and self.training and torch.is_grad_enabled():
        raise ValueError(
            f"model.tiled_layer: {base.__name__} got a KV cache in a training forward; the tiles cannot fill one "
            f"(pass use_cache=False, or set model.config.use_cache=False)"
        )
    if cache is not None or hidden_states.is_meta:  # generation with a KV cache: the layer's own forward (no tiles)
        state.counts.untiled_calls += 1
        return base.forward(self, hidden_states, **kwargs)
    if isinstance(hidden_states, DTensor):
        raise ValueError(
            "model.tiled_layer: the layer's input is a DTensor (tensor parallelism); the tiled layer runs on plain "
            "tensors only (set model.tiled_layer=false or distributed.tp_size=1)"
        )
    if hidden_states.ndim != 3:
        raise ValueError(
            f"model.tiled_layer: the layer's input has shape {tuple(hidden_states.shape)}; only [B, S, hidden] is tiled"
        )
    if not state.probed and not torch.is_inference_mode_enabled():
        _probe(self, hidden_states, kwargs)
        state.probed = True
    batch, seq = hidden_states.shape[:2]
    tile = resolve_layer_tile_tokens(state.setting, state.hidden, batch * seq)
    assert tile is not None
    positions = max(tile // batch, 1)
    counts = state.counts
    counts.calls += 1
    counts.max_tokens = max(counts.max_tokens, batch * seq)
    counts.max_tile_tokens = max(counts.max_tile_tokens, batch * min(positions, seq))
    return _run_tiled(self, hidden_states, kwargs, positions, None, counts)


_TILED_CLASSES: dict[type, type] = {}


def _tiled_class(cls: type) -> type:
    """A subclass of ``cls`` with the same name whose ``forward`` tiles (one per class)."""
    from automodel.models.tiled_mlp import same_named_subclass

    return same_named_subclass(cls, {"forward": _tiled_forward, "_automodel_untiled_layer_class": cls}, _TILED_CLASSES)


def is_tiled_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a decoder layer wrapped by :func:`apply_tiled_layer`."""
    return hasattr(module, _MARK)


def layer_tile_counts(model: nn.Module) -> list[TiledLayerCounts]:
    """The :class:`TiledLayerCounts` of every tiled layer of ``model``, in module order."""
    return [getattr(m, _MARK).counts for m in model.modules() if is_tiled_layer(m)]


def apply_tiled_layer(model: nn.Module, tiled_layer: bool | int) -> int:
    """Tile every decoder layer of ``model`` end to end (in place; idempotent); returns the layers wrapped.

    Call after LoRA, before activation checkpointing, ``torch.compile`` of the blocks, activation offload and
    FSDP2 (their wrappers call ``type(block).forward``, which becomes the tiled one). ``False`` does nothing.

    Mutates ``model``: each decoder layer's class becomes a same-named subclass whose ``forward`` tiles;
    parameters and their names are unchanged. :func:`remove_tiled_layer` undoes it. The final norm runs in tiles
    too (:func:`automodel.models.tiled_mlp.tile_final_norms`; :func:`~automodel.models.tiled_mlp.remove_tiled_mlp`
    undoes that).

    Raises:
        UserInputError: as :func:`check_tiled_layer_for_model`; at a layer's first call, the probe's refusals.
    """
    if tiled_layer is False or tiled_layer is None:
        return 0
    from automodel.models.tiled_mlp import hidden_size, tile_final_norms

    layers = check_tiled_layer_for_model(model, tiled_layer)
    _register()
    config = getattr(model, "config", None)
    hidden = (hidden_size(config) if config is not None else None) or 1
    for layer in layers:
        if is_tiled_layer(layer):
            continue
        setattr(layer, _MARK, _State(tiled_layer, hidden))
        layer.__class__ = _tiled_class(type(layer))
    logger.info(
        "model.tiled_layer=%s: %d decoder layer(s) run their norms, projections, MLP and residuals over token tiles "
        "(%s); the attention core on whole rows",
        tiled_layer, len(layers),
        f"{tiled_layer} tokens per tile" if tiled_layer is not True else f"equal tiles of at most {hidden} tokens",
    )  # fmt: skip
    tile_final_norms(model, tiled_layer)  # the final norm in tiles too (automodel.models.tiled_mlp)
    return len(layers)


def remove_tiled_layer(model: nn.Module) -> int:
    """Undo :func:`apply_tiled_layer` (in place); returns the layers unwrapped."""
    count = 0
    for module in model.modules():
        if is_tiled_layer(module):
            module.__class__ = _untiled_class(type(module))
            delattr(module, _MARK)
            count += 1
    return count
