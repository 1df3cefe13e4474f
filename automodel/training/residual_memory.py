"""The memory planner's view of a decoder layer's residual structure where it is wider than one ``[N, h]`` stream of
the compute dtype: hyper-connections (DeepSeek-V4's and HY-V4's ``hc_mult``, Qwen4-Exp's ``hc_count``), and a
residual stream kept in fp32 in a bf16 model (ZAYA's ``residual_in_fp32``: :func:`residual_fp32`).

A hyper-connected layer takes ``K`` residual streams (``[B, S, K, h]`` or ``[B, S, K h]``). Before its attention and
its MLP it normalizes the streams, computes mixing weights from them (in fp32 in DeepSeek-V4 and HY-V4) and collapses
them into the block's ``[B, S, h]`` input; after the block it expands the output back into ``K`` streams and mixes
them with the residual ones. Every step keeps a ``[N, K h]`` tensor or its fp32 copy for the backward: with its
attention and MLP left out, a layer of DeepSeek-V4's real size (hidden 4096, 4 streams) saves about 18 ``[N, h]`` per
token in fp32 and 48 in bf16 (its mixing runs in fp32) beyond a plain pre-norm layer of its two norms, which saves 3
(Llama's: the first norm's normalized input, the second's input and normalized input) and 6 in bf16 (their fp32
copies), its input's 3 further streams included
(:attr:`automodel.training.memory_plan.ModelDims.residual_saved_extra`).

:func:`residual_saved` measures it: a fresh copy of the layer's class is built on the meta device (no memory, the
model untouched), its attention, linear mixer and MLP replaced by stubs that return a copy of their input and save
nothing (Qwen4-Exp's per-layer embedding, which needs its ids, left out), and one forward of 64 tokens runs under
saved-tensor hooks; with its output alive, the storages autograd still keeps are counted, once each, less the
parameters and the input, and less what a plain pre-norm layer of the layer's hidden-size norms keeps so (the part the
planner's stream term counts). A stub that ignored its input would leave the norm before it out of the graph: its
saved tensors freed, and the subtraction wrong by them.

ZAYA's layer takes its input in fp32 and scales the residual and each block's output in fp32 around the block
(``ZayaResidualScaling``): the probe gives it an fp32 input, as its model does, and counts 4 ``[N, h]`` per token in
fp32 and 6 in bf16 beyond a plain layer's; checkpointing keeps its layer inputs in fp32
(:attr:`automodel.training.memory_plan.ModelDims.residual_fp32`).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from automodel.models.block_call import layers_owner
from automodel.models.tiled_mlp import is_hidden_norm
from automodel.training.attention_memory import ATTENTION_NAMES
from automodel.training.mlp_memory import live_moments
from automodel.training.saved_storage import probe_pair, saved_storage_bytes

__all__ = ["residual_backward_extra", "residual_fp32", "residual_saved"]

#: the stub of these blocks returns ``(output, None)`` (transformers' attention modules; HY-V4's three values and a
#: linear mixer's output alone are tried next), the others' their output
_TUPLE_NAMES = ATTENTION_NAMES
#: the children a decoder layer's forward calls for its attention, mixer and MLP: stubbed
_BLOCK_NAMES = (*ATTENTION_NAMES, "linear_attn", "mixer", "mlp", "feed_forward", "ffn")
#: the attention stub's outputs tried in turn: ``(output, None)``, ``(output, None, None)``, the output alone
_ATTENTION_RETURNS = (2, 3, 0)
#: the MLP and mixer stubs' outputs tried in turn: the output alone, ``(output, None)``
_MLP_RETURNS = (0, 2)

_CACHE: dict[tuple, tuple[float, float] | None] = {}


class _Stub(torch.nn.Module):
    """A block that saves nothing: a fresh leaf of its input's shape that requires grad, as its output, alone or
    followed by ``values - 1`` Nones."""

    def __init__(self, values: int) -> None:
        super().__init__()
        self.values = values

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        x = args[0] if args else kwargs["hidden_states"]
        out = x.clone()  # of its input (a clone saves nothing): what fed the block stays in the graph, as in the layer
        return (out, *[None] * (self.values - 1)) if self.values else out


def _model_class(layer: torch.nn.Module) -> type:
    """The transformers class of ``layer`` (FSDP2 and the tiled MLP subclass it)."""
    for cls in type(layer).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls
    return type(layer)


def residual_saved(layer: torch.nn.Module, config: Any, streams: int,  # noqa: ANN401
                   fp32_stream: bool = False) -> tuple[float, float] | None:
    """``(fp32, bf16)``: the ``[N, h]`` units per token (in the compute dtype's elements) that the decoder layer
    ``layer`` (built from ``config``, its model's text config) saves for its backward beyond its input, its
    attention, mixer and MLP left out (its norms, residual adds and, with ``streams > 1``, its hyper-connections),
    less what a plain pre-norm layer of as many norms of its norm class saves so (:func:`_plain_saved_on_meta`: the
    part the planner's stream term counts). With ``fp32_stream`` the layer is given its input in fp32 whatever the
    compute dtype, as its model hands it (:func:`residual_fp32`: ZAYA). ``None`` where the layer's class cannot be
    built or run so on the meta device (the planner then counts its norms and residual alone)."""
    cls = _model_class(layer)
    key = _probe_key(cls, layer, config, streams, fp32_stream)
    return probe_pair(_CACHE, key, lambda dtype: _saved_on_meta(cls, config, streams, dtype, fp32_stream))


def residual_backward_extra(layer: torch.nn.Module, config: Any, streams: int,  # noqa: ANN401
                            fp32_stream: bool = False) -> tuple[tuple[float, float], tuple[float, float]] | None:
    """``((untiled, norms tiled) in fp32, (untiled, norms tiled) in bf16)``: what the backward of the decoder layer
    ``layer``'s residual structure holds beyond what it saved, in ``[N, h]`` units per token of the compute dtype's
    elements, its attention, mixer and MLP stubbed as in :func:`residual_saved` (0 where not more):

    * untiled: the most it holds at once beyond its saved tensors, less the two ``[N, h]`` gradients (its output's and
      its input's) the planner counts for any layer: the gradients of its ``K`` streams, what its residual structure's
      backward makes and its norms' backward temporaries (fp32 in bf16). Gemma 3n's AltUp correction (``correct``:
      the innovation repeated to ``K`` streams times their coefficients, plus the predictions) holds ``[K, N, h]``
      gradients of its product, its innovation and the predictions at once, first in the layer's backward, with
      every tensor the layer saved alive: its checkpointed layer was planned 9.4% under in bf16 at hidden 256 (6.0 in
      fp32, 9.9 in bf16 at the tiny config's ``K = 2``);
    * norms tiled (the tiled MLP's norms, whose fp32 temporaries are one tile's): how much higher its backward's
      peak is than a plain pre-norm layer's of as many norms (:func:`_plain_forward`), beyond what it saves more
      (:func:`residual_saved`, which the planner counts at every moment): the norms' temporaries cancel.

    Measured on the meta device (no memory, no compute) by :func:`automodel.training.mlp_memory.live_moments` with
    the output's gradient counted, at :data:`_PEAK_TOKENS`' two lengths: per token the difference (the parameters'
    gradients, a constant, cancel). ``None`` where the layer cannot be run so."""
    cls = _model_class(layer)
    key = _probe_key(cls, layer, config, streams, fp32_stream)
    return probe_pair(_BACKWARD_CACHE, key, lambda dtype: _on_meta(cls, config, streams, dtype, fp32_stream, _backward_extra))


def _probe_key(cls: type, layer: torch.nn.Module, config: Any, streams: int, fp32_stream: bool) -> tuple:  # noqa: ANN401
    """What a probe of the stubbed layer depends on: its class, streams, input dtype, width and parameter shapes."""
    return (cls, streams, fp32_stream, config.hidden_size, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()))


#: the two lengths of :func:`residual_backward_extra`'s probe (on the meta device they cost nothing)
_PEAK_TOKENS = (256, 512)

_BACKWARD_CACHE: dict[tuple, tuple[float, float] | None] = {}

#: ``run(tokens)`` -> ``(input, further inputs, the layer's forward on them)``, all made on the meta device
_Run = Callable[[int], tuple[torch.Tensor, dict[str, torch.Tensor], Callable[[], Any]]]


def _saved_on_meta(cls: type, config: Any, streams: int, dtype: torch.dtype, fp32_stream: bool = False) -> float:  # noqa: ANN401
    return _on_meta(cls, config, streams, dtype, fp32_stream, _saved_extra)


def _saved_extra(layer: torch.nn.Module, norms: list[torch.nn.Module], run: _Run, h: int, dtype: torch.dtype) -> float:
    """:func:`residual_saved`'s figure for one stubbed layer: what it saves beyond the plain layer, per token."""
    tokens = 64
    x, extra, call = run(tokens)
    # the parameters left with the stubs in place (a dropped block's are freed) and the input aside
    saved = saved_storage_bytes(call, (*layer.parameters(), *layer.buffers(), x, *extra.values()))
    return (saved - _plain_saved_on_meta(norms, tokens, h, dtype)) / tokens / h / torch.finfo(dtype).bits * 8


def _backward_extra(layer: torch.nn.Module, norms: list[torch.nn.Module], run: _Run, h: int,
                    dtype: torch.dtype) -> tuple[float, float]:
    """:func:`residual_backward_extra`'s figures for one stubbed layer, per token: the most its backward holds beyond
    what it saved, less the two ``[N, h]`` gradients (its output's and its input's) the planner counts for any layer;
    and how much higher its backward's peak is than the plain layer's, beyond what it saves more (where its norms run
    in tiles: their fp32 temporaries, which the first figure holds, are not made so)."""
    held, higher = [], []
    for tokens in _PEAK_TOKENS:
        _, _, call = run(tokens)
        saved, _, backward = live_moments(lambda call=call: _first(call()), output_grad=True)
        plain = torch.empty((1, tokens, h), dtype=dtype, device="meta", requires_grad=True)
        plain_saved, _, plain_backward = live_moments(lambda plain=plain: _plain_forward(norms, plain), output_grad=True)
        held.append(backward - saved)
        higher.append((backward - plain_backward) - (saved - plain_saved))
    unit = h * (torch.finfo(dtype).bits // 8) * (_PEAK_TOKENS[1] - _PEAK_TOKENS[0])
    return round(max(0.0, (held[1] - held[0]) / unit - 2), 2), round(max(0.0, (higher[1] - higher[0]) / unit), 2)


def _first(out: Any) -> torch.Tensor:  # noqa: ANN401
    return out[0] if isinstance(out, tuple) else out


def _on_meta(cls: type, config: Any, streams: int, dtype: torch.dtype, fp32_stream: bool,  # noqa: ANN401
             measure: Callable[[torch.nn.Module, list[torch.nn.Module], _Run, int, torch.dtype], Any]) -> Any:
    """``measure(layer, norms, run, h, dtype)`` for a fresh copy of the layer class ``cls`` built on the meta device
    with its blocks stubbed (:class:`_Stub`), its hidden-size norms and ``run``, on the first of the stubs' outputs and
    the input layouts that runs; raises the last error where none does."""
    h = config.hidden_size
    with torch.device("meta"):
        layer = cls(config, 0).to(dtype)
    if getattr(layer, "ple", None) is not None:  # Qwen4-Exp's per-layer embedding needs its ids: left out
        layer.ple = None
    norms = [m for _, m in layer.named_children() if is_hidden_norm(m, h, held_by_layer=True)]
    # several streams: token-major (hyper-connections: [B, S, K, h] or [B, S, K h]) or stacked first (Gemma 3n's
    # AltUp predictions: [K, B, S, h])
    layouts: tuple[Callable[[int], tuple[int, ...]], ...] = (
        (lambda t: (1, t, streams, h), lambda t: (1, t, streams * h), lambda t: (streams, 1, t, h)) if streams > 1
        else (lambda t: (1, t, h),))  # fmt: skip
    width = getattr(config, "hidden_size_per_layer_input", None)
    # Gemma 3n's per-layer input, which its layer's gate multiplies (Qwen4-Exp's is built from ids: left out above)
    per_layer = isinstance(width, int) and "per_layer_input" in inspect.signature(cls.forward).parameters
    errors = []
    # the attention's outputs, then the MLP's: the output alone or followed by a None (ZAYA's MLP returns its router
    # state beside its output)
    for values, mlp_values in ((v, m) for m in _MLP_RETURNS for v in _ATTENTION_RETURNS):
        for name in _BLOCK_NAMES:
            if isinstance(getattr(layer, name, None), torch.nn.Module):
                setattr(layer, name, _Stub(values if name in _TUPLE_NAMES else mlp_values))
        for layout in layouts:

            def run(tokens: int, layout: Callable[[int], tuple[int, ...]] = layout) -> tuple:
                x = torch.empty(layout(tokens), dtype=torch.float32 if fp32_stream else dtype, device="meta", requires_grad=True)
                extra = {"per_layer_input": torch.empty(1, tokens, width, dtype=dtype, device="meta")} if per_layer else {}
                return x, extra, lambda: layer(x, position_embeddings=None, attention_mask=None, **extra)

            try:
                return measure(layer, norms, run, h, dtype)
            except Exception as e:  # noqa: BLE001 - the next stream layout or attention outputs
                errors.append(e)
    raise errors[-1]


def _plain_forward(norms: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``x = x + block(norm(x))`` for each norm, the block a :class:`_Stub`: a plain pre-norm layer, blocks left out."""
    for norm in norms:
        x = x + _Stub(0)(norm(x))
    return x


def _plain_saved_on_meta(norms: list[torch.nn.Module], tokens: int, h: int, dtype: torch.dtype) -> int:
    """Bytes that a plain pre-norm layer with ``norms`` (meta-device modules, in order) saves beyond its input, its
    blocks left out (:func:`_plain_forward`; of Llama's two RMSNorms: 3 ``[N, h]`` in fp32, 6 in bf16, whose norms
    keep fp32 copies)."""
    x = torch.empty((1, tokens, h), dtype=dtype, device="meta", requires_grad=True)
    params = [p for norm in norms for p in (*norm.parameters(), *norm.buffers())]
    return saved_storage_bytes(lambda: _plain_forward(norms, x), (*params, x))


class _LayerInput(Exception):  # noqa: N818 - a signal, not an error: the first layer's input was seen
    pass


_FP32_CACHE: dict[tuple, bool] = {}


def residual_fp32(model: torch.nn.Module, layers: list[torch.nn.Module]) -> bool:
    """Whether ``model`` hands its decoder layers (``layers``, from
    :func:`automodel.models.block_call.decoder_layers`) their hidden states in fp32 whatever its dtype: ZAYA keeps its
    residual stream in fp32 (``residual_in_fp32``), so checkpointing keeps, and activation offload moves, fp32 layer
    inputs in a bf16 run, and every residual add and scale runs in fp32.

    Measured, not read off a config key: a fresh copy of the layers' owner (the text model) is built from its config
    on the meta device in bf16 (no memory, the model untouched) and run on 16 token ids up to its first layer, whose
    input's dtype is read. ``False`` where the owner cannot be built or run so (the compute dtype, as before)."""
    owner, attr = layers_owner(model, layers)
    config = getattr(owner, "config", None)
    if owner is None or config is None:
        return False
    cls = _model_class(owner)
    key = (cls, config.hidden_size, getattr(config, "num_hidden_layers", None))
    if key not in _FP32_CACHE:
        _FP32_CACHE[key] = False
        seen: list[torch.dtype] = []

        def first_input(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("hidden_states")
            seen.append(x.dtype)
            raise _LayerInput

        try:
            with torch.device("meta"):  # a copy of the config: building a model may set attributes on it
                fresh = cls(copy.deepcopy(config)).to(torch.bfloat16)
            getattr(fresh, attr)[0].register_forward_pre_hook(first_input, with_kwargs=True)
        except Exception:  # noqa: BLE001 - an owner that cannot be built on the meta device: the compute dtype
            return False
        ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
        # with its cache (without one transformers' mask reads the position ids for packed rows: a value the meta
        # device does not have), then without (a hybrid's cache that the mask cannot read)
        for use_cache in (True, False):
            try:
                fresh(input_ids=ids, use_cache=use_cache)
            except _LayerInput:
                _FP32_CACHE[key] = seen[0] == torch.float32
                break
            except Exception:  # noqa: BLE001 - an owner that cannot run on the meta device: the compute dtype
                continue
    return _FP32_CACHE[key]
