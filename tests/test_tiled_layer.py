"""``model.tiled_layer`` (automodel.models.tiled_layer): a decoder layer tiled end to end gives the loss and every
gradient of the untiled layer, for each layer structure it is proven for (Llama, Qwen3's q/k norms, Mistral's
windows, Qwen2's biases; GQA), in fp64 and fp32, with tiles that do not divide the tokens, packed rows,
activation checkpointing, activation offload and the tiled MLP; a recomputed layer saves a few full-row tensors;
every other layer structure is refused with its class name, before any weight loads.

The multi-process checks are in existing launches: every CP method at cp=2, fp32 and fp64, plain and packed
rows (tests/test_context_parallel.py); headwise Ulysses (tests/test_ulysses.py); the recipe with FSDP2, ring CP,
checkpointing and activation offload (tests/test_recipe_parity.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from automodel.errors import UserInputError
from automodel.models.tiled_layer import (
    apply_tiled_layer,
    check_tiled_layer_for_model,
    is_tiled_layer,
    layer_tile_counts,
    remove_tiled_layer,
    resolve_layer_tile_tokens,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=256)  # fmt: skip
KINDS = {"llama": {}, "qwen3": {}, "qwen2": {}, "mistral": {"sliding_window": 7}}
# (loss, gradients) relative bounds. The tiles sum the weight gradients over their tokens in another order than the
# whole row, so fp32 differs by round-off, whose size depends on the CPU's vector width: Qwen3's q/k norm gradients
# read 1.09e-6 on one 2-core machine and under 1e-6 on another. fp64 is the proof that the sums are the same (1e-13);
# fp32 shows that nothing is lost on the way (a tile lost or counted twice moves a gradient by its share of the
# row's 58 tokens, 5 per tile: about 10%)
BOUNDS = {torch.float64: (1e-14, 1e-13), torch.float32: (1e-6, 1e-5)}


def _model(kind: str, dtype: torch.dtype, attn: str = "sdpa") -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(kind, **SIZES, **KINDS.get(kind, {}))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=dtype).train()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run(model: nn.Module, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 29), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # documents by position_ids restarts (transformers' packed mask)
        pos = torch.cat([torch.arange(11), torch.arange(18)])
        batch["position_ids"] = pos.expand(2, -1).clone()
    return batch


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_tiled_layer_computes_the_untiled_loss_and_gradients(kind, dtype):
    model = _model(kind, dtype)
    tiled = copy.deepcopy(model)
    assert apply_tiled_layer(tiled, 5) == 2
    loss_bar, grad_bar = BOUNDS[dtype]
    for packed in (False, True):
        want, got = _run(model, _batch(packed)), _run(tiled, _batch(packed))
        assert abs(got[0] - want[0]) <= loss_bar * abs(want[0]), (kind, packed)
        assert want[1].keys() == got[1].keys()
        worst = max(_rel(got[1][n], want[1][n]) for n in want[1])
        assert worst <= grad_bar, (kind, dtype, packed, worst)
    counts = layer_tile_counts(tiled)
    # 2 rows x 29 tokens, tiles of 5 tokens -> 2 positions x 2 rows: 15 tiles per part, two parts, two calls
    assert [c.calls for c in counts] == [2, 2] and counts[0].tiles == 2 * 2 * 15
    assert counts[0].backward_tiles == 2 * 2 * 15 and counts[0].max_tile_tokens == 4


def test_with_checkpointing_offload_and_the_tiled_mlp_the_numbers_stay():
    from automodel.models.block_call import apply_activation_checkpointing, block_calls
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.activation_offload import apply_activation_offload

    model = _model("qwen3", torch.float64)
    want = _run(model, _batch(True))
    apply_tiled_mlp(model, 3)
    apply_tiled_layer(model, 7)
    apply_activation_checkpointing(model)
    store = apply_activation_offload(model)
    got = _run(model, _batch(True))
    assert abs(got[0] - want[0]) <= 1e-14 * abs(want[0])
    assert max(_rel(got[1][n], want[1][n]) for n in want[1]) <= 1e-13
    assert all(c.counts.recomputed == 1 for c in block_calls(model))  # every layer recomputed once
    assert [c.calls for c in layer_tile_counts(model)] == [2, 2]  # forward + the recomputation, tiled
    assert sum(n for n, _ in store.per_layer().values()) == 2  # only the layer inputs went to the host
    assert remove_tiled_layer(model) == 2 and not any(is_tiled_layer(m) for m in model.modules())


def _saved_bytes(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> int:
    """Bytes of the distinct tensors one layer's forward saves for its backward (storage-deduplicated)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, **kwargs)
    return sum(seen.values())


def test_a_tiled_layer_saves_a_few_full_row_tensors():
    """One Llama layer's forward (no checkpointing: what its recomputation keeps): the tiled one saves its input, q,
    k, v, the attention's output and what SDPA saves; the untiled one every norm, projection and MLP intermediate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=4, vocab_size=64)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).train()
    seq = 512
    hidden = torch.randn(1, seq, 64, requires_grad=True)
    pe = model.model.rotary_emb(hidden, torch.arange(seq)[None])
    kwargs = {"position_embeddings": pe, "attention_mask": None}
    layer = model.model.layers[0]
    untiled = _saved_bytes(layer, hidden, kwargs)
    apply_tiled_layer(model, 64)
    tiled = _saved_bytes(layer, hidden, kwargs)
    row = seq * 64 * 4  # one [S, hidden] fp32 tensor
    scores = 4 * seq * seq * 4  # eager's probabilities (the attention core, untouched)
    # tiled: input, q, k, v, attention output (both Functions share the input) + the core's scores
    assert tiled - scores <= 6 * row, (tiled, row)
    assert untiled - scores >= 15 * row, (untiled, row)  # norms, q/k/v, o_proj, residuals, 4 x MLP's [S, 4H]


def test_tile_rule():
    assert resolve_layer_tile_tokens(False, 4096, 10**6) is None
    assert resolve_layer_tile_tokens(True, 4096, 10_000) == 3334  # 3 equal tiles of at most 4096
    assert resolve_layer_tile_tokens(True, 4096, 100) == 100
    assert resolve_layer_tile_tokens(64, 4096, 100) == 64
    with pytest.raises(ValueError, match=">= 1"):
        resolve_layer_tile_tokens(0, 4096, 100)


def test_every_matrix_family_is_tiled_or_refused_by_name_before_weights():
    from transformers import AutoModelForCausalLM

    from tests.family_matrix import FAMILIES

    tiled, refused = set(), {}
    for fam in FAMILIES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(fam.build_config(), attn_implementation=fam.attn_implementation())
        try:
            check_tiled_layer_for_model(model, True)
            tiled.add(fam.name)
        except UserInputError as e:
            refused[fam.name] = str(e)
    assert {"llama", "qwen3", "mistral", "qwen2"} <= tiled
    # the matrix builds InternLM3, EXAONE and IQuest-Coder as Llama models (their checkpoints' layers are Llama's)
    built = {fam.name for fam in FAMILIES}  # an older release (scripts/compat.sh) lacks some families
    assert tiled == {"llama", "qwen3", "mistral", "qwen2", "internlm3", "exaone", "iquestcoder"} & built, tiled
    assert "Gemma2DecoderLayer is not a decoder layer structure" in refused["gemma2"]
    for name, why in refused.items():
        assert why.startswith("model.tiled_layer: ") and "set model.tiled_layer=false" in why, (name, why)


def test_another_structure_is_refused_by_name_or_by_the_first_call_probe():
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    class ScaledResidualLayer(LlamaDecoderLayer):  # a Llama layer with its own forward: refused by name
        def forward(self, hidden_states, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return super().forward(hidden_states, **kwargs) + hidden_states

    class GatedAttention(LlamaAttention):  # an attention whose output is not o_proj(core): refused by the probe
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
            out, weights = super().forward(*args, **kwargs)
            return 2 * out, weights

    model = _model("llama", torch.float32)
    layer_class = type(model.model.layers[0])
    for layer in model.model.layers:
        layer.__class__ = ScaledResidualLayer
    with pytest.raises(UserInputError, match="ScaledResidualLayer is not a decoder layer structure the tiled layer"):
        check_tiled_layer_for_model(model, True)
    for layer in model.model.layers:
        layer.__class__ = layer_class
        layer.self_attn.__class__ = GatedAttention
    with pytest.raises(UserInputError, match="attention GatedAttention runs a forward the tiled layer is not proven"):
        check_tiled_layer_for_model(model, True)
    for layer in model.model.layers:
        layer.self_attn.__class__ = LlamaAttention
    apply_tiled_layer(model, 4)
    for layer in model.model.layers:  # swapped after the check: the probe at the first call finds it
        layer.self_attn.__class__ = GatedAttention
    with pytest.raises(UserInputError, match=r"LlamaDecoderLayer.s forward is not the structure .*\(the output differs"):
        model(**_batch(False), use_cache=False)


def test_random_draws_a_cache_in_training_and_bad_values_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        drop = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SIZES, attention_dropout=0.1))
    with pytest.raises(UserInputError, match="attention_dropout=0.1 in LlamaDecoderLayer: random draws"):
        check_tiled_layer_for_model(drop, True)
    with pytest.raises(UserInputError, match="model.tiled_layer=0 must be"):
        check_tiled_layer_for_model(drop, 0)
    model = _model("llama", torch.float32)
    apply_tiled_layer(model, 4)
    with pytest.raises(ValueError, match="KV cache in a training forward"):
        model(**_batch(False), use_cache=True)
    with torch.no_grad():  # evaluation with a cache (generation) runs the layer's own forward
        model.eval()(input_ids=_batch(False)["input_ids"], use_cache=True)
    assert layer_tile_counts(model)[0].untiled_calls == 1


def test_config_rules():
    from automodel.config.rules import check_rules
    from automodel.config.schema import DistributedSection, ModelSection, RecipeConfig
    from automodel.config.tiled_layer_rules import tiled_layer_problems

    assert tiled_layer_problems(RecipeConfig(model=ModelSection(tiled_layer=True))) == []
    assert tiled_layer_problems(RecipeConfig(model=ModelSection(tiled_layer=4096))) == []
    (problem,) = tiled_layer_problems(RecipeConfig(model=ModelSection(tiled_layer=0)))
    assert "model.tiled_layer=0 must be false, true" in problem
    (problem,) = tiled_layer_problems(
        RecipeConfig(model=ModelSection(tiled_layer=True), distributed=DistributedSection(tp_size=2))
    )
    assert "distributed.tp_size=2" in problem and "set distributed.tp_size=1 or model.tiled_layer=false" in problem
    assert any("model.tiled_layer=-4 must be" in p for p in check_rules(RecipeConfig(model=ModelSection(tiled_layer=-4)), 2))


def test_the_plan_counts_what_a_tiled_recomputed_layer_holds():
    """Llama-3.1-8B at 1M tokens, Ulysses cp 8, checkpointing, offload, bf16, flash: the recomputed layer's
    attention moment holds the two device layer inputs, the attention core's tensors (q, k, v, the output and its
    transposed copy) and the gradients of the attention output, the input and q/k/v, not the ~13 hidden-sized
    tensors of the untiled layer; the search offers the tiled layer with its key, and the estimate charges its
    recomputation in place of the tiled MLP's."""
    import dataclasses

    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.training.memory_plan import RunShape, plan_memory
    from automodel.training.plan_search import Techniques, all_techniques, technique_seconds
    from tests.test_head_chunks import LLAMA_8B as d

    base = RunShape(local_batch=1, seq=1 << 20, cp=8, cp_method="ulysses", activation_checkpointing=True,
                    tiled_mlp=True, activation_offload=True, offload="all", chunk_tokens=1024, compute_bytes=2,
                    attention_kernel="flash")  # fmt: skip
    tiled = dataclasses.replace(base, tiled_layer=True)
    untiled_plan, tiled_plan = plan_memory(d, base), plan_memory(d, tiled)
    n, c, h = (1 << 20) // 8, 2, d.hidden
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    moment = tiled_plan.by_moment["recompute"]["attention"]
    # the post part's saved copy of the attention output is freed by the attention's backward (its backward ran):
    # q, k, v, the kernel's output and LSE stay (measured: scripts/bench_memory.py --tiled-layer only)
    core = (q + 2 * kv + q) * c + d.heads * 4
    grads = (h + 2 * q + 2 * kv) * c
    always = 24 + 2 * d.head_dim * c
    assert moment["activations"] == pytest.approx(n * (2 * h * c + always + core + grads))
    # head groups: each group is checkpointed, the kernel's output and LSE are not saved, in no moment
    groups = plan_memory(d, dataclasses.replace(tiled, head_chunks=2))
    assert groups.by_moment["recompute"]["attention"]["activations"] == pytest.approx(
        n * (2 * h * c + always + (q + 2 * kv) * c + grads))  # fmt: skip
    assert groups.by_moment["recompute"]["MLP"]["activations"] == pytest.approx(
        tiled_plan.by_moment["recompute"]["MLP"]["activations"] - n * (q * c + d.heads * 4))  # fmt: skip
    assert moment["attention workspace"] == untiled_plan.by_moment["recompute"]["attention"]["attention workspace"]
    # (the tiled MLP runs the layer's norms in tiles too, so the untiled layer's plan is 17% above the tiled one's)
    assert tiled_plan.total_bytes < 0.9 * untiled_plan.total_bytes
    assert "layer tiled end to end, 4096 tokens per tile" in tiled_plan.terms["activations"].note
    # the search: the tiled layer with the tiled MLP only, its key, and its recomputation charged
    assert Techniques(True, True, True, True, "all", tiled_layer=True) in all_techniques()
    assert not any(t.tiled_layer and not t.tiled_mlp for t in all_techniques())
    t = Techniques(True, True, True, True, "all", tiled_layer=True)
    assert t.text(1) == "ckpt+chunk+lay+aoff+off:all" and "model.tiled_layer=true" in t.overrides(1)
    spec = GPU_SPECS["h100"]
    costs = technique_seconds(d, tiled, spec, "h100", 1.0)
    assert "tiled layer" in costs and "tiled MLP" not in costs
    assert costs["tiled layer"] > technique_seconds(d, base, spec, "h100", 1.0)["tiled MLP"]


def test_the_run_log_says_what_the_tiled_layer_did():
    from automodel.training.technique_report import (
        collect_technique_report,
        reset_technique_counts,
        technique_lines,
        technique_problems,
    )

    model = _model("llama", torch.float32)
    apply_tiled_layer(model, 8)
    reset_technique_counts(model, None)
    _run(model, _batch(False))
    report = collect_technique_report(model, None, 1)
    tl = report["tiled_layer"]
    # 2 rows x 29 tokens in tiles of 8 tokens (4 positions x 2 rows): 8 tiles per part, pre and post, per layer
    assert tl == {"layers": 2, "layers_tiled": 2, "calls": 2, "tiles": 32, "backward_tiles": 32,
                  "max_tile_tokens": 8, "max_tokens": 58}  # fmt: skip
    (line,) = [x for x in technique_lines(report) if x.startswith("tiled layer")]
    assert line == ("tiled layer: 2 of 2 decoder layers, 2 call(s) of up to 58 tokens in 32 tile(s) of at most 8 "
                    "tokens (pre and post parts); 32 tile(s) recomputed by the tiled backward")  # fmt: skip
    assert technique_problems(report) == []
    reset_technique_counts(model, None)
    assert "model.tiled_layer is on but only 0 of 2" in technique_problems(collect_technique_report(model, None, 1))[0]


def test_eager_attention_with_a_sliding_window_is_exact():
    """The core is the model's own eager_attention_forward (the modeling file's function) with Mistral's window."""
    model = _model("mistral", torch.float64, attn="eager")
    tiled = copy.deepcopy(model)
    apply_tiled_layer(tiled, 6)
    want, got = _run(model, _batch(True)), _run(tiled, _batch(True))
    assert abs(got[0] - want[0]) <= 1e-14 * abs(want[0])
    assert max(_rel(got[1][n], want[1][n]) for n in want[1]) <= 1e-13
