"""The causal-LM families of the CP support matrix (tests/test_family_matrix.py, scripts/support_table.py).

Each :class:`Family` builds transformers' default config of one ``model_type`` (``AutoConfig.for_model``),
scaled down in sizes only: fp32, hidden 64, 4 query / 2 KV heads of 16 where the family has those knobs,
vocab 128, small expert, state and latent sizes, and windows and chunks of :data:`WINDOW` tokens so that a
row of :data:`SEQ` tokens split over 2 ranks crosses them. The layer pattern stays the default's: every
kind of its ``layer_types`` in order, cycled to the fewest layers that hold them all (:meth:`Family.build_config`
checks it). A row ``<family>@flagship`` holds the released flagship's pattern where the default's differs
(Nemotron-H's default is ``M E * -``, Nemotron-H-8B's ``M-M-M-M*-...``). ``attn`` is the attention
implementation the family really trains with: ``sdpa`` where the model class supports it, otherwise
transformers' default (``eager``); the worker checks that against the class.

Layer-kind tags (joined with ``+``): ``full`` dense causal attention, ``sliding`` sliding-window
layers, ``chunked`` chunked attention, ``nope`` layers without RoPE, ``softcap`` attention logit
soft-capping, ``sinks`` attention sinks, ``mla`` multi-head latent attention (V head dim != QK head
dim), ``moe`` mixture-of-experts MLPs, ``alibi`` ALiBi position bias, ``abspos`` learned absolute
positions, ``linear`` linear-attention mixers (Gated DeltaNet and relatives), ``mamba`` Mamba/SSM
mixers, ``conv`` short-convolution mixers, ``mlp`` layers without a token mixer (an MLP block alone).

:data:`UNBUILDABLE` lists decoder families considered and left out, with the reason; :data:`OUT_OF_SCOPE` the
model types of transformers' causal-LM mapping that are not decoder-only text LMs (encoders, decoders of
encoder-decoder models, multimodal wrappers).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

SEQ = 64  # tokens per row (a multiple of 2*cp for ring/thd at cp=2 and usp at cp=4; 4 windows long)
WINDOW = 16  # sliding window / attention chunk, in tokens
VOCAB = 128
CP = 2
DOC_LENGTHS = (20, 28, 16)  # a packed row: three documents (sum SEQ), each crossing a window and a rank boundary
#: methods that have no configuration at cp=2 run in a launch of their own at cp=USP_CP, with these options
CP4_METHODS = {"usp": {"ulysses_size": 2}}
USP_CP = 4
#: a column of a cp=2 method run again at cp=USP_CP ("<method>@4"): Ulysses with more ranks than the tiny configs'
#: 2 KV heads (their copies per rank) and a head shard per rank of 4 (ZAYA's CCA: a rank whose heads read no conv
#: weight), paths 2 ranks never take
AT_CP4 = f"@{USP_CP}"
CP4_REPEATS = ("ulysses",)
PACKED = " packed"  # a packed column is "<method> packed"
AUTO_COLUMNS = ("auto", "auto packed")
#: packed rows at cp_size=1 through the recipe's path (bind_cp_method at cp_size 1, run_micro_batch) against each
#: document alone: the model's own forward where it keeps documents apart, else a method's document-aware attention
CP1_PACKED = "cp=1 packed"

__all__ = [
    "AUTO_COLUMNS",
    "CP1_PACKED",
    "CP",
    "AT_CP4",
    "CP4_METHODS",
    "CP4_REPEATS",
    "DOC_LENGTHS",
    "ABSENT",
    "FAMILIES",
    "OUT_OF_SCOPE",
    "PACKED",
    "SEQ",
    "UNBUILDABLE",
    "USP_CP",
    "VOCAB",
    "WINDOW",
    "Family",
    "absent_reason",
    "assert_falcon_refused",
    "case_family",
    "columns",
    "falcon_refused",
    "family_by_name",
    "installed_cases",
    "launched_cases",
    "left_out",
    "skip_if_absent",
    "skip_unless_pinned_transformers",
]


#: the keys of a default config whose value is a window or an attention chunk, in tokens: scaled to WINDOW
WINDOW_KEYS = ("sliding_window", "attention_window_size", "window_size", "attention_chunk_size")


def layer_pattern(config: Any) -> list[str] | None:
    """The config's per-layer types (``layer_types``, which transformers aliases to ``layers_block_type`` for the
    hybrids that name them so), or ``None`` where the config has no list of them."""
    try:
        types = getattr(config, "layer_types", None)
    except Exception:  # noqa: BLE001 - a property that cannot answer
        return None
    return list(types) if isinstance(types, (list, tuple)) and types else None


@functools.cache
def default_config(model_type: str) -> Any:
    """transformers' default config of ``model_type`` (one instance per type: read it, never change it)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type)


def cycled(pattern: list[str] | tuple[str, ...], n: int) -> list[str]:
    """``pattern`` repeated to ``n`` entries."""
    return [pattern[i % len(pattern)] for i in range(n)]


def covering_count(pattern: list[str] | tuple[str, ...], at_least: int = 2) -> int:
    """The fewest layers (at least ``at_least``) whose prefix of ``pattern`` cycled holds every kind in it."""
    kinds, seen = set(pattern), set()
    for i, kind in enumerate(cycled(pattern, len(pattern))):
        seen.add(kind)
        if seen == kinds:
            return max(at_least, i + 1)
    return at_least


@dataclass(frozen=True)
class Family:
    """One row of the matrix: transformers' default config of ``model_type``, scaled down in sizes only.

    ``config_kwargs`` holds sizes (hidden, intermediate, heads, KV heads, head size, vocabulary, experts, state
    sizes, latent ranks) and what the CPU run needs (no fused kernels, no dropout or router noise); never a layer
    pattern or a feature switch. :meth:`build_config` keeps the default config's layer pattern: every kind of its
    ``layer_types``, in order, cycled to the layer count, which is the fewest layers that hold every kind
    (``layers`` overrides it); windows and attention chunks (:data:`WINDOW_KEYS`) become :data:`WINDOW` tokens.
    A row named ``<family>@flagship`` holds ``pattern``, the released flagship checkpoint's layer types (named
    in ``note``), where it differs from the default's.
    """

    name: str
    model_type: str
    config_kwargs: dict[str, Any]
    kinds: str
    attn: str = "sdpa"
    train_mode: bool = True  # False only where training mode is random by design (noted in `note`)
    note: str = ""
    layers: int | None = None  # the layer count (default: the fewest that hold every kind of the pattern)
    layer_key: str = "num_hidden_layers"  # the config's key for the layer count
    pattern: tuple[str, ...] | None = None  # the flagship's layer types (default: the default config's)

    def attn_implementation(self) -> str:
        """``attn``, except that an entry written for ``sdpa`` runs ``eager`` where the installed transformers has no
        exact SDPA path for the model (gptj and codegen before 5.18 have none; Doge before 5.25 skips its causal
        mask under SDPA: ``torch_internals.sdpa_problem``, which the recipe refuses), as a user of that release
        trains it."""
        if self.attn != "sdpa":
            return self.attn
        from transformers import AutoModelForCausalLM
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        from automodel.distributed.torch_internals import sdpa_problem

        model_class = AutoModelForCausalLM._model_mapping.get(CONFIG_MAPPING[self.model_type], None)
        return "sdpa" if model_class is None or sdpa_problem(model_class) is None else "eager"

    def target_pattern(self) -> list[str] | None:
        """The layer types this row's config must have, in order (``None``: the config lists none): ``pattern``,
        else the default config's, cycled to the layer count."""
        pattern = list(self.pattern) if self.pattern else layer_pattern(default_config(self.model_type))
        if pattern is None:
            return None
        return cycled(pattern, self.layers or covering_count(pattern))

    def build_config(self):
        """The tiny fp32 config of this family (no download), every dropout probability set to 0.

        Raises:
            ValueError: the config built does not have :meth:`target_pattern`'s layer types.
        """
        from transformers import AutoConfig

        default = default_config(self.model_type)
        target = self.target_pattern()
        kwargs = dict(self.config_kwargs)
        kwargs.setdefault(self.layer_key, len(target) if target else (self.layers or 2))
        for key in WINDOW_KEYS:
            value = getattr(default, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                kwargs.setdefault(key, WINDOW)
        # the layer count alone keeps the pattern where the config derives it (from periods and offsets: Jamba,
        # Zamba, Bamba; from a window pattern: Gemma 3); otherwise the list is given
        try:
            config = AutoConfig.for_model(self.model_type, **kwargs)
        except Exception:  # noqa: BLE001 - a default list of another length (Zamba2's layers_block_type)
            if target is None:
                raise
            config = None
        if target is not None and (config is None or layer_pattern(config) != target):
            config = AutoConfig.for_model(self.model_type, layer_types=target, **kwargs)
        got = layer_pattern(config)
        if target is not None and got != target:
            raise ValueError(f"{self.name}: the config has layer types {got}, the row wants {target}")
        for key, value in list(vars(config).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float) and value > 0:
                setattr(config, key, 0.0)
        return config

    def build_model(self, seed: int = 0):
        """The model from :meth:`build_config` with :meth:`attn_implementation` and weights drawn from ``seed``, in train mode."""
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            self.build_config(), attn_implementation=self.attn_implementation(), dtype=torch.float32
        )
        nontrivial_init(self.model_type, model)
        return model.train(self.train_mode)


def nontrivial_init(model_type: str, model) -> None:
    """Give the parameters that transformers initialises to a constant hiding part of the computation a drawn value
    (mutates ``model``; the other families are unchanged). ZAYA: its per-KV-head key scale ``qk_norm.temp`` starts
    at zero, which zeroes every key, so the attention would be uniform and the q/k convolutions would get no
    gradient; drawn from U(0.5, 1.5)."""
    import torch

    if model_type == "zaya":
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("qk_norm.temp"):
                    param.copy_(torch.rand(param.shape, generator=g) + 0.5)


_DENSE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _kw(*, drop: tuple[str, ...] = (), **over: Any) -> dict[str, Any]:
    kw = {k: v for k, v in _DENSE.items() if k not in drop}
    kw.update(over)
    return kw


def _compass_rope() -> dict[str, Any]:
    """Cohere Compass's RoPE parameters for the tiny model (head_dim 16). Releases whose rotary embedding pre-rotates
    its frequencies by ``mrope_section`` (5.17: ``inv_freq_3d``, default ``[22, 22, 20]``, which needs head_dim 128)
    are given a section of the tiny model's 8 frequencies; later releases use the section otherwise and keep their
    default."""
    import inspect

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    try:
        from transformers.models.cohere_compass import modeling_cohere_compass
    except ImportError:
        return rope
    if "inv_freq_3d" in inspect.getsource(modeling_cohere_compass):
        rope["mrope_section"] = [3, 3, 2]
    return rope


def _alternate(n: int, a: str, b: str) -> list[str]:
    return [a if i % 2 == 0 else b for i in range(n)]


_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
               mamba_expand=2, mamba_chunk_size=16)
_NEMOTRON_H = dict(ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1, chunk_size=16,
                   use_mamba_kernels=False, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   moe_shared_expert_intermediate_size=64)
_LFM2_FLAGSHIP = ("conv", "conv", "full_attention")
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=8)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4)

FAMILIES: list[Family] = [
    # --- dense full causal attention
    Family("llama", "llama", _kw(), "full"),
    Family("qwen2", "qwen2", _kw(), "full"),
    Family("qwen3", "qwen3", _kw(), "full"),
    Family("gemma", "gemma", _kw(), "full"),
    Family("olmo", "olmo", _kw(), "full"),
    Family("olmo2", "olmo2", _kw(), "full"),
    Family("granite", "granite", _kw(drop=("head_dim",)), "full"),
    Family("glm", "glm", _kw(), "full"),
    Family("glm4", "glm4", _kw(), "full"),
    Family("phi", "phi", _kw(drop=("head_dim",), resid_pdrop=0.0, embd_pdrop=0.0), "full"),
    Family("stablelm", "stablelm", _kw(drop=("head_dim",), hidden_dropout=0.0), "full"),
    Family("helium", "helium", _kw(), "full"),
    Family("cohere", "cohere", _kw(drop=("head_dim",)), "full"),
    Family("ernie4_5", "ernie4_5", _kw(), "full"),
    Family("seed_oss", "seed_oss", _kw(), "full"),
    Family("apertus", "apertus", _kw(), "full"),
    Family("nemotron", "nemotron", _kw(), "full"),
    Family("arcee", "arcee", _kw(), "full"),
    Family("internlm3", "internlm3", _kw(), "full"),
    Family("exaone", "exaone", _kw(), "full"),
    Family("hunyuan_v1_dense", "hunyuan_v1_dense", _kw(), "full"),
    Family("jais2", "jais2", _kw(), "full"),
    Family("nanochat", "nanochat", _kw(), "full"),
    Family("bitnet", "bitnet", _kw(), "full"),
    Family("persimmon", "persimmon", _kw(drop=("head_dim",), hidden_dropout=0.0), "full"),
    Family("diffllama", "diffllama", _kw(), "full+differential"),
    # keep_window_size (a size: the top-k of the dynamic mask) shorter than the rows, so each query's top-k runs
    Family("doge", "doge", _kw(keep_window_size=8), "full+dynamic-mask"),
    Family("falcon", "falcon", _kw(drop=("head_dim", "num_key_value_heads")), "full"),
    Family("falcon@flagship", "falcon", _kw(drop=("head_dim", "num_key_value_heads"), alibi=True, multi_query=False),
           "full+alibi", note="Falcon-RW-1B's and -7B's ALiBi (alibi=True) with a K/V head per query head "
           "(multi_query=False); the default config is Falcon-7B's RoPE with one K/V head"),
    Family("gptj", "gptj", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256, rotary_dim=8,
                                tie_word_embeddings=False), "full", layer_key="n_layer"),
    Family("codegen", "codegen", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256,
                                      rotary_dim=8, tie_word_embeddings=False), "full", layer_key="n_layer"),
    Family("gpt_neox", "gpt_neox", _kw(drop=("head_dim", "num_key_value_heads"), hidden_dropout=0.0), "full"),
    Family("gpt2", "gpt2", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False),
           "full+abspos", layer_key="n_layer"),
    Family("gpt_bigcode", "gpt_bigcode", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256,
                                              tie_word_embeddings=False), "full+abspos", layer_key="n_layer"),
    Family("opt", "opt", _kw(drop=("head_dim", "num_key_value_heads"), ffn_dim=128, word_embed_proj_dim=64),
           "full+abspos"),
    Family("bloom", "bloom", dict(vocab_size=VOCAB, hidden_size=64, n_head=4, hidden_dropout=0.0,
                                  attention_dropout=0.0, tie_word_embeddings=False), "full+alibi", attn="eager",
           layer_key="n_layer"),
    Family("mpt", "mpt", dict(vocab_size=VOCAB, d_model=64, n_heads=4, max_seq_len=256,
                              expansion_ratio=2, tie_word_embeddings=False), "full+alibi", attn="eager",
           layer_key="n_layers"),
    # --- sliding windows
    Family("mistral", "mistral", _kw(), "sliding"),
    Family("ministral", "ministral", _kw(), "sliding"),
    Family("gemma2", "gemma2", _kw(query_pre_attn_scalar=16),
           "sliding+full+softcap", attn="eager"),
    Family("gemma3_text", "gemma3_text", _kw(query_pre_attn_scalar=16),
           "sliding+full"),
    Family("phi3", "phi3", _kw(drop=("head_dim",), resid_pdrop=0.0, embd_pdrop=0.0), "full"),
    Family("phi3@flagship", "phi3", _kw(drop=("head_dim",), resid_pdrop=0.0, embd_pdrop=0.0, sliding_window=WINDOW),
           "sliding", note="Phi-3-mini-4k's window on every layer (sliding_window 2047); the default config has none"),
    Family("smollm3", "smollm3", _kw(), "full+nope", layers=4),
    Family("cohere2", "cohere2", _kw(), "sliding+full"),
    Family("starcoder2", "starcoder2", _kw(drop=("head_dim",), residual_dropout=0.0, embedding_dropout=0.0), "full"),
    Family("starcoder2@flagship", "starcoder2", _kw(drop=("head_dim",), residual_dropout=0.0, embedding_dropout=0.0,
                                                    sliding_window=WINDOW), "sliding",
           note="StarCoder2's window on every layer (sliding_window 4096); the default config has none"),
    Family("exaone4", "exaone4", _kw(), "sliding+full"),
    Family("vaultgemma", "vaultgemma", _kw(query_pre_attn_scalar=16),
           "sliding+full+softcap", attn="eager"),
    Family("granite_swa", "granite_swa", _kw(drop=("head_dim",)), "sliding+full",
           attn="eager"),
    Family("olmo3", "olmo3", _kw(), "sliding+full"),
    Family("cwm", "cwm", _kw(), "full+sliding"),
    Family("gemma3n_text", "gemma3n_text", _kw(query_pre_attn_scalar=16,
                                               hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                               laurel_rank=8, altup_num_inputs=2, num_kv_shared_layers=0,
                                               activation_sparsity_pattern=[0.95] * 5, intermediate_size=[128] * 5),
           "sliding+full"),
    Family("gemma4_text", "gemma4_text", _kw(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8),
           "sliding+full"),
    Family("gpt_neo", "gpt_neo", dict(vocab_size=VOCAB, hidden_size=64, num_heads=4,
                                      attention_types=[[["global", "local"], 1]], window_size=WINDOW,
                                      max_position_embeddings=256, tie_word_embeddings=False),
           "sliding+full+abspos", attn="eager", layer_key="num_layers"),
    # --- mixture of experts (some with windows)
    Family("mixtral", "mixtral", _kw(**_MOE), "full+moe"),
    Family("qwen2_moe", "qwen2_moe", _kw(shared_expert_intermediate_size=64, **_QWEN_MOE), "full+moe"),
    Family("qwen3_moe", "qwen3_moe", _kw(**_QWEN_MOE), "full+moe"),
    Family("olmoe", "olmoe", _kw(num_experts=4, num_experts_per_tok=2), "full+moe"),
    Family("phimoe", "phimoe", _kw(drop=("head_dim",), router_jitter_noise=0.0,
                                   input_jitter_noise=0.0, **_MOE), "full+moe", train_mode=False,
           note="run in eval mode: in training mode its router (sparsemixer) draws random numbers per token"),
    Family("glm4_moe", "glm4_moe", _kw(drop=("head_dim",), n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, first_k_dense_replace=1), "full+moe"),
    Family("cohere2_moe", "cohere2_moe", _kw(num_experts=4, num_experts_per_tok=2), "sliding+full+moe"),
    Family("jetmoe", "jetmoe", dict(vocab_size=VOCAB, hidden_size=64, num_key_value_heads=2,
                                    kv_channels=16, intermediate_size=64, num_local_experts=4,
                                    num_experts_per_tok=2, tie_word_embeddings=False), "full+moe"),
    Family("dbrx", "dbrx", dict(vocab_size=VOCAB, d_model=64, n_heads=4, max_seq_len=256,
                                attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}),
           "full+moe", layer_key="n_layers",
           note="clip_qkv 8 (DBRX's): with the default config's None, transformers' forward fails (a clamp with no "
           "bound)"),
    Family("minimax_m2", "minimax_m2", _kw(**_MOE), "full+moe"),
    Family("hunyuan_v1_moe", "hunyuan_v1_moe", _kw(num_experts=4, moe_topk=2), "full+moe"),
    Family("ernie4_5_moe", "ernie4_5_moe", _kw(moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
                                               moe_layer_start_index=1), "full+moe"),
    Family("dots1", "dots1", _kw(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                 moe_intermediate_size=32, first_k_dense_replace=1), "full+moe"),
    Family("afmoe", "afmoe", _kw(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
           "sliding+full+moe"),
    Family("granitemoe", "granitemoe", _kw(drop=("head_dim",), **_MOE), "full+moe"),
    # --- multi-head latent attention
    Family("deepseek_v3", "deepseek_v3", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                             q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                             n_group=2, topk_group=1, moe_intermediate_size=32,
                                             first_k_dense_replace=1),
           "mla+moe"),
    Family("deepseek_v2", "deepseek_v2", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                             q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, n_shared_experts=1,
                                             first_k_dense_replace=1), "mla+moe"),
    Family("minicpm3", "minicpm3", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                       q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8),
           "mla"),
    Family("longcat_flash", "longcat_flash", _kw(num_key_value_heads=4,
                                                 kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                                                 qk_nope_head_dim=16, head_dim=8, v_head_dim=8, n_routed_experts=4,
                                                 moe_topk=2, expert_ffn_hidden_size=32, ffn_hidden_size=64,
                                                 zero_expert_num=2), "mla+moe", layers=1, layer_key="num_layers"),
    Family("glm4_moe_lite", "glm4_moe_lite", _kw(drop=("head_dim",), n_routed_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, first_k_dense_replace=1, **_MLA), "mla+moe"),
    Family("youtu", "youtu", _kw(drop=("head_dim",), **_MLA), "mla"),
    # --- sparse attention picked by an indexer (DeepSeek sparse attention)
    Family("deepseek_v32", "deepseek_v32", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                               q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                               v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                               topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                               index_n_heads=2, index_head_dim=16, index_topk=WINDOW),
           "dsa+mla+moe"),
    Family("glm_moe_dsa", "glm_moe_dsa", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                             q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             first_k_dense_replace=1, index_n_heads=2, index_head_dim=16,
                                             index_topk=WINDOW), "dsa+mla+moe"),
    Family("dots3_note_text", "dots3_note_text", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=16,
        head_dim=24, n_routed_experts=4, num_experts_per_tok=2, index_topk=WINDOW, index_head_dim=16, index_n_heads=2,
        shared_experts_intermediate_size=32, swa_num_attention_heads=4, swa_num_key_value_heads=4,
        swa_q_lora_rank=48, swa_kv_lora_rank=32, swa_head_dim=24, swa_qk_nope_head_dim=16, swa_v_head_dim=8,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
        "dsa+sliding+mla+moe"),
    # --- attention sinks, chunked attention
    Family("gpt_oss", "gpt_oss", _kw(**_MOE),
           "sinks+sliding+full+moe", attn="eager"),
    Family("llama4_text", "llama4_text", _kw(intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1),
           "chunked+full+nope+moe"),
    # --- hybrids: linear attention, state-space and convolution mixers
    Family("qwen3_next", "qwen3_next", _kw(shared_expert_intermediate_size=64, **_QWEN_MOE, **_GDN),
           "linear+full+moe"),
    Family("qwen3_5_moe_text", "qwen3_5_moe_text", _kw(shared_expert_intermediate_size=64, **_QWEN_MOE, **_GDN),
           "linear+full+moe"),
    Family("qwen3_5_text", "qwen3_5_text", _kw(**_GDN), "linear+full", pattern=("linear_attention", "full_attention"),
           note="one Gated DeltaNet layer and one attention layer, not the default's 3 to 1: in 4 layers the last "
           "Gated DeltaNet layers' A_log gradients are 1e-6 of the largest, where transformers' own fp32 kernel "
           "differs from itself (chunk 8 or 16 against 64) by 1-3e-4 on this table's measure, above its 1e-4 "
           "(tests/test_state_mixers.py proves the mixer in fp64)"),
    Family("olmo_hybrid", "olmo_hybrid", _kw(drop=("head_dim",), linear_num_key_heads=4, linear_num_value_heads=4,
                                             linear_key_head_dim=16, linear_value_head_dim=16),
           "linear+full"),
    Family("falcon_h1", "falcon_h1", _kw(drop=("head_dim",), mamba_d_ssm=128, **_MAMBA2), "mamba+full"),
    Family("bamba", "bamba", _kw(drop=("head_dim",), **_MAMBA2), "mamba"),
    Family("bamba@flagship", "bamba", _kw(drop=("head_dim",), attn_layer_indices=[9], **_MAMBA2), "mamba+full",
           pattern=("linear_attention",) * 9 + ("full_attention",),
           note="Bamba-9B's layers: attention at layers 9, 18 and 27 (attn_layer_indices), Mamba-2 elsewhere; the "
           "default config has no attention layer"),
    Family("granitemoehybrid", "granitemoehybrid", _kw(drop=("head_dim",), shared_intermediate_size=64,
                                                       **_MOE, **_MAMBA2), "mamba+moe"),
    Family("granitemoehybrid@flagship", "granitemoehybrid", _kw(drop=("head_dim",), shared_intermediate_size=64,
                                                                **_MOE, **_MAMBA2), "mamba+full+moe",
           pattern=("linear_attention",) * 9 + ("full_attention",),
           note="Granite-4.0-H's 9 Mamba-2 layers to 1 attention layer; the default config has no attention layer"),
    Family("jamba", "jamba", _kw(drop=("head_dim",), num_experts=4, num_experts_per_tok=2, use_mamba_kernels=False,
                                 mamba_d_state=8, mamba_dt_rank=8), "mamba+full+moe"),
    Family("minimax", "minimax", _kw(block_size=16, **_MOE), "full+linear+moe"),
    Family("minimax@flagship", "minimax", _kw(block_size=16, **_MOE), "linear+full+moe",
           pattern=("linear_attention",) * 7 + ("full_attention",),
           note="MiniMax-Text-01's 7 lightning-attention layers to 1 softmax layer; the default config alternates "
           "them"),
    Family("kimi_linear", "kimi_linear", _kw(drop=("head_dim",), num_key_value_heads=4, kv_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8,
                                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             linear_head_dim=16, linear_num_heads=4), "linear+mla+moe"),
    Family("zamba2", "zamba2", dict(vocab_size=VOCAB, hidden_size=64, mamba_d_state=16, n_mamba_heads=4,
                                    chunk_size=16, intermediate_size=128, num_attention_heads=4,
                                    num_key_value_heads=4, use_mamba_kernels=False, tie_word_embeddings=False),
           "mamba+full"),
    Family("zamba", "zamba", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8,
                                  n_mamba_heads=2, intermediate_size=128, use_mamba_kernels=False,
                                  tie_word_embeddings=False), "mamba+full"),
    Family("nemotron_h", "nemotron_h", _kw(**_NEMOTRON_H), "mamba+moe+full+mlp"),
    Family("nemotron_h@flagship", "nemotron_h", _kw(**_NEMOTRON_H), "mamba+mlp+full",
           pattern=tuple({"M": "linear_attention", "-": "mlp", "*": "full_attention"}[c] for c in "M-M-M-M*-"),
           note="Nemotron-H-8B's layers (hybrid_override_pattern M-M-M-M*-M-M-M-M-M*-...): Mamba-2 and MLP "
           "layers, attention every ninth; the default config is M E * - (Mamba-2, MoE, attention, MLP)"),
    Family("recurrent_gemma", "recurrent_gemma", dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                                      num_attention_heads=4,
                                                      num_key_value_heads=2, tie_word_embeddings=False),
           "rglru+sliding", layers=3),  # 5.17's config has no layer_types (its block_types cycle): 3 hold both kinds
    Family("mamba", "mamba", dict(vocab_size=VOCAB, hidden_size=64, state_size=8,
                                  use_mambapy=True, tie_word_embeddings=False), "mamba", attn="eager"),
    Family("mamba2", "mamba2", dict(vocab_size=VOCAB, hidden_size=64, num_heads=8, head_dim=16,
                                    state_size=16, n_groups=1, chunk_size=16), "mamba", attn="eager"),
    Family("falcon_mamba", "falcon_mamba", dict(vocab_size=VOCAB, hidden_size=64, state_size=8,
                                                use_mambapy=True, tie_word_embeddings=False), "mamba", attn="eager"),
    Family("rwkv", "rwkv", dict(vocab_size=VOCAB, hidden_size=64, context_length=256,
                                attention_hidden_size=64, tie_word_embeddings=False), "rwkv", attn="eager"),
    # the default config's mode ("inference": chunkwise on whole chunks, token by token for the rest, any length);
    # "train" needs every row a multiple of chunk_size (a packed row's documents alone are not)
    Family("xlstm", "xlstm", dict(vocab_size=VOCAB, hidden_size=64, embedding_dim=64, num_heads=4,
                                  chunk_size=WINDOW, tie_word_embeddings=False), "xlstm", attn="eager"),
    Family("lfm2_moe", "lfm2_moe", _kw(drop=("head_dim",), num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
           "conv+full+moe", pattern=_LFM2_FLAGSHIP,
           note="its default config lists no layer types (a model cannot be built from it): LFM2-8B-A1B's layers, "
           "two short convolutions to one attention layer"),
    Family("lfm2", "lfm2", _kw(drop=("head_dim",), block_auto_adjust_ff_dim=False), "full"),
    Family("lfm2@flagship", "lfm2", _kw(drop=("head_dim",), block_auto_adjust_ff_dim=False), "conv+full",
           pattern=_LFM2_FLAGSHIP,
           note="LFM2-1.2B's layers: two short convolutions to one attention layer (full_attn_idxs 2, 5, 8, ...); "
           "the default config has attention on every layer"),
    # --- decoder families of transformers 5.25 new to the table: the default config of each, scaled in sizes by
    # the same rule (the keys it has of _DENSE, small experts, MLA ranks, indexer and linear-attention heads)
    Family("hy_v3", "hy_v3", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
           "full+moe"),
    Family("mimo_v2_flash", "mimo_v2_flash", _kw(drop=('attention_dropout', 'pad_token_id', 'eos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, v_head_dim=8),
           "full+sliding+sinks+mla+moe"),
    Family("minicpm5_moe", "minicpm5_moe", _kw(drop=('attention_dropout',), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "full+moe"),
    Family("ministral3", "ministral3", _kw(drop=('attention_dropout',)),
           "full"),
    Family("granitemoe_swa", "granitemoe_swa", _kw(drop=('head_dim', 'attention_dropout', 'pad_token_id'), shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
           "full+sliding+sinks+moe"),
    Family("granitemoeshared", "granitemoeshared", _kw(drop=('head_dim', 'attention_dropout', 'pad_token_id'), shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
           "full+moe"),
    Family("exaone_moe", "exaone_moe", _kw(drop=('head_dim', 'attention_dropout'), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "sliding+full+moe"),
    Family("sarvam_moe", "sarvam_moe", _kw(drop=('attention_dropout', 'bos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "full+moe"),
    Family("solar_open", "solar_open", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "full+moe"),
    Family("laguna", "laguna", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
           "full+moe"),
    Family("gemma4_unified_text", "gemma4_unified_text", _kw(drop=('attention_dropout',)),
           "sliding+full"),
    Family("flex_olmo", "flex_olmo", _kw(drop=('head_dim', 'attention_dropout', 'bos_token_id'), num_experts=4, num_experts_per_tok=2),
           "full+moe"),
    Family("apertus1p5_text", "apertus1p5_text", _kw(drop=('head_dim', 'attention_dropout')),
           "full"),
    Family("param2moe", "param2moe", _kw(drop=('attention_dropout', 'bos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "full+moe"),
    Family("qwen4_exp_text", "qwen4_exp_text", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4, hc_lowrank=8, ple_embed_dim=64, ngram_vocab_size_base=512, split_ngram_parts=4, heads_per_ngram=2),
           "linear+dsa+moe"),
    Family("zaya", "zaya", _kw(drop=('intermediate_size', 'attention_dropout'), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16),
           "cca+moe"),
    Family("bailing_hybrid", "bailing_hybrid", _kw(drop=('max_position_embeddings', 'attention_dropout', 'bos_token_id'), num_key_value_heads=4, moe_intermediate_size=32, num_experts=4, topk_group=1, num_expert_group=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, linear_head_dim=16, linear_num_heads=4, num_experts_per_token=2),
           "linear+mla+moe"),
    Family("sarvam_mla", "sarvam_mla", _kw(drop=('attention_dropout', 'pad_token_id'), num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8),
           "mla+moe"),
    Family("axk2", "axk2", _kw(drop=('attention_dropout', 'pad_token_id'), num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=16),
           "dsa+mla+moe"),
    Family("hy_v4", "hy_v4", _kw(drop=('attention_dropout',), num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, index_n_heads=2, index_head_dim=16, index_topk=16),
           "dsa+mla+moe"),
    Family("deepseek_v4", "deepseek_v4", _kw(drop=('attention_dropout', 'intermediate_size'), num_key_value_heads=1, head_dim=16, q_lora_rank=48, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=16),
           "hca+csa+moe", layers=4),
    Family("lfm3", "lfm3", _kw(drop=('attention_dropout',)),
           "conv+full+sliding"),
    Family("aria_text", "aria_text", _kw(drop=('attention_dropout',), moe_num_experts=4, moe_topk=2),
           "full+moe"),
    Family("axk1", "axk1", _kw(drop=('attention_dropout', 'pad_token_id'), num_key_value_heads=4, head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8),
           "mla+moe"),
    Family("beam", "beam", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1),
           "sliding+full+moe"),
    Family("biogpt", "biogpt", _kw(drop=('num_key_value_heads', 'head_dim', 'attention_dropout')),
           "full+abspos"),
    Family("cpmant", "cpmant", dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16, dim_ff=128, tie_word_embeddings=False),
           "full+relpos"),
    Family("ctrl", "ctrl", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256, dff=128, tie_word_embeddings=False),
           "full+abspos"),
    Family("dory", "dory", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id')),
           "sliding+full"),
    Family("ergo", "ergo", _kw(drop=('intermediate_size', 'head_dim', 'attention_dropout', 'tie_word_embeddings'), moe_intermediate_size=32, shared_intermediate_size=32, num_experts=4, num_experts_per_tok=2, first_dense_intermediate_size=128),
           "sliding+full+moe"),
    Family("flint", "flint", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
           "full+sliding+sinks+moe"),
    Family("gpt_neox_japanese", "gpt_neox_japanese", _kw(drop=('intermediate_size', 'num_key_value_heads', 'head_dim', 'attention_dropout', 'pad_token_id')),
           "full"),
    Family("hrm_text", "hrm_text", _kw(drop=('num_key_value_heads', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id')),
           "full"),
    Family("hyperclovax", "hyperclovax", _kw(drop=('attention_dropout', 'pad_token_id')),
           "full"),
    Family("inkling2_loop_text", "inkling2_loop_text", _kw(drop=('intermediate_size', 'attention_dropout', 'tie_word_embeddings', 'pad_token_id', 'bos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, unpadded_vocab_size=VOCAB, log_scaling_n_floor=16, rel_extent=16, d_rel=4, loop_gate_rank=8),
           "sliding+full+relpos+conv+moe"),
    Family("inkling2_text", "inkling2_text", _kw(drop=('intermediate_size', 'attention_dropout', 'tie_word_embeddings', 'pad_token_id', 'bos_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, unpadded_vocab_size=VOCAB, log_scaling_n_floor=16, rel_extent=16, d_rel=4),
           "sliding+full+relpos+conv+moe"),
    Family("inkling_text", "inkling_text", _kw(drop=('attention_dropout', 'tie_word_embeddings', 'pad_token_id'), moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, rel_extent=16, d_rel=4),
           "sliding+full+relpos+conv+moe"),
    Family("iquestcoder", "iquestcoder", _kw(drop=('attention_dropout', 'pad_token_id')),
           "full"),
    Family("kolibri1", "kolibri1", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
           "sliding+full+moe"),
    Family("kolibri1_1", "kolibri1_1", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, index_topk=16, mlp_only_intermediate_size=128, index_pool_size=32, index_compression=4, index_num_heads=2, index_num_local_tokens=8, index_num_sink_tokens=2),
           "sliding+dsa+moe"),
    Family("lara_mini", "lara_mini", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id'), moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4),
           "linear+sliding+full+moe"),
    Family("mellum", "mellum", _kw(drop=('attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
           "full+moe"),
    Family("minimax_m3_vl_text", "minimax_m3_vl_text", _kw(drop=('attention_dropout', 'pad_token_id'), shared_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, dense_intermediate_size=128),
           "full+moe"),
    Family("modernbert-decoder", "modernbert-decoder", _kw(drop=('num_key_value_heads', 'head_dim', 'attention_dropout')),
           "full+sliding"),
    Family("openai-gpt", "openai-gpt", dict(vocab_size=VOCAB, n_embd=64, n_head=4, n_positions=256, tie_word_embeddings=False),
           "full+abspos"),
    Family("xglm", "xglm", _kw(drop=('hidden_size', 'intermediate_size', 'num_attention_heads', 'num_key_value_heads', 'head_dim', 'attention_dropout'), d_model=64, ffn_dim=128, attention_heads=4),
           "full+abspos"),
    Family("moshi", "moshi", _kw(drop=('intermediate_size', 'attention_dropout', 'pad_token_id', 'bos_token_id', 'eos_token_id'), ffn_dim=128),
           "full"),
    Family("cohere_compass_text", "cohere_compass_text", _kw(rope_parameters={"full_attention": _compass_rope()}), "full",
           note="RoPE parameters keyed by layer type: with the default config's (not keyed), transformers' rotary "
           "embedding fails (KeyError 'full_attention')"),
]

#: decoder-only causal-LM types of transformers' mapping (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) that have no row, and why
UNBUILDABLE: dict[str, str] = {
    "gemma4_assistant": "a draft model: its default config does not validate (hidden_size_per_layer_input must be 0), "
    "and its forward reads the backbone's key/value states",
    "gemma4_unified_assistant": "a draft model: its forward needs the backbone's inputs_embeds and shared key/value "
    "states (shared_kv_states), so it does not run alone",
    "blt": "Byte Latent Transformer: an entropy patcher, a local encoder and decoder with cross-attention around a "
    "global transformer; its tiny config did not finish one forward on CPU in 200 s here",
}

#: model types of transformers' causal-LM mapping that are not decoder-only text LMs: out of scope, listed once.
#: ``gpt-sw3`` builds GPT-2 (the ``gpt2`` row); the text models of multimodal wrappers are rows where listed
OUT_OF_SCOPE: dict[str, str] = {
    **dict.fromkeys(("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                     "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                     "xlm-roberta", "xlm-roberta-xl", "xmod", "xlm", "xlnet", "reformer"),
                    "encoder (bidirectional, masked or permutation LM) with a causal-LM head"),
    **dict.fromkeys(("bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus",
                     "plbart", "prophetnet", "trocr", "whisper", "musicgen", "musicgen_melody"),
                    "the decoder of an encoder-decoder model (cross-attention to an encoder)"),
    **dict.fromkeys(("gemma3", "gemma3n", "gemma4", "gemma4_unified", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
                     "dots3_note", "llama4", "mllama", "fuyu", "got_ocr2", "git", "phi4_multimodal",
                     "moss_transcribe_diarize", "emu3"),
                    "a multimodal model (its text model is a row where transformers maps one)"),
    "gpt-sw3": "GPT-SW3 builds GPT-2 (the `gpt2` row)",
}


def _for_installed_transformers(families: list[Family]) -> tuple[list[Family], dict[str, str]]:
    """``(the families the installed transformers has, {name: why left out})``: a compat run on an older release
    (scripts/compat.sh) leaves out what it does not ship instead of crashing on it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kept = [fam for fam in families if fam.model_type in CONFIG_MAPPING_NAMES]
    absent = {
        fam.name: f"model_type {fam.model_type!r} is not in this transformers release"
        for fam in families
        if fam.model_type not in CONFIG_MAPPING_NAMES
    }
    return kept, absent


FAMILIES, ABSENT = _for_installed_transformers(FAMILIES)


def absent_reason(name: str) -> str | None:
    """Why the installed transformers cannot build ``name`` (a row's name, ``<row>@<variant>``, or a ``model_type``),
    e.g. ``"lfm3: absent in transformers 5.17.0"``; ``None`` where it can. Tests that name families run only these
    (:func:`installed_cases`, :func:`skip_if_absent`): on the release CI runs every family is present
    (``tests/test_family_matrix.py`` checks), so nothing is left out there."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    base = name.split("@")[0]
    model_type = next((f.model_type for f in FAMILIES if f.name == base), base)
    if base in ABSENT or model_type not in CONFIG_MAPPING_NAMES:
        return f"{name}: absent in transformers {transformers.__version__}"
    if name == "qwen4_exp_text@qsa" and "indexed_attention" not in (types := default_config(base).layer_types):
        return (f"{name}: absent in transformers {transformers.__version__} (Qwen4-Exp's sparse layers are "
                f"{sorted(set(types) - {'linear_attention'})} there, an "
                "earlier form every CP method refuses as unrecognised: tests/test_sparse_attention.py)")
    return None


def case_family(case_name: str) -> str:
    """The row (``<row>[@<variant>]``) a launch's case is named for: ``"qwen4_exp_text@qsa/thd/float64"`` ->
    ``"qwen4_exp_text@qsa"``."""
    return case_name.split("/")[0]


def installed_cases(cases: dict[str, dict]) -> dict[str, dict]:
    """The cases of a launch (named ``<row>[@<variant>]/...``) whose row the installed transformers has
    (:func:`absent_reason`): one absent family must not fail the whole launch; its test skips with the reason
    (:func:`skip_if_absent`)."""
    return {name: case for name, case in cases.items() if absent_reason(case_family(name)) is None}


def falcon_refused() -> str | None:
    """Why every CP method refuses Falcon on the installed transformers, or ``None`` where it computes it exactly:
    before 5.25 ``FalconAttention`` computes its scores, mask and SDPA in its own code (docs/compat.md), which no
    method reproduces; 5.25 hands q, k, v to ``AttentionInterface``. Tests that run Falcon under a method expect the
    refusal there instead."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.25"):
        return None
    return f"transformers {transformers.__version__}'s FalconAttention computes its own attention: refused"


def assert_falcon_refused(method: str, config: dict[str, Any] | None = None) -> None:
    """Where :func:`falcon_refused`: ``method`` refuses the ``falcon`` row's tiny model (``config`` set on it, e.g.
    ``{"alibi": True}``) with the reason, naming its own attention code (what a launch that leaves Falcon out on
    that release checks in its place)."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from automodel.distributed.cp import check_model_for_cp, profile_model
    from automodel.errors import CPUnsupportedError

    assert falcon_refused(), "transformers >= 5.25 computes Falcon under every method: run it"
    fam = family_by_name("falcon")
    built = fam.build_config()
    for key, value in (config or {}).items():
        setattr(built, key, value)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built, attn_implementation=fam.attn_implementation())
    with pytest.raises(CPUnsupportedError, match=rf"cp_method={method} does not compute FalconForCausalLM .*"
                                                 r"FalconAttention, which computes its own attention"):
        check_model_for_cp(method, profile_model(model), seq_len=SEQ)


def launched_cases(cases: dict[str, dict]) -> dict[str, dict]:
    """The cases of a layer-kind launch (each with its ``family``) the installed transformers runs: its families
    (:func:`installed_cases`), and Falcon only where the methods compute it (transformers >= 5.25; before,
    :func:`left_out` checks the refusal instead)."""
    return {name: case for name, case in installed_cases(cases).items()
            if case["family"] != "falcon" or not falcon_refused()}  # fmt: skip


def left_out(name: str, case: dict, method: str) -> bool:
    """Skip a case whose family the installed transformers lacks (the reason names the release); for Falcon before
    5.25 (its own attention code) check that ``method`` refuses it, and return True: :func:`launched_cases` left it
    out. False: the launch ran it."""
    skip_if_absent(case_family(name))
    if case["family"] == "falcon" and falcon_refused():
        assert_falcon_refused(method, case.get("config"))
        return True
    return False


def skip_unless_pinned_transformers(what: str) -> None:
    """``pytest.skip`` where the installed transformers is not ``constraints.txt``'s (CI's release, the one
    docs/support_matrix.md and docs/choosing.md are generated on): ``what`` (a generated page) lists the families and
    verdicts of that release, which an older one (5.17: fewer families, Falcon refused) does not reproduce."""
    import pathlib

    import transformers

    pins = (pathlib.Path(__file__).resolve().parents[1] / "constraints.txt").read_text()
    pinned = re.search(r"^transformers==(\S+)$", pins, re.M).group(1)
    if transformers.__version__ != pinned:
        import pytest

        pytest.skip(f"{what} is generated on transformers {pinned} (constraints.txt); the installed "
                    f"{transformers.__version__} has other families and verdicts")


def skip_if_absent(name: str) -> None:
    """``pytest.skip`` with :func:`absent_reason`'s reason where the installed transformers lacks ``name``."""
    why = absent_reason(name)
    if why is not None:
        import pytest

        pytest.skip(why)


def family_by_name(name: str) -> Family:
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise KeyError(name)


def family_or_skip(name: str) -> Family:
    """:func:`family_by_name`, or the calling test skipped where the installed transformers lacks the family (an older
    release in a compat run: :data:`ABSENT`)."""
    if name in ABSENT:
        import pytest

        pytest.skip(f"{name}: {ABSENT[name]}")
    return family_by_name(name)


# ---------------------------------------------------------------------------------------------------------
# the published table (docs/support_matrix.md), rendered from the worker's result

METHODS = ("ring", "ulysses", "thd", "thd_docs")  # the unpacked columns at cp=2 (each method's own-loop API)


def columns() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(columns of the cp=2 launch, columns of the cp=USP_CP launch)``: every method unpacked, then packed for
    every registered method that takes packed rows (read from the registry, :attr:`CPMethod.supports_packed`),
    then ``auto`` (unpacked and packed; the cp=2 launch)."""
    from automodel.distributed.cp import cp_methods

    packers = [name for name, m in cp_methods().items() if m.supports_packed]
    main = METHODS + tuple(m + PACKED for m in packers if m not in CP4_METHODS) + (CP1_PACKED,) + AUTO_COLUMNS
    cp4 = (tuple(CP4_METHODS) + tuple(m + AT_CP4 for m in CP4_REPEATS)
           + tuple(m + PACKED for m in packers if m in CP4_METHODS))  # fmt: skip
    return main, cp4


def column_method(column: str) -> str:
    """The CP method a column runs: its name without `` packed`` and the cp=4 mark (``"ulysses@4"``: ulysses)."""
    return column.removesuffix(PACKED).removesuffix(AT_CP4)


def table_columns() -> tuple[str, ...]:
    """The table's columns in order: unpacked (cp=2, then cp=4), packed, auto."""
    main, cp4 = columns()
    unpacked = [c for c in main + cp4 if not c.endswith(PACKED) and c not in AUTO_COLUMNS]
    packed = [c for c in main + cp4 if c.endswith(PACKED) and c not in AUTO_COLUMNS + (CP1_PACKED,)]
    return tuple(unpacked + packed) + (CP1_PACKED,) + AUTO_COLUMNS


DOC_PATH = "docs/support_matrix.md"
REGENERATE = "PYTHONPATH=. python scripts/support_table.py"
TABLE_START, TABLE_END = "<!-- matrix:start -->", "<!-- matrix:end -->"
KIND_LEGEND = {
    "full": "dense causal attention",
    "sliding": "sliding-window attention (window 16)",
    "chunked": "chunked attention (chunks of 16)",
    "nope": "layers without RoPE",
    "softcap": "attention logit soft-capping",
    "sinks": "attention sinks",
    "mla": "multi-head latent attention (V head dim != QK head dim)",
    "dsa": "sparse attention chosen by an indexer (DeepSeek sparse attention)",
    "hca": "a sliding window with sinks plus heavily compressed KV entries (DeepSeek-V4: each pools a block of tokens)",
    "csa": "a sliding window with sinks plus compressed KV entries chosen by an indexer (DeepSeek-V4)",
    "differential": "differential attention",
    "dynamic-mask": "dynamic mask attention (Doge)",
    "moe": "mixture-of-experts MLPs (a layer of its own where the pattern names it: Nemotron-H's `moe`)",
    "mlp": "layers without a token mixer (an MLP block alone: Nemotron-H's `mlp`)",
    "alibi": "ALiBi position bias",
    "abspos": "learned absolute positions",
    "linear": "linear-attention mixers (Gated DeltaNet, lightning attention, ...)",
    "mamba": "Mamba / Mamba-2 state-space mixers",
    "conv": "short-convolution mixers",
    "rglru": "RG-LRU recurrent blocks",
    "rwkv": "RWKV time mixing",
    "xlstm": "mLSTM blocks",
    "cca": "compressed convolutional attention (ZAYA: q and k mixed by a causal convolution, v by a delayed state)",
    "relpos": "a learned relative-position bias in the attention logits (CPM-Ant, Inkling)",
}


def _md(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


_REFUSAL_HEAD = re.compile(r"^distributed\.cp_method=\S+ does not compute \S+ \(model_type=\S+\) exactly: ")
_REFUSAL_TAIL = re.compile(r"\. It would train with losses and gradients that differ.*$")


def short_reason(message: str, limit: int = 110) -> str:
    """The reason of a refusal message (without the method/model preamble and the advice), cut at a word
    boundary."""
    text = _REFUSAL_TAIL.sub("", _REFUSAL_HEAD.sub("", _md(message)))
    if len(text) <= limit:
        return text
    return text[: text.rfind(" ", 0, limit)].rstrip(",;:") + " ..."


def cell_text(cell: dict) -> str:
    if "picked" in cell:  # an auto column: the method it picked, and that method's outcome
        return f"{cell['picked']}: {cell_text({k: v for k, v in cell.items() if k != 'picked'})}"
    status = cell["status"]
    if status == "exact":
        return "exact" + (f" ({cell['path']})" if cell.get("path") else "")
    if status == "refused":
        return f"refused: {short_reason(cell['detail'])}"
    if status == "crash":
        head = cell["detail"].split(":", 1)[0] if not cell["detail"].startswith("ranks disagree") else "ranks disagree"
        return f"**crash** ({_md(head)})"
    return f"**{status}**"


def column_title(column: str) -> str:
    """A column's header: the method, ``packed`` for packed rows, and the CP size where it is not :data:`CP`."""
    method = column[: -len(PACKED)] if column.endswith(PACKED) else column
    if method.endswith(AT_CP4):
        return method.removesuffix(AT_CP4) + f" (cp={USP_CP})"
    return column + (f" (cp={USP_CP})" if method in CP4_METHODS else "")


def render_table(result: dict) -> str:
    """The family x method table, exactly as the docs hold it between the markers."""
    cols = result["methods"]
    lines = ["| family | model_type | layer kinds | attn | " + " | ".join(map(column_title, cols)) + " |",
             "|---|---|---|---|" + "---|" * len(cols)]
    for name, cells in result["cells"].items():
        meta = result["meta"][name]
        attn = meta["attn"] + ("" if meta.get("train_mode", True) else ", eval mode")
        row = [f"`{name}`", f"`{meta['model_type']}`", meta["kinds"], attn]
        row += [cell_text(cells[m]) for m in cols]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def column_counts(result: dict) -> dict[str, dict[str, int]]:
    """Per column: how many cells are exact, refused, wrong, crash."""
    out = {c: {s: 0 for s in ("exact", "refused", "wrong", "crash")} for c in result["methods"]}
    for cells in result["cells"].values():
        for column, cell in cells.items():
            out[column][cell["status"]] = out[column].get(cell["status"], 0) + 1
    return out


def table_section(markdown: str) -> str:
    """What lies between the table markers of a rendered document."""
    start, end = markdown.index(TABLE_START) + len(TABLE_START), markdown.index(TABLE_END)
    return markdown[start:end].strip()


def failures(result: dict) -> list[tuple[str, str, dict]]:
    """Every (family, method, cell) that is neither exact nor refused."""
    return [(f, m, c) for f, cells in result["cells"].items() for m, c in cells.items()
            if c["status"] not in ("exact", "refused")]


def render_markdown(result: dict) -> str:
    counts: dict[str, int] = {}
    for cells in result["cells"].values():
        for column, cell in cells.items():
            if column not in AUTO_COLUMNS:  # an auto cell repeats the column it picked
                counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in ("exact", "refused", "wrong", "crash"))
    statuses = ("exact", "refused", "wrong", "crash")
    per_column = ["| column | " + " | ".join(statuses) + " |", "|---|" + "---|" * len(statuses)]
    per_column += [f"| {column_title(c)} | " + " | ".join(str(n[s]) for s in statuses) + " |"
                   for c, n in column_counts(result).items()]  # fmt: skip
    picks: dict[str, dict[str, int]] = {c: {} for c in AUTO_COLUMNS if c in result["methods"]}
    for cells in result["cells"].values():
        for column, counts in picks.items():
            key = cells[column].get("picked", "refused")
            counts[key] = counts.get(key, 0) + 1
    n_families = len({result["meta"][name]["model_type"] for name in result["cells"]})
    out = [
        "# CP support matrix: model families x CP methods",
        "",
        f"Generated by `scripts/support_table.py`; do not edit by hand. Regenerate with `{REGENERATE}`",
        "(one launch of 4 processes, about 7 minutes on 2 busy CPU cores; it rewrites this file and exits 1 when a",
        "cell is wrong or crashes; `--json` keeps the raw result and `--families ... --merge` reruns only those rows).",
        "`tests/test_family_matrix.py` runs every layer kind's families in CI and, under `-m slow`, the same matrix "
        "with the check that the table below is current.",
        "",
        f"Each family of the installed transformers ({n_families} families, {len(result['cells'])} rows) is built "
        "from transformers' default",
        "config for it (`AutoConfig.for_model`), scaled down in sizes only (fp32, hidden size 64, 4 query / 2 KV",
        f"heads of 16 where the family has those knobs, vocab {VOCAB}, windows and attention chunks of {WINDOW} "
        "tokens) and keeping",
        "the default layer pattern: every layer kind of its `layer_types`, in order, cycled to the fewest layers",
        "that hold them all. A row `<family>@flagship` adds the layer pattern of the released flagship checkpoint",
        "where the default's differs (named in the notes below). Each runs with the attention implementation",
        "it trains with (`sdpa` where the model supports it, else transformers' default). One row of",
        f"{SEQ} tokens trains one step at cp={CP} (pairs of gloo processes on CPU) with each CP method's own-loop API",
        "([own_loop.md](own_loop.md), [ulysses.md](ulysses.md), [thd.md](thd.md); `thd_docs` splits the",
        f"row's one document over both ranks; usp at cp={USP_CP} = ulysses_size 2 x ring 2 on 4 processes, through",
        f"`context_parallel`; Ulysses again at cp={USP_CP}, where each rank holds one of 4 query heads and a copy of",
        "one of 2 KV heads), and the loss and gradients are compared with the same step in one process. The",
        f"*packed* columns train the same row as three documents ({' + '.join(map(str, DOC_LENGTHS))} tokens, "
        "`seq_lens`, through",
        "`context_parallel`) under every method that takes packed rows, against each document run alone in one",
        f"process. The *{CP1_PACKED}* column trains that packed row at `distributed.cp_size=1` through the recipe's",
        "path (`bind_cp_method` at cp_size 1 with packed rows, `run_micro_batch`) against each document alone: the",
        "model's own forward where a probe shows it keeps the documents apart (*own forward*), else the named",
        "method's document-aware attention on the one rank, or packing refused (docs/own_loop.md).",
        "The *auto* columns name the method `cp_method: auto` picks for the model",
        f"(`choose_cp_method` at cp={CP}, rows of {SEQ} tokens, unpacked / packed) and repeat that method's cell;",
        "an auto cell is **wrong** when it picks a method that is not exact, or refuses, while another column of",
        "the same rows is exact. A cell is:",
        "",
        "- **exact**: loss relative error <= 1e-5 and, for every parameter, max abs gradient difference / max abs",
        "  reference gradient <= 1e-4 (the denominator floored at 1e-3 x the model's largest gradient entry, for",
        "  gradients that are zero in exact arithmetic), and every parameter with a reference gradient has one;",
        "- **refused**: the method raised `automodel.errors.UserInputError` (the start of its message is shown);",
        "- **wrong**: it ran and computed different numbers, the silent failure the library must never allow;",
        "- **crash**: any other exception (its type is shown; the details are below the table).",
        "",
        f"Result: {summary} (the auto columns not counted: they repeat the cell they picked).",
        "",
        *per_column,
        "",
        "`auto` picked: " + "; ".join(f"{column}: " + ", ".join(f"{k} {n}" for k, n in sorted(
            counts.items(), key=lambda kv: (kv[0] == "refused", -kv[1]))) for column, counts in picks.items()) + ".",
        "",
        TABLE_START,
        render_table(result),
        TABLE_END,
        "",
        "Layer kinds: " + "; ".join(f"`{k}` {v}" for k, v in KIND_LEGEND.items()) + ".",
    ]
    notes = [(n, m["note"]) for n, m in result["meta"].items() if m.get("note")]
    if notes:
        out += ["", "Notes: " + "; ".join(f"`{n}`: {_md(t)}" for n, t in notes) + "."]
    bad = failures(result)
    if bad:
        out += ["", "## Cells that are wrong or crash", "",
                "| family | method | status | detail |", "|---|---|---|---|"]
        out += [f"| `{f}` | {m} | {c['status']} | {_md(c['detail'])} |" for f, m, c in bad]
    out += ["", "## Families not in the matrix", ""]
    if UNBUILDABLE:
        out += ["| family | why |", "|---|---|"] + [f"| `{n}` | {_md(r)} |" for n, r in UNBUILDABLE.items()]
    else:
        out += ["None: every family tried builds from a tiny config and runs its forward and backward on CPU at cp=1."]
    out += ["", "Every other `model_type` of transformers' causal-LM mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) is",
            "not a decoder-only text LM and is out of scope (`tests/family_matrix.py` `OUT_OF_SCOPE`;",
            "`tests/test_family_matrix.py` checks that every type of the installed release is a row, here or there):",
            ""]
    by_reason: dict[str, list[str]] = {}
    for model_type, reason in OUT_OF_SCOPE.items():
        by_reason.setdefault(reason, []).append(model_type)
    out += [f"- {_md(reason)}: " + ", ".join(f"`{t}`" for t in types) + "." for reason, types in by_reason.items()]
    return "\n".join(out) + "\n"
