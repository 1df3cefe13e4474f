"""The model profile and the exactness check of automodel.distributed.cp, without processes.

The family matrix (tests/test_family_matrix.py) proves each verdict against one process; this module
pins what the profile reads from a model and what the refusal says.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.distributed.cp import (
    check_model_config_for_cp,
    check_model_for_cp,
    cp_methods,
    get_cp_method,
    methods_that_run,
    profile_model,
    register_cp_method,
    unregister_cp_method,
)
from automodel.distributed.cp.profile import CHUNKED, FULL, LINEAR, SLIDING, UNKNOWN
from automodel.errors import CPUnsupportedError, UserInputError

SMALL = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def _meta(model_type: str, attn_implementation: str | None = None, **kw):
    config = AutoConfig.for_model(model_type, **(SMALL | kw))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)


def _gemma2(**kw):
    """Gemma 2 as the recipe builds it on every transformers release: eager (its logit softcapping has no SDPA
    path; transformers 5.25 defaults to eager, 5.17 to an SDPA that drops the cap, which the recipe refuses)."""
    return _meta("gemma2", attn_implementation="eager", sliding_window=16, head_dim=16, **kw)


def _doge(**kw):
    """Doge as the recipe builds it: sdpa where transformers masks its attention causally (5.25), eager where its SDPA
    skips the causal mask (5.17 .. 5.24: the recipe refuses sdpa there; torch_internals.sdpa_problem)."""
    from tests.family_matrix import family_by_name

    return _meta("doge", attn_implementation=family_by_name("doge").attn_implementation(), **kw)


def test_profile_reads_each_layer_kind_from_the_modules():
    gemma2 = profile_model(_gemma2(num_hidden_layers=4))
    assert [layer.kind for layer in gemma2.layers] == [SLIDING, FULL, SLIDING, FULL]
    assert gemma2.layers[0].window == 16 and gemma2.layers[1].window is None
    assert all(layer.softcap == 50.0 for layer in gemma2.layers) and gemma2.attn_implementation == "eager"

    oss = profile_model(_meta("gpt_oss", num_hidden_layers=2, sliding_window=16, head_dim=16, num_local_experts=4))
    assert all(layer.sinks for layer in oss.layers)

    llama4 = profile_model(_meta("llama4_text", num_hidden_layers=4, attention_chunk_size=16, head_dim=16))
    assert [layer.kind for layer in llama4.layers] == [CHUNKED, CHUNKED, CHUNKED, FULL]
    assert llama4.layers[3].position_scaled and not llama4.layers[3].rope  # NoPE + attention temperature

    nxt = profile_model(_meta("qwen3_next", num_hidden_layers=4, head_dim=16))
    assert [layer.kind for layer in nxt.layers] == [LINEAR, LINEAR, LINEAR, FULL]
    assert "GatedDeltaNet" in nxt.layers[0].mixer

    # a Mamba-1 block holds its RMS norm before the mixer: the profile names the mixer, not the norm
    for model_type, mixer in (("mamba", "MambaMixer"), ("falcon_mamba", "FalconMambaMixer")):
        ssm = profile_model(_meta(model_type, num_hidden_layers=2, state_size=4, expand=2))
        assert [(layer.kind, layer.mixer) for layer in ssm.layers] == [(LINEAR, mixer)] * 2, model_type

    mla = profile_model(_meta("deepseek_v3", num_hidden_layers=1, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=16, kv_lora_rank=16, q_lora_rank=16))  # fmt: skip
    assert mla.layers[0].mla and (mla.layers[0].qk_head_dim, mla.layers[0].v_head_dim) == (24, 16)


def test_profile_from_a_config_alone_and_an_unrecognised_stack():
    from transformers import MistralConfig

    config = MistralConfig(num_hidden_layers=2, sliding_window=32, **SMALL)
    profile = profile_model(config)
    assert not profile.from_modules and profile.architecture == "MistralForCausalLM"
    assert [layer.kind for layer in profile.layers] == [SLIDING, SLIDING]

    class Opaque(torch.nn.Module):  # a model whose decoder stack the profile cannot find
        def __init__(self):
            super().__init__()
            self.config = config

    opaque = profile_model(Opaque())
    assert {layer.kind for layer in opaque.layers} == {UNKNOWN}  # nothing is assumed exact
    assert methods_that_run(opaque, 64) == []


def test_refusal_names_the_kind_the_layers_the_method_and_what_would_run():
    rwkv = profile_model(_meta("rwkv", num_hidden_layers=3))
    check_model_for_cp("ring", rwkv, seq_len=64)  # RwkvSelfAttention has a kernel (cp/layers/rwkv.py)
    # the same layers with a mixer class no kernel computes (a retention layer, say)
    profile = dataclasses.replace(rwkv, layers=tuple(dataclasses.replace(layer, mixer="RetNetRetention")
                                                     for layer in rwkv.layers))
    with pytest.raises(CPUnsupportedError) as err:
        check_model_for_cp("ring", profile, seq_len=64)
    msg = str(err.value)
    assert msg.startswith("distributed.cp_method=ring does not compute RwkvForCausalLM (model_type=rwkv)")
    assert "layers 0-2: a linear-attention / state-space mixer (" in msg and "carries a state along" in msg
    assert "no CP method runs this model exactly yet: train it with distributed.cp_size=1" in msg
    check_model_for_cp("ring", profile_model(_meta("qwen3_next", num_hidden_layers=4, head_dim=16)), seq_len=64)
    assert isinstance(err.value, UserInputError)  # the recipe prints it as one error: line

    gemma2 = profile_model(_gemma2(num_hidden_layers=2))
    check_model_for_cp("ring", gemma2, seq_len=64)  # eager: ring routes it, the halo kernel applies the cap
    assert {"ring", "ulysses", "thd", "thd_docs", "usp"} <= set(methods_that_run(gemma2, 64))
    mistral = profile_model(_meta("mistral", num_hidden_layers=2, sliding_window=16))
    check_model_for_cp("thd", mistral, seq_len=64)  # windows shorter than the row: the halo kernel
    check_model_for_cp("thd_docs", mistral, seq_len=64)  # the halo kernel among a split document's ranks
    assert {"ring", "ulysses", "thd", "thd_docs", "usp"} <= set(methods_that_run(mistral, 64))


def test_heads_and_vlm_checks_read_the_profile():
    llama = profile_model(_meta("llama", num_hidden_layers=1))
    with pytest.raises(UserInputError, match="num_attention_heads=4, which is not divisible by distributed.cp_size=3"):
        check_model_config_for_cp("ulysses", llama, 3)
    assert check_model_config_for_cp("ring", llama, 3, seq_len=96) is llama
    assert check_model_config_for_cp("ulysses", llama, 1) is None  # no CP: nothing to check


def test_a_registered_method_is_selectable_and_listed():
    from automodel.distributed.cp import CPMethod
    from automodel.distributed.cp.method import standard_problem

    class Everything(CPMethod):
        name = "test_everything"

        def layer_problem(self, layer, seq_len):
            return standard_problem(self.name, layer, seq_len, windows=True, chunks=True, sinks=True,
                                    softcap=True, mla=True)  # fmt: skip

    register_cp_method(Everything())
    try:
        assert get_cp_method("test_everything").name in cp_methods()
        with pytest.raises(ValueError, match="already registered"):
            register_cp_method(Everything())
        mistral = profile_model(_meta("mistral", num_hidden_layers=1, sliding_window=16))
        runs = methods_that_run(mistral, 64)
        assert runs[-1] == "test_everything" and {"ring", "ulysses", "thd", "thd_docs", "usp"} <= set(runs)
    finally:
        unregister_cp_method("test_everything")
    assert "test_everything" not in cp_methods()


def test_profile_holds_what_the_memory_tp_lora_and_vlm_checks_read():
    from transformers import LlamaConfig

    llama = profile_model(LlamaConfig(hidden_size=64, intermediate_size=96, vocab_size=80, num_hidden_layers=3,
                                      num_attention_heads=4, tie_word_embeddings=True))
    assert (llama.hidden_size, llama.intermediate_size, llama.vocab_size, llama.num_hidden_layers) == (64, 96, 80, 3)
    assert llama.text_model_type == "llama" and llama.tie_word_embeddings
    assert dict(llama.base_model_tp_plan)["layers.*.self_attn.o_proj"] == "rowwise"
    assert llama.image_token_id is None and llama.spatial_merge_size is None
    vl = profile_model(AutoConfig.for_model("qwen2_vl"))  # the text sizes come from the text config
    assert vl.model_type == "qwen2_vl" and vl.text_model_type == "qwen2_vl_text" and vl.is_vlm
    assert vl.hidden_size == AutoConfig.for_model("qwen2_vl").get_text_config().hidden_size
    assert vl.image_token_id == 151655 and vl.spatial_merge_size == 2


def test_profile_line_counts_the_layer_kinds_in_order_and_names_the_heads():
    from automodel.distributed.cp.profile import profile_line

    llama = profile_line(profile_model(_meta("llama", num_hidden_layers=4, head_dim=16)))
    assert llama == (
        "model profile: LlamaForCausalLM (llama), 4 layers: full attention x4; 4 heads, 2 kv heads of 16; "
        "attn_implementation=sdpa"
    )
    gemma2 = profile_line(profile_model(_gemma2(num_hidden_layers=4)))
    assert "4 layers: sliding window 16 x2, full attention x2; logit softcapping;" in gemma2
    assert gemma2.endswith("attn_implementation=eager")
    nxt = profile_line(profile_model(_meta("qwen3_next", num_hidden_layers=4, head_dim=16)))
    assert "4 layers: Qwen3NextGatedDeltaNet x3, full attention x1; 4 heads, 2 kv heads of 16" in nxt
    oss = profile_line(profile_model(_meta("gpt_oss", num_hidden_layers=2, sliding_window=16, head_dim=16,
                                           num_local_experts=4)))  # fmt: skip
    assert "2 layers: sliding window 16 x1, full attention x1; attention sinks;" in oss
    mla = profile_line(profile_model(_meta("deepseek_v3", num_hidden_layers=1, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                           v_head_dim=16, kv_lora_rank=16, q_lora_rank=16)))  # fmt: skip
    assert "1 layers: full attention x1; MLA;" in mla
    mamba = profile_line(profile_model(_meta("mamba", num_hidden_layers=2, state_size=4, expand=2)))
    assert "2 layers: MambaMixer x2; no attention heads;" in mamba
    doge = profile_line(profile_model(_doge(num_hidden_layers=2, head_dim=16)))
    assert "2 layers: dynamic mask attention (Doge) x2;" in doge
    doge_moe = profile_line(profile_model(_doge(num_hidden_layers=2, head_dim=16, is_moe=True, num_experts=16)))
    assert "2 layers: DogeCDMoE (no CP kernel) x2;" in doge_moe


# ------------------------------------------------------------------ layers without a token mixer (issue 36)


def _nemotron_h():
    """transformers' default Nemotron-H config (pattern M E * -) scaled down in sizes, on the meta device."""
    from tests.family_matrix import family_by_name

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_by_name("nemotron_h").build_config())


def test_nemotron_h_mlp_and_moe_layers_have_no_token_mixer_and_every_method_runs_them():
    from automodel.distributed.cp import choose_cp_method
    from automodel.distributed.cp.profile import MLP_ONLY, profile_line

    assert AutoConfig.for_model("nemotron_h").layers_block_type == ["linear_attention", "moe", "full_attention", "mlp"]
    model = _nemotron_h()
    profile = profile_model(model)
    assert [(layer.kind, layer.mixer) for layer in profile.layers] == [
        (LINEAR, "NemotronHMamba2Mixer"), (MLP_ONLY, "NemotronHMoE"), (FULL, ""), (MLP_ONLY, "NemotronHMLP"),
    ]  # fmt: skip
    from_config = profile_model(model.config)  # the config alone names the same kinds
    assert [layer.kind for layer in from_config.layers] == [LINEAR, MLP_ONLY, FULL, MLP_ONLY]
    line = profile_line(profile)  # what the dry run prints
    assert "4 layers: NemotronHMamba2Mixer x1, NemotronHMoE (no token mixer) x1, full attention x1, " \
           "NemotronHMLP (no token mixer) x1;" in line, line  # fmt: skip
    assert profile.layers[1].describe() == "no token mixer (NemotronHMoE)"
    assert {"ulysses", "thd_docs"} <= set(methods_that_run(profile, 64))
    for packed in (False, True):
        choice = choose_cp_method(profile, 2, seq_len=64, packed=packed)
        check_model_for_cp(choice.method, profile, seq_len=64)
        assert choice.reason.startswith(f"cp_method auto: {choice.name}")


class _ShiftMLP(torch.nn.Module):
    """Named like an MLP, but its forward mixes each token with the one before it."""

    def __init__(self, hidden: int):
        super().__init__()
        self.up_proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.up_proj(torch.roll(x, 1, dims=1))


class _TokenMixer(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.proj(x.cumsum(1))


@pytest.mark.parametrize(
    ("block", "named"),
    [(_ShiftMLP, "_ShiftMLP at model.layers.3.mixer"), (_TokenMixer, "_TokenMixer at model.layers.3.mixer"),
     (lambda h: torch.nn.Conv1d(h, h, 3, padding=2), "Conv1d at model.layers.3.mixer")],
)  # fmt: skip
def test_a_block_the_config_calls_mlp_must_prove_it_mixes_no_tokens(block, named):
    """The rule is structural: a layer the config calls ``mlp`` whose modules are not all token-local (an
    MLP-named class that rolls the sequence, an unknown class, a convolution) is unknown, and every method's
    refusal names its class, its module path and how to report it."""
    from automodel.distributed.cp.profile import REPORT_HINT

    model = _nemotron_h()
    with torch.device("meta"):
        model.model.layers[3].mixer = block(model.config.hidden_size)
    profile = profile_model(model)
    layer = profile.layers[3]
    assert layer.kind == UNKNOWN and f"{layer.mixer.split(',')[0]} at {layer.module_path}" == named, layer
    assert [spec.kind for spec in profile.layers[:3]] == [LINEAR, "mlp_only", FULL]
    assert methods_that_run(profile, 64) == []
    for method in ("ulysses", "thd_docs", "ring"):
        with pytest.raises(CPUnsupportedError) as err:
            check_model_for_cp(method, profile, seq_len=64)
        msg = str(err.value)
        assert f"layer 3: an unrecognised token mixer ({named.split(' at ')[0]}, in a layer the config calls " \
               f"'mlp'" in msg and "at model.layers.<i>.mixer)" in msg, msg  # fmt: skip
        assert REPORT_HINT in msg and "transformers version" in msg


def test_a_known_token_mixing_block_names_its_module_path():
    doge = profile_model(_doge(num_hidden_layers=2, head_dim=16, is_moe=True, num_experts=16))
    assert [layer.module_path for layer in doge.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    # one reason for the stack (the index as <i>), so that a 60-layer model's refusal is one line
    with pytest.raises(CPUnsupportedError, match=r"layers 0-1: DogeCDMoE: Doge's cross-domain mixture of experts .* "
                                                 r"\(at model\.layers\.<i>\.mlp\) is not exact under ulysses: a "
                                                 r"token's expert choice depends on tokens elsewhere"):
        check_model_for_cp("ulysses", doge, seq_len=64)


def test_doge_dynamic_mask_attention_is_sparse_attention_every_method_runs():
    """Doge (issue 43): its attention is the kind ``sparse_attention`` (K and V gathered, cp/layers/dynamic_mask.py)
    from the model and from its config alone, and every built-in method runs it."""
    from tests.family_matrix import family_by_name

    fam = family_by_name("doge")
    config = fam.build_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation())
    for profile in (profile_model(model), profile_model(model.config)):
        assert all(layer.kind == "sparse_attention" and layer.mixer == "DogeAttention" for layer in profile.layers)
        assert profile.layers[0].sparse_widths == (2 * 2 * 16, 0)  # K and V: 2 KV heads of 16
        assert sorted(methods_that_run(profile, 64)) == sorted(cp_methods())


def test_doge_sdpa_is_refused_exactly_where_transformers_leaves_it_unmasked():
    """transformers 5.17 .. 5.24's Doge skips its causal mask under SDPA: one process then lets a token see later
    tokens of its row (measured here: a change of the last token moves earlier logits). Where that happens, SDPA is
    refused by the recipe at any cp size and by every CP method, naming eager; where the logits are causal (5.25, and
    eager everywhere), nothing is refused."""
    from automodel.distributed.torch_internals import doge_skips_causal_mask, sdpa_problem
    from automodel.models.loader import check_attn_supported
    from tests.family_matrix import family_by_name

    config = family_by_name("doge").build_config()
    leaks = {}
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).double().eval()
        for module in model.modules():
            if type(module).__name__ == "DogeAttention":  # A = 0 at init: every bias 1, which hides the leak
                module.A.data = torch.randn(module.A.shape, dtype=torch.float64)
        x = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
        y = x.clone()
        y[0, -1] = 3 if x[0, -1] != 3 else 4
        with torch.no_grad():
            a, b = (model(input_ids=ids, use_cache=False).logits[0, :-1] for ids in (x, y))
        leaks[attn] = float((a - b).abs().max()) > 1e-6
    assert not leaks["eager"]
    assert doge_skips_causal_mask() == leaks["sdpa"]
    cls = type(model)
    if not leaks["sdpa"]:  # transformers >= 5.25
        assert sdpa_problem(cls, config) is None and family_by_name("doge").attn_implementation() == "sdpa"
        check_attn_supported(config, "sdpa")
        return
    assert "skips its causal mask under SDPA" in sdpa_problem(cls, config)
    assert family_by_name("doge").attn_implementation() == "eager"
    with pytest.raises(UserInputError, match=r"DogeForCausalLM cannot run attn_implementation='sdpa'; set "
                       r"model\.attn_implementation=eager: transformers .*'s Doge skips its causal mask"):  # fmt: skip
        check_attn_supported(config, "sdpa")  # no CP (cp_size 1) as well
    with torch.device("meta"):
        profile = profile_model(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"))
    assert methods_that_run(profile, 64) == []
    for method in cp_methods():
        with pytest.raises(CPUnsupportedError, match=r"DogeAttention with attn_implementation=sdpa on transformers .*"
                                                     r"use attn_implementation=eager"):
            check_model_for_cp(method, profile, seq_len=64)


#: issue 43: attention layers whose computation is known and which no CP method computes yet, each refused by every
#: method with what it computes and why no method does (not the request to report an unrecognised layer)
KNOWN_GAPS = {  # Doge's attention is exact (dynamic_mask.py); its cross-domain MoE (is_moe=True) mixes tokens
    "doge_moe": ("DogeCDMoE: Doge's cross-domain mixture of experts", "a token's expert choice depends on tokens"),
    # CPM-Ant: non-causal attention over the whole row (a later token changes earlier logits), its prompt prefix
    "cpmant": ("CPM-Ant's attention (CpmAntAttention): every token sees every token of its row",
               "CP methods compute causal attention"),
    "inkling_text": ("InklingAttention: attention whose keys and values are first mixed by short causal convolutions",
                     "no method's attention applies the relative-position bias"),
}


@pytest.mark.parametrize("name", list(KNOWN_GAPS))
def test_known_attention_without_a_cp_kernel_is_refused_by_every_method_with_its_reason(name):
    from automodel.distributed.cp.profile import REPORT_HINT
    from tests.family_matrix import family_by_name

    what, why = KNOWN_GAPS[name]
    fam = family_by_name(name.removesuffix("_alibi").removesuffix("_moe"))
    config = fam.build_config()
    if name == "falcon_alibi":
        config.alibi = True
    if name == "doge_moe":
        config.is_moe, config.num_experts = True, 16
    with torch.device("meta"):  # the attention the recipe builds (Doge: eager where its SDPA is unmasked, refused)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation())
    for profile in (profile_model(model), profile_model(model.config)):  # the model, and its config alone (before loading)
        assert all(layer.kind == UNKNOWN and layer.known_gap for layer in profile.layers), profile.layers
        assert methods_that_run(profile, 64) == []
        for method in cp_methods():
            with pytest.raises(CPUnsupportedError) as err:
                check_model_for_cp(method, profile, seq_len=64)
            message = str(err.value)
            assert what in message and why in message and f"is not exact under {method}:" in message, message
            assert REPORT_HINT not in message and "unrecognised" not in message, message


def test_dry_run_of_nemotron_h_with_auto_names_the_layers_without_a_token_mixer(tmp_path):
    """``cp_method: auto`` on transformers' default Nemotron-H pattern picks a method, and the dry run's profile
    line names the MoE and MLP layers as layers without a token mixer."""
    import yaml

    from automodel.config import load_config
    from automodel.training.dry_run import dry_run_report

    model = {"_target_": "transformers.NemotronHConfig", "vocab_size": 1024, "hidden_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
             "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16,
             "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "moe_shared_expert_intermediate_size": 64}  # fmt: skip (no layers_block_type: the default M E * -)
    child = tmp_path / "nemotron_h.yaml"
    child.write_text(yaml.safe_dump({"defaults": ["cp", "_self_"], "model": {"config": model},
                                     "distributed": {"cp_method": "auto"}}))  # fmt: skip
    report = dry_run_report(load_config(["--config", str(child), "recipe.dry_run=true"], world_size=2))
    line = next(ln for ln in report.splitlines() if "model profile: NemotronHForCausalLM" in ln)
    assert "4 layers: NemotronHMamba2Mixer x1, NemotronHMoE (no token mixer) x1, full attention x1, " \
           "NemotronHMLP (no token mixer) x1;" in line, line  # fmt: skip
    import re

    picked = re.search(r"; exact under cp_method (\w+)$", line)
    assert picked and picked.group(1) in cp_methods(), line  # auto resolved to a method that computes it
    assert f"cp_method auto: {picked.group(1)}" in report


def _falcon(**kw):
    from transformers import FalconConfig

    config = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **kw)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def test_falcon_runs_where_it_dispatches_its_attention_alibi_too():
    # transformers >= 5.25's FalconAttention calls the AttentionInterface (5.17's computes its own): RoPE Falcon
    # is then full causal attention; with ALiBi the bias rides in the mask transformers builds, which a CP method's
    # attention replaces, so cp/layers/alibi.py makes the layer hand q, k, v and its bf16 slopes to the method (every
    # built-in one applies them); on 5.17 every method refuses both, naming the bias from the config alone
    from transformers.models.falcon.modeling_falcon import FalconAttention

    from automodel.distributed.cp.method import standard_problem
    from automodel.distributed.cp.profile import _dispatches_attention

    dispatches = _dispatches_attention(FalconAttention)
    for kw, kv in ((dict(), 1), (dict(new_decoder_architecture=True, num_kv_heads=2), 2), (dict(multi_query=False), 4)):
        rope = profile_model(_falcon(**kw))
        assert not dispatches or rope.num_key_value_heads == kv, kw  # 5.17's config has no num_key_value_heads
        assert [layer.kind for layer in rope.layers] == [FULL if dispatches else UNKNOWN] * 2, kw
        assert not any(layer.alibi or layer.own_code for layer in rope.layers), kw
        assert (set(methods_that_run(rope, 64)) >= {"ring", "ulysses", "thd", "thd_docs", "usp"}) == dispatches
    alibi = _falcon(alibi=True)
    for profile in (profile_model(alibi), profile_model(alibi.config)):
        if dispatches:
            assert all(layer.kind == FULL and layer.alibi and layer.own_code for layer in profile.layers)
            assert set(methods_that_run(profile, 64)) == set(cp_methods())
            assert set(methods_that_run(profile, 64, packed=True)) == set(cp_methods()) - {"ring"}
            assert standard_problem("mine", profile.layers[0], 64).startswith("ALiBi (each score of head h")
            continue
        assert [layer.kind for layer in profile.layers] == [UNKNOWN] * 2
        assert methods_that_run(profile, 64) == []
        for method in cp_methods():
            with pytest.raises(CPUnsupportedError) as err:
                check_model_for_cp(method, profile, seq_len=64)
            if not profile.from_modules:
                assert "ALiBi position bias in its attention mask (config.alibi=True)" in str(err.value), method
            else:
                assert "computes its own attention" in str(err.value), method


def test_falcon_alibi_bias_is_transformers_bf16_bias():
    """Falcon's bias as the CP kernels compute it (``key_bias`` with the divisor) equals what transformers folds into
    the mask: bf16(bf16(slope) * j) / sqrt(d), 16 heads (slopes 2^(-k/2): not exact in bf16) and positions past 256
    (where bf16 rounds the product); without the bf16 rounding it differs."""
    import math

    from transformers import FalconConfig
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    from automodel.distributed.cp.layers.alibi import alibi_slopes, key_bias

    config = FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=16, alibi=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    layer = next(m for m in model.modules() if type(m).__name__ == "FalconAttention")
    slopes = alibi_slopes(layer, torch.device("cpu"))
    positions = torch.arange(600)[None]
    for dtype in (torch.float32, torch.float64):
        want = build_alibi_tensor(torch.ones(1, 600, dtype=torch.long), 16, dtype).view(1, 16, 600) / math.sqrt(4)
        assert torch.equal(key_bias(slopes, positions, dtype, math.sqrt(4)), want)
        assert not torch.equal(key_bias(slopes, positions, dtype) / math.sqrt(4), want)


def test_own_loop_refuses_a_softcapping_model_that_runs_sdpa():
    """transformers 5.17 lets Gemma 2 run SDPA without its logit cap; CP methods apply the cap, so ``context_parallel``
    refuses it before the mesh is read (5.25 refuses SDPA for the class itself; the switch is made by hand here)."""
    from automodel.distributed.cp import context_parallel

    model = _gemma2(num_hidden_layers=2)
    model.config._attn_implementation = "sdpa"  # what 5.17's default picks
    with pytest.raises(UserInputError, match=r"Gemma2ForCausalLM soft-caps its attention logits "
                       r"\(attn_logit_softcapping=50\.0\) but runs attn_implementation='sdpa'.*attn_implementation='eager'"):  # fmt: skip
        context_parallel(model, None, "ring")


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_alibi_layers_run_under_every_method(name):
    """BLOOM's and MPT's ALiBi layers (their own attention code, made to dispatch: cp/layers/alibi.py) are full
    causal attention with ALiBi, which every built-in method applies (ulysses: its rank's head slopes over whole
    rows; ring, thd, thd_docs, usp: the halo kernel with the bias of each key's in-document position), from the
    model and from its config alone; a method that does not say it applies ALiBi refuses them with the reason."""
    from automodel.distributed.cp.method import standard_problem
    from tests.family_matrix import family_by_name

    config = family_by_name(name).build_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for profile in (profile_model(model), profile_model(config)):
        assert all(layer.kind == FULL and layer.alibi for layer in profile.layers), profile.layers
        assert set(methods_that_run(profile, 64)) == set(cp_methods())
        assert set(methods_that_run(profile, 64, packed=True)) == set(cp_methods()) - {"ring"}  # ring: one document
        reason = standard_problem("mine", profile.layers[0], 64)
        assert reason.startswith("ALiBi (each score of head h gets slope_h * (j - i)") and "which mine does" in reason


def test_gpt_neo_layers_run_under_every_method():
    """GPT-Neo's global and local layers (masks in its own code, made to dispatch: cp/layers/alibi.py) are full causal
    and sliding-window attention (its ``window_size``), from the model and from its config alone, which every
    built-in method computes; a method that does not install the dispatch refuses them with the reason."""
    from automodel.distributed.cp.method import standard_problem
    from tests.family_matrix import WINDOW, family_by_name

    config = family_by_name("gpt_neo").build_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for profile in (profile_model(model), profile_model(config)):
        assert [(layer.kind, layer.window) for layer in profile.layers] == [(FULL, None), (SLIDING, WINDOW)]
        assert all(layer.own_code and not layer.alibi and not layer.known_gap for layer in profile.layers)
        assert set(methods_that_run(profile, 64)) == set(cp_methods())
        assert set(methods_that_run(profile, 64, packed=True)) == set(cp_methods()) - {"ring"}  # ring: one document
        reason = standard_problem("mine", profile.layers[1], 64, windows=True)
        assert reason.startswith("sliding-window attention (window 16) computed in the layer's own code (GPT-Neo), "
                                 "which mine does not reach"), reason
