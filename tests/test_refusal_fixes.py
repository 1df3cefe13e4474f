"""Every refusal names a fix that works (issue 30): the first fix offered runs, and every alternative CP method a
refusal names runs the model under the same conditions.

- gpt-oss (no SDPA path in transformers) with ``model.attn_implementation=sdpa``: every path a user reaches (the
  config rules, the dry run, ``cp_method: auto``, the model check of a real launch) names
  ``model.attn_implementation=eager`` first, and with it every method's check passes (the own loop builds
  gpt-oss eager: transformers refuses ``sdpa`` for it itself). The real launch: tests/test_user_errors.py.
- The alternatives: each one a refusal names passes the same checks (:func:`run_problems`) at the same
  ``cp_size`` / ``tp_size`` / row length / packing; the family x method sweep is tests/test_refusal_matrix.py.
"""

from __future__ import annotations

import pytest

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import check_model_config_for_cp, cp_methods, profile_model
from automodel.distributed.cp.registry import alternatives, run_problems
from automodel.errors import UserInputError
from tests.family_matrix import SEQ, family_by_name

GPT_OSS = [
    "model.config._target_=transformers.GptOssConfig",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "+model.config.head_dim=16",
    "+model.config.num_local_experts=2",
    "+model.config.num_experts_per_tok=1",
    "+model.config.sliding_window=16",
    f"data.seq_len={SEQ}",
    "recipe.dry_run=true",
    "recipe.dry_run_world_size=2",
]
EAGER_FIX = "set model.attn_implementation=eager"


def _dry_run(*overrides: str) -> str:
    from automodel.training.dry_run import dry_run_report

    return dry_run_report(load_config(["--config", "configs/cp.yaml", *GPT_OSS, *overrides], world_size=2))


@pytest.mark.parametrize("method", ["ring", "ulysses", "thd", "thd_docs", "auto"])
def test_gpt_oss_with_sdpa_names_eager_first_and_eager_runs(method):
    with pytest.raises(UserInputError) as err:  # the dry run's model checks, in the launch's order
        _dry_run(f"distributed.cp_method={method}")
    msg = str(err.value)
    assert msg.startswith(f"GptOssForCausalLM cannot run attn_implementation='sdpa'; {EAGER_FIX}"), msg
    assert "cp_size=1" not in msg
    report = _dry_run(f"distributed.cp_method={method}", "model.attn_implementation=eager")  # the fix works
    assert "attn_implementation=eager" in report and "exact under cp_method" in report, report


def test_config_rules_offer_eager_first_for_an_inline_model_without_sdpa():
    with pytest.raises(ConfigError) as err:  # ring takes sdpa and eager, not flex
        load_config(["--config", "configs/cp.yaml", *GPT_OSS, "model.attn_implementation=flex_attention"],
                    world_size=2, cuda_available=True)  # fmt: skip
    msg = str(err.value)
    assert "got 'flex_attention'; set model.attn_implementation=eager (GptOssForCausalLM has no SDPA path)" in msg
    assert msg.index(EAGER_FIX) < msg.index("cp_size=1")
    _dry_run("model.attn_implementation=eager")  # the first fix offered passes the rules and the model check


def test_the_eager_fix_names_why_an_inline_model_has_no_exact_sdpa():
    gemma2 = ["model.config._target_=transformers.Gemma2Config", "model.config.hidden_size=64",
              "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
              "model.config.num_key_value_heads=2", "model.config.head_dim=16"]  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_config(["--config", "configs/cp.yaml", *gemma2, "model.attn_implementation=flex_attention"],
                    world_size=2, cuda_available=True)  # fmt: skip
    # 5.25 marks Gemma 2 without SDPA; 5.17 .. 5.24 offer SDPA, which would drop its softcapping: either reason is named
    reasons = ("(Gemma2ForCausalLM has no SDPA path)", "(SDPA cannot apply its attention logit softcapping")
    assert any(f"set model.attn_implementation=eager {why}" in str(err.value) for why in reasons), str(err.value)


def test_own_loop_gpt_oss_is_eager_and_every_method_at_cp2_takes_it():
    """``context_parallel(model, mesh, m)`` checks the model with :func:`check_model_config_for_cp` first: a
    gpt-oss built as users must build it (eager: transformers refuses sdpa for it) passes it under every method
    that has a configuration at cp_size 2, on rows of one document and on packed rows where the method
    takes them."""
    model = family_by_name("gpt_oss").build_config()
    import torch
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="eager"):  # transformers' own refusal in the own loop
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(model, attn_implementation="sdpa")
    with torch.device("meta"):  # as transformers' refusal says
        built = AutoModelForCausalLM.from_config(model, attn_implementation="eager")
    profile = profile_model(built)
    assert profile.attn_implementation == "eager" and any(layer.sinks for layer in profile.layers)
    for name, method in cp_methods().items():
        if not method.auto_configs(2, None):
            continue  # usp: no configuration at cp_size 2
        check_model_config_for_cp(name, profile, 2, seq_len=SEQ, packed=method.supports_packed)


def test_alternatives_are_exactly_the_methods_with_no_problem():
    """A refusal's alternatives and ``run_problems`` agree at every condition a refusal site knows."""
    llama = profile_model(family_by_name("llama").build_config())
    for cp, tp, packed in [(2, 1, False), (2, 1, True), (4, 1, False), (4, 2, False), (4, 2, True), (3, 1, False)]:
        found = {m.name: (m, o) for m, o in alternatives(llama, cp_size=cp, tp_size=tp, seq_len=96, packed=packed)}
        for name, method in cp_methods().items():
            configs = method.auto_configs(cp, None)
            runs = any(not run_problems(m, llama, cp_size=cp, tp_size=tp, seq_len=96, packed=packed)
                       for m, _ in configs)  # fmt: skip
            assert (name in found) == runs, (name, cp, tp, packed)
        if packed:
            assert "ring" not in found
        if tp == 2 and cp == 4:  # 4 heads / tp 2 = 2 per TP rank: Ulysses cannot split them over 4
            assert "ulysses" not in found and "ring" in found or packed
    # heads not divisible: the refusal names the methods that do run, and each passes the same check
    with pytest.raises(UserInputError) as err:
        check_model_config_for_cp("ulysses", llama, 4, tp_size=2, seq_len=96, packed=True)
    assert err.value.alternatives and "ring" not in err.value.alternatives, err.value.alternatives
    assert "methods that run this model exactly: " in str(err.value)
    for label in err.value.alternatives:
        name = label.split(" ")[0]
        options = dict(kv.split("=") for kv in label[len(name) + 2 : -1].split(", ")) if "(" in label else {}
        method = cp_methods()[name]
        if "ulysses_size" in options:
            method = type(method)(int(options["ulysses_size"]))
        check_model_config_for_cp(method, llama, 4, tp_size=2, seq_len=96, packed=True)


def test_a_refusal_with_no_alternative_at_these_settings_says_to_change_them():
    """A Qwen2-VL (64 heads) on packed rows at cp=3: ring takes no packed rows, Ulysses cannot split 64 heads over
    3, thd / thd_docs / usp take no VLM. Nothing runs at these settings, but ring and Ulysses do at others: the
    refusal says to change the sizes or the packing, not that no method runs the model."""
    from transformers import Qwen2VLConfig

    profile = profile_model(Qwen2VLConfig())
    assert profile.is_vlm and profile.num_attention_heads % 3
    with pytest.raises(UserInputError) as err:
        check_model_config_for_cp("ring", profile, 3, packed=True)
    assert err.value.alternatives == ()
    assert "no other CP method runs this model exactly at these sizes and rows: change distributed.cp_size" in str(
        err.value
    )
    assert [m.name for m, _ in alternatives(profile, exclude="ring", cp_size=3, packed=False)] == []  # 64 % 3
    assert "ulysses" in [m.name for m, _ in alternatives(profile, cp_size=4, packed=True)]  # 64 % 4 == 0
