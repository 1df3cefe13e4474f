"""Compile settings in the config: what is accepted, and what is rejected before any model loads.

No process group, no model: ``load_config`` validates the typed config and the rules only.
"""

from __future__ import annotations

import pytest
import torch

from automodel.config import ConfigError, load_config

CP = "configs/cp.yaml"
ULYSSES = "configs/cp_ulysses.yaml"


def load(*overrides: str, config: str = CP, world: int = 2):
    return load_config(["--config", config, *overrides], world_size=world).cfg


def problems(*overrides: str, config: str = CP, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["--config", config, *overrides], world_size=world)
    return str(info.value)


def test_defaults_are_off():
    cfg = load()
    assert cfg.model.compile is False and cfg.model.compile_backend == "inductor"
    assert cfg.distributed.enable_compiled_autograd is False and cfg.fsdp.enabled is True


@pytest.mark.parametrize("config", [CP, ULYSSES])
def test_supported_combinations_validate(config):
    ca = ["distributed.enable_compiled_autograd=true", "fsdp.enabled=false"]
    for overrides in (
        ca,
        ["model.compile=true"],
        ["model.compile=true", "fsdp.enabled=false"],
        [*ca, "model.compile=true", "model.compile_backend=aot_eager"],
        ["model.compile=true", "model.activation_checkpointing=true"],
    ):
        load(*overrides, config=config)


def test_compiled_autograd_with_fsdp2_is_rejected_with_the_reason_and_the_fix():
    msg = problems("distributed.enable_compiled_autograd=true", "fsdp.enabled=true")
    assert "distributed.enable_compiled_autograd=true with fsdp.enabled=true" in msg
    assert "torch._dynamo.disable" in msg and "reduce-scatter" in msg
    assert "set fsdp.enabled=false" in msg and "distributed.enable_compiled_autograd=false" in msg


def test_compiled_autograd_with_activation_checkpointing_is_rejected():
    msg = problems("distributed.enable_compiled_autograd=true", "fsdp.enabled=false", "model.activation_checkpointing=true")
    assert "distributed.enable_compiled_autograd=true with model.activation_checkpointing=true" in msg
    assert "set model.activation_checkpointing=false" in msg and "model.compile=true" in msg


def test_unknown_compile_backend_is_rejected():
    msg = problems("model.compile_backend=tensorrt")
    assert "model.compile_backend" in msg and "tensorrt" in msg


def test_backend_check_and_fixed_length_padding_units():
    from automodel.distributed.compiled_autograd import check_compile_backend
    from automodel.training.compile_stats import pad_batch_to_length

    with pytest.raises(ValueError, match="'bogus' is not one of"):
        check_compile_backend("bogus")
    batch = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "labels": torch.tensor([[6, 7, -100]]),
        "position_ids": torch.tensor([[0, 1, 0]]),
        "seq_lens": torch.tensor([[2, 1]]),
        "seq_lens_padded": torch.tensor([[2, 1]]),
    }
    out = pad_batch_to_length(batch, 5, pad_token_id=9)
    assert out["input_ids"].tolist() == [[5, 6, 7, 9, 9]]
    assert out["labels"].tolist() == [[6, 7, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    assert out["seq_lens"].tolist() == [[2, 1]] and out["seq_lens_padded"].tolist() == [[2, 3]]
    assert pad_batch_to_length(batch, 3) is batch
    with pytest.raises(ValueError, match="longer than the fixed compile length 2"):
        pad_batch_to_length(batch, 2)



def test_memory_plan_of_a_replicated_run_is_unsharded():
    from automodel.config.rules import parallel_sizes
    from automodel.training.memory_plan import run_shape_from_config

    cfg = load("distributed.cp_size=1", "fsdp.enabled=false", "distributed.enable_compiled_autograd=true")
    sizes, _ = parallel_sizes(cfg, 2)
    shape = run_shape_from_config(cfg, sizes, seq=256, grad_acc=1)
    assert shape.fsdp == 1 and shape.dp_shard == 2
