"""Every tensor-parallel combination that cannot run is rejected before work, naming the value and the fix.

Config rules (:func:`automodel.config.rules.tp_problems`, run by ``load_config`` before any process
group or model) and the model-config check (``check_model_config_for_tp``: run by the trainer and
the dry run on the resolved transformers config, before any weight is read). One process, no model.
"""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig, Qwen2VLConfig, Qwen3Config

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import check_model_config_for_cp
from automodel.distributed.tensor_parallel import TP_MODEL_TYPES, tp_config_problems, tp_plan
from automodel.errors import UserInputError
from automodel.models.parallelize import check_model_config_for_tp


def load(*overrides: str, world: int = 2):
    return load_config(["--config", "configs/cp.yaml", *overrides], world_size=world)


def problems(*overrides: str, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, world=world)
    return str(info.value)


TP2 = ("distributed.cp_size=1", "distributed.tp_size=2")


def test_valid_tp_configs_load():
    assert load(*TP2).cfg.distributed.tp_size == 2
    cfg = load(*TP2, "distributed.enable_loss_parallel=true", "distributed.sequence_parallel=true").cfg
    assert cfg.distributed.enable_loss_parallel and cfg.distributed.sequence_parallel
    assert load("distributed.tp_size=2", "distributed.cp_method=ulysses", world=4).cfg.distributed.cp_size == 2


def test_loss_parallel_and_sequence_parallel_need_tp():
    msg = problems("distributed.enable_loss_parallel=true")
    assert "distributed.enable_loss_parallel=true needs a vocabulary sharded by tensor parallelism" in msg
    assert "set distributed.enable_loss_parallel=false, or distributed.tp_size=2" in msg
    msg = problems("distributed.sequence_parallel=true")
    assert "distributed.sequence_parallel=true splits the tokens over the tensor-parallel ranks" in msg
    assert "distributed.tp_size=1; set distributed.sequence_parallel=false" in msg


def test_chunked_loss_with_tp_is_rejected():
    msg = problems(*TP2, "loss.chunk_tokens=64", "distributed.enable_loss_parallel=true")
    assert "loss.chunk_tokens=64 with distributed.tp_size=2" in msg
    assert "set loss.chunk_tokens=null and distributed.enable_loss_parallel=true" in msg


def test_compile_and_the_replicated_mode_with_tp_are_rejected():
    msg = problems(*TP2, "model.compile=true")
    assert "model.compile=true with distributed.tp_size=2: on torch 2.13 the compiled decoder blocks" in msg
    msg = problems(*TP2, "fsdp.enabled=false")
    assert "fsdp.enabled=false with distributed.tp_size=2: the replicated mode sums whole, plain gradients" in msg
    msg = problems(*TP2, "fsdp.enabled=false", "distributed.enable_compiled_autograd=true")
    assert "distributed.enable_compiled_autograd=true with distributed.tp_size=2: compiled autograd runs only" in msg


def test_peft_with_tp_is_rejected():
    msg = problems(*TP2, "+peft.method=lora")
    assert "peft with distributed.tp_size=2: LoRA wraps the projections that the TP plan shards" in msg


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_attention_heads", 3), ("num_key_value_heads", 1), ("intermediate_size", 385), ("vocab_size", 1025)],
)
def test_inline_model_sizes_must_divide_by_tp(key, value):
    overrides = [f"model.config.{key}={value}"]
    if key == "num_attention_heads":
        overrides.append("model.config.num_key_value_heads=1")
    msg = problems(*TP2, *overrides)
    assert f"model.config.{key}={value} is not divisible by distributed.tp_size=2" in msg
    assert "set distributed.tp_size to a divisor of" in msg


def test_ulysses_splits_the_heads_tp_left():
    # 4 heads: tp=2 leaves 2 per rank, which cp=4 cannot split (world 8)
    msg = problems("distributed.tp_size=2", "distributed.cp_size=4", "distributed.cp_method=ulysses", world=8)
    assert "num_attention_heads=4, 2 per TP rank (distributed.tp_size=2), which is not divisible by distributed.cp_size=4" in msg
    with pytest.raises(UserInputError, match=r"2 per TP rank \(distributed.tp_size=2\), which is not divisible by distributed.cp_size=4"):
        check_model_config_for_cp("ulysses", LlamaConfig(num_attention_heads=4), 4, tp_size=2)
    check_model_config_for_cp("ulysses", LlamaConfig(num_attention_heads=8), 4, tp_size=2)  # 4 per TP rank
    check_model_config_for_cp("ring", LlamaConfig(num_attention_heads=4), 4, tp_size=2)  # ring splits tokens


def test_model_config_checks_before_weights():
    check_model_config_for_tp(LlamaConfig(), 1)  # no TP: nothing to check
    check_model_config_for_tp(Qwen3Config(num_key_value_heads=8), 8)
    with pytest.raises(UserInputError, match=r"tensor parallelism supports model_type in .*got 'gpt2'"):
        check_model_config_for_tp(GPT2Config(), 2)
    with pytest.raises(UserInputError, match="num_key_value_heads=8 is not divisible by distributed.tp_size=16"):
        check_model_config_for_tp(LlamaConfig(num_attention_heads=32, num_key_value_heads=8, vocab_size=32768), 16)
    with pytest.raises(UserInputError, match="vocab_size=32001 is not divisible by distributed.tp_size=2"):
        check_model_config_for_tp(LlamaConfig(vocab_size=32001), 2)
    with pytest.raises(UserInputError, match="vision-language model.*set distributed.tp_size=1"):
        check_model_config_for_tp(Qwen2VLConfig(), 2)


def test_problems_list_every_size_at_once():
    config = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=99, vocab_size=101)
    found = tp_config_problems(config, 4)
    assert [p.split("=")[0] for p in found] == [
        "model.config.num_attention_heads",
        "model.config.num_key_value_heads",
        "model.config.intermediate_size",
        "model.config.vocab_size",
    ]


def test_plan_extends_transformers_plan():
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=1, tie_word_embeddings=True))
    plain = tp_plan(model, loss_parallel=True)
    for pattern, kind in model.config.base_model_tp_plan.items():  # transformers' own entries, all mapped
        style = plain["model." + pattern]
        # embedding_rowwise: transformers 5.17's entry for a tied embedding (5.25 has none)
        expected = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "embedding_rowwise": RowwiseParallel}.get(kind)
        assert isinstance(style, expected) if expected else type(style).__name__ == "ReplicatedWithGradAllReduce"
    assert isinstance(plain["model.embed_tokens"], RowwiseParallel)  # beyond transformers: vocab-sharded
    assert not plain["lm_head"].use_local_output  # loss parallel: the DTensor logits reach the loss
    assert not any(isinstance(s, SequenceParallel) for s in plain.values())
    sp = tp_plan(model, loss_parallel=False, sequence_parallel=True)
    assert {k for k, s in sp.items() if isinstance(s, SequenceParallel)} == {
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.norm",
    }
    assert sp["lm_head"].use_local_output  # gathered logits without loss parallel
    assert set(TP_MODEL_TYPES) == {"llama", "qwen2", "qwen3", "mistral"}


def test_plan_takes_the_tied_embedding_entry_of_older_transformers():
    """transformers 5.17 adds ``embed_tokens: embedding_rowwise`` to a tied model's plan (5.25 does not): the same
    vocabulary-sharded embedding the plan makes anyway, on every release; that style anywhere else is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    def plan_with(extra: dict) -> dict:
        config = LlamaConfig(num_hidden_layers=1, tie_word_embeddings=True)
        config.base_model_tp_plan = {k: v for k, v in config.base_model_tp_plan.items() if k != "embed_tokens"} | extra
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return tp_plan(model, loss_parallel=True, sequence_parallel=True)

    without, with_entry = plan_with({}), plan_with({"embed_tokens": "embedding_rowwise"})
    assert sorted(without) == sorted(with_entry)
    assert all(type(without[k]) is type(with_entry[k]) and vars(without[k]) == vars(with_entry[k]) for k in without)
    with pytest.raises(ValueError, match=r"uses 'embedding_rowwise' for 'layers\.\*\.mlp\.up_proj', which this "
                       r"recipe does not map"):  # fmt: skip
        plan_with({"layers.*.mlp.up_proj": "embedding_rowwise"})
