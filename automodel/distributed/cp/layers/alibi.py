"""Attention layers that compute their attention in their own code (BLOOM's and MPT's ALiBi, GPT-Neo), made to dispatch.

``BloomAttention`` adds ``slope_h * j`` (``j``: the key's index in the row) to each score of head ``h`` and
``MptAttention`` ``slope_h * (j - S + 1)`` over its ``S`` keys; both then take the softmax over the keys they are
given. Each differs from ALiBi's ``slope_h * (j - i)`` by a constant per query, which the softmax cancels, so the
bias needs nothing but positions: a method that sees whole rows per head subset (Ulysses) adds
``slope_h * position(j)`` for its heads, ``position`` the key's index in its document (its row without documents:
what each document alone gets).

Neither layer calls transformers' ``AttentionInterface``, so a CP method cannot reach its attention. While a context
of a method that applies ALiBi is active (:func:`dispatch_alibi_layers`), each such layer's ``forward`` computes its q, k, v and
output projection as the original does and hands q, k, v with its slopes to the method's attention function
(``alibi_slopes=[H]`` fp32); outside it the original forward runs.
The patch is on the instances (mutates the model); :func:`restore_alibi_layers` undoes it.

GPT-Neo's ``GPTNeoSelfAttention`` builds causal (``global``) and local-window (``local``: each query sees its last
``window_size`` keys, itself included) masks from a buffer indexed by the number of queries and keys it is given,
does not scale its scores and takes the softmax in fp32. Inside a context it hands q, k, v to the method's attention
with ``scaling=1.0`` and, on a local layer, ``sliding_window=window_size`` (transformers' convention: the same keys),
which every method computes exactly (the halo kernel under ring, thd, thd_docs and usp, the global mask under
Ulysses); no slopes.

GPT-NeoX-Japanese's ``GPTNeoXJapaneseAttention``, OpenAI GPT's ``Attention`` (:func:`dispatch_key`:
``"OpenAIGPTAttention"``) and ``XGLMAttention`` compute plain causal attention in their own code; inside a context
each hands q, k, v (GPT-NeoX-Japanese's after its partial RoPE) to the method's attention with its own scale.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "ALIBI_LAYERS",
    "OWN_CODE_LAYERS",
    "PLAIN_OWN_CODE_LAYERS",
    "alibi_slopes",
    "dispatch_alibi_layers",
    "dispatch_key",
    "key_bias",
    "restore_alibi_layers",
]

#: the attention classes this module makes dispatch
ALIBI_LAYERS = ("BloomAttention", "MptAttention", "FalconAttention")  # Falcon's with config.alibi=True only
#: causal attention in the layer's own code, no bias (GPT-NeoX-Japanese, OpenAI GPT's ``Attention``, XGLM): keys of
#: :func:`dispatch_key`
PLAIN_OWN_CODE_LAYERS = ("GPTNeoXJapaneseAttention", "OpenAIGPTAttention", "XGLMAttention")
#: every class this module makes dispatch: the ALiBi layers, GPT-Neo's (its flash variant computes the same), the
#: plain ones
OWN_CODE_LAYERS = (*ALIBI_LAYERS, "GPTNeoSelfAttention", "GPTNeoFlashAttention2", *PLAIN_OWN_CODE_LAYERS)
_PATCHED = "_automodel_alibi_forward"  # marks a patched instance


def alibi_slopes(module: torch.nn.Module, device: torch.device | None = None) -> torch.Tensor:
    """``[H]`` fp32: the slope of each head of ``module`` as its model computes it (the bias of the key after the
    first minus the first key's, which transformers' builders give exactly)."""
    name = type(module).__name__
    if name == "BloomAttention":
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        bias = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long, device=device), module.num_heads, torch.float32)
        return (bias[:, 0, 1] - bias[:, 0, 0]).float()  # [H, 1, 2]: (0, slope)
    if name == "MptAttention":
        from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

        config = module._automodel_config
        bias = build_mpt_alibi_tensor(module.n_heads, 2, config.attn_config.alibi_bias_max, device=device)
        return (bias[:, 0, 1] - bias[:, 0, 0]).float()  # [H, 1, 2]: (-slope, 0)
    if name == "FalconAttention":
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor as build_falcon_alibi

        bias = build_falcon_alibi(torch.ones(1, 2, dtype=torch.long, device=device), module.num_heads, torch.float32)
        return bias[:, 0, 1].float()  # [H, 1, 2]: (0, bf16(slope)), the slopes rounded to bf16 as Falcon has them
    raise TypeError(f"{name} is not an ALiBi layer this module knows ({', '.join(ALIBI_LAYERS)})")


def _dispatching(module: torch.nn.Module) -> str | None:
    """The attention implementation to hand the layer's q, k, v to: the one registered for the innermost active
    CP context's method, where that method applies ALiBi; else ``None`` (the layer's own forward)."""
    from automodel.distributed.cp.active import innermost

    top = innermost()
    return module._automodel_alibi_impls.get(top[0]) if top is not None else None


def _attend(module: torch.nn.Module, impl: str, query, key, value, scaling: float, **extra) -> torch.Tensor:
    """``[B, n, H, D]``: ``impl``'s attention of ``[B, H, n, D]`` q, k, v with the module's slopes (``extra``:
    ``falcon_alibi_divisor``, see :func:`key_bias`)."""
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS[impl]
    slopes = alibi_slopes(module, query.device)
    out, _ = fn(module, query, key, value, None, dropout=0.0, scaling=scaling, alibi_slopes=slopes, **extra)
    return out


def _no_dropout(module: torch.nn.Module, p: float) -> None:
    if p and module.training:
        raise ValueError(
            f"{type(module).__name__} has attention dropout {p}, which the CP attention with ALiBi does not apply; "
            "set the model's attention dropout to 0"
        )


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):  # fmt: skip
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, residual, alibi, attention_mask, layer_past=layer_past,
                                  use_cache=use_cache, output_attentions=output_attentions, **kwargs)  # fmt: skip
    from transformers.models.bloom.modeling_bloom import dropout_add

    if layer_past is not None:
        raise ValueError("BloomAttention under CP: no KV cache (pass use_cache=False)")
    _no_dropout(self, self.attention_dropout.p)
    batch, n, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))  # [B, H, n, D] each
    context = _attend(self, impl, query, key, value, self.inv_norm_factor).reshape(batch, n, -1)
    if self.pretraining_tp > 1 and self.slow_but_exact:  # as BloomAttention: the dense layer in slices
        slices = self.hidden_size / self.pretraining_tp
        output = torch.zeros_like(context)
        for i in range(self.pretraining_tp):
            output = output + torch.nn.functional.linear(
                context[:, :, int(i * slices) : int((i + 1) * slices)],
                self.dense.weight[:, int(i * slices) : int((i + 1) * slices)],
            )
    else:
        output = self.dense(context)
    return dropout_add(output, residual, self.hidden_dropout, self.training), None


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, position_bias, cache, attention_mask, **kwargs)
    if cache is not None:
        raise ValueError("MptAttention under CP: no KV cache (pass use_cache=False)")
    _no_dropout(self, self.attn_dropout_p)
    batch, n = hidden_states.shape[:2]
    mixed = self.Wqkv(hidden_states)
    if self.clip_qkv:
        mixed = mixed.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (x.reshape(batch, n, self.n_heads, self.head_dim).transpose(1, 2) for x in mixed.chunk(3, 2))
    context = _attend(self, impl, query, key, value, self.softmax_scale).reshape(batch, n, -1)
    return self.out_proj(context), None


def _gpt_neo_forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                     output_attentions=False, **kwargs):  # fmt: skip
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, layer_past=layer_past,
                                  use_cache=use_cache, output_attentions=output_attentions, **kwargs)  # fmt: skip
    if layer_past is not None:
        raise ValueError("GPTNeoSelfAttention under CP: no KV cache (pass use_cache=False)")
    _no_dropout(self, self.attn_dropout.p)
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    batch, n, _ = hidden_states.shape
    query, key, value = (
        self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)  # [B, H, n, D]
        for proj in (self.q_proj, self.k_proj, self.v_proj)
    )
    window = {"sliding_window": int(self.config.window_size)} if self.attention_type == "local" else {}
    # GPT-Neo does not scale its scores (scaling 1.0); its own mask is replaced by the method's (causal, per document)
    out, _ = ALL_ATTENTION_FUNCTIONS[impl](self, query, key, value, None, dropout=0.0, scaling=1.0, **window)
    return self.resid_dropout(self.out_proj(out.reshape(batch, n, -1))), None


def _plain(module, impl: str, query, key, value, scaling: float) -> torch.Tensor:
    """``[B, n, H, D]``: ``impl``'s causal attention (per document, the method's mask) of ``[B, H, n, D]`` q, k, v."""
    from automodel.distributed.torch_internals import ALL_ATTENTION_FUNCTIONS

    out, _ = ALL_ATTENTION_FUNCTIONS[impl](module, query, key, value, None, dropout=0.0, scaling=scaling)
    return out


def _gpt_neox_japanese_forward(self, hidden_states, attention_mask=None, position_ids=None, layer_past=None,
                               use_cache=False, output_attentions=False, position_embeddings=None, **kwargs):  # fmt: skip
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, attention_mask, position_ids, layer_past=layer_past,
                                  use_cache=use_cache, output_attentions=output_attentions,
                                  position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    if layer_past is not None:
        raise ValueError("GPTNeoXJapaneseAttention under CP: no KV cache (pass use_cache=False)")
    _no_dropout(self, self.attention_dropout.p)
    from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import apply_rotary_pos_emb

    qkv = self.query_key_value(hidden_states)  # as the class: [B, n, H, 3 * D], q | k | v per head
    qkv = qkv.view(*qkv.shape[:-1], self.num_attention_heads, 3 * self.head_size)
    query, key, value = (qkv[..., i * self.head_size : (i + 1) * self.head_size].permute(0, 2, 1, 3) for i in range(3))
    cos, sin = position_embeddings  # from the positions the model was given (global, in-document)
    q_rot, k_rot = apply_rotary_pos_emb(query[..., : self.rotary_ndims], key[..., : self.rotary_ndims], cos, sin)
    query = torch.cat((q_rot, query[..., self.rotary_ndims :]), dim=-1).contiguous()
    key = torch.cat((k_rot, key[..., self.rotary_ndims :]), dim=-1).contiguous()
    out = _plain(self, impl, query, key, value, 1.0 / self.norm_factor)  # its scores divided by sqrt(head_size)
    return self.dense(out.reshape(*hidden_states.shape[:-1], -1)), None, self.dense_bias


def _openai_gpt_forward(self, x, attention_mask=None, output_attentions=False):
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, x, attention_mask=attention_mask, output_attentions=output_attentions)
    _no_dropout(self, self.attn_dropout.p)
    query, key, value = self.c_attn(x).split(self.split_size, dim=2)
    query, key, value = (self.split_heads(t) for t in (query, key, value))  # [B, H, n, D] each
    # its own mask (a causal buffer: masked scores -1e4, whose exp is 0 as the method's) replaced by the method's;
    # scores divided by sqrt(head_dim) where the block scales them (every block of OpenAIGPTModel)
    out = _plain(self, impl, query, key, value, value.shape[-1] ** -0.5 if self.scale else 1.0)
    return [self.resid_dropout(self.c_proj(out.reshape(*x.shape[:-1], -1)))]


def _xglm_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, key_value_states=key_value_states, cache=cache,
                                  attention_mask=attention_mask, **kwargs)  # fmt: skip
    if cache is not None or key_value_states is not None:
        raise ValueError("XGLMAttention under CP: self-attention without a KV cache only (pass use_cache=False)")
    _no_dropout(self, self.dropout)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    query = (self.q_proj(hidden_states) * self.scaling).view(shape).transpose(1, 2)  # scaled before the product
    key, value = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.k_proj, self.v_proj))
    out = _plain(self, impl, query, key, value, 1.0)
    return self.out_proj(out.reshape(*hidden_states.shape[:-1], self.embed_dim)), None


def _falcon_forward(self, hidden_states, attention_mask=None, position_ids=None, layer_past=None, use_cache=False,
                    output_attentions=False, position_embeddings=None, **kwargs):  # fmt: skip
    impl = _dispatching(self)
    if impl is None:
        return type(self).forward(self, hidden_states, attention_mask, position_ids=position_ids,
                                  layer_past=layer_past, use_cache=use_cache, output_attentions=output_attentions,
                                  position_embeddings=position_embeddings, **kwargs)  # fmt: skip
    if layer_past is not None:
        raise ValueError("FalconAttention under CP: no KV cache (pass use_cache=False)")
    _no_dropout(self, self.attention_dropout)
    shape = hidden_states.shape[:-1]
    fused = self.query_key_value(hidden_states).view(*shape, -1, self.head_dim)
    if self.new_decoder_architecture:  # as FalconAttention: each KV group's queries, then its key and value
        grouped = fused.view(*shape, self.num_kv_heads, -1, self.head_dim)
        query, key, value = grouped[..., :-2, :].flatten(-3, -2), grouped[..., -2, :], grouped[..., -1, :]
    elif self.multi_query:
        query, key, value = fused.split([self.num_heads, 1, 1], dim=-2)
    else:
        query, key, value = fused.unflatten(-2, (self.num_heads, 3)).unbind(-2)
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # [B, H, n, D]; ALiBi: no RoPE
    # transformers folds bf16(bf16(slope_h) * j) / sqrt(head_dim) into the mask: the divisor and the bf16 product
    # travel to the kernel, which computes them the same way for each key's position in its document
    context = _attend(self, impl, query, key, value, self.scaling,
                      falcon_alibi_divisor=math.sqrt(self.config.hidden_size // self.num_heads))  # fmt: skip
    return self.dense(context.reshape(*shape, -1)), None


_FORWARDS = {"BloomAttention": _bloom_forward, "MptAttention": _mpt_forward,
             "GPTNeoSelfAttention": _gpt_neo_forward, "GPTNeoFlashAttention2": _gpt_neo_forward,
             "FalconAttention": _falcon_forward, "GPTNeoXJapaneseAttention": _gpt_neox_japanese_forward,
             "OpenAIGPTAttention": _openai_gpt_forward, "XGLMAttention": _xglm_forward}  # fmt: skip


def dispatch_key(cls: type) -> str:
    """The name this module knows an attention class by: its class name, except OpenAI GPT's ``Attention``
    (``"OpenAIGPTAttention"``, a name no other model's class shares)."""
    if cls.__name__ == "Attention" and cls.__module__.endswith("modeling_openai"):
        return "OpenAIGPTAttention"
    return cls.__name__


def dispatch_alibi_layers(model: torch.nn.Module, impls: dict[str, str]) -> int:
    """Make every :data:`ALIBI_LAYERS` module of ``model`` hand its attention, while a context of a method of
    ``impls`` is the innermost active one (:mod:`automodel.distributed.cp.active`), to the attention function
    registered under that method's name in ``impls`` (method -> implementation name), which must apply
    ``alibi_slopes``. The model's config is left as it is (its mask code runs as without CP; the layers ignore
    the mask). Mutates the modules (an instance ``forward``); idempotent. Returns how many."""
    count = 0
    for module in model.modules():
        name = dispatch_key(type(module))
        if name not in _FORWARDS or (name == "FalconAttention" and getattr(module.config, "alibi", False) is not True):
            continue  # Falcon without ALiBi dispatches through AttentionInterface itself
        module._automodel_config = model.config
        if not hasattr(module, "num_key_value_groups"):  # GPT-Neo: the methods' inner kernels read it
            module.num_key_value_groups = 1
            module._automodel_set_groups = True
        module._automodel_alibi_impls = {**getattr(module, "_automodel_alibi_impls", {}), **impls}
        if not getattr(module, _PATCHED, False):
            module.forward = functools.partial(_FORWARDS[name], module)
            setattr(module, _PATCHED, True)
        count += 1
    return count


def restore_alibi_layers(model: torch.nn.Module) -> None:
    """Undo :func:`dispatch_alibi_layers` (the modules' own forward again). Mutates the modules."""
    for module in model.modules():
        if getattr(module, _PATCHED, False):
            if module.__dict__.pop("_automodel_set_groups", False):
                module.__dict__.pop("num_key_value_groups", None)
            for attr in ("forward", _PATCHED, "_automodel_config", "_automodel_alibi_impls"):
                module.__dict__.pop(attr, None)


def key_bias(
    slopes: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, falcon_divisor: float | None = None
) -> torch.Tensor:
    """``[B, H, S]`` in ``dtype``: ``slopes [H]`` times each key's ``positions [B, S]`` (its index in its document).

    ``falcon_divisor``: Falcon's ALiBi as transformers builds it (``build_alibi_tensor``, then the mask): the product
    of the bf16 slope and the integer position rounded to bf16, cast to ``dtype``, divided by ``falcon_divisor``
    (``sqrt(head_dim)``); the same torch ops, so each document gets the bias it gets alone."""
    if falcon_divisor is not None:
        product = slopes.bfloat16()[None, :, None] * positions.to(slopes.device, torch.long)[:, None, :]  # bf16
        return product.to(dtype) / falcon_divisor
    return (slopes.to(torch.float64)[None, :, None] * positions.to(slopes.device, torch.float64)[:, None, :]).to(dtype)
