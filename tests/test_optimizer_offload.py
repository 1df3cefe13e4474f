"""Optimizer offload (automodel.training.optimizer_offload) and the rules of the offload keys.

In this process: the wrapped optimizer on host copies gives, step after step, the very parameters and state
of the optimizer without offload (fp32 and fp64, AdamW with weight decay and SGD with momentum, an LR schedule
on the wrapper, a parameter without a gradient); its state view is keyed like the plain optimizer's; the config
rules refuse what cannot run, with the fix.

Through the recipe (tests/test_recipe_parity.py's launches, tests/workers/recipe_worker.py): ring cp=2 with
activation offload and ``fsdp.offload=optimizer``, Ulysses cp=2 with activation offload and ``fsdp.offload=all``,
both against the same runs without offload; a run with offload stopped at step 4 and resumed (with offload, and
without), and a checkpoint without offload resumed with it, against the uninterrupted run. Every CP method at
cp=2 (tests/test_context_parallel.py) and ring at cp=4 (tests/test_cp_parity.py) step the offloaded optimizer
on their gradients too.
"""

from __future__ import annotations

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.training.optimizer_offload import HostOffloadOptimizer


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)
    model.extra = torch.nn.Parameter(torch.ones(2, dtype=dtype))  # never used: no gradient
    return model


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(5)
    lrs = []
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g, dtype=model[0].weight.dtype)
        model(x).square().sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    ],
    ids=["adamw", "sgd"],
)
def test_offloaded_steps_equal_plain_steps(dtype, make):
    ref = _model(dtype)
    ref_opt = make(list(ref.parameters()))
    ref_lrs = _train(ref, ref_opt)
    model = _model(dtype)
    opt = HostOffloadOptimizer(model.parameters(), make)
    lrs = _train(model, opt)
    assert lrs == ref_lrs  # the scheduler drives the wrapped optimizer's groups
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
        assert p.grad is None  # zero_grad cleared the model's gradients
    assert torch.equal(model.extra, torch.ones(2, dtype=dtype))
    assert all(m is not p and m.data_ptr() != p.data_ptr() for m, p in zip(opt.masters, model.parameters()))
    assert all(torch.equal(m, p) for m, p in zip(opt.masters, model.parameters()))
    ref_sd, sd = ref_opt.state_dict(), opt.model_view().state_dict()
    assert sorted(sd["state"]) == sorted(ref_sd["state"]) and len(sd["state"]) == 4  # extra: no state
    for k, state in ref_sd["state"].items():
        for key, value in state.items():
            assert torch.equal(sd["state"][k][key], value), (k, key)
    assert sd["param_groups"] == ref_sd["param_groups"]
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = params_bytes - model.extra.numel() * model.extra.element_size()
    assert opt.host_bytes() == params_bytes + grad_bytes + state_bytes


def test_model_view_shares_the_host_state_and_loading_groups():
    model = _model(torch.float32)
    opt = HostOffloadOptimizer(model.parameters(), lambda p: torch.optim.AdamW(p, lr=0.1))
    opt.ensure_state()  # no step yet: an lr=0 step creates the state and changes no parameter
    assert torch.equal(model[0].weight, _model(torch.float32)[0].weight)
    view = opt.model_view()
    weight = [id(p) for p in model.parameters()].index(id(model[0].weight))
    assert (
        view.state[model[0].weight] is opt.state[opt.masters[weight]]
    )  # the same tensors: a load fills them
    opt.load_param_groups([{"lr": 0.25, "params": [0, 1, 2, 3, 4]}])
    assert opt.param_groups[0]["lr"] == 0.25 and opt.param_groups[0]["params"][weight] is opt.masters[weight]
    with torch.no_grad():
        model[0].weight.add_(1.0)
    opt.sync_from_model()
    assert torch.equal(opt.masters[weight], model[0].weight)
    with pytest.raises(ValueError, match="2 parameter groups, this one 1"):
        opt.load_param_groups([{}, {}])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.activation_offload=true"],
            r"model.activation_offload=true with model.activation_checkpointing=false: .*"
            r"set model.activation_checkpointing=true, or model.activation_offload=false",
        ),
        (
            ["fsdp.offload=all", "fsdp.enabled=false"],
            r"fsdp.offload=all with fsdp.enabled=false: .*set fsdp.enabled=true, or fsdp.offload=optimizer",
        ),
        (["fsdp.offload=some"], r"fsdp.offload"),
    ],
)
def test_bad_offload_settings_are_refused_before_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "configs/cp.yaml", *overrides], world_size=2)


def test_good_offload_settings_validate():
    for overrides in (
        ["model.activation_checkpointing=true", "model.activation_offload=true", "fsdp.offload=optimizer"],
        ["fsdp.offload=all"],
        ["fsdp.offload=optimizer", "fsdp.enabled=false"],
    ):
        cfg = load_config(["--config", "configs/cp.yaml", *overrides], world_size=2).cfg
        assert cfg.fsdp.offload in (False, "optimizer", "all")
