"""``model.checkpoint_group_layers`` (automodel.models.checkpoint_groups): only every k-th decoder layer's input is kept
(and offloaded); the others are rebuilt in the backward. One process here (the loss and every gradient against
groups of 1, with the tiled layer, the tiled MLP and activation offload; what is kept; the refusals; the planner's
terms and search); under CP and FSDP2: tests/test_context_parallel.py (tests/workers/context_parallel_worker.py)."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn

from automodel.models.block_call import apply_activation_checkpointing, block_calls
from automodel.models.checkpoint_groups import apply_checkpoint_groups, check_group_layers, group_starts


def _llama(dtype: torch.dtype, layers: int = 5) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=97)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").to(dtype)


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _prepare(model: nn.Module, k: int, offload: bool, tiled: bool):
    from automodel.models.tiled_layer import apply_tiled_layer
    from automodel.models.tiled_mlp import apply_tiled_mlp
    from automodel.training.activation_offload import apply_activation_offload

    if tiled:
        apply_tiled_mlp(model, 5)
        apply_tiled_layer(model, 7)
    apply_activation_checkpointing(model)
    groups = apply_checkpoint_groups(model, k)
    store = apply_activation_offload(model) if offload else None
    return groups, store


@pytest.mark.parametrize(("dtype", "k", "offload", "tiled"), [(torch.float64, 2, True, False),
                                                              (torch.float32, 3, False, False)])  # fmt: skip
def test_the_loss_and_every_gradient_equal_groups_of_one(dtype, k, offload, tiled):
    base = _llama(dtype)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    plain, grouped = copy.deepcopy(base), copy.deepcopy(base)
    _prepare(plain, 1, offload, tiled)
    groups, store = _prepare(grouped, k, offload, tiled)
    want, got = _run(plain, ids), _run(grouped, ids)
    bar = 1e-15 if dtype == torch.float64 else 1e-6
    assert abs(got[0] - want[0]) <= bar * abs(want[0])
    for n, g in want[1].items():
        assert float((got[1][n] - g).norm()) <= bar * float(g.norm()), n
    starts = group_starts(5, k)
    c = groups.counts
    assert (c.kept, c.dropped, c.rebuilt, c.replayed) == (starts, 5 - starts, 5 - starts, 5 - starts)
    assert groups.starts == list(range(0, 5, k))
    assert [b.counts.recomputed for b in block_calls(grouped)] == [1] * 5  # each layer recomputed once, as before
    if store is not None:  # only the groups' first layers' inputs went to the host
        assert store.stats().packed == starts and sorted(store.per_layer()) == groups.starts


def test_a_members_input_is_freed_after_its_forward():
    """The member's input is not kept by the graph: only a handle (a weak reference sees it die)."""
    model = _llama(torch.float32, layers=2)
    _prepare(model, 2, False, False)
    seen: list[weakref.ref] = []
    layer = model.model.layers[1]
    hook = layer.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0])))
    out = model(input_ids=torch.randint(0, 97, (1, 16)), labels=torch.randint(0, 97, (1, 16)))
    hook.remove()
    gc.collect()
    assert seen and seen[0]() is None  # layer 1's input is gone before the backward
    out.loss.backward()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:  # noqa: ANN003
        return hidden_states + torch.tanh(self.lin(hidden_states))


class _Scaled(nn.Module):
    """A stack that changes the hidden state between its layers: a member's input cannot be rebuilt."""

    _no_split_modules = ["_Block"]
    supports_gradient_checkpointing = True

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x) * 0.5)


def test_refusals_name_the_value_the_rule_and_the_fix():
    model = _Scaled().train()
    apply_activation_checkpointing(model)
    apply_checkpoint_groups(model, 2)
    with pytest.raises(ValueError, match=r"decoder layer 1 \(_Block\) does not take the previous layer's output.*"
                                         r"set model.checkpoint_group_layers=1"):  # fmt: skip
        model(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(ValueError, match="model.checkpoint_group_layers=0 must be an int >= 1"):
        check_group_layers(0)
    with pytest.raises(ValueError, match="they are not checkpointed; set model.activation_checkpointing=true"):
        apply_checkpoint_groups(_Scaled(), 2)
    assert apply_checkpoint_groups(_Scaled(), 1) is None


def test_config_rules():
    from automodel.config.offload_rules import checkpoint_group_problems
    from automodel.config.schema import RecipeConfig

    def problems(**model) -> list[str]:
        cfg = RecipeConfig()
        for key, value in model.items():
            setattr(cfg.model, key, value)
        return checkpoint_group_problems(cfg)

    assert problems(checkpoint_group_layers=2, activation_checkpointing=True) == []
    assert problems(checkpoint_group_layers="auto", activation_checkpointing=True) == []
    assert "must be an int >= 1" in problems(checkpoint_group_layers=0, activation_checkpointing=True)[0]
    assert "set model.activation_checkpointing=true, or model.checkpoint_group_layers=1" in problems(
        checkpoint_group_layers=2)[0]  # fmt: skip
    assert "model.compile=false" in problems(checkpoint_group_layers=2, activation_checkpointing=True, compile=True)[0]
    cfg = RecipeConfig()
    cfg.model.activation_checkpointing, cfg.model.checkpoint_group_layers, cfg.distributed.tp_size = True, 3, 2
    assert "distributed.tp_size=2" in checkpoint_group_problems(cfg)[0]


def test_the_plan_counts_the_groups_on_the_host_and_the_device():
    from automodel.training.memory_plan import ModelDims, RunShape, checkpoint_group_auto_choice, plan_memory
    from automodel.training.step_estimate import replayed_layers

    d = ModelDims(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, head_dim=128, vocab=152064,
                  params=32_000_000_000, trainable=32_000_000_000, layer_params=500_000_000,
                  root_params=1_500_000_000)  # fmt: skip
    r = RunShape(local_batch=1, seq=3_000_000, cp=8, cp_method="ulysses", activation_checkpointing=True,
                 chunk_tokens=1024, compute_bytes=2, tiled_mlp=True, tiled_layer=True, activation_offload=True,
                 offload="all")  # fmt: skip
    per = r.local_tokens * d.hidden * 2  # one layer input
    one, two = plan_memory(d, r), plan_memory(d, dataclasses.replace(r, checkpoint_group=2))
    offloaded = {p: next(t.bytes for t in plan.host if t.name == "offloaded activations") for p, plan in ((1, one), (2, two))}
    assert offloaded == {1: 64 * per, 2: 32 * per}
    # the recompute holds the group's two inputs and the prefetched one: one more than without groups
    assert two.by_moment["recompute"]["attention"]["activations"] - one.by_moment["recompute"]["attention"]["activations"] == per
    assert replayed_layers(d, dataclasses.replace(r, checkpoint_group=2)) == 32 and replayed_layers(d, r) == 0
    k, why = checkpoint_group_auto_choice(d, r, host_limit_bytes=256 * 2**30)
    assert k == 2 and "the fewest layers per group" in why
    assert checkpoint_group_auto_choice(d, r, host_limit_bytes=1e15)[0] == 1
    # without offload the kept inputs are on the device: ceil(L / k) at the loss
    kept = dataclasses.replace(r, activation_offload=False, offload=False)
    loss1 = plan_memory(d, kept).phases["loss"]["activations"]
    loss4 = plan_memory(d, dataclasses.replace(kept, checkpoint_group=4)).phases["loss"]["activations"]
    assert loss1 - loss4 == (64 - 16) * per


def test_the_estimate_counts_the_rebuilt_forwards_cp_exchange():
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.training.memory_plan import ModelDims, RunShape
    from automodel.training.step_estimate import comm_terms, estimate_step

    d = ModelDims(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, head_dim=128, vocab=152064,
                  params=32_000_000_000, trainable=32_000_000_000, layer_params=500_000_000,
                  root_params=1_500_000_000)  # fmt: skip
    r = RunShape(local_batch=1, seq=3_000_000, cp=8, cp_method="ulysses", activation_checkpointing=True,
                 chunk_tokens=1024, compute_bytes=2)  # fmt: skip
    sizes = {"tp": 1, "cp": 8, "dp": 1, "dp_replicate": 1}
    grouped = dataclasses.replace(r, checkpoint_group=2)
    one, two = (next(t for t in comm_terms(d, x, sizes, 8) if t.exchange is not None) for x in (r, grouped))
    # 32 of the 64 layers run their forward, and its all-to-alls, once more
    assert two.bytes - one.bytes == pytest.approx(32 * one.exchange.forward_bytes)
    assert one.exchange.forward_bytes > 0 and "32 rebuilt layer forwards" in two.note
    e1, e2 = (estimate_step(d, x, sizes, 8, 1, GPU_SPECS["h100"], 8) for x in (r, grouped))
    assert e2.exposed_s > e1.exposed_s


def test_the_search_tries_groups_and_names_their_key():
    from automodel.training.plan_search import Techniques, all_techniques

    grouped = [t for t in all_techniques() if t.checkpoint_group > 1]
    assert grouped and all(t.activation_offload and t.offload for t in grouped)
    t = Techniques(True, True, True, True, "all", tiled_layer=True, checkpoint_group=2)
    assert t.text(1) == "ckpt+chunk+lay+aoff+grp2+off:all"
    assert "model.checkpoint_group_layers=2" in t.overrides(1)
    assert "model.checkpoint_group_layers" not in " ".join(dataclasses.replace(t, checkpoint_group=1).overrides(1))


def test_auto_resolves_from_the_plans_host_memory_and_the_rules_refuse_bad_values():
    """``model.checkpoint_group_layers: auto`` on the shipped 32B config (no model built: its dims): 2 at its row (the
    host would need 406 GiB per GPU without groups), 1 at 2M tokens (fits without); a bad value is one config error."""
    from automodel.config import load_config
    from automodel.config.typecheck import ConfigError
    from automodel.training.memory_plan import ModelDims, resolve_checkpoint_group

    d = ModelDims(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, head_dim=128, vocab=152064,
                  params=32_763_876_352, trainable=32_763_876_352, layer_params=488_646_656,
                  root_params=1_557_135_360)  # fmt: skip
    sizes = {"cp": 8, "tp": 1, "dp_shard": 1}
    argv = ["--config", "configs/qwen2_5_32b_longest_8gpu.yaml", "model.checkpoint_group_layers=auto"]
    cfg = load_config(argv, world_size=8).cfg
    assert resolve_checkpoint_group(cfg, d, sizes, 4524192, 1, 256 * 2**30)[0] == 2
    assert resolve_checkpoint_group(cfg, d, sizes, 2_000_000, 1, 256 * 2**30)[0] == 1
    with pytest.raises(ConfigError, match="model.checkpoint_group_layers=0 must be an int >= 1"):
        load_config(["--config", "configs/qwen2_5_32b_longest_8gpu.yaml", "model.checkpoint_group_layers=0"], world_size=8)
