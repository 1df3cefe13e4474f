"""The memory planner's view of an attention module that calls its kernel more than once a forward, convolves its
projections or routes its heads through experts: what it keeps for its backward beyond a Llama attention of the same
heads, measured on the meta device (on the CPU where its forward reads values).

The planner's attention terms describe one kernel call per layer (q, K and V as the kernel saves them, its output and
log-sum-exp, the output projection's input). DiffLlama's differential attention calls the kernel twice, on the two
halves of V (each repeated to the KV heads), and combines the two outputs: their concatenation, the difference, a
group norm over ``2 d``, before its output projection. Its step was planned 14% to 39% under its measured peak
(hidden 256, bf16: ``scripts/bench_plan_families.py``).

:func:`attention_saved_extra` measures it: a fresh copy of the module's class is built on the meta device (no memory,
the model untouched) with its attention function replaced by :func:`_kernel_stub`, a kernel that keeps what a fused
kernel keeps (q, K, V, the output and its fp32 log-sum-exp) and computes nothing; one forward of 64 tokens runs under
saved-tensor hooks (:func:`~automodel.training.saved_storage.saved_storage_bytes`), and the same for transformers'
``LlamaAttention`` of the module's widths. The difference, per token in ``q`` units (``heads x head_dim`` of the
compute dtype), is what the planner adds to every layer's attention term
(:attr:`automodel.training.memory_plan.ModelDims.attention_saved_extra`). Only a module whose ``forward`` calls its
attention function more than once (read off its source), or that convolves its projections over the tokens (ZAYA's
compressed convolutional attention: 5.4 ``q`` per token more, its step planned 33% to 53% under; Inkling's short
convolutions of k and v: 1), or that routes its heads through experts (JetMoE's mixture of attention heads: 8.5 ``q``
per token more, its step planned 14% to 37% under; its router reads values, so it runs on the CPU with zero weights)
is probed (:func:`probed`): the planner's terms for one plain call are measured against the real kernels family by
family (``docs/benchmarks.md``). Per-head q/k norms, which the planner counts itself, are
subtracted by the caller where it counts them.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from automodel.training.saved_storage import probe_pair, saved_storage_bytes

__all__ = ["ATTENTION_NAMES", "attention_calls", "attention_module", "attention_saved_extra", "calls_attention_function",
           "mixer_saved_extra", "probed", "routes_heads", "torch_only"]

#: the name the probe's kernel is registered under in transformers' ``AttentionInterface``
_PROBE_NAME = "automodel_memory_probe"
_TOKENS = 64
_CACHE: dict[tuple, tuple[float, float] | None] = {}


#: the names transformers' decoder layers give their attention module (``self_attention``: Falcon, Bloom, JetMoE)
ATTENTION_NAMES = ("self_attn", "attention", "attn", "self_attention")


def attention_module(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The child of a decoder ``layer`` named as its attention (:data:`ATTENTION_NAMES`), or ``None``."""
    return next((getattr(layer, n) for n in ATTENTION_NAMES if isinstance(getattr(layer, n, None), torch.nn.Module)),
                None)  # fmt: skip


def _interface_calls(module: torch.nn.Module) -> int:
    """``attention_interface(`` in the source of ``module``'s ``forward`` (0 where it cannot be read)."""
    from automodel.distributed.cp.profile import _forward_source

    return _forward_source(type(module)).count("attention_interface(")


def attention_calls(attention: torch.nn.Module) -> int:
    """How many times ``attention``'s ``forward`` calls its attention function (``attention_interface(`` in its
    source; 1 where it cannot be read)."""
    return max(1, _interface_calls(attention))


def calls_attention_function(module: torch.nn.Module) -> bool:
    """Whether ``module``'s ``forward`` calls an attention function (``attention_interface(`` in its source); a mixer
    held where a layer holds its attention that mixes the tokens in its own code does not (MiniMax's lightning
    attention)."""
    return _interface_calls(module) > 0


#: what a modeling file names where a CUDA kernel package may run its token mixing in place of its torch code (fla,
#: causal-conv1d, mamba-ssm, hub kernels)
_KERNEL_MARKS = ("use_kernel_func_from_hub_with_fallback(", "is_fast_path_available", "lazy_load_kernel(")


def torch_only(mixer: torch.nn.Module) -> bool:
    """Whether ``mixer``'s modeling file names no kernel package that would run its token mixing in place of its
    torch code (:data:`_KERNEL_MARKS`): what the CPU runs is then what every device runs (MiniMax's lightning
    attention; Kimi Linear's and Qwen3-Next's delta rules run fla's kernels where fla is installed)."""
    return _names_no_kernel(type(mixer).__module__)


@functools.cache
def _names_no_kernel(module_name: str) -> bool:
    """:func:`torch_only` per modeling file, read once (a model asks for each of its linear layers)."""
    import inspect
    import sys

    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    return not any(mark in source for mark in _KERNEL_MARKS)


def mixer_saved_extra(mixer: torch.nn.Module, config: Any, layer_idx: int, hidden: int, heads: int, kv_heads: int,
                      head_dim: int) -> tuple[float, float] | None:  # noqa: ANN401
    """``(fp32, bf16)``: ``q`` units per token that a linear-attention mixer held where its decoder layer holds the
    attention (``mixer``, of the layer ``layer_idx``, built from ``config``; MiniMax's ``MiniMaxLightningAttention``
    in its ``linear_attention`` layers, transformers' torch implementation on every device) keeps for its backward
    beyond ``LlamaAttention`` of its widths, whose terms the planner counts for every layer. Its blocks keep per block
    their ``[heads, b, b]`` scores, decayed q and k, and the ``[heads, d, d]`` state before and after the block;
    measured at eight blocks of its ``block_size`` (and at least :data:`_TOKENS` tokens), on the meta device;
    ``None`` where it cannot run there."""
    block = getattr(mixer, "block_size", None)
    tokens = max(_TOKENS, 8 * block) if isinstance(block, int) and block > 0 else _TOKENS
    return _measured(type(mixer), config, layer_idx, hidden, heads, kv_heads, head_dim, tokens)


def routes_heads(attention: torch.nn.Module) -> bool:
    """Whether ``attention`` projects through routed experts: a parameter that stacks matrices (3-D, every size
    above 1) outside a convolution. JetMoE's mixture of attention heads (MoA) keeps per token a gathered copy of
    its input for each of its ``k`` query experts, their outputs before the gate, and K and V repeated to the ``k``
    groups of query heads."""
    conv = {id(m.weight) for m in attention.modules() if isinstance(m, torch.nn.modules.conv._ConvNd)}
    return any(p.ndim == 3 and min(p.shape) > 1 and id(p) not in conv for p in attention.parameters())


def probed(attention: torch.nn.Module) -> bool:
    """Whether the planner measures ``attention`` (:func:`attention_saved_extra`): its forward calls its attention
    function more than once (DiffLlama), it convolves its projections over the tokens before the kernel (a
    ``Conv1d`` among its modules: ZAYA's compressed convolutional attention mixes q and k so, Inkling shortly
    convolves k and v), or it routes its heads through experts (:func:`routes_heads`: JetMoE), whose tensors the
    planner's one-call terms do not count."""
    return (attention_calls(attention) > 1 or any(isinstance(m, torch.nn.Conv1d) for m in attention.modules())
            or routes_heads(attention))  # fmt: skip


class _Kernel(torch.autograd.Function):
    """Keeps q, k, v, the output ``[B, H, S, d_v]`` and the fp32 log-sum-exp ``[B, H, S]`` for its backward, as the
    fused kernels do; computes nothing (the probe runs on the meta device)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        batch, heads, seq, _ = query.shape
        out = query.new_empty(batch, heads, seq, value.shape[-1])
        lse = query.new_empty(batch, heads, seq, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # noqa: ANN401
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def _kernel_stub(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:  # noqa: ANN401
    """An attention function of transformers' signature: ``[B, S, H, d_v]`` out of ``[B, H, S, d]`` q, k, v."""
    return _Kernel.apply(query, key, value).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_NAME, _kernel_stub)


def attention_saved_extra(attention: torch.nn.Module, config: Any, layer_idx: int, hidden: int, heads: int,
                          kv_heads: int, head_dim: int) -> tuple[float, float] | None:  # noqa: ANN401
    """``(fp32, bf16)``: ``q`` units per token (``heads x head_dim`` elements of the compute dtype) that the attention
    module ``attention`` (of the decoder layer ``layer_idx``, built from ``config``) keeps for its backward beyond
    ``LlamaAttention`` of its widths, both with :func:`_kernel_stub` (the module docstring); 0 where its forward
    calls its attention function once and holds no convolution (:func:`probed`); ``None`` where the probe cannot
    build or run it on the meta device."""
    if not probed(attention):
        return (0.0, 0.0)
    return _measured(type(attention), config, layer_idx, hidden, heads, kv_heads, head_dim, _TOKENS)


def _measured(cls: type, config: Any, layer_idx: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
              tokens: int) -> tuple[float, float] | None:  # noqa: ANN401
    """``(fp32, bf16)`` of :func:`_extra_on_meta` at ``tokens`` tokens, cached per class, widths and layer."""
    key = (cls, hidden, heads, kv_heads, head_dim, layer_idx, tokens)
    return probe_pair(_CACHE, key, lambda dtype: _extra_on_meta(cls, config, layer_idx, hidden, heads, kv_heads,
                                                                head_dim, dtype, tokens))  # fmt: skip


def _extra_on_meta(cls: type, config: Any, layer_idx: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                   dtype: torch.dtype, tokens: int = _TOKENS) -> float:  # noqa: ANN401
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    _register()
    own = copy.copy(config)
    own._attn_implementation = _PROBE_NAME
    llama = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                        attention_bias=False)  # fmt: skip
    llama._attn_implementation = _PROBE_NAME
    saved = [_saved(module_cls, cfg, layer_idx, hidden, head_dim, dtype, tokens)
             for module_cls, cfg in ((cls, own), (LlamaAttention, llama))]  # fmt: skip
    return round((saved[0] - saved[1]) / tokens / (heads * head_dim) / torch.finfo(dtype).bits * 8, 2)


def _saved(cls: type, config: Any, layer_idx: int, hidden: int, head_dim: int, dtype: torch.dtype,
           tokens: int = _TOKENS) -> int:  # noqa: ANN401
    """Bytes ``cls(config, layer_idx)`` in ``dtype`` keeps for its backward of ``tokens`` tokens: on the meta
    device, or, where its forward reads values (a router's ``.tolist()``: JetMoE's expert sizes), on the CPU with
    zero weights and input (every token routed alike; what it keeps does not depend on the values), where its
    parameters take at most :data:`_CPU_PROBE_BYTES`."""
    with torch.device("meta"):
        module = cls(config, layer_idx).to(dtype)
    try:
        return _saved_on(module, "meta", hidden, head_dim, dtype, tokens)
    except (NotImplementedError, RuntimeError) as err:
        size = sum(p.numel() * p.element_size() for p in module.parameters())
        if "meta" not in str(err) or size > _CPU_PROBE_BYTES:
            raise
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            tensor.zero_()
    return _saved_on(module, "cpu", hidden, head_dim, dtype, tokens)


#: the most parameter bytes :func:`_saved` materializes on the CPU for a module that cannot run on the meta device
_CPU_PROBE_BYTES = 2**30


def _saved_on(module: torch.nn.Module, device: str, hidden: int, head_dim: int, dtype: torch.dtype,
              tokens: int = _TOKENS) -> int:
    x = torch.zeros(1, tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    rope = tuple(torch.zeros(1, tokens, head_dim, dtype=dtype, device=device) for _ in range(2))
    return saved_storage_bytes(lambda: module(x, position_embeddings=rope, attention_mask=None)[0],
                               (*module.parameters(), *module.buffers(), x, *rope))  # fmt: skip
