"""``automodel.models.layer_calls``: the decoder-layer calls one training forward makes, read off the config, equal
the calls counted with forward hooks, for every family of the support matrix and for looped configs whose loops the
tiny rows do not run (Inkling2-loop's loop lies past its 6 layers; Dory's slices overlap). A family that starts to
loop its layers in a new transformers release fails here, before the memory plan under-counts it (Dory: -55%).

One process, tiny models on CPU, one forward of 16 tokens each (about 10 s for the matrix).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.distributed.cp.profile import text_config
from automodel.models.layer_calls import LayerCalls, layer_calls
from automodel.models.parallelize import decoder_layers
from tests.family_matrix import FAMILIES, cycled, family_or_skip

pytestmark = pytest.mark.usefixtures("one_thread")

#: (family, config overrides): configs whose loops run, each with layers called 0, 1 and several times
LOOPED = [
    # input 2, recurrent 2 (x3), output 2
    ("dory", {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
              "n_recurrent_loops": 3}),
    # layers 2..3 looped three times
    ("inkling2_loop_text", {"n_layers_per_attn_res_block": 2, "loop_layer_index_start": 2, "loop_layer_index_end": 4,
                            "loop_num_passes": 3}),
    # 3 high cycles of 2 low ones, the gradient through the last L cycle of the first two and both of the third
    ("hrm_text", {"H_cycles": 3, "L_cycles": 2, "L_bp_cycles": [2]}),
]


def _counted(config) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: ANN001
    """Per decoder layer, the calls with and without autograd in one training forward of 16 tokens."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    layers = decoder_layers(model)
    grad, no_grad = [0] * len(layers), [0] * len(layers)

    def hook(index):  # noqa: ANN001, ANN202
        def count(module, args, kwargs):  # noqa: ANN001, ANN202
            (grad if torch.is_grad_enabled() else no_grad)[index] += 1

        return count

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(hook(i), with_kwargs=True)
    model(input_ids=torch.randint(0, 64, (1, 16)))
    return tuple(grad), tuple(no_grad)


def _declared(config, modules: int) -> tuple[tuple[int, ...], tuple[int, ...]]:  # noqa: ANN001
    calls = layer_calls(text_config(config), modules)
    return (calls.grad, calls.no_grad) if calls is not None else ((1,) * modules, (0,) * modules)


def test_every_family_calls_its_layers_as_declared():
    looped, wrong = [], []
    for fam in FAMILIES:
        config = fam.build_config()
        config.use_cache = False
        counted = _counted(config)
        if counted != _declared(config, len(counted[0])):
            wrong.append((fam.name, counted, _declared(config, len(counted[0]))))
        if counted[0] != (1,) * len(counted[0]) or any(counted[1]):
            looped.append(fam.name)
    assert not wrong, wrong
    # the rows that loop as they stand: Dory's overlapping slices, HRM's cycles (the check above can fail), where the
    # installed transformers has them
    assert sorted(looped) == sorted({"dory", "hrm_text"} & {f.name for f in FAMILIES}), looped


@pytest.mark.parametrize("name,overrides", LOOPED, ids=[name for name, _ in LOOPED])
def test_looped_configs_call_their_layers_as_declared(name, overrides):
    fam = family_or_skip(name)
    config = fam.build_config()
    config.use_cache = False
    for key, value in overrides.items():
        setattr(config, key, value)
    if len(getattr(config, "layer_types", None) or ()) not in (0, config.num_hidden_layers):  # Dory: 4 -> 6 layers
        config.layer_types = cycled(config.layer_types, config.num_hidden_layers)
    counted = _counted(config)
    assert counted == _declared(config, len(counted[0]))
    grad, _ = counted
    assert max(grad) > 1, counted  # the loop ran


def test_the_schemes_by_hand():
    class Config:
        pass

    dory = Config()
    dory.num_hidden_layers, dory.n_input_layers, dory.n_recurrent_layers = 36, 8, 20
    dory.n_output_layers, dory.n_recurrent_loops = 8, 2
    calls = layer_calls(dory, 36)
    assert calls == LayerCalls((1,) * 8 + (2,) * 20 + (1,) * 8, (0,) * 36, restarts=1) and calls.total == 56
    inkling = Config()
    inkling.loop_layer_index_start, inkling.loop_layer_index_end, inkling.loop_num_passes = 6, 18, 3
    assert layer_calls(inkling, 24).total == 6 + 36 + 6 and layer_calls(inkling, 24).restarts == 2
    assert layer_calls(inkling, 6) is None  # the loop past the layers: each once
    hrm = Config()
    hrm.H_cycles, hrm.L_cycles, hrm.L_bp_cycles, hrm.num_layers_per_stack = 2, 3, [2], 4
    calls = layer_calls(hrm, 8)
    # high cycle 0: 1 of 3 L cycles with grad (the list padded [1, 2]); cycle 1: 2 of 3; H once per cycle
    assert calls.grad == (3,) * 4 + (2,) * 4 and calls.no_grad == (3,) * 4 + (0,) * 4
    assert calls.total == 20 and calls.total_no_grad == 12
    assert calls.restarts == 3 + 2 - 1  # the stacks' passes with autograd (3 L, 2 H) but the first
    assert layer_calls(Config(), 12) is None and layer_calls(dory, 0) is None


def test_the_step_estimate_counts_a_looped_model_as_its_unrolled_copy():
    """Dory with its 2 recurrent layers looped 3 times does the FLOPs of the same model with 6 recurrent layers run
    once (10 layer calls either way): matrix products and attention, with and without checkpointing; and one HRM
    forward adds its no_grad calls' forward FLOPs (2 N per call), nothing saved."""
    from automodel.training.memory_plan import model_dims
    from automodel.training.step_estimate import flops_per_token

    def dims(name: str, **overrides):  # noqa: ANN202
        config = family_or_skip(name).build_config()
        for key, value in overrides.items():
            setattr(config, key, value)
        if len(getattr(config, "layer_types", None) or ()) not in (0, config.num_hidden_layers):
            config.layer_types = cycled(config.layer_types, config.num_hidden_layers)
        with torch.device("meta"):
            return model_dims(AutoModelForCausalLM.from_config(config))

    looped = dims("dory", num_hidden_layers=6, n_input_layers=2, n_recurrent_layers=2, n_output_layers=2,
                  n_recurrent_loops=3)  # fmt: skip
    unrolled = dims("dory", num_hidden_layers=10, n_input_layers=2, n_recurrent_layers=6, n_output_layers=2,
                    n_recurrent_loops=1)  # fmt: skip
    assert (looped.layers, looped.calls, unrolled.calls, unrolled.layer_calls) == (6, 10, 10, 0)
    for ac in (False, True):
        assert flops_per_token(looped, 4096, ac) == pytest.approx(flops_per_token(unrolled, 4096, ac), rel=1e-12)
    hrm = dims("hrm_text")
    once = dataclasses.replace(hrm, layer_calls=0, no_grad_layer_calls=0, looped_params=0, no_grad_params=0)
    layer = hrm.layer_matmul_params // hrm.layers  # its 4 layers are alike
    mm, attn = flops_per_token(hrm, 4096, False)
    mm1, attn1 = flops_per_token(once, 4096, False)
    assert (hrm.calls, hrm.no_grad_layer_calls) == (10, 6)
    assert mm - mm1 == pytest.approx(6 * 6 * layer + 2 * 6 * layer)  # 6 more calls with autograd, 6 without
    assert attn / attn1 == pytest.approx((6 * 10 + 2 * 6) / (6 * 4))
