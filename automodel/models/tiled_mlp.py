"""Sequence-tiled MLP (``model.tiled_mlp``): each decoder layer's MLP runs over tiles of its tokens.

An MLP (dense, MoE with its shared experts, the hybrids' feed-forward blocks) computes every token on
its own, so running it over tiles of the token dimension and concatenating the outputs is exact. What
tiling saves is the ``[tokens, intermediate]`` activations: without it the gate / up / activation
tensors of the whole sequence are alive at once (in the forward, and again in the backward or in the
recompute of activation checkpointing); with it they exist for one tile at a time.

How (:class:`_TiledMLPFunction`, one ``torch.autograd.Function`` per MLP call):

- **forward**: the MLP runs tile by tile under ``no_grad``; only its input is saved (``[N, H]``, the
  same tensor the first projection saves without tiling), the outputs are concatenated.
- **backward**: each tile is recomputed with grad enabled and back-propagated on its own slice of the
  output gradient (``torch.autograd.grad``): the input gradient is written per tile, the parameter
  gradients are summed across tiles and returned once. The trainable parameters are inputs of the
  Function, so autograd, FSDP2 (its reduce-scatter after the layer's backward, once) and LoRA (frozen
  base weights get nothing) see ordinary gradient flow. The RNG state (and autocast state) of the
  forward is replayed for the recompute.

Tiles are taken along the flattened tokens of the MLP's input (``[B, S, H]`` -> ``B*S`` tokens, each
tile passed as ``[1, t, H]``; a ``[N, H]`` input is tiled as ``[t, H]``). The MLP module is wrapped by
swapping its class for a subclass (same name, same ``forward``) whose ``__call__`` tiles: every hook of
the module runs per tile, so under tensor parallelism with sequence parallel each tile is all-gathered
and reduce-scattered by TP's own hooks ("tiles of the tokens a rank holds after the TP split"); the
module's parameter names do not change (checkpoints and the HF export see the same model). The tiled
call is a ``torch._dynamo.disable`` region: a compiled decoder block (``model.compile``) breaks its
graph at the MLP, which runs eagerly.

Exactness is checked, not assumed: at each MLP's first call (real weights), a probe on the first 8
tokens of the real input checks that each output token's gradient reaches no other input token (an MLP
that mixes tokens, e.g. RWKV's time shift, is refused) and that every trainable tensor the MLP's output
depends on is one of its own parameters (gradients to anything else would be lost). Random draws
inside the MLP (dropout, MoE router jitter, LoRA dropout) are refused: per tile they draw other masks
than on the whole sequence. A model whose router logits feed an auxiliary loss
(``output_router_logits``) is refused: the logits are recorded by hooks inside the tiles.

Tile size (:func:`resolve_tile_tokens`, the one rule the memory planner uses too): an int is tokens per
tile; ``true`` cuts the ``N`` tokens of the call into equal tiles of at most ``H`` (hidden) tokens, so that
one tile's ``[t, I]`` intermediate is no larger than one MLP weight ``[I, H]`` whatever the sequence length
(an MLP no wider than ``H`` is not cut: its intermediates are no larger than its input).

A call of one tile (``N`` at most the tile) still runs through the recomputing Function: it keeps only its
input, like a call of many tiles, so the memory a row needs grows with its length (a row of ``H`` tokens
does not keep the intermediates that a row of ``H + 1`` drops). The exception is an MLP called inside a
tile of the tiled layer (:mod:`automodel.models.tiled_layer`, which recomputes that tile itself): there a
one-tile call runs the MLP's own ``forward`` (:func:`layer_tile_scope`; counted in
``TileCounts.in_layer_tiles``).

**The final norm is tiled too** (:func:`tile_final_norms`, by :func:`apply_tiled_mlp` and by
:func:`automodel.models.tiled_layer.apply_tiled_layer`). It runs on every local token at once, after every layer has
saved what it keeps, and without checkpointing its backward comes before any layer's has freed it. Run whole,
transformers' RMSNorm keeps its input's fp32 copy and its normalized tensor, and its backward makes five fp32
``[N, h]`` temporaries, which do not halve in bf16: 12 ``[N, h]`` bf16 units at its backward's peak, 7 at its
forward's (:func:`automodel.training.norm_memory.peak_units`); at 700K tokens per rank and hidden 4096, 66 GiB, more
than the tiled layer's own peak. A norm computes each token on its own, so it runs through the same Function (the
same probe, the same tile rule with :data:`NORM_TILE_WIDTH`): it keeps its input, and at its peaks holds its input,
its output or its gradients and one tile's temporaries (about 3.5 units). Which module: the final norm the decoder
(``get_decoder()``) holds under a known name (:func:`find_final_norms`). Not under tensor parallelism (sequence
parallelism shards the norm's tokens through DTensor hooks; there it runs whole, and the memory plan counts it whole).
Counted apart (``tile_counts(model, "final_norm")``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from automodel.errors import UserInputError
from automodel.models.tile_backward import check_same_parameters, tile_gradients

__all__ = [
    "FINAL_NORM_NAMES",
    "MLP_ATTRIBUTES",
    "NORM_TILE_WIDTH",
    "PROBE_TOKENS",
    "apply_tiled_mlp",
    "builds_experts",
    "check_tiled_mlp_for_model",
    "check_tiled_mlp_for_model_config",
    "find_final_norms",
    "find_layer_norms",
    "find_mlps",
    "is_hidden_norm",
    "is_tiled",
    "layer_tile_scope",
    "mlp_intermediate_width",
    "mlp_tile_width",
    "remove_tiled_mlp",
    "resolve_tile_tokens",
    "tile_counts",
    "tile_final_norms",
    "tile_layer_norms",
    "QK_NORM_NAMES",
    "TileCounts",
]

logger = logging.getLogger(__name__)

#: tokens of the real input the first-call probe runs on
PROBE_TOKENS = 8
#: attribute names under which decoder layers hold their MLP (besides the class-name pattern below)
MLP_ATTRIBUTES = ("mlp", "feed_forward", "block_sparse_moe", "shared_mlp", "ffn", "mlp_block", "moe")
_MLP_CLASS = re.compile(r"(MLP|Mlp|FeedForward|FFN|Ffn|SparseMoe\w*|MoE|Moe)$")
#: MLP classes that mix tokens (refused before any weight loads; the probe refuses others at the first call)
_TOKEN_MIXING = {"RwkvFeedForward": "it mixes each token with the previous one (time shift)"}
_MARK = "_automodel_tiled_mlp"
#: the attribute names transformers' decoders give their final norm (:func:`find_final_norms`)
FINAL_NORM_NAMES = ("norm", "ln_f", "norm_f", "final_layer_norm", "final_layernorm", "final_norm", "ln_out", "out_norm",
                    "layer_norm", "layernorm", "embedding_norm")  # LFM2 names its final norm embedding_norm
_BASE_MODEL_NAMES = ("model", "transformer", "backbone", "gpt_neox", "rwkv", "language_model")
#: the width :func:`resolve_tile_tokens` is given for a norm, in units of ``hidden``: its backward's five ``[t, h]``
#: fp32 temporaries (above ``hidden``, so ``true`` cuts tiles of at most ``hidden`` tokens, as for an MLP)
NORM_TILE_WIDTH = 5
#: per-head query / key norms (Qwen3, Gemma 3, OLMo 2; HunYuan's query_layernorm / key_layernorm, Persimmon's and
#: LFM2's q_layernorm / k_layernorm): not hidden-size norms (their input is ``[B, S, heads, d]``)
QK_NORM_NAMES = ("q_norm", "k_norm", "query_layernorm", "key_layernorm", "q_layernorm", "k_layernorm")
#: the tile kinds :func:`tile_counts` tells apart
_KINDS = ("mlp", "final_norm", "layer_norm")
_INLINE_MLP = re.compile(r"^(fc\d|c_fc|c_proj|ffn|mlp|w\d|up|down|gate|dense_h_to_4h|dense_4h_to_h)")


# ------------------------------------------------------------------ sizes


def resolve_tile_tokens(
    tiled_mlp: bool | int | None, hidden: int, intermediate: int, tokens: int
) -> int | None:
    """Tokens per tile for one MLP call of ``tokens`` tokens; ``None`` when tiling is off.

    Args:
        tiled_mlp: ``model.tiled_mlp``: ``False``/``None`` (off), ``True`` (picked), or tokens per tile (>= 1).
        hidden: the MLP's input width ``H``.
        intermediate: the per-token intermediate width ``I`` one rank computes (dense: ``intermediate_size``
            / tp; MoE: ``top_k * moe_intermediate_size`` plus the shared experts; see
            :func:`mlp_intermediate_width`).
        tokens: tokens of the call on this rank (``B * S_local``).

    Returns:
        ``min(tile, tokens)`` (at least 1): ``True`` gives equal tiles of at most ``hidden`` tokens,
        ``ceil(tokens / ceil(tokens / hidden))`` (one tile's ``[t, intermediate]`` intermediate is no larger
        than one ``[intermediate, hidden]`` weight), or ``tokens`` when ``intermediate <= hidden`` (tiling
        is no larger than the input); an int gives itself. A tile >= ``tokens`` means one tile, which still
        runs through the recomputing Function (only the input is kept). ``automodel.training.memory_plan``
        plans with this function.

    Raises:
        ValueError: ``tiled_mlp`` is an int < 1, or ``True`` with a non-positive size.
    """
    if tiled_mlp is None or tiled_mlp is False:
        return None
    tokens = max(int(tokens), 1)
    if tiled_mlp is True:
        if hidden < 1 or intermediate < 1:
            raise ValueError(
                f"tiled_mlp=true needs positive sizes, got hidden={hidden} intermediate={intermediate}"
            )
        if intermediate <= hidden:
            return tokens
        tiles = -(-tokens // hidden)
        tile = -(-tokens // tiles)
    else:
        tile = int(tiled_mlp)
        if tile < 1:
            raise ValueError(f"model.tiled_mlp={tiled_mlp} must be >= 1 tokens per tile, true or false")
    return min(tile, tokens)


def _first_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def hidden_size(config: Any) -> int | None:
    """The decoder's hidden width from a transformers config (text config of a VLM)."""
    from automodel.distributed.cp.profile import text_config

    return _first_int(text_config(config), "hidden_size", "n_embd", "d_model")


def builds_experts(config: Any) -> bool:
    """``False`` where the (text) config names experts' sizes but says the model builds a dense MLP
    (``is_moe=False``: Doge's default); ``True`` elsewhere."""
    return getattr(config, "is_moe", None) is not False


def mlp_tile_width(config: Any) -> int | None:
    """The per-token MLP width :func:`apply_tiled_mlp` cuts its tiles by with ``tiled_mlp=true``:
    :func:`mlp_intermediate_width`, or ``4 x hidden`` where the config names none; ``None`` without a hidden size."""
    hidden = hidden_size(config) if config is not None else None
    width = mlp_intermediate_width(config) if config is not None else None
    return width or (4 * hidden if hidden else None)


def mlp_intermediate_width(config: Any) -> int | None:
    """The widest per-token MLP intermediate of the model (the whole MLP, before any TP split).

    Dense: ``intermediate_size`` (``ffn_dim``, ``n_inner``, ...). MoE: ``num_experts_per_tok *
    moe_intermediate_size`` plus the shared experts (``n_shared_experts * moe_intermediate_size`` or
    ``shared_expert_intermediate_size``). A model with dense and MoE layers (DeepSeek-V3) gets the larger. A config
    with ``is_moe=False`` (Doge's default: its experts' sizes named, a dense MLP built) is dense.
    ``None`` when the config names none of these (``true`` then assumes ``4 * hidden``).
    """
    from automodel.distributed.cp.profile import text_config

    text = text_config(config)
    dense = _first_int(text, "intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "d_ff")
    top_k = _first_int(text, "num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_top_k")
    if not builds_experts(text):  # Doge: experts named, a dense MLP run (config.is_moe=False)
        top_k = None
    widths = [dense] if dense else []
    if top_k:
        expert = _first_int(text, "moe_intermediate_size", "expert_intermediate_size") or dense
        if expert:
            shared = (_first_int(text, "n_shared_experts", "num_shared_experts") or 0) * expert
            shared += _first_int(text, "shared_expert_intermediate_size") or 0
            widths.append(top_k * expert + shared)
    return max(widths) if widths else None


# ------------------------------------------------------------------ finding the MLPs


def _is_mlp(attr: str, module: nn.Module) -> bool:
    return attr in MLP_ATTRIBUTES or bool(_MLP_CLASS.search(type(module).__name__))


def find_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every decoder layer's MLP: ``(qualified name, module)``, each module once (a shared block once).

    Inside each decoder layer (:func:`automodel.models.parallelize.decoder_layers`), the outermost
    submodules held under one of :data:`MLP_ATTRIBUTES` or whose class name ends like an MLP (``...MLP``,
    ``...Mlp``, ``...FeedForward``, ``...FFN``, ``...SparseMoeBlock``, ``...MoE``, ``...Moe``); nothing
    inside a found MLP is listed (a MoE block's experts and shared experts are tiled with it).
    Layers without one (Mamba or attention-only layers of a hybrid) are skipped.

    Raises:
        UserInputError: the model has no decoder layers, or no layer has an MLP module.
    """
    from automodel.models.parallelize import decoder_layers

    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise UserInputError(f"model.tiled_mlp: {e}; set model.tiled_mlp=false") from None
    found = _outermost_in_layers(model, layers, _is_mlp)
    if not found:
        inline = sorted(
            {
                attr
                for layer in layers
                for attr, child in layer.named_children()
                if isinstance(child, nn.Linear) and _INLINE_MLP.search(attr)
            }
        )
        why = f" (its MLP is inline: {', '.join(inline)} are direct children of the layer)" if inline else ""
        raise UserInputError(
            f"model.tiled_mlp: {type(model).__name__} has no MLP module in its decoder layers "
            f"({type(layers[0]).__name__}){why}; nothing to tile: set model.tiled_mlp=false"
        )
    return found


def _outermost_in_layers(
    model: nn.Module, layers: list[nn.Module], take: Callable[[str, nn.Module], bool],
    skip: Callable[[str, nn.Module], bool] = lambda attr, module: False,
) -> list[tuple[str, nn.Module]]:
    """The outermost modules inside ``layers`` that ``take(attribute name, module)`` accepts, as ``(qualified name in
    ``model``, module)``, each once (a shared block once), in layer order; nothing inside a taken module, nothing at
    or under a module ``skip`` accepts, and nothing inside a nested decoder layer (Zamba's hybrid: walked on its own)."""
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        names.setdefault(id(module), name)
    found: dict[int, tuple[str, nn.Module]] = {}
    layer_ids = {id(layer) for layer in layers}

    def walk(module: nn.Module) -> None:
        for attr, child in module.named_children():
            if id(child) in layer_ids or skip(attr, child):
                continue
            if take(attr, child):
                found.setdefault(id(child), (names.get(id(child), attr), child))
            else:
                walk(child)

    for layer in layers:
        walk(layer)
    return list(found.values())


def _random_draws(name: str, module: nn.Module) -> str | None:
    """What inside ``module`` draws random numbers in training (dropout, router jitter), or ``None``."""
    for sub_name, sub in module.named_modules():
        where = f"{name}.{sub_name}" if sub_name else name
        if isinstance(sub, nn.Dropout) and sub.p > 0:
            return f"{where} is a dropout with p={sub.p}"
        for key, value in vars(sub).items():
            if (
                isinstance(value, float)
                and not isinstance(value, bool)
                and value > 0
                and ("dropout" in key or "jitter" in key)
            ):
                return f"{where}.{key}={value}"
    return None


def _static_problems(model: nn.Module, mlps: list[tuple[str, nn.Module]]) -> list[str]:
    from automodel.distributed.cp.profile import text_config

    problems = []
    config = getattr(model, "config", None)
    if config is not None and getattr(text_config(config), "output_router_logits", False):
        problems.append(
            "the model's config has output_router_logits=true: the router logits for the auxiliary loss are "
            "recorded by hooks inside each tile, without gradients, so the auxiliary loss would be wrong; set "
            "model.config_overrides={output_router_logits: false} or model.tiled_mlp=false"
        )
    seen: set[type] = set()
    for name, module in mlps:
        cls = type(module)
        why = _TOKEN_MIXING.get(cls.__name__)
        if why is not None and cls not in seen:
            problems.append(
                f"{name} ({cls.__name__}) is not a per-token MLP: {why}; set model.tiled_mlp=false"
            )
        seen.add(cls)
        draws = _random_draws(name, module)
        if draws is not None:
            problems.append(
                f"{draws}: random draws inside the MLP differ per tile from the whole sequence's, so the losses "
                f"would differ from the run without tiling; set it to 0 (model.config_overrides, peft.dropout) "
                f"or model.tiled_mlp=false"
            )
            break
    return problems


def check_tiled_mlp_for_model(model: nn.Module, tiled_mlp: bool | int) -> list[tuple[str, nn.Module]]:
    """Refuse ``model`` for ``model.tiled_mlp`` before work; return its MLPs (:func:`find_mlps`).

    Works on a meta-device model (no weights). Checks: an MLP module is found; none is known to mix
    tokens; nothing inside an MLP draws random numbers; the config does not record router logits for an
    auxiliary loss; ``tiled_mlp`` is ``true`` or an int >= 1.

    Raises:
        UserInputError: with every problem found, each naming the module or key and the fix.
    """
    if tiled_mlp is not True and (
        isinstance(tiled_mlp, bool) or not isinstance(tiled_mlp, int) or tiled_mlp < 1
    ):
        raise UserInputError(
            f"model.tiled_mlp={tiled_mlp!r} must be false, true (tile picked from the hidden and MLP sizes) or "
            f"tokens per tile >= 1"
        )
    mlps = find_mlps(model)
    problems = _static_problems(model, mlps)
    if problems:
        raise UserInputError("model.tiled_mlp: " + "; ".join(problems))
    return mlps


# ------------------------------------------------------------------ the tiled call


@dataclass
class TileCounts:
    """What one tiled MLP did since the last :meth:`reset` (the run log reports it after the first step)."""

    calls: int = 0  # calls of the MLP (a checkpointed layer's recomputation calls it again)
    tiled_calls: int = 0  # calls run through the tiled Function (one tile or more), keeping only the input
    in_layer_tiles: int = 0  # one-tile calls inside a tiled layer's tile: the MLP's own forward (the layer recomputes)
    tiles: int = 0  # tiles run by the tiled calls' forwards
    backward_tiles: int = 0  # tiles recomputed by the tiled backward
    max_tile_tokens: int = 0  # the largest tile (tokens)
    max_tokens: int = 0  # the most tokens of one call

    def reset(self) -> None:
        self.calls = self.tiled_calls = self.in_layer_tiles = self.tiles = self.backward_tiles = 0
        self.max_tile_tokens = self.max_tokens = 0


@dataclass
class _Tiling:
    """What one wrapped MLP needs at call time (stored on the module)."""

    setting: bool | int
    hidden: int
    intermediate: int  # per-token width one rank computes (after the TP split)
    probed: bool = False
    counts: TileCounts = field(default_factory=TileCounts)
    #: ``"mlp"``, ``"final_norm"`` (:func:`tile_final_norms`) or ``"layer_norm"`` (:func:`tile_layer_norms`): norms
    #: through the same call
    kind: str = "mlp"


@dataclass
class _OutputSpec:
    """The structure of the MLP's output: a tensor, or a tuple/list with tensors at some positions."""

    container: type | None  # None: a single tensor
    values: list[Any] = field(default_factory=list)  # non-tensor entries (tensors: None placeholders)
    tensor_positions: list[int] = field(default_factory=list)
    token_dims: list[int] = field(
        default_factory=list
    )  # per tensor output: the dim tiles are concatenated on
    placements: list[Any] = field(
        default_factory=list
    )  # per tensor output: DTensor (mesh, placements) or None


def _token_dim(t: torch.Tensor, tile: int, flat: bool) -> int:
    if not flat and t.ndim >= 3 and t.shape[0] == 1 and t.shape[1] == tile:
        return 1
    if t.ndim >= 1 and t.shape[0] == tile:
        return 0
    raise ValueError(
        f"model.tiled_mlp: an MLP output of shape {tuple(t.shape)} has no token dimension of the tile's {tile} "
        f"tokens; this MLP cannot be tiled (set model.tiled_mlp=false)"
    )


def _flatten_output(
    out: Any, tile: int, flat: bool, spec: _OutputSpec | None
) -> tuple[list[torch.Tensor], _OutputSpec]:
    """The output's tensors (local tensors of DTensors) and its structure (checked against ``spec``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(out, torch.Tensor):
        items, container = [out], None
    elif isinstance(out, (tuple, list)):
        items, container = list(out), type(out)
    else:
        raise ValueError(
            f"model.tiled_mlp: an MLP returned a {type(out).__name__}; only a tensor or a tuple of them can be "
            f"tiled (set model.tiled_mlp=false)"
        )
    tensors, new = [], _OutputSpec(container)
    for i, item in enumerate(items):
        if isinstance(item, torch.Tensor):
            new.tensor_positions.append(i)
            new.values.append(None)
            if isinstance(item, DTensor):
                new.placements.append((item.device_mesh, tuple(item.placements)))
                item = item.to_local()
            else:
                new.placements.append(None)
            new.token_dims.append(_token_dim(item, tile, flat))
            tensors.append(item)
        elif item is None or isinstance(item, (int, float, bool, str)):
            new.values.append(item)
        else:
            raise ValueError(
                f"model.tiled_mlp: an MLP returned a {type(item).__name__} in its output; this MLP cannot be "
                f"tiled (set model.tiled_mlp=false)"
            )
    if spec is not None and (
        spec.container is not new.container
        or spec.tensor_positions != new.tensor_positions
        or spec.token_dims != new.token_dims
        or spec.values != new.values
    ):
        raise ValueError("model.tiled_mlp: the MLP returned differently structured outputs for two tiles")
    return tensors, new


class _Runner:
    """Runs one MLP call tile by tile. Its token inputs are flat local tensors: ``[1, N, D]`` or ``[N, D]``."""

    def __init__(
        self, module: nn.Module, call: Callable[..., Any], n_inputs: int, n: int, tile: int, flat: bool
    ):
        self.module, self.call, self.n_inputs, self.flat = module, call, n_inputs, flat
        self.bounds = [(a, min(a + tile, n)) for a in range(0, n, tile)]
        self.spec: _OutputSpec | None = None
        self.rng: tuple[Any, Any] | None = None
        self.autocast: tuple[str, bool, torch.dtype] | None = None
        self.counts: TileCounts = getattr(module, _MARK).counts

    def tile(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return x[a:b] if self.flat else x[:, a:b]

    def run(self, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        # copies: an MLP may scale its input in place (Mixtral's jitter), which must not reach the saved input
        out = self.call(*[t.clone() for t in tiles])
        tensors, self.spec = _flatten_output(out, tiles[0].shape[0 if self.flat else 1], self.flat, self.spec)
        return tensors

    def forward_all(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        per_tile = [self.run([self.tile(x, a, b) for x in xs]) for a, b in self.bounds]
        assert self.spec is not None
        if len(per_tile) == 1:  # one tile: its outputs are the call's (no copy through cat)
            return per_tile[0]
        return [torch.cat([t[j] for t in per_tile], dim=d) for j, d in enumerate(self.spec.token_dims)]

    def trainable(self) -> list[torch.Tensor]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def save_state(self, device: torch.device) -> None:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.rng = (torch.get_rng_state(), cuda)
        kind = device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def replay(self, device: torch.device) -> contextlib.ExitStack:
        """A context that restores the forward's RNG and autocast state (the recompute draws the same numbers)."""
        stack = contextlib.ExitStack()
        devices = [device] if device.type == "cuda" else []
        stack.enter_context(torch.random.fork_rng(devices=devices))
        assert self.rng is not None and self.autocast is not None
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1], device)
        kind, enabled, dtype = self.autocast
        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
        return stack


class _TiledMLPFunction(torch.autograd.Function):
    """``outputs = MLP(*token_inputs)`` computed per tile; ``params`` (the MLP's trainable parameters) receive
    their gradients through this node, summed over the tiles."""

    @staticmethod
    def forward(ctx: Any, runner: _Runner, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        xs, params = list(tensors[: runner.n_inputs]), tensors[runner.n_inputs :]
        runner.save_state(xs[0].device)
        outs = runner.forward_all(xs)
        ctx.runner = runner
        ctx.params = params
        ctx.save_for_backward(*xs)
        ctx.mark_non_differentiable(*[o for o in outs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        runner: _Runner = ctx.runner
        xs = list(ctx.saved_tensors)
        params = list(ctx.params)
        check_same_parameters("model.tiled_mlp", runner.module, runner.trainable(), params)
        k = runner.n_inputs
        needs_x = list(ctx.needs_input_grad[1 : 1 + k])
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1 + k :]) if need]
        assert runner.spec is not None
        dims = runner.spec.token_dims
        with runner.replay(xs[0].device), torch.enable_grad():
            runner.counts.backward_tiles += len(runner.bounds)
            grad_xs, sums = tile_gradients(
                runner.bounds, xs, grads, needs_x, params, wanted,
                cut_input=lambda x, _k, a, b: runner.tile(x, a, b),
                cut_output=lambda g, j, a, b: g.narrow(dims[j], a, b - a),
                run=lambda _a, leaves: runner.run(leaves),
            )  # fmt: skip
        return (None, *grad_xs, *sums)


def _token_inputs(
    args: tuple, kwargs: dict
) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], tuple[tuple, dict]]]:
    """The MLP's token inputs (every tensor argument: the hidden states first, then e.g. Bloom's residual,
    each with the hidden states' leading token dims) and a function that puts tiles in their places.

    A tensor of the token dims alone (``[B, S]`` beside ``[B, S, D]`` hidden states, ``[N]`` beside ``[N, D]``:
    DeepSeek-V4's MoE takes the input ids for its hash-routed layers) is a token input too: it is returned with a
    trailing dim of 1 (``[B, S, 1]``), and ``place`` drops that dim again."""
    where = [("a", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    where += [("k", key) for key, v in kwargs.items() if isinstance(v, torch.Tensor)]
    tensors = [args[i] if kind == "a" else kwargs[i] for kind, i in where]
    if not tensors:
        raise ValueError("model.tiled_mlp: the MLP was called without a tensor; it cannot be tiled")
    lead = tensors[0].shape[:-1]
    per_token = [j > 0 and t.shape == lead for j, t in enumerate(tensors)]  # the token dims alone
    tensors = [t.unsqueeze(-1) if alone else t for t, alone in zip(tensors, per_token, strict=True)]
    if tensors[0].ndim < 2 or any(t.ndim != tensors[0].ndim or t.shape[:-1] != lead for t in tensors[1:]):
        raise ValueError(
            f"model.tiled_mlp: the MLP was called with tensors of shapes {[tuple(t.shape) for t in tensors]}; only "
            f"[B, S, ..., D] or [N, D] inputs of the same tokens (and [B, S] or [N] ones) can be tiled (set "
            f"model.tiled_mlp=false)"
        )

    # the non-tensor arguments only: ``place`` lives on the runner, which the autograd node keeps until the layer's
    # backward; holding the token inputs here would keep each layer's whole [N, h] input alive beside what
    # save_for_backward saves (and what activation checkpointing drops)
    rest_args = [None if isinstance(a, torch.Tensor) else a for a in args]
    rest_kwargs = {k: None if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def place(tiles: list[torch.Tensor]) -> tuple[tuple, dict]:
        new_args, new_kwargs = list(rest_args), dict(rest_kwargs)
        for (kind, i), t, alone in zip(where, tiles, per_token, strict=True):
            t = t.squeeze(-1) if alone else t
            if kind == "a":
                new_args[i] = t
            else:
                new_kwargs[i] = t
        return tuple(new_args), new_kwargs

    return tensors, place


def _graph_leaves(outputs: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` variables) that ``outputs`` depend on through autograd."""
    seen: set[int] = set()
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            yield variable
        stack.extend(fn for fn, _ in node.next_functions)


def _probe(module: nn.Module, call: Callable[..., Any], xs: list[torch.Tensor], flat: bool) -> None:
    """Refuse ``module`` unless its output tokens depend on their own input tokens only, and its output's
    trainable leaves are its own parameters. ``xs``: the real flat token inputs (their first tokens are used)."""
    n = min(PROBE_TOKENS, xs[0].shape[0 if flat else 1])
    if n < 2:
        return
    name = type(module).__name__
    leaves = [
        (x[:n] if flat else x[:, :n]).detach().clone().requires_grad_(x.is_floating_point()) for x in xs
    ]
    devices = [xs[0].device] if xs[0].device.type == "cuda" else []
    with (
        torch.random.fork_rng(devices=devices),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),  # not activation checkpointing's
    ):
        outs, spec = _flatten_output(call(*[leaf.clone() for leaf in leaves]), n, flat, None)
        j = n // 2
        first = outs[0]
        token = first[j] if spec.token_dims[0] == 0 else first[0, j]
        differentiable = [leaf for leaf in leaves if leaf.requires_grad]
        if token.requires_grad and differentiable:
            for g in torch.autograd.grad(
                token.float().sum(), differentiable, retain_graph=True, allow_unused=True
            ):
                if g is None:
                    continue
                g = g.reshape(n, -1) if flat else g[0].reshape(n, -1)
                if bool((torch.cat([g[:j], g[j + 1 :]]) != 0).any()):
                    raise UserInputError(
                        f"model.tiled_mlp: {name} is not a per-token MLP (output token {j} of a probe depends on "
                        f"other input tokens), so tiling it would change the results; set model.tiled_mlp=false"
                    )
        own = {id(p) for p in module.parameters()} | {id(leaf) for leaf in leaves}
        foreign = [t for t in _graph_leaves(outs) if id(t) not in own and t.requires_grad]
        if foreign:
            raise UserInputError(
                f"model.tiled_mlp: {name}'s output depends on {len(foreign)} trainable tensor(s) that are not its "
                f"own parameters (shapes {[tuple(t.shape) for t in foreign[:3]]}); their gradients would be lost "
                f"in the tiled backward, so it is refused; set model.tiled_mlp=false"
            )


def _local(x: torch.Tensor, flat: bool) -> tuple[torch.Tensor, Any]:
    """``x``'s local tensor and its DTensor ``(mesh, placements)`` (``None`` for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        return x, None
    placements = tuple(x.placements)
    token_dim = 0 if flat else 1
    if any(
        not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == token_dim)) for p in placements
    ):
        raise ValueError(
            f"model.tiled_mlp: the MLP's input is a DTensor with placements {placements}; tiles are taken along "
            f"the tokens, which needs it replicated or sharded on the tokens"
        )
    return x.to_local(), (x.device_mesh, placements)


#: how deep this thread is inside tiled-layer tiles (:func:`layer_tile_scope`)
_LAYER_TILE = threading.local()


@contextlib.contextmanager
def layer_tile_scope() -> Iterator[None]:
    """Within it, a tiled MLP call of one tile runs the MLP's own forward: for the tiled layer
    (:mod:`automodel.models.tiled_layer`), whose tile Function already keeps only its inputs and recomputes the
    tile, MLP included, in the backward (a second recompute would cost an MLP forward and save nothing). A call
    of several tiles still tiles. Per thread (the autograd engine runs CUDA backwards on its own threads)."""
    _LAYER_TILE.depth = getattr(_LAYER_TILE, "depth", 0) + 1
    try:
        yield
    finally:
        _LAYER_TILE.depth -= 1


@torch._dynamo.disable(reason="automodel: the tiled MLP runs its tiles eagerly")
def _tiled_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a tiled MLP: the module's own ``__call__`` (its hooks, its ``forward``) per tile."""
    from torch.distributed.tensor import DTensor

    tiling: _Tiling = getattr(self, _MARK)
    base_call = functools.partial(nn.Module.__call__, self)
    if tiling.kind != "mlp":  # a norm of a vector ([H]) or of no tensor: whole, and the report says so
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.ndim < 2:
            tiling.counts.calls += 1
            return base_call(*args, **kwargs)
    xs, place = _token_inputs(args, kwargs)
    flat = xs[0].ndim == 2
    locals_, dspecs = zip(*(_local(x, flat) for x in xs), strict=True)
    shape = locals_[0].shape
    n = shape[0] if flat else shape[0] * shape[1]
    # [B, S, ...] -> [1, B * S, ...] (xLSTM's multi-head norm takes [B, S, heads, d]); tiles along dim 1
    flat_xs = [t if flat else t.reshape(1, n, *t.shape[2:]) for t in locals_]

    def call(*tiles: torch.Tensor) -> Any:
        wrapped = [
            t if spec is None else DTensor.from_local(t, spec[0], spec[1], run_check=False)
            for t, spec in zip(tiles, dspecs, strict=True)
        ]
        a, k = place(wrapped)
        return base_call(*a, **k)

    if (
        not tiling.probed
        and all(s is None for s in dspecs)
        and not (xs[0].is_meta or torch.is_inference_mode_enabled())
    ):
        _probe(self, call, flat_xs, flat)
        tiling.probed = True
    tile = resolve_tile_tokens(tiling.setting, tiling.hidden, tiling.intermediate, n)
    counts = tiling.counts
    counts.calls += 1
    counts.max_tokens = max(counts.max_tokens, n)
    if tile is None:
        return base_call(*args, **kwargs)
    if tile >= n and getattr(_LAYER_TILE, "depth", 0) > 0:  # the tiled layer recomputes this tile itself
        counts.in_layer_tiles += 1
        return base_call(*args, **kwargs)
    runner = _Runner(self, call, len(flat_xs), n, tile, flat)
    counts.tiled_calls += 1
    counts.tiles += len(runner.bounds)
    counts.max_tile_tokens = max(counts.max_tile_tokens, min(tile, n))
    params = runner.trainable()
    if torch.is_grad_enabled() and (any(x.requires_grad for x in flat_xs) or params):
        outs = list(_TiledMLPFunction.apply(runner, *flat_xs, *params))
    else:
        with torch.no_grad():
            outs = runner.forward_all(flat_xs)
    spec = runner.spec
    assert spec is not None
    items = list(spec.values)
    for pos, out, dim, placement in zip(
        spec.tensor_positions, outs, spec.token_dims, spec.placements, strict=True
    ):
        if dim == 1 and not flat:  # [1, N, ...] -> [B, S, ...] as the untiled MLP returns it
            out = out.reshape(shape[0], shape[1], *out.shape[2:])
        if placement is not None:
            out = DTensor.from_local(out, placement[0], placement[1], run_check=False)
        items[pos] = out
    if spec.container is None:
        return items[0]
    return spec.container(items)


_TILED_CLASSES: dict[type, type] = {}


def same_named_subclass(cls: type, attrs: dict[str, Any], cache: dict[type, type]) -> type:
    """A subclass of ``cls`` with its name, module and qualified name and ``attrs`` (a tiling forward or call), made
    once per class and kept in ``cache`` (mutated), so a module whose ``__class__`` is switched to it reads as before in
    reprs and logs."""
    sub = cache.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {**attrs, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        cache[cls] = sub
    return sub


def _tiled_class(cls: type) -> type:
    """A subclass of ``cls`` with the same name whose ``__call__`` tiles (one per class)."""
    return same_named_subclass(cls, {"__call__": _tiled_call, "_automodel_untiled_class": cls}, _TILED_CLASSES)


def tile_counts(model: nn.Module, kind: str = "mlp") -> list[TileCounts]:
    """The :class:`TileCounts` of every tiled MLP of ``model`` (``kind="final_norm"``: of its tiled final norm;
    ``"layer_norm"``: of its decoder layers' tiled norms), in module order (empty: nothing tiled)."""
    if kind not in _KINDS:
        raise ValueError(f"tile_counts: kind={kind!r} is not one of {_KINDS}")
    return [getattr(m, _MARK).counts for m in model.modules() if is_tiled(m) and getattr(m, _MARK).kind == kind]


def is_tiled(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by :func:`apply_tiled_mlp` (an MLP) or :func:`tile_final_norms` (the final norm)."""
    return hasattr(module, _MARK)


def _tile_module(module: nn.Module, setting: bool | int, hidden: int, width: int, kind: str) -> bool:
    """Run ``module``, a per-token module of ``hidden`` inputs, over token tiles through :class:`_TiledMLPFunction`
    (in place; ``False`` where it already is). ``setting``: ``True`` or tokens per tile, resolved per call by
    :func:`resolve_tile_tokens` with ``width`` as the intermediate width; ``kind`` names it in the counts."""
    if is_tiled(module):
        return False
    setattr(module, _MARK, _Tiling(setting, hidden, width, kind=kind))
    module.__class__ = _tiled_class(type(module))
    return True


def find_final_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The text decoder's final norm: ``[(qualified name, module)]``, or empty where none is found.

    The module held under one of :data:`FINAL_NORM_NAMES` (the first found) by ``model.get_decoder()``, by ``model``
    or by their base model one level down (Llama 4's), whose class name contains ``norm`` (any case) and whose
    parameters are all ``[hidden]`` vectors (or none). Other norms outside the layers are left whole (an embedding norm, a hyper-connection head's norm over
    its streams, a vision tower's): their inputs need not be ``[B, S, hidden]``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder = decoder if isinstance(decoder, nn.Module) else model
    config = getattr(model, "config", None)
    hidden = hidden_size(config) if config is not None else None
    names = {id(m): n for n, m in model.named_modules()}
    tops = [decoder] + ([model] if decoder is not model else [])  # ModernBERT-decoder's get_decoder() is its head
    holders = [*tops, *(child for top in tops for attr, child in top.named_children() if attr in _BASE_MODEL_NAMES)]
    for holder in holders:
        for attr in FINAL_NORM_NAMES:
            norm = getattr(holder, attr, None)
            if (
                isinstance(norm, nn.Module)
                and "norm" in type(norm).__name__.lower()
                and all(tuple(p.shape) == (hidden,) for p in norm.parameters())
            ):
                return [(names.get(id(norm), attr), norm)]
    return []


def is_hidden_norm(module: nn.Module, hidden: int | None, *, held_by_layer: bool = False) -> bool:
    """Whether ``module`` is a norm over the hidden size (one that normalizes each ``[hidden]`` token vector of the
    residual stream): a class named like a norm (any case) whose parameters are all ``[hidden]`` vectors, with a
    ``[hidden]`` weight (Llama's RMSNorm, ``nn.LayerNorm``); or one without parameters whose ``normalized_shape`` is
    ``(hidden,)`` (OLMo's LayerNorm) or, where it names no width, that a decoder layer holds itself (``held_by_layer``:
    NanoChat's, Dory's and HRM's RMSNorms). A parameter-free norm deeper in a layer (a value or per-head norm, a
    hyper-connection's) is not one: nothing says its width. Shared by the tiled layer norms (:func:`find_layer_norms`)
    and the memory plan, which counts what they run."""
    if hidden is None or "norm" not in type(module).__name__.lower():
        return False
    params = list(module.parameters())
    if params:
        weight = getattr(module, "weight", None)
        return (
            isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (hidden,)
            and all(tuple(p.shape) == (hidden,) for p in params)
        )
    width = getattr(module, "normalized_shape", None)
    if width is not None:
        return tuple(width) == (hidden,) if isinstance(width, (tuple, list, torch.Size)) else width == hidden
    return held_by_layer


def find_layer_norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every decoder layer's hidden-size norms: ``[(qualified name, module)]`` in module order (empty: none, or no
    decoder layers found).

    Inside each decoder layer (:func:`automodel.models.parallelize.decoder_layers`), the outermost modules named like a
    norm over the hidden size (:func:`is_hidden_norm`: Llama's ``input_layernorm`` and ``post_attention_layernorm``,
    Gemma's four, NanoChat's parameter-free two); not the per-head q/k norms (:data:`QK_NORM_NAMES`), nothing inside
    a layer's MLP (tiled with it) and nothing inside a nested decoder layer (found with its own layer)."""
    from automodel.models.parallelize import decoder_layers

    try:
        layers = decoder_layers(model)
    except ValueError:
        return []
    config = getattr(model, "config", None)
    hidden = hidden_size(config) if config is not None else None
    held = {id(child) for layer in layers for child in layer.children()}
    return _outermost_in_layers(model, layers, lambda attr, m: is_hidden_norm(m, hidden, held_by_layer=id(m) in held),
                                skip=lambda attr, m: attr in QK_NORM_NAMES or _is_mlp(attr, m))  # fmt: skip


def tile_layer_norms(model: nn.Module, setting: bool | int, *, tp_size: int = 1) -> int:
    """Run every decoder layer's hidden-size norm (:func:`find_layer_norms`) over token tiles, as the final norm
    (in place; idempotent); returns how many it wrapped. ``setting``: ``True`` or tokens per tile; ``False`` /
    ``None`` or ``tp_size`` above 1 does nothing. Whole, transformers' RMSNorm saves its input's fp32 copy and its
    normalized tensor, and its backward makes five fp32 ``[N, h]`` temporaries: 12 ``[N, h]`` bf16 units at the
    backward's peak, the recomputed layer's peak once its MLP is tiled (:func:`automodel.training.memory_plan`'s norm
    moment); tiled, it keeps its input and holds one tile's temporaries. Inside a tiled layer's tile a one-tile call
    runs the norm's own forward (:func:`layer_tile_scope`). :func:`remove_tiled_mlp` undoes it."""
    if setting is False or setting is None or tp_size > 1:
        return 0
    return len(_tile_norms(model, setting, find_layer_norms(model), "layer_norm"))


def _tile_norms(
    model: nn.Module, setting: bool | int, norms: list[tuple[str, nn.Module]], kind: str
) -> list[tuple[str, nn.Module]]:
    """Run ``norms`` (of ``model``) over token tiles as ``kind`` (:func:`_tile_module` with the width
    :data:`NORM_TILE_WIDTH` x hidden); returns those it wrapped (a norm already tiled keeps its setting)."""
    config = getattr(model, "config", None)
    hidden = (hidden_size(config) if config is not None else None) or 1
    return [(name, m) for name, m in norms if _tile_module(m, setting, hidden, NORM_TILE_WIDTH * hidden, kind)]


def tile_final_norms(model: nn.Module, setting: bool | int, *, tp_size: int = 1) -> int:
    """Run the final norm (:func:`find_final_norms`) over token tiles (in place; idempotent: a norm already tiled
    keeps its setting); returns how many it wrapped (0 or 1). ``setting``: ``True`` or tokens per tile;
    ``False`` / ``None`` or ``tp_size`` above 1 does nothing (see the module docstring).
    :func:`remove_tiled_mlp` undoes it."""
    if setting is False or setting is None or tp_size > 1:
        return 0
    norms = _tile_norms(model, setting, find_final_norms(model), "final_norm")
    if norms:
        logger.info("the final norm (%s) runs over token tiles too", ", ".join(name for name, _ in norms))
    return len(norms)


def apply_tiled_mlp(
    model: nn.Module, tiled_mlp: bool | int, *, tp_size: int = 1, sequence_parallel: bool = False
) -> int:
    """Run every decoder layer's MLP over sequence tiles (in place; idempotent); returns the MLPs wrapped.

    Call after LoRA and TP (any order is exact: the tiles enter the MLP through its hooks), before
    activation checkpointing, ``torch.compile`` of the blocks and FSDP2. ``tiled_mlp=False`` does nothing.

    Args:
        model: an HF causal LM (or VLM).
        tiled_mlp: ``True`` (tile from :func:`resolve_tile_tokens`) or tokens per tile.
        tp_size, sequence_parallel: the TP split, for ``True``: without sequence parallel a rank computes
            ``1/tp_size`` of the intermediate (tiles ``tp_size`` times larger); with it, it gathers
            ``tp_size`` times its tokens per tile (tiles as without TP).

    Mutates ``model``: each MLP module's class becomes a same-named subclass that tiles; parameters,
    their names and ``forward`` are unchanged; the final norm and the decoder layers' hidden-size norms likewise
    (:func:`tile_final_norms`, :func:`tile_layer_norms`; not under TP).
    :func:`remove_tiled_mlp` undoes it.

    Raises:
        UserInputError: as :func:`check_tiled_mlp_for_model`; at an MLP's first call, the probe's refusals.
    """
    if tiled_mlp is False or tiled_mlp is None:
        return 0
    mlps = check_tiled_mlp_for_model(model, tiled_mlp)
    config = getattr(model, "config", None)
    hidden = (hidden_size(config) if config is not None else None) or 1
    width = mlp_intermediate_width(config) if config is not None else None
    if tiled_mlp is True and width is None:
        width = mlp_tile_width(config) or 4 * hidden
        logger.info(
            "model.tiled_mlp=true: the config names no MLP width; tiles assume 4 x hidden = %d", width
        )
    split = 1 if sequence_parallel else max(int(tp_size), 1)
    per_rank = max((width or hidden) // split, 1)
    for _, module in mlps:
        _tile_module(module, tiled_mlp, hidden, per_rank, "mlp")
    tile_final_norms(model, tiled_mlp, tp_size=tp_size)
    norms = tile_layer_norms(model, tiled_mlp, tp_size=tp_size)
    logger.info(
        "model.tiled_mlp=%s: %d MLP module(s) and %d norm(s) of the decoder layers run over token tiles (%s)",
        tiled_mlp,
        len(mlps),
        norms,
        f"{tiled_mlp} tokens per tile"
        if tiled_mlp is not True
        else f"equal tiles of at most {hidden} tokens",
    )
    return len(mlps)


def remove_tiled_mlp(model: nn.Module) -> int:
    """Undo :func:`apply_tiled_mlp`, :func:`tile_final_norms` and :func:`tile_layer_norms` on ``model`` (in place);
    returns the modules unwrapped."""
    count = 0
    for module in model.modules():
        if is_tiled(module):
            module.__class__ = type(module)._automodel_untiled_class
            delattr(module, _MARK)
            count += 1
    return count


def check_tiled_mlp_for_model_config(
    model_cfg: Any, resolved: Any, *, attn_implementation: str, seed: int
) -> None:
    """The recipe's check of ``model.tiled_mlp`` before any weight loads: the model built on the meta device
    (no memory) and checked by :func:`check_tiled_mlp_for_model`. No-op when ``model.tiled_mlp`` is false.

    ``model_cfg``: the config's ``model`` section; ``resolved``: :func:`automodel.models.loader.resolve_model_config`'s
    result.
    """
    if model_cfg.tiled_mlp is False:
        return
    from automodel.models.loader import build_model

    model = build_model(model_cfg, resolved, attn_implementation=attn_implementation, seed=seed, meta=True)
    check_tiled_mlp_for_model(model, model_cfg.tiled_mlp)
