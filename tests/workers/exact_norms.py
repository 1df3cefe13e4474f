"""RMSNorms in the input's dtype, so that an fp64 model is fp64 end to end (the fp64 parity cases of the Gemma families,
of HY-V4's hyper-connections and of DeepSeek-V4's norms, RoPE, hyper-connections and compressors).

Gemma 3, Gemma 3n and Gemma 4 compute every RMSNorm in fp32 whatever the model's dtype (``x.float()``, then
``.type_as(x)``): an fp64 model keeps fp32 round-off in each norm, so CP against one process agrees to ~1e-7 there,
not to fp64's ~1e-15, and a leak of 1e-7 would hide under it. Inside :func:`norms_in_input_dtype` those norms compute
the same formula in the input's dtype (the classes are patched for the duration; instances keep their weights), so
the fp64 cases prove the CP path exact to fp64 round-off. fp32 models compute exactly as transformers does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: (module, class, the weight's offset: Gemma 3 scales by ``1 + weight``, Gemma 3n and 4 by ``weight``)
NORMS = (
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm", 1.0),
    ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", 0.0),
    ("transformers.models.gemma4.modeling_gemma4", "Gemma4RMSNorm", 0.0),
    ("transformers.models.moshi.modeling_moshi", "MoshiRMSNorm", 0.0),  # Moshi's too (x.float(), then back)
    ("transformers.models.hrm_text.modeling_hrm_text", "HrmTextRMSNorm", 0.0),  # HRM's (no weight)
    ("transformers.models.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextRMSNorm", 1.0),  # per group of hidden_size too
)


def _forward(offset: float):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._norm(x)
        weight = getattr(self, "weight", None) if getattr(self, "with_scale", True) else None
        return out if weight is None else out * (offset + weight)

    return forward


def _hy_v4_unweighted(self, x: torch.Tensor) -> torch.Tensor:
    eps = getattr(self, "variance_epsilon", None)
    eps = self.eps if eps is None else eps  # transformers 5.17-5.24 name it eps
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _hy_v4_connection(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = streams.flatten(2)
    mixes = F.linear(flat, self.fn.to(flat.dtype)) * self.input_norm(flat)
    pre_b, post_b = self.base.to(flat.dtype).split(self.hc_mult, dim=-1)
    pre_scale, post_scale = self.scale.to(flat.dtype).unbind(0)
    pre_logits, post_logits = mixes.split(self.hc_mult, dim=-1)
    pre = torch.sigmoid(pre_logits * pre_scale + pre_b) + self.hc_eps
    post = self.hc_post_magnitude * torch.sigmoid(post_logits * post_scale + post_b) + self.hc_eps
    return post, torch.sum(pre.unsqueeze(-1) * streams, dim=2)


def _hy_v4_head(self, x: torch.Tensor) -> torch.Tensor:
    flat = x.flatten(2)
    mixes = F.linear(flat, self.hc_fn.to(flat.dtype)) * self.input_norm(flat)
    pre = torch.sigmoid(mixes * self.hc_scale.to(flat.dtype) + self.hc_base.to(flat.dtype)) + self.eps
    return (pre.unsqueeze(-1) * x).sum(dim=2)


def _input_dtype_rms(self, x: torch.Tensor) -> torch.Tensor:
    """T5-style RMSNorm (``weight * x / rms(x)``) in the input's dtype (Kolibri-1.1's, ZAYA's: transformers computes
    in fp32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


#: T5-style RMSNorms without a ``_norm`` method: the same formula in the input's dtype
T5_NORMS = (("transformers.models.kolibri1_1.modeling_kolibri1_1", "Kolibri1_1RMSNorm", _input_dtype_rms),
            ("transformers.models.zaya.modeling_zaya", "ZayaRMSNorm", _input_dtype_rms))


#: HY-V4's hyper-connections (token-local: each token's streams mixed by weights computed from that token alone)
#: and their unweighted RMSNorm compute in fp32 whatever the model's dtype (``.float()``): the same formulas in the
#: input's dtype
HY_V4 = (
    ("transformers.models.hy_v4.modeling_hy_v4", "HYV4UnweightedRMSNorm", _hy_v4_unweighted),
    ("transformers.models.hy_v4.modeling_hy_v4", "HYV4HyperConnection", _hy_v4_connection),
    ("transformers.models.hy_v4.modeling_hy_v4", "HYV4HyperHead", _hy_v4_head),
)


def _doge_norm(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


#: Doge's RMSNorm computes in fp32 whatever the model's dtype (``.to(torch.float32)``): the formula in the input's dtype
OTHER = (("transformers.models.doge.modeling_doge", "DogeRMSNorm", _doge_norm),)
#: DeepSeek-V4 computes in fp32 whatever the model's dtype in its RMSNorms, its RoPE (``rope.float()``), its
#: hyper-connections and its compressors' pooling softmax (``dtype=torch.float32``): (module, class or ``None`` for a
#: function, attribute) rewritten with those casts removed, the same formulas in the input's dtype
DEEPSEEK_V4 = tuple(
    ("transformers.models.deepseek_v4.modeling_deepseek_v4", cls, attr)
    for cls, attr in ((None, "apply_rotary_pos_emb"), ("DeepseekV4RMSNorm", "forward"), ("DeepseekV4UnweightedRMSNorm", "forward"),
                      ("DeepseekV4HyperConnection", "forward"), ("DeepseekV4HyperHead", "forward"),
                      ("DeepseekV4HCACompressor", "forward"), ("DeepseekV4CSACompressor", "forward"),
                      ("DeepseekV4Indexer", "forward"))
)  # fmt: skip (the function first: the methods recompiled after it call the rewritten one)
#: Doge's eager attention (what transformers < 5.25 trains Doge with: its SDPA is refused there, torch_internals.
#: sdpa_problem) takes its softmax in fp32 (``dtype=torch.float32``): the same function in the input's dtype (an fp64
#: reference otherwise differs from the CP kernel's fp64 softmax by fp32's round-off, 5e-6 in A's gradient)
DOGE_EAGER = (("transformers.models.doge.modeling_doge", None, "eager_attention_forward"),)
_FP32_CASTS = (("hidden_states.to(torch.float32)", "hidden_states"), (".float()", ""),
               ("softmax(dim=2, dtype=torch.float32)", "softmax(dim=2)"),
               ("softmax(attn_weights, dim=-1, dtype=torch.float32)", "softmax(attn_weights, dim=-1)"))  # fmt: skip


def _in_input_dtype(module, function):
    """``function`` (of ``module``) recompiled from its source with the fp32 casts of :data:`_FP32_CASTS` removed."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(function))
    for old, new in _FP32_CASTS:
        source = source.replace(old, new)
    namespace = dict(vars(module))
    exec(compile(source, inspect.getsourcefile(function), "exec"), namespace)  # noqa: S102 - transformers' own source
    return namespace[function.__name__]


@contextlib.contextmanager
def norms_in_input_dtype(enabled: bool = True) -> Iterator[None]:
    """Patch the Gemma RMSNorm classes of :data:`NORMS`, HY-V4's of :data:`HY_V4`, Doge's norm and eager attention
    and DeepSeek-V4's functions (those the installed transformers has) to compute in the input's dtype; restored on
    exit. ``enabled=False``: nothing changes."""
    saved = []
    try:
        if enabled:
            for module_name, class_name, offset in NORMS:
                try:
                    cls = getattr(importlib.import_module(module_name), class_name)
                except (ImportError, AttributeError):
                    continue
                saved.append((cls, cls.forward))
                cls.forward = _forward(offset)
            for module_name, class_name, forward in (*HY_V4, *OTHER, *T5_NORMS):
                try:
                    cls = getattr(importlib.import_module(module_name), class_name)
                except (ImportError, AttributeError):
                    continue
                saved.append((cls, cls.forward))
                cls.forward = forward
            for module_name, class_name, attr in (*DEEPSEEK_V4, *DOGE_EAGER):
                try:
                    module = importlib.import_module(module_name)
                except ImportError:
                    continue
                owner = module if class_name is None else getattr(module, class_name)
                function = getattr(owner, attr)  # a decorated one: its source holds the decorator
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, _in_input_dtype(module, function))
            from automodel.distributed.cp.layers import compressed_attention

            saved.append((compressed_attention, "pool_weights", compressed_attention.pool_weights))
            compressed_attention.pool_weights = lambda gate: gate.softmax(dim=2)
        yield
    finally:
        for entry in reversed(saved):
            if len(entry) == 2:
                entry[0].forward = entry[1]
            else:
                setattr(*entry)
