"""Config composition and validation: every rejected config names the key and the fix.

Most checks call :func:`automodel.config.load_config` in-process (no process group, no model);
``test_subprocess_*`` run the real recipe script to check exit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from automodel.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"


def load(*overrides: str, world: int = 2, config: str = "configs/cp.yaml"):
    return load_config(["--config", config, *overrides], world_size=world)


def problems(*overrides: str, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, world=world)
    return str(info.value)


# ------------------------------------------------------------------ composition and overrides


def test_default_config_is_valid_and_typed():
    cfg = load().cfg
    assert cfg.distributed.cp_size == 2 and cfg.distributed.cp_method == "ring"
    assert isinstance(cfg.optimizer["lr"], float)
    assert cfg.model.config["_target_"] == "transformers.LlamaConfig"


def test_config_found_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(["--config", "configs/cp.yaml"], world_size=2).path == REPO / "configs" / "cp.yaml"
    assert load_config(["--config", "cp"], world_size=2).path == REPO / "configs" / "cp.yaml"
    assert load_config([], world_size=2).path == REPO / "configs" / "cp.yaml"  # the embedded default


def test_hydra_override_grammar():
    cfg = load("distributed.cp_size=1", "step_scheduler.max_steps=20", "optimizer.lr=1e-4").cfg
    assert (cfg.distributed.cp_size, cfg.step_scheduler.max_steps, cfg.optimizer["lr"]) == (1, 20, 1e-4)
    # a schema key the YAML leaves at its default needs no '+'
    assert load("recipe.dry_run=true", "export.dtype=bfloat16").cfg.recipe.dry_run is True
    # '+' adds a key the target accepts; '~' deletes (the schema default comes back)
    cfg = load("+optimizer.foreach=true", "~checkpoint", "~step_scheduler.val_every_steps").cfg
    assert cfg.optimizer["foreach"] is True
    assert cfg.checkpoint.enabled is True and cfg.checkpoint.keep_last == 2
    assert cfg.step_scheduler.val_every_steps is None


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"--config nope.yaml: no such file"):
        load_config(["--config", "nope.yaml"], world_size=1)


def test_unknown_flag():
    with pytest.raises(ConfigError, match=r"unknown flag '--cfg'"):
        load_config(["--cfg", "x.yaml"], world_size=1)


# ------------------------------------------------------------------ unknown keys and types


def test_unknown_key_added_with_plus():
    msg = problems("+new.key=1")
    assert "new: unknown key" in msg and "Known keys:" in msg


def test_unknown_nested_key_added_with_plus_suggests_the_right_one():
    msg = problems("+step_scheduler.max_step=3")
    assert "step_scheduler.max_step: unknown key" in msg and "did you mean 'step_scheduler.max_steps'" in msg


def test_misspelt_override_without_plus_suggests_the_right_one():
    msg = problems("step_scheduler.max_step=3")
    assert "step_scheduler.max_step: unknown key" in msg and "did you mean 'step_scheduler.max_steps'" in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("step_scheduler.max_steps=abc", "step_scheduler.max_steps: expected int, got 'abc'"),
        ("step_scheduler.max_steps=2.5", "step_scheduler.max_steps: expected int, got 2.5"),
        ("recipe.dry_run=maybe", "recipe.dry_run: expected bool, got 'maybe'"),
        (
            "distributed.backend=mpi",
            "distributed.backend: 'mpi' is not allowed; expected one of 'auto', 'gloo', 'nccl'",
        ),
        ("checkpoint.resume=sometimes", "checkpoint.resume: expected bool or one of 'auto'"),
        ("model.dtype=fp8", "model.dtype: 'fp8' is not allowed"),
        ("data=3", "data: expected a mapping"),
        ("optimizer.lr=fast", "optimizer.lr: expected float (argument of 'torch.optim.AdamW'), got 'fast'"),
    ],
)
def test_wrong_types(override, expected):
    assert expected in problems(override)


def test_target_node_keys_are_checked_against_the_callable():
    msg = problems("+optimizer.lrr=0.1")
    assert "optimizer.lrr: unknown key ('torch.optim.AdamW' takes no 'lrr')" in msg
    assert "did you mean 'optimizer.lr'" in msg
    msg = problems("+model.config.num_hiden_layers=3")
    assert (
        "model.config.num_hiden_layers: unknown key" in msg
        and "did you mean 'model.config.num_hidden_layers'" in msg
    )
    assert "cannot import 'transformers.LlamaConfg'" in problems(
        "model.config._target_=transformers.LlamaConfg"
    )


def test_keys_the_recipe_supplies_are_rejected_in_targets():
    assert "data.dataset.seq_len: set by the recipe (from data.seq_len)" in problems(
        "+data.dataset.seq_len=64"
    )
    assert "optimizer.params: set by the recipe" in problems("+optimizer.params=1")


def test_all_problems_are_reported_at_once():
    msg = problems("step_scheduler.max_steps=abc", "+foo=1", "distributed.backend=mpi")
    assert "3 problems" in msg


# ------------------------------------------------------------------ impossible combinations


def test_world_size_not_divisible_by_fixed_sizes():
    msg = problems("distributed.cp_size=3", world=2)
    assert "world size 2 (processes launched) is not divisible by" in msg and "= 3" in msg


def test_world_size_does_not_match_product():
    msg = problems("distributed.dp_shard=2", "distributed.cp_size=2", world=2)
    assert "dp_shard * cp_size * tp_size = 1*2*2*1 = 4 does not match the world size 2" in msg
    assert "launch 4 processes" in msg


def test_sequence_length_not_divisible_by_2_cp_tp_is_padded_by_the_collator():
    from automodel.training.row_padding import pad_multiple

    loaded = load("distributed.cp_size=4", "data.seq_len=100", world=4)  # no longer an error
    assert pad_multiple(loaded.cfg) == 8  # rows are right-padded to 104 with labels -100: exact
    assert load("distributed.cp_size=4", "data.seq_len=100", "data.pad_to_multiple_of=8", world=4)


def test_pad_to_multiple_of_must_be_a_multiple_of_2_cp_tp():
    msg = problems("data.pad_to_multiple_of=6", world=2)
    assert "data.pad_to_multiple_of=6 is not a multiple of 2*cp_size = 2*2 = 4" in msg


def test_ring_cp_needs_sdpa_or_eager():
    msg = problems("model.attn_implementation=flex_attention")
    assert "distributed.cp_method=ring with cp_size=2 needs model.attn_implementation in ['sdpa', 'eager']" in msg
    assert "set model.attn_implementation=sdpa (eager for a model without SDPA support, e.g. gpt-oss)" in msg
    # the other methods named pass the same rules (flex: only ulysses at cp=2; usp has no configuration at cp=2)
    assert "takes attn_implementation='flex_attention' with this config: ulysses, or auto" in msg
    assert load("model.attn_implementation=flex_attention", "distributed.cp_method=ulysses")
    assert load("model.attn_implementation=eager")  # ring routes an eager model's layers (docs/cp_layer_kinds.md)
    assert load("model.attn_implementation=flex_attention", "distributed.cp_size=1")  # fine without CP
    msg = problems("model.attn_implementation=eager", "distributed.enable_compiled_autograd=true")
    assert "enable_compiled_autograd=true with distributed.cp_method=ring and model.attn_implementation=eager" in msg


def test_ring_cp_rejects_packed_rows():
    msg = problems("+data.dataset.pack=true")
    assert "data.dataset.pack=true (several documents per row) with distributed.cp_method=ring" in msg
    assert "Set distributed.cp_method to one that takes packed rows with this config: ulysses | thd | thd_docs, or auto" in msg
    for other in ("ulysses", "thd", "thd_docs"):  # each method named passes the same rules
        assert load("+data.dataset.pack=true", f"distributed.cp_method={other}")
    assert load("+data.dataset.pack=true", "distributed.cp_size=1")


def test_unknown_cp_method():
    from automodel.distributed.cp import cp_methods

    msg = problems("distributed.cp_method=allgather_magic")
    assert f"distributed.cp_method='allgather_magic' is not one of {sorted(cp_methods())}" in msg


def test_global_batch_not_divisible():
    msg = problems(
        "distributed.cp_size=1", "step_scheduler.global_batch_size=12", "step_scheduler.local_batch_size=4"
    )
    assert "step_scheduler.global_batch_size=12 is not divisible by local_batch_size * dp = 4*2 = 8" in msg


def test_loss_parallel_needs_tensor_parallel():  # the TP rules: tests/test_tp_validation.py
    assert "enable_loss_parallel=true needs a vocabulary sharded" in problems(
        "distributed.enable_loss_parallel=true"
    )


def test_a_model_is_required():
    assert "model: set model.pretrained_model_name_or_path" in problems("~model.config")


def test_nonpositive_values():
    msg = problems("step_scheduler.max_steps=0", "clip_grad.max_norm=-1")
    assert "step_scheduler.max_steps=0 must be >= 1" in msg and "clip_grad.max_norm=-1.0 must be > 0" in msg


# ------------------------------------------------------------------ model-level checks (config only)


def _check(config, **kw):
    from automodel.models.loader import check_model_for_run

    args = dict(attn_implementation="sdpa", cp_size=2, cp_method="ring", seq_len=256)
    args.update(kw)
    check_model_for_run(config, **args)


def test_model_without_sdpa_is_rejected_naming_eager():
    from transformers import Gemma2Config

    with pytest.raises(
        ValueError,
        match=r"Gemma2ForCausalLM cannot run attn_implementation='sdpa'; set model.attn_implementation=eager "
        r"\(distributed.cp_method=ring runs eager models\)",
    ):
        _check(Gemma2Config(num_hidden_layers=1))


def test_sdpa_is_refused_where_it_would_drop_the_attention_softcap_on_any_transformers():
    """transformers 5.17 lets Gemma 2 run SDPA, which ignores ``attn_logit_softcapping``; 5.25 refuses the class. The
    recipe refuses it on both, naming eager, and says why where the class alone would allow it."""
    from transformers import Gemma2Config

    from automodel.distributed.torch_internals import sdpa_problem

    class CapsWithSdpa:  # a class that claims SDPA (Gemma2ForCausalLM on 5.17)
        _supports_sdpa = True

    assert sdpa_problem(CapsWithSdpa, Gemma2Config(num_hidden_layers=1)) == (
        "SDPA cannot apply its attention logit softcapping (attn_logit_softcapping=50.0)"
    )
    assert sdpa_problem(CapsWithSdpa, Gemma2Config(num_hidden_layers=1, attn_logit_softcapping=None)) is None
    assert sdpa_problem(type("NoSdpa", (), {})) == "NoSdpa has no SDPA path"
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM cannot run attn_implementation='sdpa'; set "
                       r"model\.attn_implementation=eager"):  # fmt: skip
        _check(Gemma2Config(num_hidden_layers=1, attn_logit_softcapping=30.0), cp_size=1)
    _check(Gemma2Config(num_hidden_layers=1), attn_implementation="eager")


def test_sliding_window_shorter_than_the_row_and_softcap_run_under_ring_ulysses_thd():
    from transformers import Gemma2Config, MistralConfig

    from automodel.distributed.cp import check_model_config_for_cp

    config = MistralConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    gemma2 = Gemma2Config(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    for method in ("ring", "ulysses", "thd", "thd_docs"):  # the halo kernel (ring, thd, thd_docs) or the global mask
        check_model_config_for_cp(method, config, 2, seq_len=8192)
        check_model_config_for_cp(method, gemma2, 2, seq_len=8192)  # eager: the halo kernel applies the cap


def test_vocab_must_cover_the_tokenizer():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"tokenizer has 1024 token ids but the model's vocab_size is 512"):
        _check(LlamaConfig(vocab_size=512, num_hidden_layers=1), vocab_needed=1024)


@pytest.mark.parametrize(
    "family", ["LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig", "GemmaConfig"]
)
def test_supported_families_pass(family):
    import transformers

    _check(getattr(transformers, family)(num_hidden_layers=1), seq_len=2048)


def test_config_overrides_apply_and_are_checked():
    from automodel.models.loader import resolve_model_config

    cfg = load("+model.config_overrides.num_hidden_layers=3").cfg
    assert resolve_model_config(cfg.model).config.num_hidden_layers == 3
    cfg = load("+model.config_overrides.num_layerz=3").cfg
    with pytest.raises(
        ValueError, match=r"model.config_overrides: \['num_layerz'\] are not fields of LlamaConfig"
    ):
        resolve_model_config(cfg.model)


def test_inline_config_must_match_the_pretrained_one(tmp_path):
    from transformers import LlamaConfig

    from automodel.models.loader import resolve_model_config

    LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                tie_word_embeddings=True).save_pretrained(tmp_path)  # fmt: skip
    cfg = load(f"model.pretrained_model_name_or_path={tmp_path}").cfg
    resolved = resolve_model_config(cfg.model)
    assert resolved.pretrained and resolved.config.hidden_size == 128 and resolved.config.use_cache is False
    cfg = load(f"model.pretrained_model_name_or_path={tmp_path}", "model.config.hidden_size=64").cfg
    with pytest.raises(
        ValueError, match=r"model.config does not describe .*hidden_size: model.config has 64, .* has 128"
    ):
        resolve_model_config(cfg.model)


def test_missing_pretrained_model_offline(monkeypatch):
    from automodel.models.loader import resolve_model_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load("model.pretrained_model_name_or_path=no-such-org/no-such-model", "~model.config").cfg
    with pytest.raises(ValueError, match=r"no config found in local files and the hub cache"):
        resolve_model_config(cfg.model)


# ------------------------------------------------------------------ dry runs of the real-model configs


@pytest.mark.parametrize(
    ("config", "world", "expect"),
    [
        (
            "configs/llama3_2_1b_32k_cp4.yaml",
            8,
            ["dp_shard 2 x cp 4", "[1, 32768] int64 before CP -> [1, 8192]"],
        ),
        (
            "configs/qwen3_1_7b_64k_cp8.yaml",
            16,
            ["dp_shard 2 x cp 8", "[1, 65536] int64 before CP -> [1, 8192]"],
        ),
        (
            "configs/llama3_1_8b_tp2_cp4.yaml",
            16,
            [
                "dp_shard 2 x cp 4 x tp 2",
                "[1, 65536] int64 before CP -> [1, 16384]",
                "[1, 16, 16384, 128] / [1, 4, 16384, 128]",  # 16 of 32 heads, 4 of 8 KV heads per TP rank
                "with loss parallel ([16384, 64128] per rank) vs",
                "without ([16384, 128256] gathered); distributed.enable_loss_parallel is on",
            ],
        ),
    ],
)
def test_real_model_configs_dry_run_without_weights(config, world, expect, monkeypatch):
    from automodel.training.dry_run import dry_run_report

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # (dry runs read local files only in any case)
    loaded = load_config(["--config", config, "recipe.dry_run=true", f"recipe.dry_run_world_size={world}"])
    assert loaded.world_size == world
    report = dry_run_report(loaded)
    for text in expect:
        assert text in report
    assert "stands in for" in report  # built from the inline config, no weights


def test_dry_run_plans_the_configs_gpus_else_the_minimum_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    loaded = load_config(["--config", "configs/llama3_2_1b_32k_cp4.yaml", "recipe.dry_run=true"])
    assert loaded.world_size == 8  # recipe.gpus: the 8 GPUs its header names
    loaded = load_config(["--config", "configs/llama3_2_1b_32k_cp4.yaml", "recipe.dry_run=true", "recipe.gpus=null"])
    assert loaded.world_size == 4


# ------------------------------------------------------------------ the real script


def _recipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_subprocess_invalid_config_exits_2_before_anything_is_built(tmp_path):
    out = tmp_path / "outputs"
    proc = _recipe(
        "--config", "configs/cp.yaml", "distributed.cp_size=3", f"recipe.output_root={out}", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "world size 1 (processes launched) is not divisible by" in proc.stderr
    assert not out.exists()  # no run directory, no process group, no model


def test_subprocess_dry_run(tmp_path):
    proc = _recipe("--config", "configs/cp.yaml", "recipe.dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "world size 2 = dp_replicate 1 x dp_shard 1 x cp 2 x tp 1" in proc.stdout
    assert "0       0        0  0  0 |       0        0 | [0, 64), [192, 256)" in proc.stdout
    assert "[4, 256] int64 before CP -> [4, 128] on each rank" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_compiled_autograd_with_fsdp2_is_rejected():
    # the narrower rule that replaced "rejected until it works": see tests/test_compile_config.py
    msg = problems("distributed.enable_compiled_autograd=true")
    assert "distributed.enable_compiled_autograd=true with fsdp.enabled=true" in msg
    assert "set fsdp.enabled=false" in msg


def test_warmup_stable_decay_steps_are_checked_before_the_model_loads():
    wsd = ("lr_scheduler._target_=automodel.training.lr_schedule.warmup_stable_decay", "step_scheduler.max_steps=20")
    assert "warmup_steps + decay_steps = 10 + 15 is more than step_scheduler.max_steps=20" in problems(
        *wsd, "lr_scheduler.warmup_steps=10", "+lr_scheduler.decay_steps=15"
    )
    # the default decay (the last 10%: 2 of 20 steps) after a warmup of all 20 steps
    assert "warmup_steps + decay_steps = 20 + 2" in problems(*wsd, "lr_scheduler.warmup_steps=20", "+lr_scheduler.decay_steps=null")
    assert "decay_shape='cosin' is not one of linear | cosine | 1-sqrt" in problems(*wsd, "+lr_scheduler.decay_shape=cosin")
    load(*wsd, "lr_scheduler.warmup_steps=10", "+lr_scheduler.decay_steps=10")  # fits exactly: valid
