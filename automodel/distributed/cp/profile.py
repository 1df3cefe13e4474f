"""The model profile: what context parallelism needs to know about a model, read once.

:func:`profile_model` inspects an HF causal LM (or VLM) from its config and, when given the model
itself (real or on the meta device: no weights are needed), its modules. It lists every decoder
layer's token mixer, which is what decides whether a CP method computes the layer exactly:

- ``full_attention``: causal softmax attention over the whole row;
- ``sliding_window``: causal attention limited to the last ``window`` tokens;
- ``chunked_attention``: causal attention inside fixed chunks of ``chunk`` tokens (Llama 4);
- ``sparse_attention``: DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5, dots3's ``indexed_attention``, HY-V4):
  latent attention whose keys an indexer chooses per query (the top ``index_topk`` of the query's document),
  recognised by its attention class (:data:`~automodel.distributed.cp.layers.sparse_support.DSA_ATTENTION`);
  DeepSeek-V4's attention, a window with sinks plus compressed KV entries that an indexer chooses on its CSA layers
  (:data:`~automodel.distributed.cp.layers.sparse_support.COMPRESSED_ATTENTION`: every layer of ``deepseek_v4``);
  Qwen4-Exp's query-sparse attention (QSA: blocks of ordinary keys chosen per query, ``QSA_ATTENTION``) and
  Kolibri-1.1's indexed layers (``KV_GATHER_ATTENTION``); and Doge's dynamic mask attention
  (``DYNAMIC_MASK_ATTENTION``);
- ``linear_mixer``: linear attention or a state-space / convolution mixer (Gated DeltaNet, Mamba,
  short convolutions): a state carried along the sequence, not a softmax over keys;
- ``mlp_only``: no token mixer at all (a block of MLP / MoE only, Nemotron-H's ``mlp`` and ``moe`` layers):
  nothing moves along the sequence, so every split computes it exactly. Recognised by an explicit rule, never
  by a name alone: the config's layer type names a block without a token mixer (``mlp``, ``moe``, ...) *and*,
  when the modules are read, every module of the layer is token-local (:func:`_token_local_problem`);
- ``unknown``: a layer this profile does not recognise (refused by every method, naming the layer's class and
  module path and how to report it: :data:`REPORT_HINT`).

Per attention layer it also records attention sinks (gpt-oss), logit softcapping (Gemma 2), the
query/key and value head sizes (MLA: DeepSeek-V3 has ``v_head_dim != qk_head_dim``), RoPE or NoPE,
and whether the layer scales its queries by the absolute position (Llama 4's attention temperature
on NoPE layers, which reads ``cache_position``). For the model: heads, KV heads, head size, VLM or
not, and the attention implementation; the sizes the memory plan and the TP plan read (hidden,
intermediate, vocabulary, layers), the text model type, tied embeddings, transformers' TP plan, and a
VLM's image / video token ids and spatial merge.

Every check that depends on the model (the CP methods' exactness, head splitting, the dry run, the
memory plan, the TP plan, LoRA's tied-head check, the VLM parts) reads this profile instead of
re-deriving it from the config. It lives in
``distributed`` (not ``models``) because the own-loop API checks a model against a method when the
model is prepared, and ``distributed`` may not import ``models``.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

from automodel.distributed.cp.layers.linear_support import STATE_MIXERS
from automodel.distributed.cp.layers.sparse_support import (
    COMPRESSED_ATTENTION,
    DYNAMIC_MASK_ATTENTION,
    KV_GATHER_ATTENTION,
    SPARSE_ATTENTION,
)

__all__ = [
    "FULL",
    "SLIDING",
    "CHUNKED",
    "SPARSE",
    "LINEAR",
    "MLP_ONLY",
    "UNKNOWN",
    "REPORT_HINT",
    "LayerSpec",
    "ModelProfile",
    "profile_line",
    "profile_model",
    "text_config",
]

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED = "chunked_attention"
SPARSE = "sparse_attention"
LINEAR = "linear_mixer"
MLP_ONLY = "mlp_only"
UNKNOWN = "unknown"

#: what a refusal of an unrecognised layer asks the user to do
REPORT_HINT = (
    "if it should run under CP, open an issue with the layer's class name, its module path and your "
    "transformers version"
)

# transformers' config.layer_types values -> our kinds (a value not listed here is UNKNOWN)
_CONFIG_LAYER_TYPES = {
    "full_attention": FULL,
    "attention": FULL,
    "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED,
    "indexed_attention": SPARSE,  # DSA; confirmed by its attention class when the modules are read
    "deepseek_sparse_attention": SPARSE,  # DeepSeek-V3.2's name for it in transformers < 5.25
    # DeepSeek-V4's window + compressed entries (its sliding_attention layers too, from its model type)
    "compressed_sparse_attention": SPARSE,
    "heavily_compressed_attention": SPARSE,
    "linear_attention": LINEAR,
    "mamba": LINEAR,
    "conv": LINEAR,
    "hybrid": LINEAR,  # attention + a linear/state-space mixer in one layer (Falcon-H1, Zamba2)
    "hybrid_sliding": LINEAR,
    # blocks without a token mixer (Nemotron-H's "mlp" and "moe" layers): confirmed by _token_local_problem
    # when the modules are read
    "mlp": MLP_ONLY,
    "moe": MLP_ONLY,
    "dense": MLP_ONLY,
    "sparse": MLP_ONLY,
}
# class names of token mixers that carry a state along the sequence
_LINEAR_MIXER = re.compile(
    r"DeltaNet|Mamba|SSM|ShortConv|LinearAttention|Lightning|Rwkv|Retention|Hyena|Mixer$|LSTMLayer$"
)
# class names the pattern above matches that are attention (Kimi-Linear's MLA layers)
_NOT_LINEAR_MIXERS = {"KimiLinearAttention"}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr`` that also survives transformers' per-layer attributes (Gemma 4's ``head_dim`` raises on
    global access: the layers then say it themselves)."""
    try:
        return getattr(obj, name, default)
    except Exception:  # noqa: BLE001 - e.g. AmbiguousGlobalPerLayerAttributeError
        return default


def text_config(config: Any) -> Any:
    """The text (decoder) config of ``config``: ``config.get_text_config()`` where it exists, else ``config``."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer's token mixer.

    Attributes:
        index: the layer's index in the decoder stack.
        kind: one of ``FULL``, ``SLIDING``, ``CHUNKED``, ``SPARSE``, ``LINEAR``, ``MLP_ONLY``, ``UNKNOWN``.
        window: the sliding window in tokens (``SLIDING``).
        chunk: the attention chunk in tokens (``CHUNKED``).
        sinks: the attention has per-head sink logits (gpt-oss).
        softcap: the attention logits are soft-capped at this value (Gemma 2), else ``None``.
        qk_head_dim, v_head_dim: head sizes of queries/keys and of values (they differ under MLA).
        rope: the layer rotates q/k by position (``False``: NoPE).
        position_scaled: the layer scales its queries by a function of the absolute position read from
            ``cache_position`` (Llama 4's attention temperature on NoPE layers).
        mixer: class name of the layer's linear/state-space mixer (``LINEAR``), of its DSA attention (``SPARSE``),
            of its MLP / MoE block
            (``MLP_ONLY``, when read from the modules) or of what was not recognised (``UNKNOWN``).
        hybrid_attention: a ``LINEAR`` layer that also runs attention (Falcon-H1).
        sparse_widths: a ``SPARSE`` layer's gathered state per token, ``(latent KV, indexer key)`` elements.
        window_in_mask_only: a ``SLIDING`` layer whose window reaches only transformers' mask, not the
            attention function (PhiMoE): a method that builds its own mask cannot see it.
        module_path: where the layer's unrecognised module sits in the model (``UNKNOWN``, read from the
            modules), e.g. ``"model.layers.3.mixer"``; ``""`` otherwise. :meth:`describe` writes it with the
            layer's index as ``<i>`` (:attr:`path_in_stack`).
        known_gap: an ``UNKNOWN`` layer whose computation is known (an ALiBi bias in the mask of a class that
            does not dispatch it): why no CP method computes it exactly and what would (``mixer`` then says what it computes);
            ``""`` for a layer nobody has looked at.
        alibi: the layer adds ALiBi's per-head bias ``slope_h * (j - i)`` to its scores in its own code (BLOOM,
            MPT: :mod:`~automodel.distributed.cp.layers.alibi` makes it hand q, k, v to a method that applies it).
        own_code: the layer computes its attention in its own code and
            :mod:`~automodel.distributed.cp.layers.alibi` makes it hand q, k, v (and its window) to the method's
            attention (GPT-Neo; BLOOM and MPT, with ``alibi``): a method must install that dispatch.
    """

    index: int
    kind: str
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    softcap: float | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    rope: bool = True
    position_scaled: bool = False
    mixer: str = ""
    hybrid_attention: bool = False
    window_in_mask_only: bool = False
    module_path: str = ""
    #: a ``SPARSE`` layer's per-token state every rank gathers: ``(latent KV width, indexer key width)`` in
    #: elements (``kv_lora_rank + qk_rope_head_dim``, ``index_head_dim``); ``None`` where the config has none
    sparse_widths: tuple[int, int] | None = None
    known_gap: str = ""
    alibi: bool = False
    own_code: bool = False

    @property
    def path_in_stack(self) -> str:
        """:attr:`module_path` with the layer's index as ``<i>`` (``"model.layers.<i>.mixer"``): the same text for
        every layer of a stack, so that a refusal groups them (``"layers 0-60: ..."``)."""
        parts = self.module_path.split(".")
        if str(self.index) in parts:
            parts[parts.index(str(self.index))] = "<i>"
        return ".".join(parts)

    @property
    def is_attention(self) -> bool:
        return self.kind in (FULL, SLIDING, CHUNKED, SPARSE)

    @property
    def mla(self) -> bool:
        """Value heads of another size than query/key heads (DeepSeek-V3's MLA)."""
        return (
            self.qk_head_dim is not None and self.v_head_dim is not None and self.qk_head_dim != self.v_head_dim
        )

    def attends_like_full(self, seq_len: int | None) -> bool:
        """Whether the layer is plain causal attention over rows of ``seq_len`` tokens: a window or chunk
        at least as long as the row never cuts anything (``None``: the row length is not known)."""
        if self.kind == FULL:
            return True
        limit = self.window if self.kind == SLIDING else self.chunk if self.kind == CHUNKED else None
        return limit is not None and seq_len is not None and limit >= seq_len

    def describe(self) -> str:
        """The layer kind in words, e.g. ``"sliding-window attention (window 16)"``."""
        if self.kind == SLIDING:
            text = f"sliding-window attention (window {self.window})"
        elif self.kind == CHUNKED:
            text = f"chunked attention (chunk {self.chunk})"
        elif self.kind == SPARSE and self.mixer in DYNAMIC_MASK_ATTENTION:
            text = (f"dynamic mask attention ({self.mixer}: a learned bias per key, and past keep_window_size visible "
                    "keys only the top keep_window_size by bias)")  # fmt: skip
        elif self.kind == SPARSE and self.mixer in COMPRESSED_ATTENTION:
            text = f"sliding-window attention with sinks and compressed KV entries ({self.mixer})"
        elif self.kind == SPARSE:
            dsa = "DSA, " if self.mixer not in KV_GATHER_ATTENTION else ""  # QSA, Kolibri-1.1: ordinary K/V
            text = f"sparse attention chosen by an indexer ({dsa}{self.mixer or 'indexed_attention'})"
        elif self.kind == LINEAR:
            text = f"a linear-attention / state-space mixer ({self.mixer or 'recurrent state'})"
        elif self.kind == MLP_ONLY:
            text = "no token mixer" + (f" ({self.mixer})" if self.mixer else "")
        elif self.kind == UNKNOWN and self.known_gap:
            text = self.mixer + (f" (at {self.path_in_stack})" if self.module_path else "")
        elif self.kind == UNKNOWN:
            where = f" at {self.path_in_stack}" if self.module_path else ""
            text = f"an unrecognised token mixer ({self.mixer or '?'}{where})"
        else:
            text = "full causal attention" + (" with an ALiBi bias" if self.alibi else "")
        return text


@dataclass(frozen=True)
class ModelProfile:
    """What CP needs to know about a model (:func:`profile_model`)."""

    model_type: str
    architecture: str
    layers: tuple[LayerSpec, ...]
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    is_vlm: bool
    attn_implementation: str | None
    from_modules: bool  # the layers were read from the modules (else from the config alone)
    # the text config's sizes (None where the config has none): the memory plan and the TP plan read them
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    num_hidden_layers: int | None = None
    #: the text config's ``model_type`` (a VLM's differs from :attr:`model_type`)
    text_model_type: str | None = None
    #: input and output embeddings share one weight (the text config's flag, else the top-level one)
    tie_word_embeddings: bool = False
    #: transformers' ``base_model_tp_plan`` of the text config, as ``(pattern, style)`` pairs
    base_model_tp_plan: tuple[tuple[str, str], ...] = ()
    #: a VLM's special token ids and its vision encoder's spatial merge (``None`` for a text model)
    image_token_id: int | None = None
    video_token_id: int | None = None
    spatial_merge_size: int | None = None

    @property
    def kinds(self) -> set[str]:
        return {layer.kind for layer in self.layers}

    def summary(self) -> str:
        """One line for logs and the dry run, e.g. ``"4 layers: 2 full_attention, 2 sliding_window (16)"``."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            key = layer.kind
            if layer.kind == SLIDING:
                key += f" ({layer.window})"
            elif layer.kind == CHUNKED:
                key += f" ({layer.chunk})"
            counts[key] = counts.get(key, 0) + 1
        extras = []
        if any(layer.sinks for layer in self.layers):
            extras.append("sinks")
        if any(layer.softcap for layer in self.layers):
            extras.append("softcapping")
        if any(layer.mla for layer in self.layers):
            extras.append("MLA")
        if any(not layer.rope for layer in self.layers if layer.is_attention):
            extras.append("NoPE layers")
        parts = ", ".join(f"{n} {k}" for k, n in counts.items())
        return (
            f"{len(self.layers)} layers: {parts}"
            + (f"; {', '.join(extras)}" if extras else "")
            + f"; heads {self.num_attention_heads} (kv {self.num_key_value_heads}); "
            f"attn_implementation={self.attn_implementation}" + ("; VLM" if self.is_vlm else "")
        )


def _layer_words(layer: LayerSpec) -> str:
    """A layer's token mixer in a few words, for :func:`profile_line` (``"sliding window 4096"``)."""
    if layer.kind == FULL:
        return "full attention" + (" (ALiBi)" if layer.alibi else "")
    if layer.kind == SLIDING:
        return f"sliding window {layer.window}"
    if layer.kind == CHUNKED:
        return f"chunked attention {layer.chunk}"
    if layer.kind == SPARSE and layer.mixer in COMPRESSED_ATTENTION:
        return "compressed attention (DeepSeek-V4)"
    if layer.kind == SPARSE:
        if layer.mixer in DYNAMIC_MASK_ATTENTION:
            return "dynamic mask attention (Doge)"
        return "sparse attention (DSA)" if layer.mixer not in KV_GATHER_ATTENTION else f"sparse attention ({layer.mixer})"
    if layer.kind == LINEAR:
        return (layer.mixer or "linear mixer") + (" + attention" if layer.hybrid_attention else "")
    if layer.kind == MLP_ONLY:
        return f"{layer.mixer} (no token mixer)" if layer.mixer else "no token mixer"
    name = re.split(r"[,:(]", layer.mixer)[0].strip() or "mixer"
    return f"{name} (no CP kernel)" if layer.known_gap else "unrecognised " + name


def profile_line(profile: ModelProfile) -> str:
    """The profile in one log line: the model, its layer kinds with counts (in order of first appearance), the
    attention features that decide a CP method, the heads and the attention implementation.

    e.g. ``"model profile: Qwen3NextForCausalLM (qwen3_next), 4 layers: Qwen3NextGatedDeltaNet x3, full attention
    x1; 16 heads, 2 kv heads of 256; attn_implementation=sdpa"``. Pure: reads ``profile`` only.
    """
    counts: dict[str, int] = {}
    for layer in profile.layers:
        words = _layer_words(layer)
        counts[words] = counts.get(words, 0) + 1
    kinds = ", ".join(f"{words} x{n}" for words, n in counts.items()) or "no layers"
    features = [
        name
        for name, present in (
            ("attention sinks", any(layer.sinks for layer in profile.layers)),
            ("logit softcapping", any(layer.softcap for layer in profile.layers)),
            ("MLA", any(layer.mla for layer in profile.layers)),
            ("NoPE layers", any(not layer.rope for layer in profile.layers if layer.is_attention)),
            ("position-scaled queries", any(layer.position_scaled for layer in profile.layers)),
            ("VLM", profile.is_vlm),
        )
        if present
    ]
    attends = any(layer.is_attention or layer.hybrid_attention or layer.kind == UNKNOWN for layer in profile.layers)
    if profile.num_attention_heads and attends:
        heads = f"{profile.num_attention_heads} heads, {profile.num_key_value_heads or profile.num_attention_heads} kv heads"
        heads += f" of {profile.head_dim}" if profile.head_dim else ""
    else:
        heads = "no attention heads"
    model = profile.architecture + (f" ({profile.model_type})" if profile.model_type else "")
    return (
        f"model profile: {model}, {len(profile.layers)} layers: {kinds}"
        + (f"; {', '.join(features)}" if features else "")
        + f"; {heads}; attn_implementation={profile.attn_implementation}"
    )


def _is_module(obj: Any) -> bool:
    return hasattr(obj, "named_modules") and hasattr(obj, "config")


def _decoder_layers(model: Any, n_layers: int) -> tuple[str, list[Any]] | None:
    """The decoder stack: ``(its module path, its n_layers layers)``, the ``ModuleList`` of ``n_layers`` layers
    (the language model's, for a VLM)."""
    import torch.nn as nn

    looped = _looped_stacks(model, n_layers)
    if looped is not None:
        return looped
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) != n_layers or n_layers == 0:
            continue
        if any(part in name.lower() for part in ("vision", "visual", "audio", "encoder")):
            continue
        first = type(module[0]).__name__
        # LongCat-Flash counts its attention sublayers (two per decoder layer) as num_hidden_layers: the stack of
        # that length is the ModuleList of one layer's attention modules
        score = 2 if "Decoder" in first else 1 if ("Layer" in first or "Block" in first) else 0
        if score == 0 and _calls_attention_interface(type(module[0])):
            score = 1
        if best is None or score > best[0]:
            best = (score, name, list(module))
    return (best[1], best[2]) if best is not None else None


def _looped_stacks(model: Any, n_layers: int) -> tuple[str, list[Any]] | None:
    """HRM (``hrm_text``): two stacks of ``num_layers_per_stack`` decoder layers, ``L_module`` and ``H_module``, run in
    a loop: per high cycle ``L_cycles`` passes of L, then one of H; the config counts the passes' layers as
    ``num_hidden_layers`` (``per_stack * H_cycles * (L_cycles + 1)``, transformers' cache slots). Returns the stack of
    those ``n_layers`` slots in order, each the module it runs (``"<prefix>.{L,H}_module.layers"``), or ``None``."""
    for name, module in model.named_modules():
        low, high = getattr(module, "L_module", None), getattr(module, "H_module", None)
        config = getattr(module, "config", None)
        per = _get(config, "num_layers_per_stack", None)
        cycles = (_get(config, "H_cycles", None), _get(config, "L_cycles", None))
        if low is None or high is None or not isinstance(per, int) or not all(isinstance(c, int) for c in cycles):
            continue
        h, l_cycles = cycles
        if per * h * (l_cycles + 1) != n_layers or len(getattr(low, "layers", [])) != per:
            continue
        slots = [(high if (i // per) % (l_cycles + 1) == l_cycles else low).layers[i % per] for i in range(n_layers)]
        return (f"{name}.L_module.layers" if name else "L_module.layers"), slots
    return None


# Modules that compute each token from that token alone (no sequence interaction). The torch classes are taken
# by type; a model's own MLP / MoE classes by name, and only when their forward does none of _SEQUENCE_OPS.
_TOKEN_LOCAL_TORCH = ("Linear", "Identity", "Dropout", "LayerNorm", "RMSNorm")
_TOKEN_LOCAL_CLASS = re.compile(
    r"(RMSNorm|LayerNorm|MLP|Mlp|FeedForward|MoE|Moe|MoeBlock|Experts|Expert|Router|TopkRouter|TopKRouter|Gate)$"
)
# what a token-local module's forward never does: convolve, scan or shift along the sequence, attend, read
# positions or a cache
_SEQUENCE_OPS = re.compile(r"conv|cumsum|cumprod|\broll\(|\bscan|shift|attention|attn|position|cache|seq_len")


def _token_local_problem(layer: Any, path: str) -> str | None:
    """``None`` when every module of ``layer`` computes each token from that token alone; else the first one
    that is not known to, as ``"<class> at <module path>"``.

    The rule is explicit, so that a sequence mixer is never taken for an MLP: a module is token-local when it
    is one of torch's :data:`_TOKEN_LOCAL_TORCH` layers or an activation (``torch.nn`` or
    ``transformers.activations``), or a model's own class named like an MLP / MoE part (:data:`_TOKEN_LOCAL_CLASS`:
    ``NemotronHMLP``, ``NemotronHMoE``, its ``...Experts`` and ``...TopkRouter``) whose forward does none of
    :data:`_SEQUENCE_OPS`. The layer module itself is not judged (its forward dispatches to its parts)."""
    for name, sub in layer.named_modules():
        if sub is layer:
            continue
        cls = type(sub)
        module = cls.__module__ or ""
        if module.startswith("torch.nn.") and (
            cls.__name__ in _TOKEN_LOCAL_TORCH or module == "torch.nn.modules.activation"
        ):
            continue
        if module == "transformers.activations":
            continue
        source = _forward_source(cls)  # a forward whose source cannot be read is not known to be token-local
        if _TOKEN_LOCAL_CLASS.search(cls.__name__) and source and not _SEQUENCE_OPS.search(source):
            continue
        return f"{cls.__name__} at {path}.{name}"
    return None


# Attention layers whose computation is known, and which no CP method computes exactly yet: what each computes
# (the layer's ``mixer`` text) and why no method does, with what would (``known_gap``). Each is an UNKNOWN layer,
# refused by every method with this reason instead of the request to report an unrecognised layer.
#: ALiBi needs nothing but positions: what a CP kernel would do, and why none does today
_ALIBI_EXACT = (
    "ALiBi itself is exact under CP (slope_h * (j - i) depends only on the two positions, in the document for "
    "packed rows): every built-in method applies it for BLOOM's, MPT's and (transformers >= 5.25) Falcon's "
    "layers, which hand it q, k and v; this layer's bias rides in the mask transformers builds, which no method "
    "reads"
)
_OWN_CODE = (
    "the layer computes its scores, mask and softmax in its own code over the keys it is given, which under CP "
    "are this rank's tokens only, so every method would drop the other ranks' keys and take positions from the "
    "rank's local index; "
)
#: class name -> (what it computes, why no method computes it and what would)
_KNOWN_ATTENTION: dict[str, tuple[str, str]] = {}
#: MLP / MoE blocks beside attention that mix tokens (a known computation no CP method reproduces): class name ->
#: (what it computes, why no method computes it); the layer is UNKNOWN with this reason
_KNOWN_TOKEN_MIXING = {
    "DogeCDMoE": (
        "DogeCDMoE: Doge's cross-domain mixture of experts (config.is_moe=True), whose router mixes tokens: it views "
        "the router logits [B, S, 2 * num_keys] as [2, B * S, num_keys], so token t of the flattened batch is routed "
        "by the logits of tokens t // 2 and B * S / 2 + t // 2 (transformers' own comment: not causal)",
        "a token's expert choice depends on tokens elsewhere in the batch (later in its row, other documents, other "
        "rows), which a rank holding part of the row does not have and which a packed document alone does not see "
        "either; Doge's attention is exact under every method (dynamic_mask), use is_moe=False",
    ),
}
#: model types that are not causal language models in the sense CP computes (whatever their layers): model type ->
#: (what they compute, why no CP method computes it); every layer is UNKNOWN with this reason, from the config too
_KNOWN_MODELS = {
    "cpmant": (
        "CPM-Ant's attention (CpmAntAttention): every token sees every token of its row (its mask ORs in a "
        "'context' flag that the model sets for every token: a later token changes earlier logits), with "
        "prompt_length learned prompt tokens prepended to each row inside the model, a bucketed relative-position "
        "bias per head from the row's own token indices and a padding mask that counts the row's non-zero tokens "
        "as if they were right-aligned",
        "CP methods compute causal attention, per document on packed rows; this non-causal attention over the whole "
        "row, its prompt prefix (one copy per row, not per rank) and its row-wide padding count would need every "
        "rank to see the whole row (and a packed document its neighbours), which no method does",
    ),
}
_INKLING = (
    "{cls}: attention whose keys and values are first mixed by short causal convolutions along the sequence (with "
    "a residual), whose scores get a learned relative-position bias (each query's own states over the key "
    "distances 0..rel_extent-1) and, on full layers with log_scaling_n_floor, a query scale from the query's "
    "position; its decoder layer also convolves the attention and MLP outputs along the sequence",
    "every method would start each shard's convolutions from zeros (they need the last conv_kernel_size - 1 inputs "
    "of the document's earlier tokens, a halo as the short-conv kernel passes), and no method's attention applies "
    "the relative-position bias it hands the attention function (per query, of the key's distance in the document) "
    "or takes the query scale from the in-document position (transformers takes it from the row position, so a "
    "packed row differs from its documents alone); it can be exact under CP (convolution halos, the bias in the "
    "halo kernel as ALiBi's, the scale from the in-document position), but no method computes it yet",
)
_KNOWN_ATTENTION.update({
    cls: (_INKLING[0].format(cls=cls), _INKLING[1])
    for cls in ("InklingAttention", "Inkling2SlidingAttention", "Inkling2FullAttention", "Inkling2LoopSlidingAttention",
                "Inkling2LoopFullAttention")
})
#: model types whose every attention layer is one of :data:`_KNOWN_ATTENTION` (their config has no switch for it),
#: so that a profile of the config alone (the recipe's check before the model loads) refuses them too
_MODEL_TYPE_ATTENTION: dict[str, str] = {"inkling_text": "InklingAttention"}
#: attention classes that add ALiBi in their own code, made to dispatch by :mod:`~automodel.distributed.cp.layers.alibi`
#: (the names are its ``ALIBI_LAYERS``), and the model types whose every attention layer is one of them
_ALIBI_LAYERS = ("BloomAttention", "MptAttention")
_ALIBI_MODEL_TYPES = ("bloom", "mpt")
#: Falcon with ``config.alibi=True``: its attention class and model type, made to dispatch by the same module (the
#: bias transformers folds into the mask, slopes and products in bf16, computed by the kernel the same way)
_FALCON_ALIBI = ("FalconAttention", "falcon")
#: GPT-Neo: the wrapper class the profile finds and the classes inside it that the same module makes dispatch
#: (global / local masks in their own code, handed to the method as causal or ``sliding_window`` attention)
_GPT_NEO = ("GPTNeoAttention", ("GPTNeoSelfAttention", "GPTNeoFlashAttention2"))
#: plain causal attention in the layer's own code (scores, causal mask and softmax), made to hand q, k, v to the method
#: by the same module: class (OpenAI GPT's is ``Attention`` in ``modeling_openai``) -> its model type
_PLAIN_OWN_CODE = {"GPTNeoXJapaneseAttention": "gpt_neox_japanese", "OpenAIGPTAttention": "openai-gpt",
                   "XGLMAttention": "xglm"}  # fmt: skip


def _own_code_key(cls: type) -> str:
    """``cls``'s name as :data:`_PLAIN_OWN_CODE` knows it (OpenAI GPT's ``Attention``: ``"OpenAIGPTAttention"``)."""
    if cls.__name__ == "Attention" and cls.__module__.endswith("modeling_openai"):
        return "OpenAIGPTAttention"
    return cls.__name__


#: Doge: its model type and the attention class made exact by cp/layers/dynamic_mask.py (the kind ``SPARSE``)
_DOGE = ("doge", "DogeAttention")


#: transformers 5.17-5.24's Doge under sdpa: what it computes, and why no CP method reproduces it
_DOGE_UNMASKED = (
    "DogeAttention with attn_implementation={attn} on transformers {version}: its model lets transformers skip the "
    "causal mask (create_causal_mask returns None under sdpa), so the dynamic mask, the bias alone, is all the "
    "attention gets and every token attends to later tokens of its row",
    "one process computes non-causal attention, which a CP method (causal, per document) does not reproduce; use "
    "attn_implementation=eager or transformers >= 5.25 (which always builds Doge's mask)",
)


def _doge_unmasked(attn: str | None) -> tuple[str, str] | None:
    """``(what, why)`` where the installed transformers' ``DogeModel`` skips the causal mask under ``attn`` (sdpa by
    default; 5.17-5.24: no ``allow_is_causal_skip=False``), else ``None``."""
    import transformers

    from automodel.distributed.torch_internals import doge_skips_causal_mask

    if attn == "eager" or not doge_skips_causal_mask():
        return None
    return _DOGE_UNMASKED[0].format(attn=attn or "sdpa", version=transformers.__version__), _DOGE_UNMASKED[1]


def _doge_from_config(text: Any, spec: LayerSpec, attn: str | None = None) -> LayerSpec:
    """A Doge attention layer from its config alone: dynamic mask attention (``SPARSE``, K and V gathered), or with
    ``is_moe`` the refused cross-domain MoE (:data:`_KNOWN_TOKEN_MIXING`), or (transformers < 5.25, sdpa) the
    refused unmasked attention (:func:`_doge_unmasked`)."""
    unmasked = _doge_unmasked(attn)
    if _get(text, "is_moe", False) or unmasked:
        mixer, gap = unmasked or _KNOWN_TOKEN_MIXING["DogeCDMoE"]
        return LayerSpec(**{**spec.__dict__, "kind": UNKNOWN, "mixer": mixer, "known_gap": gap})
    kv = (_get(text, "num_key_value_heads", None) or 0) * (spec.qk_head_dim or 0)
    return LayerSpec(**{**spec.__dict__, "kind": SPARSE, "mixer": _DOGE[1], "window": None,
                        "sparse_widths": (2 * kv, 0) if kv else None})  # fmt: skip


#: model types whose config names a sliding window that no code of their model applies: model type -> its modeling
#: module. Moshi's ``sliding_window`` (3000 by default) is stored by its decoder layer and never read: its attention
#: does not hand it to the kernel and its model builds a full causal mask (transformers 5.17 and 5.25: the logits with
#: a window of 4 and of 1000 are equal), so its layers are full causal attention. Checked against the installed
#: module's source (:func:`_window_unused`): a release that applies the window gets the window back.
_WINDOW_UNUSED = {"moshi": "transformers.models.moshi.modeling_moshi"}


@functools.cache
def _window_unused(model_type: str) -> bool:
    """The installed transformers' modeling module of ``model_type`` (:data:`_WINDOW_UNUSED`) neither passes a window
    to an attention function nor builds a sliding-window mask."""
    name = _WINDOW_UNUSED.get(model_type)
    if name is None:
        return False
    try:
        import importlib

        source = inspect.getsource(importlib.import_module(name))
    except (ImportError, OSError, TypeError):
        return False
    return "sliding_window=" not in source and "sliding_window_causal_mask" not in source


def _falcon_dispatches() -> bool:
    """transformers' ``FalconAttention`` hands q, k, v to ``AttentionInterface`` (>= 5.25; 5.17's computes its own
    attention, which :mod:`~automodel.distributed.cp.layers.alibi` does not reproduce: refused there)."""
    try:
        from transformers.models.falcon.modeling_falcon import FalconAttention
    except ImportError:
        return False
    return _dispatches_attention(FalconAttention)


def _mask_bias(text: Any) -> tuple[str, str] | None:
    """``(the bias in words, why no CP method computes it)`` for a position bias the model adds to the attention
    mask it builds, or ``None``: Falcon's ALiBi (``config.alibi``), which transformers >= 5.25 folds into the mask
    it hands to the attention function. A CP method's attention builds its own mask (or none) and would drop the
    bias, so such a layer is ``UNKNOWN``."""
    if _get(text, "alibi", False) is True:
        return (
            "an ALiBi position bias in its attention mask (config.alibi=True): each score of head h gets "
            "slope_h * j / sqrt(head_dim), j the key's index in the row, slopes and products in bf16",
            "every CP method builds its own mask (or none) and would drop the bias; " + _ALIBI_EXACT,
        )
    return None


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _dispatches_attention(cls: type) -> bool:
    """The attention module calls its kernel through transformers' ``AttentionInterface`` (so a CP method
    can see and replace it), rather than computing scores, masks or SDPA itself."""
    source = _forward_source(cls)
    return not source or "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


def _calls_attention_interface(cls: type) -> bool:
    """The module's own forward (readable source) calls its attention kernel through transformers'
    ``ALL_ATTENTION_FUNCTIONS``: an attention module whatever its class is named (LongCat-Flash's
    ``LongcatFlashMLA``), so the profile reads it as one (its head sizes, window, sinks) instead of finding
    "no attention module"."""
    return "ALL_ATTENTION_FUNCTIONS" in _forward_source(cls)


def _passes_window(cls: type) -> bool:
    """The attention module hands its window to the kernel (``sliding_window=``), not only to the mask."""
    source = _forward_source(cls)
    return not source or "sliding_window" in source


def _block_class(layer: Any) -> str:
    """The class of a mixer-less layer's MLP / MoE block: its ``mixer`` (Nemotron-H) or ``mlp`` attribute, else
    the layer's own class."""
    for attr in ("mixer", "mlp", "feed_forward", "block_sparse_moe"):
        sub = getattr(layer, attr, None)
        if sub is not None and hasattr(sub, "named_modules"):
            return type(sub).__name__
    return type(layer).__name__


def _layer_from_modules(layer: Any, base: LayerSpec, path: str = "", mask_bias: str | None = None) -> LayerSpec:
    """Refine ``base`` (from the config) with what the layer's modules show; ``path`` is the layer's module path
    (``"model.layers.3"``), named by an ``UNKNOWN`` result; ``mask_bias`` is :func:`_mask_bias` of the config."""
    import torch.nn as nn

    if base.kind == MLP_ONLY:  # the config says: no token mixer. Every module must confirm it.
        problem = _token_local_problem(layer, path)
        if problem is None:
            return LayerSpec(**{**base.__dict__, "mixer": _block_class(layer)})
        cls, _, where = problem.partition(" at ")
        return LayerSpec(**{**base.__dict__, "kind": UNKNOWN, "module_path": where,
                            "mixer": f"{cls}, in a layer the config calls {base.mixer or 'mixer-less'!r} (no token "
                            "mixer), is not known to compute each token alone"})  # fmt: skip
    attention, linear, attention_path = None, None, path
    if _calls_attention_interface(type(layer)):  # the stack's entries are attention modules (LongCat-Flash)
        attention = layer
    # a mixer class with a CP kernel names the layer's mixer wherever it sits (Zamba2's hybrid layer holds it
    # inside a whole Mamba decoder layer; Granite-4.0-H's is named "...MambaLayer", holding a Conv1d)
    linear = next((type(sub).__name__ for sub in layer.modules() if type(sub).__name__ in STATE_MIXERS), None)
    # such a mixer and its submodules are neither attention nor another mixer (its conv; Kimi's KDA is named
    # "...DeltaAttention")
    kernel_mixer = {id(m) for sub in layer.modules() if type(sub).__name__ in STATE_MIXERS for m in sub.modules()}
    outside_conv = None  # a convolution along the sequence beside a mixer with a kernel (Qwen4-Exp's PLE layers)
    for sub_name, sub in layer.named_modules():
        cls = type(sub).__name__
        if sub is layer or id(sub) in kernel_mixer:
            continue
        if isinstance(sub, nn.Conv1d) and linear in STATE_MIXERS and outside_conv is None:
            outside_conv = (f"{path}.{sub_name}" if path else sub_name, cls)
        moe = ("MoE" in cls or "Moe" in cls) and cls not in STATE_MIXERS  # Qwen3_5MoeGatedDeltaNet is one
        norm = "Norm" in cls  # MambaRMSNorm, FalconMambaRMSNorm, MambaRMSNormGated: a norm, not the mixer
        if _LINEAR_MIXER.search(cls) and cls not in _NOT_LINEAR_MIXERS and not moe and not norm and linear is None:
            linear = cls
        elif isinstance(sub, nn.Conv1d) and linear is None:
            linear = f"{cls} (a convolution along the sequence)"
        elif (cls.endswith("Attention") or _calls_attention_interface(type(sub))) and attention is None:
            # an attention module by its name, or by what its forward does (LongCat-Flash's LongcatFlashMLA)
            attention, attention_path = sub, f"{path}.{sub_name}" if path else sub_name
    spec = dict(base.__dict__)
    if outside_conv is not None:  # the kernel covers its mixer only: another conv's halo would not travel
        spec.update(kind=UNKNOWN, module_path=outside_conv[0],
                    mixer=f"{outside_conv[1]} (a convolution along the sequence) beside {linear}, outside the mixer "
                    "its CP kernel computes")  # fmt: skip
        return LayerSpec(**spec)
    if linear is not None and attention is not None and linear in STATE_MIXERS:
        # attention beside a mixer CP computes (Falcon-H1, Zamba2): it runs through the method's attention, so
        # it must dispatch through AttentionInterface; what it applies (window, sinks, softcap) is recorded
        # and linear_support refuses anything but plain causal attention
        cls = type(attention)
        if cls.__name__ in _KNOWN_ATTENTION or not _dispatches_attention(cls):
            spec.update(kind=UNKNOWN, module_path=attention_path,
                        mixer=f"{linear} beside {cls.__name__}, which does not dispatch its attention "
                        "through transformers' AttentionInterface")  # fmt: skip
            return LayerSpec(**spec)
        spec.update(kind=LINEAR, mixer=linear, hybrid_attention=True)
        if isinstance(getattr(attention, "sinks", None), nn.Parameter):
            spec["sinks"] = True
        softcap = getattr(attention, "attn_logit_softcapping", None) or getattr(attention, "softcap", None)
        if isinstance(softcap, (int, float)) and softcap:
            spec["softcap"] = float(softcap)
        window = getattr(attention, "sliding_window", None)
        if isinstance(window, int) and window:
            spec["window"] = window
        return LayerSpec(**spec)
    known = next(((f"{path}.{n}" if path else n, type(s).__name__) for n, s in layer.named_modules()
                  if type(s).__name__ in _KNOWN_ATTENTION), None)  # fmt: skip
    if linear is not None and known is not None and linear not in STATE_MIXERS:
        # Inkling's convolved K/V: convolutions in the attention path, known, without a kernel (Inkling 2's
        # first attention-like module is its depth-wise block residual)
        mixer, gap = _KNOWN_ATTENTION[known[1]]
        spec.update(kind=UNKNOWN, module_path=known[0], mixer=mixer, known_gap=gap)
        return LayerSpec(**spec)
    if linear is not None:
        spec.update(kind=LINEAR, mixer=linear, hybrid_attention=attention is not None)
        return LayerSpec(**spec)
    if attention is None:
        if base.kind in (MLP_ONLY, LINEAR):
            return base
        if base.kind == UNKNOWN:
            return LayerSpec(**{**spec, "module_path": path, "mixer": f"{base.mixer or '?'}: {type(layer).__name__}"})
        spec.update(kind=UNKNOWN, module_path=path, mixer=type(layer).__name__ + " (no attention module found)")
        return LayerSpec(**spec)
    if type(attention).__name__ in COMPRESSED_ATTENTION and (base.is_attention or base.kind == UNKNOWN):
        # DeepSeek-V4: every layer type of it (window only, HCA, CSA) runs the compressed-attention kernel
        dim = getattr(attention, "head_dim", None)
        spec.update(kind=SPARSE, mixer=type(attention).__name__, window=getattr(attention, "sliding_window", None),
                    sinks=True, sparse_widths=_compressed_widths(getattr(attention, "config", None),
                                                                 getattr(attention, "layer_type", "")),
                    **({"qk_head_dim": dim, "v_head_dim": dim} if isinstance(dim, int) else {}))  # fmt: skip
        return LayerSpec(**spec)
    if base.kind == UNKNOWN and type(attention).__name__ in _KNOWN_ATTENTION:  # a layer type of its own
        mixer, gap = _KNOWN_ATTENTION[type(attention).__name__]
        spec.update(kind=UNKNOWN, module_path=attention_path, mixer=f"{mixer} ({base.mixer or 'its own layer type'})",
                    known_gap=gap)  # fmt: skip
        return LayerSpec(**spec)
    if base.kind in (LINEAR, MLP_ONLY, UNKNOWN):  # the config said otherwise, the modules show attention
        spec.update(kind=UNKNOWN, module_path=attention_path,
                    mixer=f"{type(attention).__name__} (config layer type {base.mixer or base.kind})")
        return LayerSpec(**spec)
    cls = type(attention)
    if base.kind == SPARSE:  # the config says indexed_attention: the attention class must be a DSA one we know
        if cls.__name__ not in SPARSE_ATTENTION:
            spec.update(kind=UNKNOWN, module_path=attention_path,
                        mixer=f"{cls.__name__} (config layer type indexed_attention), a sparse attention without a "
                        "CP kernel")  # fmt: skip
            return LayerSpec(**spec)
        spec["mixer"] = cls.__name__
    elif getattr(attention, "indexer", None) is not None:  # an indexer where the config names other attention
        spec.update(kind=UNKNOWN, module_path=attention_path,
                    mixer=f"{cls.__name__} with an indexer ({type(attention.indexer).__name__}) in a layer the config "
                    f"calls {base.kind}")  # fmt: skip
        return LayerSpec(**spec)
    falcon_alibi = cls.__name__ == _FALCON_ALIBI[0] and mask_bias and _dispatches_attention(cls)  # 5.25's class
    if (cls.__name__ in _ALIBI_LAYERS or falcon_alibi) and base.kind == FULL:
        dim = getattr(attention, "head_dim", None)
        spec.update(alibi=True, own_code=True, **({"qk_head_dim": dim, "v_head_dim": dim} if isinstance(dim, int) else {}))
        return LayerSpec(**spec)
    if cls.__name__ == _GPT_NEO[0] and base.kind in (FULL, SLIDING):
        inner = getattr(attention, "attention", None)
        if type(inner).__name__ not in _GPT_NEO[1]:
            spec.update(kind=UNKNOWN, module_path=attention_path,
                        mixer=f"GPTNeoAttention holding {type(inner).__name__}, not one of {', '.join(_GPT_NEO[1])}")
            return LayerSpec(**spec)  # fmt: skip
        dim = getattr(inner, "head_dim", None)
        spec.update(own_code=True, **({"qk_head_dim": dim, "v_head_dim": dim} if isinstance(dim, int) else {}))
        return LayerSpec(**spec)
    if _own_code_key(cls) in _PLAIN_OWN_CODE and base.kind == FULL:  # GPT-NeoX-Japanese, OpenAI GPT, XGLM
        heads = next((getattr(attention, a) for a in ("num_heads", "num_attention_heads", "n_head")
                      if isinstance(getattr(attention, a, None), int)), None)  # fmt: skip
        width = getattr(attention, "embed_dim", None) or getattr(attention, "hidden_size", None) or getattr(
            attention, "split_size", None)
        dim = width // heads if isinstance(width, int) and heads else None
        spec.update(own_code=True, **({"qk_head_dim": dim, "v_head_dim": dim} if dim else {}))
        return LayerSpec(**spec)
    if cls.__name__ in _KNOWN_ATTENTION:
        mixer, gap = _KNOWN_ATTENTION[cls.__name__]
        spec.update(kind=UNKNOWN, module_path=attention_path, mixer=mixer, known_gap=gap)
        return LayerSpec(**spec)
    mixing = next(((f"{path}.{n}" if path else n, type(m).__name__) for n, m in layer.named_modules()
                   if type(m).__name__ in _KNOWN_TOKEN_MIXING), None)  # fmt: skip
    if mixing is not None:
        mixer, gap = _KNOWN_TOKEN_MIXING[mixing[1]]
        spec.update(kind=UNKNOWN, module_path=mixing[0], mixer=mixer, known_gap=gap)
        return LayerSpec(**spec)
    doge = cls.__name__ in DYNAMIC_MASK_ATTENTION
    unmasked = _doge_unmasked(getattr(getattr(attention, "config", None), "_attn_implementation", None)) if doge else None
    if unmasked:
        spec.update(kind=UNKNOWN, module_path=attention_path, mixer=unmasked[0], known_gap=unmasked[1])
        return LayerSpec(**spec)
    if doge and base.kind in (FULL, SLIDING):
        # Doge: K and V gathered (cp/layers/dynamic_mask.py); its window (config.sliding_window) in the kernel's mask
        dim = getattr(attention, "head_dim", None)
        kv = getattr(attention.k_proj, "out_features", None) if hasattr(attention, "k_proj") else None
        spec.update(kind=SPARSE, mixer=cls.__name__, window=None,
                    sparse_widths=(2 * kv, 0) if isinstance(kv, int) else None,
                    **({"qk_head_dim": dim, "v_head_dim": dim} if isinstance(dim, int) else {}))  # fmt: skip
        return LayerSpec(**spec)
    if not _dispatches_attention(cls):
        spec.update(
            kind=UNKNOWN,
            module_path=attention_path,
            mixer=f"{cls.__name__}, which computes its own attention and mask instead of dispatching through "
            "transformers' AttentionInterface",
        )
        return LayerSpec(**spec)
    if mask_bias:
        spec.update(kind=UNKNOWN, module_path=attention_path, mixer=f"{cls.__name__} with {mask_bias[0]}",
                    known_gap=mask_bias[1])  # fmt: skip
        return LayerSpec(**spec)
    if base.kind == SLIDING and not _passes_window(cls):
        spec["window_in_mask_only"] = True
    if isinstance(getattr(attention, "sinks", None), nn.Parameter):
        spec["sinks"] = True
    softcap = getattr(attention, "attn_logit_softcapping", None) or getattr(attention, "softcap", None)
    if isinstance(softcap, (int, float)) and softcap:
        spec["softcap"] = float(softcap)
    qk = getattr(attention, "qk_head_dim", None) or getattr(attention, "head_dim", None)
    v = getattr(attention, "v_head_dim", None) or qk
    if isinstance(qk, int):
        spec["qk_head_dim"] = qk
    if isinstance(v, int):
        spec["v_head_dim"] = v
    return LayerSpec(**spec)


#: model types whose every attention layer is one class of ``COMPRESSED_ATTENTION`` (DeepSeek-V4)
_COMPRESSED_MODEL_TYPES = {"deepseek_v4": "DeepseekV4Attention"}


def _compressed_widths(text: Any, layer_type: str) -> tuple[int, int] | None:
    """A DeepSeek-V4 layer's gathered state per token, ``(with gradient, without)`` in elements: the window's K = V
    (``head_dim``) plus the compressor's ``kv_proj`` and ``gate_proj`` outputs (HCA ``2 * head_dim``, CSA ``4 * head_dim``),
    and the CSA indexer's (``4 * index_head_dim``, no gradient); ``None`` where the config has no head size."""
    head = _get(text, "head_dim", None)
    if not isinstance(head, int):
        return None
    if layer_type == "compressed_sparse_attention":
        return 5 * head, 4 * int(_get(text, "index_head_dim", 0) or 0)
    if layer_type == "heavily_compressed_attention":
        return 3 * head, 0
    return head, 0


def _layers_from_config(text: Any, n_layers: int) -> list[LayerSpec]:
    layer_types = _get(text, "layer_types", None)
    window = _get(text, "sliding_window", None)
    window = int(window) if isinstance(window, int) and window > 0 else None
    if window is not None and layer_types is None and _window_unused(str(_get(text, "model_type", ""))):
        window = None  # Moshi: a window no code applies (full causal attention)
    if _get(text, "use_sliding_window", True) is False:
        window = None
    chunk = _get(text, "attention_chunk_size", None)
    no_rope = _get(text, "no_rope_layers", None)  # 1 = RoPE, 0 = NoPE (Llama 4, SmolLM3)
    temperature = bool(_get(text, "attn_temperature_tuning", False))
    softcap = _get(text, "attn_logit_softcapping", None)
    heads = _get(text, "num_attention_heads", None)
    head_dim = _get(text, "head_dim", None) or (
        _get(text, "hidden_size") // heads if heads and _get(text, "hidden_size", None) else None
    )
    qk = _get(text, "qk_head_dim", None)
    if qk is None and _get(text, "qk_nope_head_dim", None) is not None:
        qk = _get(text, "qk_nope_head_dim") + (_get(text, "qk_rope_head_dim", 0) or 0)
    v = _get(text, "v_head_dim", None)
    latent = (_get(text, "kv_lora_rank", None) or 0) + (_get(text, "qk_rope_head_dim", None) or 0)
    index_dim = _get(text, "index_head_dim", None)
    widths = (int(latent), int(index_dim)) if latent and isinstance(index_dim, int) else None
    qsa_dim, kv_heads = _get(text, "indexer_head_dim", None), _get(text, "num_key_value_heads", None)
    if widths is None and isinstance(qsa_dim, int) and kv_heads and head_dim:  # QSA: K and V, the indexer's raw key
        widths = (2 * int(kv_heads) * int(head_dim), int(qsa_dim) * int(_get(text, "indexer_kv_heads", 1) or 1))
    if widths is None and _get(text, "index_pool_size", None) is not None and kv_heads and head_dim:  # Kolibri-1.1
        widths = (2 * int(kv_heads) * int(head_dim), 0)  # K and V gathered; its indexer reads them
    gpt_neo = _get(text, "attention_layers", None) if str(_get(text, "model_type", "")) == "gpt_neo" else None
    if layer_types is None and isinstance(gpt_neo, (list, tuple)):  # GPT-Neo: "global" / "local" (its window_size)
        layer_types = ["sliding_attention" if t == "local" else "full_attention" for t in gpt_neo]
        window = int(_get(text, "window_size", 0) or 0) or None
    layers = []
    for i in range(n_layers):
        if layer_types is not None and i < len(layer_types):
            kind = _CONFIG_LAYER_TYPES.get(layer_types[i], UNKNOWN)
            mixer = layer_types[i] if kind in (UNKNOWN, LINEAR, MLP_ONLY) else ""
        else:
            kind, mixer = (SLIDING if window is not None else FULL), ""
        if kind == SLIDING and window is None:
            kind = FULL
        if kind == CHUNKED and not chunk:
            kind = FULL
        rope = bool(no_rope[i]) if isinstance(no_rope, (list, tuple)) and i < len(no_rope) else True
        layers.append(
            LayerSpec(
                index=i,
                kind=kind,
                window=window if kind == SLIDING else None,
                chunk=int(chunk) if kind == CHUNKED else None,
                softcap=float(softcap) if softcap else None,
                qk_head_dim=qk or head_dim,
                v_head_dim=v or qk or head_dim,
                rope=rope,
                position_scaled=temperature and not rope,
                mixer=mixer,
                sparse_widths=widths if kind == SPARSE else None,
            )
        )
    return layers


def _architecture_of(config: Any) -> str:
    """The model class a config builds: ``config.architectures[0]``, else transformers' causal-LM class."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    from automodel.distributed.torch_internals import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    except (KeyError, ValueError):
        return type(config).__name__


def profile_model(model_or_config: Any, attn_implementation: str | None = None) -> ModelProfile:
    """Profile an HF model (preferred: its modules are read too; the meta device is fine) or its config.

    Args:
        model_or_config: a ``PreTrainedModel`` (any device, meta included; an FSDP2/TP-wrapped one too)
            or a ``PretrainedConfig``.
        attn_implementation: the implementation the run uses; default: the config's
            ``_attn_implementation``.

    Returns:
        the :class:`ModelProfile`. Nothing is mutated.
    """
    is_model = _is_module(model_or_config)
    config = model_or_config.config if is_model else model_or_config
    text = text_config(config)
    n_layers = int(_get(text, "num_hidden_layers", 0) or 0)
    layers = _layers_from_config(text, n_layers)
    bias = _mask_bias(text)
    from_modules = False
    if is_model:
        found = _decoder_layers(model_or_config, n_layers)
        if found is None:  # the modules cannot confirm what the config says: nothing is assumed exact
            layers = [
                LayerSpec(index=i, kind=UNKNOWN, mixer=f"no decoder stack of {n_layers} layers found")
                for i in range(max(n_layers, 1))
            ]
        else:
            prefix, stack = found
            layers = [
                _layer_from_modules(layer, spec, f"{prefix}.{i}" if prefix else str(i), bias)
                for i, (layer, spec) in enumerate(zip(stack, layers))
            ]
            from_modules = True
    falcon_alibi = str(_get(text, "model_type", "")) == _FALCON_ALIBI[1] and bias is not None and _falcon_dispatches()
    if (str(_get(text, "model_type", "")) in _ALIBI_MODEL_TYPES or falcon_alibi) and not from_modules:
        layers = [LayerSpec(**{**spec.__dict__, "alibi": True, "own_code": True}) if spec.kind == FULL else spec
                  for spec in layers]  # fmt: skip
    if str(_get(text, "model_type", "")) in ("gpt_neo", *_PLAIN_OWN_CODE.values()) and not from_modules:
        layers = [LayerSpec(**{**spec.__dict__, "own_code": True}) if spec.is_attention else spec for spec in layers]
    if str(_get(text, "model_type", "")) == _DOGE[0] and not from_modules:
        attn = attn_implementation or getattr(config, "_attn_implementation", None)
        layers = [_doge_from_config(text, spec, attn) if spec.is_attention else spec for spec in layers]
    model_gap = _KNOWN_MODELS.get(str(_get(text, "model_type", "")))
    if model_gap:  # CPM-Ant: not causal attention, whatever the modules show (its stack sits in an "encoder")
        layers = [LayerSpec(index=i, kind=UNKNOWN, mixer=model_gap[0], known_gap=model_gap[1])
                  for i in range(max(n_layers, 1))]  # fmt: skip
    model_type = str(_get(text, "model_type", ""))
    if model_type in _COMPRESSED_MODEL_TYPES and not from_modules:  # DeepSeek-V4's config: its class on every layer
        types_ = _get(text, "layer_types", None) or []
        layers = [LayerSpec(**{**spec.__dict__, "kind": SPARSE, "mixer": _COMPRESSED_MODEL_TYPES[model_type],
                               "sinks": True, "window": _get(text, "sliding_window", None),
                               "sparse_widths": _compressed_widths(text, types_[spec.index] if spec.index < len(types_)
                                                                   else "")})
                  if spec.is_attention or spec.kind == UNKNOWN else spec for spec in layers]  # fmt: skip
    known = _KNOWN_ATTENTION.get(_MODEL_TYPE_ATTENTION.get(str(_get(text, "model_type", "")), ""))
    if known and not from_modules:  # Inkling from its config alone (its "hybrid" layer types read as a mixer beside
        # attention)
        layers = [LayerSpec(**{**spec.__dict__, "kind": UNKNOWN, "mixer": known[0], "known_gap": known[1]})
                  if spec.is_attention or spec.kind in (UNKNOWN, LINEAR) else spec for spec in layers]  # fmt: skip
    if bias and not from_modules and not falcon_alibi:  # the config alone: its attention layers carry the bias
        layers = [LayerSpec(**{**spec.__dict__, "kind": UNKNOWN, "mixer": f"attention with {bias[0]}",
                               "known_gap": bias[1]})
                  if spec.is_attention else spec for spec in layers]  # fmt: skip
    heads = _get(text, "num_attention_heads", None)
    kv = _get(text, "num_key_value_heads", None) or heads
    head_dim = _get(text, "head_dim", None) or (
        _get(text, "hidden_size") // heads if heads and _get(text, "hidden_size", None) else None
    )
    attn = attn_implementation or getattr(config, "_attn_implementation", None)
    architecture = type(model_or_config).__name__ if is_model else _architecture_of(config)
    tied = _get(text, "tie_word_embeddings", None)
    vision = getattr(config, "vision_config", None)
    return ModelProfile(
        model_type=str(getattr(config, "model_type", "?")),
        architecture=architecture,
        layers=tuple(layers),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        is_vlm=getattr(config, "vision_config", None) is not None,
        attn_implementation=attn,
        from_modules=from_modules,
        hidden_size=_get(text, "hidden_size", None),
        intermediate_size=_get(text, "intermediate_size", None),
        vocab_size=_get(text, "vocab_size", None),
        num_hidden_layers=_get(text, "num_hidden_layers", None),
        text_model_type=_get(text, "model_type", None),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False) if tied is None else tied),
        base_model_tp_plan=tuple((_get(text, "base_model_tp_plan", None) or {}).items()),
        image_token_id=_get(config, "image_token_id", None),
        video_token_id=_get(config, "video_token_id", None),
        spatial_merge_size=_get(vision, "spatial_merge_size", None) if vision is not None else None,
    )
