"""The exported model is fit for generation: the tokenizer's special tokens, the KV cache, the tie flag.

A tiny Llama built from ``LlamaConfig`` (whose defaults say bos=1, eos=2) is exported with the shipped
tokenizer (bos = eos = 0, pad = 1) by :func:`export_hf_model` at world size 1, loaded back with
``from_pretrained`` and generated from: with the KV cache (the exported default), token for token what
the same model generates without it, and stopping at the tokenizer's EOS.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from automodel.data import load_tokenizer
from automodel.models.hf_save import save_hf_state
from automodel.training.export import export_hf_model

NEW = 12


def _tiny(tie: bool) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _greedy(model, ids: torch.Tensor, **kw) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                              do_sample=False, **kw)[0, ids.shape[1]:]  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tok = load_tokenizer(None)
    model = _tiny(tie=False)
    prompt = tok("the model of a small language", return_tensors="pt").input_ids
    # make the model emit EOS at its 4th new token: swap the output rows of that token and EOS (the
    # tokens before it, and so the inputs that lead to it, are unchanged)
    free = _greedy(model, prompt, eos_token_id=None, use_cache=False)
    assert tok.eos_token_id not in free.tolist()[:4]
    target = int(free[3])
    with torch.no_grad():
        w = model.lm_head.weight
        w[[target, tok.eos_token_id]] = w[[tok.eos_token_id, target]].clone()
    out = tmp_path_factory.mktemp("export") / "hf_model"
    export_hf_model(model, out, tokenizer=tok)
    return {"dir": out, "tok": tok, "prompt": prompt, "free": free}


def test_special_tokens_and_use_cache_come_from_the_tokenizer(exported):
    tok = exported["tok"]
    want = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    assert want == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}  # not LlamaConfig's 1, 2
    for name in ("config.json", "generation_config.json"):
        written = json.loads((exported["dir"] / name).read_text())
        assert {k: written.get(k) for k in want} == want, name
        assert written["use_cache"] is True, name
    assert AutoTokenizer.from_pretrained(str(exported["dir"])).eos_token_id == tok.eos_token_id


def test_exported_model_generates_with_its_kv_cache_and_stops_at_eos(exported):
    model = AutoModelForCausalLM.from_pretrained(str(exported["dir"])).eval()
    assert model.generation_config.use_cache is True
    prompt = exported["prompt"]
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                             do_sample=False, return_dict_in_generate=True)  # fmt: skip
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() > prompt.shape[1]
    new = out.sequences[0, prompt.shape[1] :].tolist()
    # the first 3 tokens as before, then EOS, and generation stops there (well before NEW tokens)
    assert new == [*exported["free"].tolist()[:3], exported["tok"].eos_token_id]
    assert _greedy(model, prompt, use_cache=False).tolist() == new  # the cache changes nothing


def test_samples_are_written_from_the_export(exported, tmp_path):
    from automodel.training.samples import generate_samples, load_exported_model, write_samples

    model = load_exported_model(exported["dir"], AutoModelForCausalLM, torch.device("cpu"))
    prompt_text = exported["tok"].decode(exported["prompt"][0])
    samples = generate_samples(model, exported["tok"], [prompt_text], NEW, torch.device("cpu"))
    path = write_samples(samples, tmp_path / "samples.jsonl")
    (line,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert line["stopped_at_eos"] is True and line["new_tokens"] == 4 and line["prompt"] == prompt_text


def test_tie_flag_follows_the_saved_embeddings(tmp_path):
    model = _tiny(tie=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # equal values, two tensors
    save_hf_state(type(model), model.config, dict(state), tmp_path / "same")  # save_pretrained pops tied keys
    assert json.loads((tmp_path / "same" / "config.json").read_text())["tie_word_embeddings"] is True
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # e.g. a merge that changed the head
    save_hf_state(type(model), model.config, dict(state), tmp_path / "differ")
    assert json.loads((tmp_path / "differ" / "config.json").read_text())["tie_word_embeddings"] is False
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "differ"))
    assert torch.equal(loaded.lm_head.weight, state["lm_head.weight"])


def test_lora_merge_keeps_a_true_tie_without_peft_warning(tmp_path):
    import warnings

    from automodel.config.schema import PeftSection
    from automodel.models.lora import apply_lora, export_lora

    model = _tiny(tie=True)
    apply_lora(model, PeftSection(), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # PEFT's "no longer tied" would raise here
        export_lora(model, PeftSection(), tmp_path / "x", base_model_name_or_path=None, merge=True,
                    tokenizer=load_tokenizer(None))  # fmt: skip
    merged = json.loads((tmp_path / "x" / "merged" / "config.json").read_text())
    assert merged["tie_word_embeddings"] is True and merged["eos_token_id"] == 0 and merged["use_cache"] is True


def test_no_progress_bar_frames_in_a_log(tmp_path, capfd):
    """stderr is not a terminal here (a cluster log): transformers' "Writing model shards" bar stays off, and
    its progress-bar switch is left as it was."""
    from transformers.utils import logging as hf_logging

    model = _tiny(tie=True)
    assert hf_logging.is_progress_bar_enabled()
    save_hf_state(type(model), model.config, dict(model.state_dict()), tmp_path / "out")
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
