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


@pytest.mark.parametrize("name", ["chunked_cp1", "chunked_ring_cp2", "chunked_ulysses_ac_cp2", "gemma2_chunked_ring_cp2"])
def test_chunked_loss_matches_plain_loss_at_cp1(runs, name):
    """Gemma 2's run soft-caps its logits (a cap of 0.1): the chunked loss applies the cap per chunk."""
    ref, run = runs["gemma2_plain_cp1" if name.startswith("gemma2") else "plain_cp1"], runs[name]
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
    ("family", "config", "transform"),
    [
        ("gemma2", {}, "30 * tanh(z / 30)"),
        ("nanochat", {}, "15 * tanh(z / 15)"),
        ("recurrent_gemma", {}, "30 * tanh(z / 30)"),
        ("cohere", {}, "z * 0.0625"),
        ("granite", {"logits_scaling": 8.0}, "z / 8"),  # the released Granite 3.x value (the default is 1)
        ("minicpm3", {}, "z / 0.25"),  # MiniCPM3 divides its hidden states before its bias-free head
    ],
)
def test_a_model_whose_logits_are_transformed_chunks_them_exactly(family, config, transform):
    """A model whose logits are a final transform of its head's output (a soft-cap, a logit scale, a divisor) passes
    the probe with that transform, and its chunked loss equals its plain loss, the loss and every parameter's
    gradient, in fp64; the head's untransformed chunked loss would have differed (what the chunked loss left out
    before: these models were refused). Without the run's check the function alone refuses, naming the transform
    and the check; the probe leaves the model as it was (train mode, RNG)."""
    import torch

    from automodel.training.chunked_loss import chunked_linear_cross_entropy_sum
    from automodel.training.step import base_decoder, check_model_for_chunked_loss, forward_loss_sum
    from tests.family_matrix import family_or_skip

    model = family_or_skip(family).build_model(0).double()
    for key, value in config.items():
        setattr(model.config, key, value)
    x = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"not its LM head of its final hidden states .*check_model_for_chunked_loss"):
        forward_loss_sum(model, {"input_ids": x}, x, 8)
    state = torch.get_rng_state()
    check_model_for_chunked_loss(model)
    assert model.training and torch.equal(torch.get_rng_state(), state)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(chunk):  # noqa: ANN001, ANN202
        model.zero_grad(set_to_none=True)
        loss = forward_loss_sum(model, {"input_ids": x}, x, chunk)
        loss.backward()
        return loss.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    torch.manual_seed(0)
    plain, plain_grads = loss_and_grads(None)
    torch.manual_seed(0)
    chunked, chunked_grads = loss_and_grads(8)
    assert abs(float(plain - chunked)) <= 1e-12 * abs(float(plain))
    for got, ref in zip(chunked_grads, plain_grads):
        assert float((got - ref).abs().max()) <= 1e-12 * max(float(ref.abs().max()), 1e-30)
    hidden = []
    handle = base_decoder(model).register_forward_hook(lambda m, a, out: hidden.append(out[0] if isinstance(
        out, tuple) else out.last_hidden_state))  # fmt: skip
    with torch.no_grad():
        torch.manual_seed(0)
        forward_loss_sum(model, {"input_ids": x}, x, None)
        head = model.get_output_embeddings()
        untransformed = chunked_linear_cross_entropy_sum(hidden[-1], head.weight, x, 8, bias=head.bias)
    handle.remove()
    # tiny random logits sit where a soft-cap is nearly linear: the difference is small but 1000x the bound above
    assert abs(float(plain - untransformed)) > 1e-9 * abs(float(plain))
    from automodel.training.logit_transform import chunkable_transform

    assert chunkable_transform(model)[0].describe() == transform


def test_logits_unlike_their_named_transform_refuse_the_chunked_loss():
    """Gemma 2's config names a soft-cap of 30; a model whose logits are something else besides (here its head's
    output doubled by a hook, as a model's own code could) fails the probe: refused, both named."""
    import torch

    from automodel.training.step import check_model_for_chunked_loss
    from tests.family_matrix import family_by_name

    model = family_by_name("gemma2").build_model(0)
    model.get_output_embeddings().register_forward_hook(lambda m, a, out: out * 2)
    with pytest.raises(ValueError, match=r"and their transform 30 \* tanh\(z / 30\).*logits are not that: they differ "
                                         r"from 30 \* tanh\(z / 30\) of the head's output z.*final_logit_softcapping=30"):
        check_model_for_chunked_loss(model)
    del torch


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


def test_the_planner_keeps_the_plain_loss_only_for_a_transform_it_cannot_chunk():
    """``loss.chunk_tokens: auto`` is resolved by the planner from a meta model: for ModernBERT-decoder (a prediction
    head before its output Linear) it plans and runs the plain loss, naming the head, and suggests no chunked loss;
    for Gemma 2 (soft-capped logits, which the chunked loss computes) and Llama the logits' share of the peak
    decides."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from automodel.training.memory_plan import (
        DEFAULT_CHUNK_TOKENS,
        RunShape,
        loss_auto_choice,
        model_dims,
        plan_memory,
        suggest_changes,
    )
    from tests.family_matrix import family_by_name

    dims = {}
    for name in ("gemma2", "llama", "modernbert-decoder"):
        config = family_by_name(name).build_config()
        config.vocab_size = 1 << 16  # the logits weigh in the step peak (Gemma 2: 4.00 of its 4.12 GiB at 4096 tokens)
        with torch.device("meta"):
            dims[name] = model_dims(AutoModelForCausalLM.from_config(config))
    assert dims["gemma2"].logit_transform == "" and dims["gemma2"].logit_softcap and dims["llama"].logit_transform == ""
    assert dims["modernbert-decoder"].logit_transform == "a prediction head before its output Linear"
    fields = {f.name for f in dataclasses.fields(RunShape)}
    shape = RunShape(**{k: v for k, v in dict(local_batch=1, seq=4096, cp=1, tp=1, dp_shard=1).items() if k in fields})
    value, reason = loss_auto_choice(dims["modernbert-decoder"], shape)
    assert value is None and "does not compute (a prediction head" in reason
    for name in ("gemma2", "llama"):  # decided by the logits' share: on
        value, reason = loss_auto_choice(dims[name], shape)
        assert value == DEFAULT_CHUNK_TOKENS and "logits and loss" in reason, reason
    for name, chunkable in (("gemma2", True), ("modernbert-decoder", False)):  # a budget the chunked loss meets
        chunked = dataclasses.replace(shape, chunk_tokens=DEFAULT_CHUNK_TOKENS)
        budget = plan_memory(dims[name], chunked).total_bytes * 1.001
        lines = suggest_changes(dims[name], shape, budget, 1)
        assert "does NOT fit" in lines[0] and ("loss.chunk_tokens=1024 ->" in lines[1]) == chunkable, (name, lines)
