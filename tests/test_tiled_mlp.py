"""``model.tiled_mlp`` (automodel.models.tiled_mlp): the loss and every gradient with the MLP run over token tiles
equal those without, per MLP class of the support matrix, in fp64 and fp32, with tiles that do not divide the
tokens, with activation checkpointing, LoRA and ``torch.compile`` of the blocks; what is refused, and why.

Measured on CPU (tiny models of tests/family_matrix.py, 2 rows of 37 tokens, tiles of 5 tokens): fp64 agrees to
~1e-15 relative (DeepSeek-V3 and Llama 4 to ~3e-7: their routers compute in fp32 whatever the model's dtype, and a tile
changes the matmul's blocking), fp32 to ~5e-7 (Qwen3-Next and Qwen3.5-MoE ~3e-5: fp32 round-off of the MoE
amplified by their linear-attention layers; the same models agree to ~1e-15 in fp64). Losses agree exactly.

The multi-process checks are merged into existing launches: every CP method at cp=2 with a tiled MLP
(tests/test_context_parallel.py), TP with and without sequence parallel (tests/test_tensor_parallel.py), and the
recipe with FSDP2, ring CP at cp=2, activation checkpointing and ``model.tiled_mlp`` (tests/test_recipe_parity.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel.errors import UserInputError
from automodel.models.tiled_mlp import (
    apply_tiled_mlp,
    check_tiled_mlp_for_model,
    find_final_norms,
    find_layer_norms,
    find_mlps,
    is_tiled,
    mlp_intermediate_width,
    remove_tiled_mlp,
    resolve_tile_tokens,
    tile_counts,
    tile_final_norms,
    tile_layer_norms,
)
from tests.family_matrix import family_by_name

pytestmark = pytest.mark.usefixtures("one_thread")

#: the MLP classes the support matrix lists: dense (Llama, Qwen3, Gemma3), MoE experts (Mixtral, Qwen3-MoE,
#: gpt-oss with its router scores output, DeepSeek-V3 with shared experts and dense layers), Llama 4's MoE
#: ([N, H] output and router logits), Bloom's MLP (called with the residual), and the hybrids' MLPs
#: (Qwen3-Next, Falcon-H1, Granite-MoE-hybrid's MoE + shared MLP, Jamba, Zamba2's shared block, LFM2-MoE);
#: DeepSeek-V4's MoE (called with the input ids, [B, S], for its hash-routed layers) and xLSTM (a multi-head norm of
#: [B, S, heads, d] inside its mixer, tiled with the layers' norms); parameter-free layer norms (NanoChat's and Dory's
#: RMSNorm, HRM's in its two nested stacks, OLMo's LayerNorm)
FAMILIES = (
    "llama", "qwen3", "gemma3_text", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4_text", "bloom",
    "qwen3_next", "falcon_h1", "granitemoehybrid", "jamba", "zamba2", "lfm2_moe",
    "nemotron_h", "deepseek_v4", "xlstm", "nanochat", "dory", "hrm_text", "olmo",
)  # fmt: skip
#: (loss, gradient) relative bounds; fp64 DeepSeek-V3 routes in fp32 (see the module docstring)
BOUNDS = {torch.float64: (1e-12, 1e-12), torch.float32: (1e-6, 1e-4)}
FP32_ROUTER = {"deepseek_v3": 1e-5, "llama4_text": 1e-5, "nemotron_h": 1e-5}  # router or its scores in fp32
# the norms (the final one and the layers', tiled with the MLP) compute in fp32 whatever the model's dtype (Gemma's,
# Qwen3-Next's and DeepSeek-V4's ``x.float()``): their weights' fp32 gradients, summed per tile, are as close to the
# fp64 truth as the whole row's fp32 sums (1.9e-7 for DeepSeek-V4's post-attention norms)
FP32_FINAL_NORM = {"gemma3_text": 1e-6, "qwen3_next": 1e-6, "deepseek_v4": 1e-6}
#: calls of the final norm module per forward, where not 1: NanoChat's and Dory's also normalize the embeddings (Dory's
#: twice more, around its embedding's residual)
FINAL_NORM_CALLS = {"nanochat": 2, "dory": 4}


def _model(name: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    fam = family_by_name(name)
    config = fam.build_config()
    config._experts_implementation = "eager"  # grouped_mm has no fp64 kernel
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, attn_implementation=fam.attn_implementation(), dtype=dtype
    ).train()


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # a cache of linear layers only fails in transformers
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _compare(ref, got) -> tuple[float, float]:
    (l0, g0), (l1, g1) = ref, got
    assert sorted(g0) == sorted(g1)
    for n in g0:  # the same parameters get a gradient
        assert (g0[n] is None) == (g1[n] is None), n
    scale = max(g.abs().max().item() for g in g0.values() if g is not None)
    worst = max(
        ((g0[n] - g1[n]).abs().max() / max(g0[n].abs().max().item(), 1e-3 * scale)).item()
        for n in g0
        if g0[n] is not None
    )
    return (abs(l0 - l1) / abs(l0)).item(), worst


def _ids(seed: int = 1, shape: tuple[int, int] = (2, 37)) -> torch.Tensor:
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", FAMILIES)
def test_loss_and_gradients_equal_untiled(name, dtype):
    model = _model(name, dtype)
    ids = _ids()
    ref = _step(model, ids)
    assert apply_tiled_mlp(model, 5) >= 1  # 5 does not divide 2 x 37 tokens: the last tile is short
    calls = []
    for _, mlp in find_mlps(model):
        mlp.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[-2 if a[0].ndim == 3 else 0]))
    got = _step(model, ids)
    # the MLP really ran per tile (its hooks fire per tile; the first call's 8-token probe fires them too)
    assert 5 in calls and 74 % 5 in calls and max(calls) < 37
    loss_bound, grad_bound = BOUNDS[dtype]
    if dtype == torch.float64:
        grad_bound = FP32_ROUTER.get(name, FP32_FINAL_NORM.get(name, grad_bound))
    elif name in ("qwen3_next", "jamba", "zamba2"):
        grad_bound = 1e-4  # fp32 round-off amplified by their state-space / linear-attention layers
    loss_rel, grad_rel = _compare(ref, got)
    assert loss_rel <= loss_bound and grad_rel <= grad_bound, (loss_rel, grad_rel)
    # the norms outside the layers (the final norm) ran in tiles of 5 too, their first-call probe passed; a norm module
    # called more than once per forward (NanoChat's and Dory's final norm also normalizes the embeddings; HRM loops its
    # layers, some cycles under no_grad) runs each call in tiles, and each call with a gradient is recomputed once
    norms = tile_counts(model, "final_norm")
    final_calls = FINAL_NORM_CALLS.get(name, 1)
    assert len(norms) == len(find_final_norms(model)) and all(c.tiled_calls == c.calls == final_calls for c in norms)
    assert all(c.max_tile_tokens == 5 and c.tiles == c.backward_tiles == 15 * final_calls for c in norms), norms
    # and every decoder layer's hidden-size norm: each call of 74 tokens in 15 tiles of 5, each recomputed once
    layer_norms = tile_counts(model, "layer_norm")
    assert len(layer_norms) == len(find_layer_norms(model)) >= 2, layer_norms
    assert all(c.calls >= 1 and c.tiled_calls == c.calls and c.max_tile_tokens == 5 for c in layer_norms), layer_norms
    assert all(c.tiles == 15 * c.calls for c in layer_norms), layer_norms
    if name == "hrm_text":  # its no_grad cycles are not recomputed
        assert all(0 < c.backward_tiles <= c.tiles and c.backward_tiles % 15 == 0 for c in layer_norms), layer_norms
        assert any(c.backward_tiles < c.tiles for c in layer_norms), layer_norms
    else:
        assert all(c.backward_tiles == c.tiles for c in layer_norms), layer_norms
    assert remove_tiled_mlp(model) >= 1 and not any(is_tiled(m) for m in model.modules())


def test_activation_checkpointing_lora_and_true():
    from automodel.config.schema import PeftSection
    from automodel.models.lora import apply_lora
    from automodel.models.parallelize import apply_activation_checkpointing

    ids = _ids(2, (1, 150))
    for lora in (False, True):
        model = _model("llama", torch.float64)
        if lora:
            apply_lora(model, PeftSection(r=4, target_modules="all-linear"), seed=0)
            with torch.no_grad():  # lora_B starts at zero: give the adapters' A a gradient too
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.1)
        ref = _step(model, ids)
        apply_tiled_mlp(model, True)  # 150 tokens, hidden 64: three tiles of 50
        apply_activation_checkpointing(model)
        loss_rel, grad_rel = _compare(ref, _step(model, ids))
        assert loss_rel <= 1e-12 and grad_rel <= 1e-12, (lora, loss_rel, grad_rel)
        if lora:
            assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def test_compiled_blocks():
    from automodel.models.compile import compile_decoder_blocks

    torch._dynamo.reset()
    model = _model("llama", torch.float32)
    ids = _ids(3)
    ref = _step(model, ids)
    apply_tiled_mlp(model, 16)
    compile_decoder_blocks(model, "aot_eager")
    loss_rel, grad_rel = _compare(ref, _step(model, ids))
    assert loss_rel <= 1e-6 and grad_rel <= 1e-4, (loss_rel, grad_rel)
    torch._dynamo.reset()


def test_no_grad_forward_and_frozen_input():
    """Validation (no grad) tiles too; an MLP whose input does not require grad still trains its weights."""
    model = _model("llama", torch.float64)
    ids = _ids(4)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.model.embed_tokens.weight.requires_grad_(False)
    for layer in model.model.layers:  # only the MLPs train: layer 0's MLP input needs no gradient
        for p in layer.self_attn.parameters():
            p.requires_grad_(False)
        layer.input_layernorm.weight.requires_grad_(False)
        layer.post_attention_layernorm.weight.requires_grad_(False)
    base = _step(model, ids)
    apply_tiled_mlp(model, 8)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, ref, rtol=0, atol=1e-12)
    loss_rel, grad_rel = _compare(base, _step(model, ids))
    assert loss_rel <= 1e-12 and grad_rel <= 1e-12
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages the forward saves for the backward (the backward then runs)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return sum(seen.values())


def test_one_tile_keeps_only_the_input():
    """A call of one tile (at most ``hidden`` tokens with ``true``, at most the tile with an int) runs through the
    recomputing Function like a call of many: exact, counted as tiled, and keeping only the MLP's input, so a row
    of ``hidden`` tokens saves less than one of ``hidden + 2`` (before: the one-tile call ran the MLP's own
    forward and kept its ``[N, I]`` intermediates, so a row of 64 tokens saved more than one of 66)."""
    from automodel.models.tiled_mlp import layer_tile_scope, tile_counts

    model = _model("llama", torch.float64)  # hidden 64, MLP 128, 2 layers
    short, long = _ids(5, (1, 64)), _ids(5, (1, 66))
    untiled = {n: _saved_bytes(model, ids) for n, ids in ((64, short), (66, long))}
    ref = _step(model, short)
    apply_tiled_mlp(model, True)
    got = _step(model, short)
    counts = tile_counts(model)
    assert [(c.calls, c.tiled_calls, c.tiles, c.backward_tiles, c.max_tile_tokens) for c in counts] == [(1, 1, 1, 1, 64)] * 2
    loss_rel, grad_rel = _compare(ref, got)
    assert loss_rel <= 1e-12 and grad_rel <= 1e-12, (loss_rel, grad_rel)
    tiled = {n: _saved_bytes(model, ids) for n, ids in ((64, short), (66, long))}
    # per layer the gated MLP's four [N, 128] intermediates (plus what it shares with its input) are no longer kept
    assert untiled[64] - tiled[64] >= 2 * 4 * 64 * 128 * 8, (untiled, tiled)
    assert tiled[64] < tiled[66] < untiled[64], (untiled, tiled)  # the shorter row saves less
    # an int tile of the whole row is one tile too
    remove_tiled_mlp(model)
    apply_tiled_mlp(model, 1000)
    assert _saved_bytes(model, short) == tiled[64]
    # inside a tiled layer's tile (which recomputes the tile itself) a one-tile call runs the MLP's own forward
    for c in tile_counts(model):
        c.reset()
    with layer_tile_scope():
        _step(model, short)
    assert [(c.calls, c.tiled_calls, c.in_layer_tiles) for c in tile_counts(model)] == [(1, 0, 1)] * 2


def test_the_final_norm_runs_in_tiles_with_the_mlp_not_under_tp():
    """The final norm's fp32 temporaries, 12 [N, h] bf16 units at its backward, are one tile's: it runs through the
    same Function (exactness: test_loss_and_gradients_equal_untiled, every family). Under TP (sequence parallel shards the norm through DTensor hooks) it stays whole, as the plan counts it."""
    from automodel.training.technique_report import technique_lines, technique_problems

    llama = _model("llama", torch.float32)
    assert [n for n, _ in find_final_norms(llama)] == ["model.norm"]
    assert apply_tiled_mlp(llama, 5, tp_size=2) >= 1 and tile_counts(llama, "final_norm") == []
    remove_tiled_mlp(llama)
    assert tile_final_norms(llama, True) == 1 and tile_final_norms(llama, 7) == 0  # idempotent: the first setting
    assert len(tile_counts(llama, "final_norm")) == 1 and tile_counts(llama) == []  # counted apart from the MLPs
    # the final norm only (BLOOM's embedding norm stays whole), also where get_decoder() is not the base model
    assert [n for n, _ in find_final_norms(_model("bloom", torch.float32))] == ["transformer.ln_f"]
    assert [n for n, _ in find_final_norms(_model("llama4_text", torch.float32))] == ["model.norm"]
    tn = {"norms": 1, "calls": 2, "tiled_calls": 1, "tiles": 4, "backward_tiles": 4, "max_tile_tokens": 64,
          "max_tokens": 256}  # fmt: skip
    assert technique_problems({"tiled_final_norm": tn}) == [
        "the final norm is tiled (with model.tiled_mlp or model.tiled_layer) but 1 of 2 call(s) ran untiled, keeping "
        "its fp32 temporaries for every token"
    ]
    assert technique_problems({"tiled_final_norm": {**tn, "tiled_calls": 2}}) == []
    lines = technique_lines({"tiled_final_norm": tn, "micro_batches": 1})
    assert lines == ["tiled final norm: 1 norm(s) outside the decoder layers, 2 call(s) of up to 256 tokens, 1 run in "
                     "4 tile(s) of at most 64 tokens; 4 tile(s) recomputed by the tiled backward"]  # fmt: skip


def test_the_layer_norms_run_in_tiles_with_the_mlp_not_under_tp():
    """Each decoder layer's hidden-size norms (not the per-head q/k norms, not a norm inside an MLP) run through the
    same Function as the MLP (exactness: test_loss_and_gradients_equal_untiled, every family); not under TP; a call
    that ran whole is a WARNING."""
    from automodel.training.technique_report import technique_lines, technique_problems

    qwen3 = _model("qwen3", torch.float32)
    assert [n for n, _ in find_layer_norms(qwen3)] == [f"model.layers.{i}.{a}" for i in range(len(qwen3.model.layers))
                                                       for a in ("input_layernorm", "post_attention_layernorm")]  # fmt: skip
    gemma = _model("gemma3_text", torch.float32)
    assert [n.rsplit(".", 1)[1] for n, _ in find_layer_norms(gemma)][:4] == [
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    assert apply_tiled_mlp(qwen3, 5, tp_size=2) >= 1 and tile_counts(qwen3, "layer_norm") == []
    remove_tiled_mlp(qwen3)
    assert tile_layer_norms(qwen3, 4) == 2 * len(qwen3.model.layers) and tile_layer_norms(qwen3, 4) == 0
    assert tile_counts(qwen3) == [] and tile_counts(qwen3, "final_norm") == []  # counted apart
    with pytest.raises(ValueError, match="kind='norm' is not one of"):
        tile_counts(qwen3, "norm")
    # a norm of [B, S, heads, d] runs in tiles of its tokens (xLSTM's multi-head norm); one of a vector runs whole
    # (the same numbers), and the counts say so
    norm = qwen3.model.layers[0].input_layernorm
    c = tile_counts(qwen3, "layer_norm")[0]
    for x, counts in ((torch.randn(2, 3, 4, qwen3.config.hidden_size), (1, 1, 2)),  # 6 tokens in tiles of 4
                      (torch.randn(qwen3.config.hidden_size), (2, 1, 2))):  # fmt: skip
        with torch.no_grad():
            assert torch.equal(norm(x), type(norm)._automodel_untiled_class.forward(norm, x))
        assert (c.calls, c.tiled_calls, c.tiles) == counts
    ln = {"norms": 4, "calls": 8, "tiled_calls": 6, "in_layer_tiles": 1, "tiles": 24, "backward_tiles": 24,
          "max_tile_tokens": 64, "max_tokens": 256}  # fmt: skip
    assert technique_problems({"tiled_layer_norms": ln}) == [
        "model.tiled_mlp tiles the decoder layers' norms but 1 of 8 norm call(s) ran untiled, keeping their fp32 "
        "temporaries for every token"
    ]
    assert technique_problems({"tiled_layer_norms": {**ln, "tiled_calls": 7}}) == []
    assert technique_lines({"tiled_layer_norms": ln, "micro_batches": 1}) == [
        "tiled layer norms: 4 norm(s) of the decoder layers, 8 call(s) of up to 256 tokens, 6 run in 24 tile(s) of at "
        "most 64 tokens; 24 tile(s) recomputed by the tiled backward; 1 inside the tiled layer's tiles"]


def test_a_tiled_mlp_call_that_ran_untiled_is_a_problem():
    from automodel.training.technique_report import technique_lines, technique_problems

    tm = {"mlps": 2, "calls": 4, "tiled_calls": 3, "in_layer_tiles": 0, "tiles": 3, "backward_tiles": 3,
          "max_tile_tokens": 64, "max_tokens": 64}  # fmt: skip
    assert technique_problems({"tiled_mlp": tm}) == [
        "model.tiled_mlp is on but 1 of 4 MLP call(s) ran untiled, keeping their intermediates"
    ]
    assert technique_problems({"tiled_mlp": {**tm, "in_layer_tiles": 1}}) == []
    lines = technique_lines({"tiled_mlp": {**tm, "in_layer_tiles": 1}, "micro_batches": 1})
    assert any("3 run in 3 tile(s)" in line and "1 inside the tiled layer's tiles" in line for line in lines), lines


def test_resolve_tile_tokens():
    assert resolve_tile_tokens(False, 128, 16384, 4096) is None
    assert resolve_tile_tokens(1000, 128, 16384, 4096) == 1000
    assert resolve_tile_tokens(10_000, 128, 16384, 4096) == 4096  # one tile (still through the tiled Function)
    # true: equal tiles of at most H tokens: 4096 / 128 = 32 tiles of 128; 1000 tokens: 8 tiles of 125
    assert resolve_tile_tokens(True, 128, 16384, 4096) == 128
    assert resolve_tile_tokens(True, 128, 16384, 1000) == 125
    assert resolve_tile_tokens(True, 4096, 14336, 131072) == 4096  # Llama-3-8B: 32 tiles
    assert resolve_tile_tokens(True, 4096, 14336, 1_000_001) == 4082  # 245 equal tiles, none over 4096
    assert resolve_tile_tokens(True, 64, 32, 100) == 100  # an MLP no wider than hidden: one tile
    with pytest.raises(ValueError, match="must be >= 1"):
        resolve_tile_tokens(0, 128, 256, 10)


def test_intermediate_width_from_config():
    from transformers import AutoConfig

    assert mlp_intermediate_width(AutoConfig.for_model("llama", intermediate_size=96)) == 96
    moe = AutoConfig.for_model(
        "qwen3_moe", intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2
    )
    assert mlp_intermediate_width(moe) == 96  # the dense width is larger than 2 x 32
    ds = family_by_name("deepseek_v3").build_config()
    want = ds.num_experts_per_tok * ds.moe_intermediate_size + ds.n_shared_experts * ds.moe_intermediate_size
    assert mlp_intermediate_width(ds) == max(ds.intermediate_size, want)


@pytest.mark.parametrize(
    "name, match",
    [
        ("opt", r"no MLP module .*inline: fc1, fc2"),
        ("mamba2", "no MLP module"),
        ("rwkv", "RwkvFeedForward.*time shift"),
    ],
)
def test_refused_before_weights(name, match):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_by_name(name).build_config())
    with pytest.raises(UserInputError, match=match):
        check_tiled_mlp_for_model(model, True)


def test_random_draws_and_router_logits_refused():
    from transformers import AutoModelForCausalLM

    config = family_by_name("mixtral").build_config()
    config.router_jitter_noise = 0.1
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserInputError, match="jitter_noise=0.1: random draws"):
        check_tiled_mlp_for_model(model, 8)
    config.router_jitter_noise, config.output_router_logits = 0.0, True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UserInputError, match="output_router_logits=true"):
        check_tiled_mlp_for_model(model, 8)
    with pytest.raises(UserInputError, match="tokens per tile >= 1"):
        check_tiled_mlp_for_model(model, 0)


def test_probe_refuses_token_mixing_and_foreign_parameters():
    """An MLP found by name that mixes tokens, or trains a tensor it does not own, is refused at its first call."""

    class MixingMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 64)

        def forward(self, x):
            return self.up(x) + x.mean(dim=1, keepdim=True)

    class ForeignMLP(nn.Module):
        def __init__(self, foreign):
            super().__init__()
            self.up = nn.Linear(64, 64)
            self.foreign = [foreign]  # not registered: its gradient would be lost

        def forward(self, x):
            return self.up(x) * self.foreign[0]

    for mlp, match in (
        (MixingMLP(), "not a per-token MLP"),
        (ForeignMLP(nn.Parameter(torch.ones(64))), "not its own"),
    ):
        model = _model("llama", torch.float32)
        model.model.layers[0].mlp = mlp
        apply_tiled_mlp(model, 4)
        with pytest.raises(UserInputError, match=match):
            model(input_ids=_ids(5, (1, 16)))


def test_config_rule():
    from automodel.config.schema import ModelSection, RecipeConfig
    from automodel.config.tiled_mlp_rules import tiled_mlp_problems

    assert tiled_mlp_problems(RecipeConfig(model=ModelSection(tiled_mlp=True))) == []
    assert tiled_mlp_problems(RecipeConfig(model=ModelSection(tiled_mlp=2048))) == []
    (problem,) = tiled_mlp_problems(RecipeConfig(model=ModelSection(tiled_mlp=0)))
    assert "model.tiled_mlp=0 must be false, true" in problem
    from automodel.config.rules import check_rules

    assert any(
        "model.tiled_mlp=-4 must be" in p
        for p in check_rules(RecipeConfig(model=ModelSection(tiled_mlp=-4)), 2)
    )


def test_every_matrix_family_is_tiled_or_refused_before_weights():
    """Every family of the support matrix (on the meta device): its MLPs are found, or it is refused with the reason."""
    from transformers import AutoModelForCausalLM

    from tests.family_matrix import FAMILIES

    refused = {}
    for fam in FAMILIES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                fam.build_config(), attn_implementation=fam.attn_implementation()
            )
        try:
            assert check_tiled_mlp_for_model(model, True), fam.name
        except UserInputError as e:
            refused[fam.name] = str(e)
    # no MLP module (OPT's, BioGPT's and XGLM's inline MLP, the Mamba family), or RWKV's time shift; Nemotron-H's default pattern
    # (M E * -) has an MoE and an MLP layer, tiled (its Mamba and attention layers have no MLP to tile)
    assert sorted(refused) == ["biogpt", "falcon_mamba", "mamba", "mamba2", "opt", "rwkv", "xglm"], sorted(
        refused
    )  # BioGPT and XGLM: an inline MLP (fc1, fc2) like OPT's


def test_bf16_tile_gradients_are_summed_in_fp32():
    """A bf16 weight's gradient summed over many tiles in bf16 rounds once per tile: 128 tiles put it twice as far from
    the fp64 gradient as the untiled bf16 run's (one rounding of the matrix product's fp32 reduction). The tiles' sum
    is fp32, rounded once (automodel.models.tile_backward): as close as the untiled run's."""
    import copy

    ref = _model("llama", torch.float64)
    ids = _ids(shape=(1, 1024))
    _, exact = _step(ref, ids)
    errors = []
    for tiled in (False, 8):  # 128 tiles of 8 tokens
        model = copy.deepcopy(ref).to(torch.bfloat16)
        if tiled:
            apply_tiled_mlp(model, tiled)
        _, got = _step(model, ids)
        errors.append(max((got[n].double() - exact[n]).norm().item() / exact[n].norm().item()
                          for n in exact if ".mlp." in n or n == "model.norm.weight"))  # fmt: skip
    untiled, tiled = errors
    assert tiled <= 1.2 * untiled, (untiled, tiled)
