"""The memory planner's view of a hidden-size norm in half precision: what it saves beyond its fp32 count.

The planner's per-layer residual stream (:func:`automodel.training.memory_plan._layer_terms`, ``2 h`` per norm) is
calibrated on fp32 runs. In bf16 or fp16 a norm that computes in fp32 saves more, in units of the compute dtype:
transformers' RMSNorm (Llama, Qwen, Mistral) upcasts its input, so its ``pow`` and ``mul`` save the fp32 copy
(``2 h`` bf16 units) beside the normalized bf16 tensor its weight multiplies (``h``): 3 units where fp32 saves 2
(the input itself and the normalized). ``torch.nn.LayerNorm`` (GPT-2, GPT-NeoX, Falcon) saves its input and its
fp32 mean and reciprocal deviation in either dtype: no extra. The difference is measured, not looked up:
:func:`half_precision_extra` runs a copy of the model's own norm module on 64 CPU tokens in fp32 and in bf16 and
counts the storages autograd saves (parameters aside) in units of ``[N, h]`` of that dtype. A millisecond per
norm class, cached.
"""

from __future__ import annotations

import copy

import torch

from automodel.training.mlp_memory import _state_key  # the probe cache's key of a module's scalar settings

__all__ = ["half_precision_extra", "saved_units"]

_TOKENS = 64


def saved_units(norm: torch.nn.Module, dtype: torch.dtype, hidden: int) -> float:
    """``[N, hidden]`` units of ``dtype`` that ``norm`` (a copy runs, on the CPU, in ``dtype``) saves for its backward
    for an input of ``N`` tokens: the distinct storages of the saved tensors, its parameters aside (the input counted
    where it is saved)."""
    with torch.device("cpu"):  # whatever the caller's default device (model_dims runs under a meta-device context)
        probe = copy.deepcopy(norm)
        if any(p.is_meta for p in probe.parameters()) or any(b.is_meta for b in probe.buffers()):
            probe = probe.to_empty(device="cpu")
            with torch.no_grad():
                for p in probe.parameters():
                    p.fill_(1.0)
        probe = probe.to(device="cpu", dtype=dtype)
        params = {p.untyped_storage().data_ptr() for p in probe.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        x = torch.linspace(-2.0, 2.0, _TOKENS * hidden, dtype=torch.float32).reshape(_TOKENS, hidden).to(dtype)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            probe(x.requires_grad_())
    if not seen:
        raise RuntimeError("the norm saved nothing on the CPU probe")
    return sum(seen.values()) / (_TOKENS * hidden * x.element_size())


def half_precision_extra(norms: list[torch.nn.Module], hidden: int) -> float:
    """Over ``norms`` (a decoder layer's hidden-size norms, or the final norm), the ``[N, h]`` units in the compute
    dtype that each saves in bf16 beyond what it saves in fp32 (>= 0 each; transformers' RMSNorm: 1, ``nn.LayerNorm``:
    0). A norm that cannot run on the CPU probe counts 0 (the fp32 count stays)."""
    total = 0.0
    for norm in norms:
        key = (type(norm), _state_key(norm), hidden)
        if key not in _CACHE:
            try:
                _CACHE[key] = max(0.0, round(saved_units(norm, torch.bfloat16, hidden)
                                             - saved_units(norm, torch.float32, hidden), 2))  # fmt: skip
            except Exception:  # noqa: BLE001 - a norm the probe cannot run: the fp32 count stays
                _CACHE[key] = 0.0
        total += _CACHE[key]
    return total


_CACHE: dict[tuple, float] = {}
