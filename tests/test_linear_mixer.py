"""Gated DeltaNet under CP (automodel/distributed/cp/layers/gated_deltanet.py, linear_mixer.py; docs/linear_mixers.md).

Single process: a row cut into pieces and chained (conv halo + state) gives the whole-row mixer; the
fp64 reference rule agrees with transformers' kernel. One 4-rank gloo launch: Qwen3-Next on a packed row
of three documents under thd and Ulysses at cp=2 (two groups at once) and cp=4, loss and every gradient
against each document run alone, and two unpacked rows under ring against one process; fp64 (with the
fp64 rule in both runs) and fp32 (transformers' kernel).
"""

from __future__ import annotations

import sys

import pytest
import torch

from automodel.distributed.cp.layers import gated_deltanet as gd
from automodel.distributed.cp.layers.linear_support import linear_mixer_problem
from automodel.distributed.cp.profile import LINEAR, LayerSpec
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _mixer(model_type: str, dtype=torch.float64):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, layer_types=["linear_attention", "full_attention"],
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4)
    if model_type == "qwen3_next":
        kw.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if model_type == "olmo_hybrid":
        kw.update(linear_allow_neg_eigval=True, pad_token_id=0)  # beta in [0, 2]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=dtype)
    mixer = model.model.layers[0].linear_attn
    with torch.no_grad():
        mixer.dt_bias.uniform_(-1.0, 1.0)
        mixer.A_log.uniform_(-2.0, 1.0)
    return mixer


def _chained(mixer, hidden, cuts):
    params = gd.core_params(mixer)
    mixed, z, b, a = gd.project(mixer, hidden)
    outs, halo, state = [], None, None
    bounds = [0, *cuts, hidden.shape[1]]
    for s, e in zip(bounds[:-1], bounds[1:]):
        out, halo, state = gd.run_core(params, mixed[:, s:e], b[:, s:e], a[:, s:e], halo, state)
        outs.append(out)
    return gd.finish(mixer, torch.cat(outs, dim=1), z)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "olmo_hybrid"])
def test_a_row_cut_into_pieces_and_chained_is_the_whole_row(model_type, monkeypatch):
    mixer = _mixer(model_type)
    hidden = torch.randn(2, 150, 32, dtype=torch.float64)
    cuts = [37, 38, 100]  # a 1-token piece: its conv halo reaches back over two pieces
    modeling = sys.modules[type(mixer).__module__]
    # transformers' kernel (fp32 inside): a cut at its 64-token chunk grid chains bit for bit, others to round-off
    whole = mixer(hidden)
    assert torch.equal(_chained(mixer, hidden, [64, 128]), whole)
    err = ((_chained(mixer, hidden, cuts) - whole).abs().max() / whole.abs().max()).item()
    assert 0 < err < 1e-5, err
    # a rule that honours fp64: the chaining itself is exact to fp64 round-off
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", gd.recurrent_gated_delta_rule)
    with gd.rule_override(gd.recurrent_gated_delta_rule):
        whole = mixer(hidden)
        assert ((_chained(mixer, hidden, cuts) - whole).abs().max() / whole.abs().max()).item() < 1e-13
    # a document start is a zero halo and a zero state: the second half alone is the chain restarted
    alone = mixer(hidden[:, 100:])
    assert torch.allclose(_chained(mixer, hidden[:, 100:], [20]), alone, rtol=0, atol=1e-13)


def test_the_fp64_reference_rule_is_transformers_rule():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    torch.manual_seed(1)
    q, k = torch.randn(2, 2, 90, 2, 8).unbind(0)
    v = torch.randn(2, 90, 4, 8)
    g, beta = -torch.rand(2, 90, 4), torch.rand(2, 90, 4)
    state = torch.randn(2, 4, 8, 8)
    # q/k repeated to the 4 value heads: transformers 5.17's rule takes them so (its mixer repeats), 5.24's too
    qr, kr = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    ref, ref_state = m.torch_chunk_gated_delta_rule(qr, kr, v, g=g, beta=beta, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, out_state = gd.recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.allclose(out_state, ref_state, rtol=1e-4, atol=1e-5)


def test_only_the_implemented_mixers_and_methods_are_exact():
    def layer(mixer, hybrid=False, window=None):
        return LayerSpec(index=0, kind=LINEAR, mixer=mixer, hybrid_attention=hybrid, window=window)

    for name in ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "OlmoHybridGatedDeltaNet"):
        for method in ("ring", "ulysses", "thd", "thd_docs", "usp"):
            assert linear_mixer_problem(method, layer(name)) is None
        assert "toy splits over the ranks without passing the state on" in linear_mixer_problem("toy", layer(name))
    for other in ("Glm5NextTextLinearAttention", "XLSTMLayer", "RecurrentGemmaRglru", "Conv1d (a convolution along the sequence)"):
        for method in ("ring", "ulysses", "thd"):
            reason = linear_mixer_problem(method, layer(other))
            assert reason and other in reason and "CP kernels exist for" in reason, reason
    # plain causal attention beside the mixer goes through the method's attention; a window beside it does not
    assert linear_mixer_problem("thd", layer("Qwen3NextGatedDeltaNet", hybrid=True)) is None
    assert "window" in linear_mixer_problem("thd", layer("Qwen3NextGatedDeltaNet", hybrid=True, window=8))


def test_installed_forward_is_the_class_forward_outside_cp_and_uninstalls():
    from transformers import AutoModelForCausalLM

    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers, uninstall_linear_mixers

    full = AutoModelForCausalLM.from_config(_mixer_config())
    hidden = torch.randn(1, 20, 32)
    before = full.model.layers[0].linear_attn(hidden)
    assert install_linear_mixers(full, cached_profile(full), "thd") == 1
    assert "forward" in vars(full.model.layers[0].linear_attn)
    assert torch.equal(full.model.layers[0].linear_attn(hidden), before)
    with pytest.raises(ValueError, match="no linear-mixer kernel for cp_method 'toy'"):
        install_linear_mixers(full, cached_profile(full), "toy")
    uninstall_linear_mixers(full)
    assert "forward" not in vars(full.model.layers[0].linear_attn)


def _mixer_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                linear_num_value_heads=4)


# ---------------------------------------------------------------------------------------------------------
# distributed: one 4-rank launch, cp=2 (two groups) and cp=4

FP64_LINEAR = 1e-12  # every Gated DeltaNet parameter but A_log (the model reads it as A_log.float())
FP64_MODEL = 1e-6  # Qwen3-Next's RMSNorms, gated norm and decay compute in fp32 even in an fp64 model
FP32 = (1e-5, 1e-4)  # loss, every gradient (DESIGN.md "Parity")


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed("tests.workers.linear_mixer_worker:main", world_size=4, timeout=600)


@pytest.mark.dist
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", ["thd", "ulysses"])
def test_packed_qwen3_next_matches_each_document_alone(dist_results, cp, method):
    for rank_result in dist_results:
        res = rank_result[cp]
        # three documents, each split over all 2*cp chunks under thd: the state crosses every rank boundary
        assert res[("local_tokens", method)] == res["row_tokens"] // cp
        exact = res[("float64", "fp64", method)]
        assert exact["loss_rel"] <= 1e-12 and not exact["missing"], exact
        for name, rel in exact["grad_rel"].items():
            bar = FP64_LINEAR if "linear_attn" in name and "A_log" not in name else FP64_MODEL
            assert rel <= bar, (name, rel)
        linear = {n for n in exact["grad_rel"] if "linear_attn" in n}
        assert {n.rsplit(".", 2)[-2] if n.endswith("weight") else n.rsplit(".", 1)[-1] for n in linear} >= {
            "conv1d", "A_log", "dt_bias", "in_proj_qkvz", "in_proj_ba", "norm", "out_proj"}
        fp32 = res[("float32", "hf", method)]
        assert fp32["loss_rel"] <= FP32[0] and not fp32["missing"], fp32
        worst = max(fp32["grad_rel"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP32[1], worst


@pytest.mark.dist
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_rows_match_one_process(dist_results, cp):
    for rank_result in dist_results:
        exact = rank_result[cp][("float64", "fp64", "ring")]
        assert exact["loss_rel"] <= 1e-12 and not exact["missing"], exact
        for name, rel in exact["grad_rel"].items():
            assert rel <= (FP64_LINEAR if "linear_attn" in name and "A_log" not in name else FP64_MODEL), (name, rel)
        fp32 = rank_result[cp][("float32", "hf", "ring")]
        assert fp32["loss_rel"] <= FP32[0] and max(fp32["grad_rel"].values()) <= FP32[1], fp32


@pytest.mark.dist
def test_the_chain_survives_activation_checkpointing(dist_results):
    for rank_result in dist_results:
        res = rank_result[2][("float32", "hf", "thd+checkpointing")]
        assert res["loss_rel"] <= FP32[0] and not res["missing"], res
        assert max(res["grad_rel"].values()) <= FP32[1], res


def test_outside_cp_packed_rows_restart_at_every_document():
    """cp_size=1 (and the self-check's reference: the prepared model outside a CP context) computes what CP
    computes on packed rows: each document from zeros; transformers' own forward carries the state across."""
    from transformers import AutoModelForCausalLM

    from automodel.distributed.cp.bind import bind_cp_method
    from automodel.distributed.cp.layers.linear_mixer import uninstall_linear_mixers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_mixer_config(), dtype=torch.float64)
    ids = torch.randint(3, 64, (1, 30))
    packed = torch.cat([torch.arange(12), torch.arange(18)])[None]
    alone = torch.cat([model(input_ids=ids[:, :12], use_cache=False).logits, model(input_ids=ids[:, 12:], use_cache=False).logits], dim=1)
    leaky = model(input_ids=ids, position_ids=packed, use_cache=False).logits
    plain = model(input_ids=ids, use_cache=False).logits
    assert (leaky - alone).abs().max() > 1e-3  # transformers' torch kernel: the state crosses the boundary
    bind_cp_method("thd", model, None, 1)  # cp_size 1: the recipe's single-device run
    assert torch.allclose(model(input_ids=ids, position_ids=packed, use_cache=False).logits, alone, rtol=1e-6, atol=1e-7)
    assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain)  # one document per row: the class's own forward
    uninstall_linear_mixers(model)
    assert torch.equal(model(input_ids=ids, position_ids=packed, use_cache=False).logits, leaky)
