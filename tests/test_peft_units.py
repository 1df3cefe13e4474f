"""PEFT LoRA pieces in one process: the ``peft:`` config section and its rules, target-module
validation on a weightless model, the seeded in-place injection, and the recipe's error line.

Parity, frozen weights, adapter-only checkpoints and the export run through the recipe in
tests/test_peft_recipe.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.errors import UserInputError
from automodel.models.lora import adapter_parameter_names, apply_lora, check_lora_targets

LORA = "configs/cp_lora.yaml"
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(*overrides: str, config: str = LORA):
    return load_config(["--config", config, *overrides], world_size=2)


def problems(*overrides: str, config: str = LORA) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, config=config)
    return str(info.value)


def tiny(device: str = "cpu"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def section(**kw):
    from automodel.config.schema import PeftSection

    return PeftSection(**kw)


# ------------------------------------------------------------------ config


def test_cp_lora_config_is_valid_and_off_by_default():
    cfg = load().cfg
    assert (cfg.peft.method, cfg.peft.r, cfg.peft.alpha, cfg.peft.dropout) == ("lora", 8, 16, 0.0)
    assert cfg.peft.target_modules == LINEARS and cfg.export.merge_lora is True
    assert load(config="configs/cp.yaml").cfg.peft is None
    # a section with only some keys takes the defaults for the rest; a string is kept as a string
    cfg = load("+peft.r=4", config="configs/cp.yaml").cfg
    assert (cfg.peft.r, cfg.peft.target_modules) == (4, "all-linear")
    assert load("peft=null", "export.merge_lora=false").cfg.peft is None


@pytest.mark.parametrize(
    "override, expect",
    [
        ("peft.r=0", "peft.r=0 must be >= 1"),
        ("peft.alpha=0", "peft.alpha=0 must be > 0"),
        ("peft.dropout=1.0", "peft.dropout=1.0 must be in [0, 1)"),
        ("peft.target_modules=[]", "peft.target_modules=[] must list at least one module name"),
        ("peft.target_modules=''", "peft.target_modules is an empty string"),
        ("peft.method=ia3", "peft.method: 'ia3' is not allowed; expected one of 'lora'"),
        ("+peft.rank=4", "peft.rank: unknown key (not a key of 'peft')"),
    ],
)
def test_bad_peft_values_are_rejected_with_the_fix(override, expect):
    assert expect in problems(override)


def test_merge_lora_without_adapters_is_rejected():
    msg = problems("export.merge_lora=true", config="configs/cp.yaml")
    assert "export.merge_lora=true but there is no peft section" in msg


# ------------------------------------------------------------------ target modules


def test_every_listed_target_must_exist_and_the_error_lists_the_names():
    model = tiny("meta")
    check_lora_targets(model, section(target_modules=["q_proj", "self_attn.v_proj"]))
    check_lora_targets(model, section(target_modules="all-linear"))
    check_lora_targets(model, section(target_modules=r".*\.(q_proj|v_proj)"))
    # PEFT itself accepts this list because q_proj matches; a typo must not silently train less
    with pytest.raises(UserInputError) as info:
        check_lora_targets(model, section(target_modules=["q_proj", "qv_proj"]))
    msg = str(info.value)
    assert "peft.target_modules: ['qv_proj'] match no module of LlamaForCausalLM" in msg
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in msg


def test_a_string_is_a_regex_over_full_names():
    with pytest.raises(UserInputError, match=r"peft.target_modules='q_proj' matches no module"):
        check_lora_targets(tiny("meta"), section(target_modules="q_proj"))


def test_a_module_lora_cannot_adapt_is_rejected():
    with pytest.raises(UserInputError, match=r"PEFT cannot put LoRA on what it selects in LlamaForCausalLM"):
        check_lora_targets(tiny("meta"), section(target_modules=["input_layernorm"]))


def test_lora_on_a_tied_output_head_is_rejected():
    with pytest.raises(UserInputError, match=r"selects the output head 'lm_head', whose weight is tied"):
        check_lora_targets(tiny("meta"), section(target_modules=["q_proj", "lm_head"]))


def test_trainer_check_runs_on_a_weightless_model():
    from automodel.models.loader import resolve_model_config
    from automodel.models.lora import check_lora_for_model_config

    cfg = load("peft.target_modules=[q_proj,v_prj]").cfg
    with pytest.raises(UserInputError, match=r"\['v_prj'\] match no module"):
        check_lora_for_model_config(
            cfg.model, resolve_model_config(cfg.model), cfg.peft, attn_implementation="sdpa"
        )


def test_recipe_dry_run_prints_one_error_line(capsys):
    from recipes.finetune import main

    code = main(["--config", LORA, "recipe.dry_run=true", "peft.target_modules=[q_proj,qv_proj]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: peft.target_modules: ['qv_proj'] match no module")


# ------------------------------------------------------------------ injection


def test_apply_lora_is_seeded_freezes_the_base_and_starts_as_the_base():
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for global_seed in (1, 2):  # ranks seed their global RNG differently; the adapters must not differ
        torch.manual_seed(0)
        model = tiny()
        with torch.no_grad():
            base_logits = model(input_ids=probe).logits
        torch.manual_seed(global_seed)
        rng = torch.get_rng_state()
        apply_lora(model, section(r=4, alpha=8, target_modules=["q_proj", "down_proj"]), seed=1234)
        assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left as it was
        with torch.no_grad():
            assert torch.equal(model(input_ids=probe).logits, base_logits)  # lora_B starts at zero
        outs.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert sorted(outs[0]) == sorted(outs[1])
    assert all(torch.equal(outs[0][k], outs[1][k]) for k in outs[0])
    names = adapter_parameter_names(model)
    assert len(names) == 2 * 2 * 2  # lora_A/B x 2 modules x 2 layers
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert type(model).__name__ == "LlamaForCausalLM"  # in place: the HF class and forward are kept
    assert outs[0]["model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape == (4, 32)


def test_resuming_a_full_checkpoint_into_a_peft_run_is_refused(tmp_path):
    from automodel.training.checkpoint import Checkpointer, CheckpointLayout

    layout = CheckpointLayout(world_size=2, dp_replicate=1, dp_shard=1, cp=2, tp=1)
    (tmp_path / "meta.json").write_text(json.dumps({"step": 2, "layout": layout.__dict__}))
    with pytest.raises(ValueError, match=r"holds the whole model but this run saves adapters only"):
        Checkpointer(tmp_path.parent, layout, trainable_only=True).load(tmp_path, None, None, None, None)


def test_dry_run_counts_the_adapters():
    from automodel.training.dry_run import dry_run_report

    report = dry_run_report(load_config(["--config", LORA, "recipe.dry_run=true"]))
    # r * (in + out) per adapted linear; cp.yaml: hidden 128, k/v out 64 (2 kv heads x 32), mlp 384, 4 layers
    per_layer = 8 * ((128 + 128) + (128 + 64) + (128 + 64) + (128 + 128) + 2 * (128 + 384) + (384 + 128))
    assert f"peft lora r=8: {4 * per_layer / 1e6:.3f}M of them are trainable adapters" in report


def test_export_of_an_adapter_on_a_pretrained_base(tmp_path):
    """A pretrained base (a local directory): adapter/ only, pointing at it (no base/, no merged/)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from automodel.models.lora import export_lora

    torch.manual_seed(0)
    base_dir = tmp_path / "base_model"
    tiny().save_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    lora = section(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    apply_lora(model, lora, seed=3)
    with torch.no_grad():  # stand-in for training: non-zero adapters
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trained = model(input_ids=probe).logits
    out = export_lora(model, lora, tmp_path / "export", base_model_name_or_path=str(base_dir))
    assert sorted(p.name for p in out.iterdir()) == ["adapter"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4,
        8,
        ["down_proj", "q_proj", "v_proj"],
    )
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        base_logits = base(input_ids=probe).logits
        reloaded = PeftModel.from_pretrained(base, str(out / "adapter"))
        assert torch.equal(reloaded(input_ids=probe).logits, trained)
    assert (base_logits - trained).abs().max() > 1e-2  # the adapters matter
