"""``loss.chunk_tokens`` through the recipe: the chunked linear cross-entropy gives the per-step losses
(and validation losses, grad norms) of the plain loss at cp=1, with ring and with Ulysses +
activation checkpointing at cp=2. One 2-rank launch for the module."""

from __future__ import annotations

import pytest

from automodel.config import ConfigError, load_config
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_loss_runs")
    return run_distributed("tests.workers.chunked_loss_worker:pair", world_size=2, timeout=900, out=str(out))[0]


def _max_rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


@pytest.mark.parametrize("name", ["chunked_cp1", "chunked_ring_cp2", "chunked_ulysses_ac_cp2"])
def test_chunked_loss_matches_plain_loss_at_cp1(runs, name):
    ref, run = runs["plain_cp1"], runs[name]
    assert sorted(run["losses"]) == list(range(1, 9))
    assert _max_rel(run["losses"], ref["losses"]) <= LOSS_RTOL
    assert _max_rel(run["val_losses"], ref["val_losses"]) <= LOSS_RTOL  # validation uses the same loss
    assert _max_rel(run["grad_norms"], ref["grad_norms"]) <= 1e-4


def test_reference_learns(runs):
    losses = runs["plain_cp1"]["losses"]
    assert losses[8] < losses[1] - 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["loss.chunk_tokens=0"], "loss.chunk_tokens=0 must be >= 1"),
        (
            ["loss.chunk_tokens=64", "distributed.cp_size=1", "distributed.tp_size=2"],
            "multiplies each chunk by the whole LM head",
        ),
    ],
)
def test_bad_chunk_settings_are_rejected_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "configs/cp.yaml", *overrides], world_size=2)


def test_model_without_a_linear_head_is_rejected():
    import torch

    from automodel.training.step import check_model_for_chunked_loss

    with pytest.raises(ValueError, match="loss.chunk_tokens needs a causal LM.*set loss.chunk_tokens=null"):
        check_model_for_chunked_loss(torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("family", "transform"),
    [
        ("gemma2", r"final_logit_softcapping=30\.0"),
        ("cohere", r"logit_scale=0\.0625"),
        ("minicpm3", r"dim_model_base=256"),
        ("recurrent_gemma", r"logits_soft_cap=30\.0"),
    ],
)
def test_a_model_whose_logits_are_transformed_refuses_the_chunked_loss(family, transform):
    """The chunked loss computes ``head(hidden)``; a model whose logits add a final transform (soft-capping, a logit
    scale, MiniCPM's width scaling) would train another loss: the probe refuses it with the transform named, the
    chunked and the plain loss of the same row differ (what the refusal prevents), and the model is left as it
    was (train mode, RNG)."""
    import torch

    from automodel.training.chunked_loss import chunked_linear_cross_entropy_sum
    from automodel.training.step import base_decoder, check_model_for_chunked_loss, forward_loss_sum
    from tests.family_matrix import family_by_name

    model = family_by_name(family).build_model(0).double()
    x = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    hidden = []
    handle = base_decoder(model).register_forward_hook(lambda m, a, out: hidden.append(out[0] if isinstance(
        out, tuple) else out.last_hidden_state))  # fmt: skip
    with torch.no_grad():
        plain = forward_loss_sum(model, {"input_ids": x}, x, None)
        head = model.get_output_embeddings()
        chunked = chunked_linear_cross_entropy_sum(hidden[-1], head.weight, x, 8, bias=head.bias)
    handle.remove()
    assert abs(float(plain - chunked)) > 1e-12 * abs(float(plain))
    # the function alone refuses the chunked loss too, naming the transform (no probe: from the config)
    with pytest.raises(ValueError, match=rf"not its LM head of its final hidden states \(.*{transform}"):
        forward_loss_sum(model, {"input_ids": x}, x, 8)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=rf"logits are not that: .*{transform}.*set\s+loss\.chunk_tokens=null"):
        check_model_for_chunked_loss(model)
    assert model.training and torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mamba", "granite", "llama4_text"])
def test_a_model_whose_logits_are_its_head_passes_the_probe(family):
    """Models whose logits are exactly the LM head of the base model's hidden states (Mamba's fp32 cast of the
    logits included; Granite's default logits_scaling of 1) keep the chunked loss, and it equals the plain loss.
    Llama 4's text model, whose ``get_decoder()`` is the causal LM itself in transformers 5.x, through its ``model``
    (it was refused, so ``loss.chunk_tokens: auto`` ran the plain loss)."""
    import torch

    from automodel.training.step import check_model_for_chunked_loss, forward_loss_sum
    from tests.family_matrix import family_by_name

    model = family_by_name(family).build_model(0)
    check_model_for_chunked_loss(model)
    x = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = forward_loss_sum(model, {"input_ids": x}, x, None)
        chunked = forward_loss_sum(model, {"input_ids": x}, x, 8)
    assert abs(float(plain - chunked)) <= 1e-5 * abs(float(plain))


def test_modernbert_decoder_prediction_head_refuses_the_chunked_loss():
    """ModernBERT-decoder's ``get_decoder()`` is its output Linear; its base model is under ``model`` and its logits
    pass a prediction head first: the probe refuses it, naming the head."""
    from automodel.training.step import base_decoder, check_model_for_chunked_loss
    from tests.family_matrix import family_by_name

    model = family_by_name("modernbert-decoder").build_model(0)
    assert base_decoder(model) is model.model
    with pytest.raises(ValueError, match=r"logits are not that: .*a prediction head.*set\s+loss\.chunk_tokens=null"):
        check_model_for_chunked_loss(model)


def test_the_planner_keeps_the_plain_loss_for_a_transformed_head():
    """``loss.chunk_tokens: auto`` is resolved by the planner from a meta model: for Gemma 2 (soft-capped logits) it
    plans and runs the plain loss, naming the transform; for Llama the logits' share of the peak decides."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from automodel.training.memory_plan import RunShape, loss_auto_choice, model_dims
    from tests.family_matrix import family_by_name

    dims = {}
    for name in ("gemma2", "llama"):
        with torch.device("meta"):
            dims[name] = model_dims(AutoModelForCausalLM.from_config(family_by_name(name).build_config()))
    assert dims["gemma2"].logit_transform == "final_logit_softcapping=30.0" and dims["llama"].logit_transform == ""
    fields = {f.name for f in dataclasses.fields(RunShape)}
    shape = RunShape(**{k: v for k, v in dict(local_batch=1, seq=1 << 16, cp=1, tp=1, dp_shard=1).items() if k in fields})
    value, reason = loss_auto_choice(dims["gemma2"], shape)
    assert value is None and "final_logit_softcapping=30.0" in reason
    assert "not its LM head" not in loss_auto_choice(dims["llama"], shape)[1]  # decided by the logits' share
