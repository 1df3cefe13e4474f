"""Every refusal template renders as sentences (issue 37): each branch (no other method, one, several; packed
rows; the dry run's layout lines; ``auto``'s refusal, which embeds each method's) is rendered here and read by
:func:`assert_sentences`: every fix is a complete instruction (``set key=value``, ``set key to ...``, never
``Set no other ...``), and sentences start after a full stop."""

from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest

from automodel.config import ConfigError, load_config
from automodel.config.rules import either
from automodel.distributed.cp import check_model_config_for_cp
from automodel.distributed.cp.choose import choose_cp_method
from automodel.distributed.cp.profile import LayerSpec, ModelProfile
from automodel.errors import CPUnsupportedError, UserInputError

# what the garbled templates said (issue 37): a fix that is no instruction, or a list inside one
GARBLED = [
    r"\b[Ss]et no\b",
    r"\bno other distributed\.cp_method passes",
    r"; or another method:",
    r"\bor another distributed\.cp_method\b",
    r", or one document per row",
    r"\), or give one document",
    r"or tp_size=1",
    r"\(or auto\b",
    r"\) \(or auto",
    r"[.;,:] *[.;,]",  # doubled punctuation
]
# a fix starts with one of these verbs, or continues a list the verb before it opened ("set a=1 or b=2")
VERBS = ("set", "train", "change", "give", "pass", "use", "launch", "apply", "name", "add", "lower", "raise")


def assert_sentences(text: str) -> None:
    """``text`` reads as sentences: no garbled template, every ``set`` names a key (``key=value`` or ``key to``),
    and after a full stop comes a capital or a method's label (``ring: ...``)."""
    for pattern in GARBLED:
        assert not re.search(pattern, text.replace("...", "…")), (pattern, text)
    for m in re.finditer(r"\b[Ss]et (\S+)", text):
        assert re.fullmatch(r"[a-z_][a-z0-9_.\[\]]*(=\S*)?", m.group(1)) or m.group(1) == "it", (m.group(0), text)
        if "=" not in m.group(1):  # "set key to ..."
            assert text[m.end() : m.end() + 4] == " to ", (m.group(0), text)
    for m in re.finditer(r"(?<!e\.g)(?<!i\.e)\. (\S+)", text):
        word = m.group(1)
        assert word[0].isupper() or re.fullmatch(r"[a-z_]+(:|$)", word) or re.match(r"[a-z_]+ \(", text[m.start(1):]), (
            word, text)  # fmt: skip
    for m in re.finditer(r"(?:^|[;.] )or (\w+)", text):  # "...; or <fix>": a fix, with its verb
        assert m.group(1) in VERBS, (m.group(0), text)


def _profile(*layers: LayerSpec, heads: int = 4, kv: int = 2, vlm: bool = False) -> ModelProfile:
    layers = tuple(dataclasses.replace(layer, index=i) for i, layer in enumerate(layers))
    return ModelProfile("llama", "LlamaForCausalLM", layers, heads, kv, 16, vlm, "sdpa", True, hidden_size=heads * 16)


FULL = LayerSpec(0, "full_attention")


def test_either_joins_fixes_as_one_clause():
    assert either("set a=1") == "set a=1"
    assert either(None, "set a=1", None) == "set a=1"
    assert either("set a=1", "set b=2") == "set a=1 or set b=2"
    assert either("set a=1", None, "set b=2", "set c=3") == "set a=1, set b=2, or set c=3"
    assert either("set a to x | y, or auto", "set b=2") == "set a to x | y, or auto; or set b=2"
    assert either("set a=1 (x, e.g. y)", "set b=2") == "set a=1 (x, e.g. y) or set b=2"  # commas inside brackets


def _problems(*overrides: str, config: str = "configs/cp.yaml", world: int = 2) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(["--config", config, *overrides], world_size=world, cuda_available=False)
    return "\n".join(err.value.problems)


def test_config_rule_refusals_with_several_one_and_no_other_method():
    several = _problems("+data.dataset.pack=true")  # ring on packed rows: ulysses | thd | thd_docs
    assert "Set distributed.cp_method to one that takes packed rows with this config: ulysses | thd | thd_docs, " \
           "or auto (which also checks the model's layers); set data.dataset.pack=false; or set " \
           "distributed.cp_size=1" in several  # fmt: skip
    one = _problems("model.attn_implementation=flex_attention", "distributed.backend=gloo")
    assert "got 'flex_attention'; set model.attn_implementation=sdpa (eager for a model without SDPA" in one
    heads = _problems("distributed.cp_method=ulysses", "distributed.cp_size=4", "model.config.num_attention_heads=6",
                      world=4)  # fmt: skip
    assert "; or set distributed.cp_method to one that takes num_attention_heads=6 with this config: " in heads
    # no other method passes (flash_attention_2 on CPU: every method refuses it): the other fixes only
    none = _problems("model.attn_implementation=flash_attention_2")
    assert "set model.attn_implementation=sdpa (eager for a model without SDPA support, e.g. gpt-oss) or set " \
           "distributed.cp_size=1" in none  # fmt: skip
    for text in (several, one, heads, none):
        for problem in text.splitlines():
            assert_sentences(problem)


def test_auto_refusals_read_as_sentences():
    """cp_method auto with packed rows where no method passes the config rules (issue 37's garbled one), and the
    model-level refusal of choose_cp_method."""
    text = _problems("+data.dataset.pack=true", "distributed.cp_method=auto", "model.attn_implementation=flash_attention_2")
    assert text.startswith("distributed.cp_method=auto found no CP method this config can run. ring: ")
    assert "would attend across documents; packed rows need a method that keeps document boundaries. Set " \
           "data.dataset.pack=false or set distributed.cp_size=1. ulysses: " in text  # fmt: skip
    assert text.endswith(". usp: no configuration at cp_size=2. Change what one method's reasons name (auto then "
                         "picks that method), or set distributed.cp_size=1")  # fmt: skip
    assert_sentences(text)
    unknown = _profile(LayerSpec(0, "unknown", mixer="DogeAttention"), FULL)
    with pytest.raises(CPUnsupportedError) as err:
        choose_cp_method(unknown, 2, seq_len=64, packed=True)
    assert ". Change what one method's reasons name (auto then picks that method), or train it with " \
           "distributed.cp_size=1. See docs/support_matrix.md" in str(err.value)  # fmt: skip
    assert_sentences(str(err.value))


def test_model_refusals_name_methods_as_an_instruction():
    """check_model_config_for_cp: several methods, none at these sizes, none at all; packed rows; heads; a VLM."""
    dense = _profile(FULL)
    texts = []
    with pytest.raises(UserInputError) as err:  # packed rows under ring: several methods run them
        check_model_config_for_cp("ring", dense, 2, packed=True)
    assert "so it is refused; set distributed.cp_method to one of the methods that run this model exactly: " \
           "ulysses | thd | thd_docs; or give it one document per row (data.dataset.pack=false)" in str(err.value)
    texts.append(str(err.value))
    with pytest.raises(UserInputError) as err:  # 6 heads over 4: one head split refused, others run
        check_model_config_for_cp("ulysses", _profile(FULL, heads=6), 4)
    assert "; or set distributed.cp_method to one of the methods that run this model exactly: ring" in str(err.value)
    texts.append(str(err.value))
    vlm = _profile(FULL, heads=64, kv=8, vlm=True)  # nothing at cp 3 on packed rows; ring/ulysses elsewhere
    with pytest.raises(UserInputError) as err:
        check_model_config_for_cp("ring", vlm, 3, packed=True)
    assert err.value.alternatives == ()
    assert "so it is refused; no other CP method runs this model exactly at these sizes and rows: change " in str(
        err.value)  # fmt: skip
    texts.append(str(err.value))
    with pytest.raises(UserInputError) as err:  # heads, and nothing else at these sizes
        check_model_config_for_cp("ulysses", vlm, 3, packed=True)
    assert "; no other CP method runs" in str(err.value) and "; or no other" not in str(err.value)
    texts.append(str(err.value))
    with pytest.raises(UserInputError) as err:  # a VLM under thd
        check_model_config_for_cp("thd", vlm, 2)
    assert "does not take; set distributed.cp_method to one of the methods that run this model exactly: ring" in str(
        err.value)  # fmt: skip
    texts.append(str(err.value))
    with pytest.raises(CPUnsupportedError) as err:  # no method computes the layer: train without CP
        check_model_config_for_cp("ring", _profile(LayerSpec(0, "unknown", mixer="DogeAttention")), 2)
    assert "no CP method runs this model exactly yet: train it with distributed.cp_size=1. See" in str(err.value)
    texts.append(str(err.value))
    for text in texts:
        assert_sentences(text)


def test_own_loop_packed_refusal_reads_as_sentences(monkeypatch):
    """context_parallel's refusal of packed rows (at the first batch): several methods, and none."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from automodel.distributed.cp import get_cp_method
    from automodel.distributed.cp.context import ContextParallel

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128))  # fmt: skip
    several = ContextParallel._packed_fix(SimpleNamespace(model=model, method=get_cp_method("ring"), cp_size=2))
    assert "refused; pass context_parallel(model, mesh, method=...) one of the methods that run packed rows of this " \
           "model: ulysses | thd | thd_docs; or give it one document per row" in several  # fmt: skip
    assert_sentences(several)
    monkeypatch.setattr("automodel.distributed.cp.context.alternatives", lambda *a, **k: [])
    none = ContextParallel._packed_fix(SimpleNamespace(model=model, method=get_cp_method("ring"), cp_size=2))
    assert none.endswith("refused; no other method runs packed rows of this model: give it one document per row")
    assert_sentences(none)


def test_dry_run_layout_lines_read_as_sentences():
    """recipe.plan_layouts on packed rows: a layout the config's rules refuse (ring), one whose heads do not split
    (tp8.cp8, ulysses at cp 8): each refused line's reason reads as sentences."""
    from automodel.training.dry_run import dry_run_report

    report = dry_run_report(load_config([
        "--config", "configs/cp_packed.yaml", "recipe.dry_run=true", "recipe.dry_run_world_size=64",
        "step_scheduler.global_batch_size=64", "recipe.gpu_type=h100",
        "recipe.plan_layouts=[tp8.cp8,cp8.ulysses,cp8.ring,tp2.cp4]",
    ]))  # fmt: skip
    lines = [line for line in report.splitlines() if line.lstrip().startswith("refused ")]
    assert len(lines) == 3, report
    ring = next(line for line in lines if "cp8.ring" in line)
    assert "Set distributed.cp_method to one that takes packed rows with this config: thd | thd_docs | usp " \
           "(ulysses_size=2), or auto" in ring  # fmt: skip
    for line in lines:
        assert_sentences(line.split("): ", 1)[1])
