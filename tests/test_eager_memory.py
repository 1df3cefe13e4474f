"""The eager attention probe (automodel.training.eager_memory): the bytes per ``[heads, S, S]`` score that a model's
own eager function keeps and holds at its peaks, against the counts read off each function's code, against one
direct call at a longer row, and as the planner uses them (Granite-SWA's sinks were planned 35% under at cp 1:
``scripts/bench_plan_families.py``, now +0.7%)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.models.parallelize import decoder_layers
from automodel.training.eager_memory import EagerScores, eager_function, eager_scores
from automodel.training.memory_plan import RunShape, model_dims, plan_memory
from automodel.training.mlp_memory import _LiveBytes
from tests.family_matrix import family_by_name

SEQ = 4096


def _model(name: str):
    """The family's tiny model on the meta device, eager attention."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(family_by_name(name).build_config(), attn_implementation="eager")


def _attention(name: str):
    return decoder_layers(_model(name))[0].self_attn


# (fp32, bf16) (saved, forward peak, backward peak) per score, read off each eager function:
# - transformers' common one: the fp32 softmax's output (and its bf16 cast, which the product with V saves); the
#   masked scores beside it in the forward (the raw ones freed by the add); the probabilities' gradient and the
#   softmax's backward beside it in the backward
# - Gemma 2: the tanh's output kept too (the capped scores' backward reads it)
# - Granite-SWA: its sinks' log-sum-exp keeps the masked scores; its backward makes exp(scores - lse), and the product
#   with the gradient, beside the softmax's backward: five fp32 scores at once
EXPECTED = {
    "llama": ((4, 8, 12), (6, 10, 12)),
    "gemma2": ((8, 12, 16), (8, 12, 14)),
    "granite_swa": ((8, 8, 20), (8, 9, 14)),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe_counts_what_each_eager_function_keeps_and_holds(name):
    fp32, bf16 = eager_scores(_attention(name))
    assert (fp32, bf16) == tuple(EagerScores(*e) for e in EXPECTED[name])


def _direct(attention, s: int) -> tuple[int, int]:
    """``(saved, backward peak)`` bytes of one fp32 call of the module's eager function at ``s`` tokens, counted
    without the probe (its sinks as zeros)."""
    fn = eager_function(attention)
    heads, groups, d = attention.config.num_attention_heads, attention.num_key_value_groups, attention.head_dim
    q = torch.randn(1, heads, s, d, requires_grad=True)
    k, v = (torch.randn(1, heads // groups, s, d, requires_grad=True) for _ in range(2))
    mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
    module = type("Module", (), {"num_key_value_groups": groups, "training": True,
                                 "sinks": torch.zeros(heads), "attn_logit_softcapping": None})()  # fmt: skip
    mode = _LiveBytes()
    with mode:
        out, weights = fn(module, q, k, v, mask, scaling=d**-0.5, dropout=0.0)
        del weights  # the decoder layer drops the returned weights
        saved = mode.current - out.untyped_storage().nbytes()
        grad = torch.ones_like(out)
        start = mode.peak = mode.current
        out.backward(grad)
    return saved, mode.peak - start + saved


@pytest.mark.parametrize("name", ["llama", "granite_swa"])
def test_probe_figures_predict_a_direct_call_at_a_longer_row(name):
    """At 512 tokens the scores are all but the ``[heads, S, d]`` tensors (q, k, v, the output, their gradients)."""
    attention = _attention(name)
    fp32, _ = eager_scores(attention)
    heads, d, s = attention.config.num_attention_heads, attention.head_dim, 512
    saved, backward = _direct(attention, s)
    linear = 12 * heads * s * d * 4  # a bound on the [heads, S, d] fp32 tensors alive at once
    for figure, measured in ((fp32.saved, saved), (fp32.backward, backward)):
        assert figure * heads * s * s <= measured <= figure * heads * s * s + linear, (name, figure, measured)


def test_a_model_without_an_eager_function_keeps_the_formula():
    """BLOOM computes its attention in its own code (no ``eager_attention_forward``): the planner's formula stands."""
    assert model_dims(_model("bloom")).eager_scores is None
    assert model_dims(_model("llama")).eager_scores is not None


def test_the_plan_counts_granite_swas_sinks_at_each_moment():
    """Per score and layer, Granite-SWA keeps 4 fp32 bytes more than Llama's eager function (the masked scores its
    sinks' log-sum-exp saves); at the recomputed layer's backward 8 more (five fp32 scores where Llama's has three)."""
    granite, llama = model_dims(_model("granite_swa")), model_dims(_model("llama"))
    shape = RunShape(local_batch=1, seq=SEQ, attn="eager")
    scores = granite.heads * SEQ * SEQ

    def activations(d, phase, **kw):
        return plan_memory(d, RunShape(**{**shape.__dict__, **kw})).phases[phase]["activations"]

    # the S^2 parts: against the same model with the formula (llama's function: 4 kept, 12 at the backward)
    formula = type(granite)(**{**granite.__dict__, "eager_scores": llama.eager_scores})
    assert activations(granite, "loss") - activations(formula, "loss") == granite.layers * scores * 4
    gap = activations(granite, "recompute", activation_checkpointing=True) - activations(
        formula, "recompute", activation_checkpointing=True)
    assert gap == scores * 8
    # Llama's measured figures are the formula's (the probe and the GPT-Neo-calibrated count agree on the kept bytes)
    unmeasured = type(llama)(**{**llama.__dict__, "eager_scores": None})
    assert activations(llama, "loss") == activations(unmeasured, "loss")
