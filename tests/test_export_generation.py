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


# ---- chat exports stop where the data taught the model to stop (issue 27, item 5)

CHAT = [{"role": "user", "content": "What is 8 plus 28?"}]


def stop_after(model, tok, prompt: torch.Tensor, stop: int) -> list[int]:
    """Make ``model`` emit ``stop`` within its first 4 greedy tokens after ``prompt``; returns the tokens it
    emits up to and including ``stop``. A model that already does (trained on chats) is left as it is;
    otherwise ``stop`` takes the place of the last of its first 4 new tokens that it emits there for the
    first time (a tiny random model repeats itself): the output rows of that token and ``stop`` swap, on
    an untied copy, so the inputs are unchanged."""
    free = _greedy(model, prompt, eos_token_id=None, use_cache=False).tolist()
    if stop in free[:4]:
        return free[: free.index(stop) + 1]
    k = max(i for i in range(4) if free[i] not in free[:i])
    assert not (set(tok.all_special_ids) | {stop}) & set(free[: k + 1]), free  # nothing before stops it
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())  # untie: the input rows stay
        w = head.weight
        w[[free[k], stop]] = w[[stop, free[k]]].clone()
    model.config.tie_word_embeddings = False
    return [*free[:k], stop]


def check_generation_stops_at(export_dir, tok, stop: int) -> None:
    """Plain transformers: ``from_pretrained`` + ``generate`` with the exported generation config stop at
    ``stop`` (see :func:`stop_after`), and would not with the tokenizer's EOS alone."""
    model = AutoModelForCausalLM.from_pretrained(str(export_dir)).eval()
    eos = model.generation_config.eos_token_id
    assert isinstance(eos, list) and stop in eos and tok.eos_token_id in eos, eos
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = prompt["input_ids"]
    want = stop_after(model, tok, prompt, stop)
    assert tok.eos_token_id not in want
    new = _greedy(model, prompt).tolist()  # the exported generation config: stops at `stop`
    assert new == want
    longer = _greedy(model, prompt, eos_token_id=tok.eos_token_id).tolist()  # EOS alone: talks on
    assert longer[: len(new)] == new and len(longer) > len(new)


def _chat_jsonl(path, n: int = 8) -> str:
    recs = [
        {"messages": [{"role": "user", "content": f"{i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_chat_export_lists_the_end_of_turn_token_and_generation_stops_there(tmp_path):
    from automodel.data import InstructionDataset

    tok = load_tokenizer(None)
    ds = InstructionDataset(None, tok, seq_len=64, format="messages")  # the shipped ChatML template
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ds.chat_stop_ids == [im_end] == [3]
    export_hf_model(_tiny(tie=True), tmp_path / "hf_model", tokenizer=tok)
    gen = json.loads((tmp_path / "hf_model" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, 3]
    assert json.loads((tmp_path / "hf_model" / "config.json").read_text())["eos_token_id"] == 0  # the tokenizer's
    check_generation_stops_at(tmp_path / "hf_model", tok, im_end)


@pytest.mark.parametrize("fmt", ["text", "prompt_response"])
def test_a_run_without_chats_keeps_its_eos(tmp_path, fmt):
    from automodel.data import InstructionDataset, TextDataset

    tok = load_tokenizer(None)
    if fmt == "text":
        TextDataset(None, tok, seq_len=64)
    else:
        assert InstructionDataset(None, tok, seq_len=64, format=fmt).chat_stop_ids == []
    save_hf_state(type(m := _tiny(tie=False)), m.config, dict(m.state_dict()), tmp_path / "out", tokenizer=tok)
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == 0


OWN_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}<|eot|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def test_a_users_own_template_and_end_of_turn_token(tmp_path):
    """A template of the user's with its own special end-of-turn token: that token joins the EOS list."""
    from automodel.data import InstructionDataset

    tok = load_tokenizer(None)
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    tok.chat_template = OWN_TEMPLATE
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert eot == 1024
    ds = InstructionDataset(_chat_jsonl(tmp_path / "chat.jsonl"), tok, seq_len=64, format="messages", split="all")
    assert ds.chat_stop_ids == [eot]
    cfg = LlamaConfig(vocab_size=1088, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    export_hf_model(AutoModelForCausalLM.from_config(cfg).eval(), tmp_path / "hf_model", tokenizer=tok)
    gen = json.loads((tmp_path / "hf_model" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0, eot]
    check_generation_stops_at(tmp_path / "hf_model", tok, eot)


@pytest.mark.parametrize(
    "end, want",
    [("{{ eos_token }}", []), ("", []), ("<|im_end|><|im_start|>", [3])],
    ids=["ends-with-eos", "no-special-token", "first-special-after-the-content"],
)
def test_end_of_turn_is_read_from_the_template(end, want, caplog):
    from automodel.data.chat_template import end_of_turn_ids, record_chat_stops

    tok = load_tokenizer(None)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m['role'] == 'assistant' %}"
        + end
        + "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    found = end_of_turn_ids(tok)
    assert found == ([0] if end == "{{ eos_token }}" else want)
    with caplog.at_level("WARNING"):
        record_chat_stops(tok)
    assert ("without a special token" in caplog.text) == (end == "")


def test_stop_ids_keep_a_pretrained_list():
    from automodel.models.hf_save import stop_token_ids

    assert stop_token_ids(None, 0, [3]) == [0, 3]
    assert stop_token_ids(2, 0, []) == 0  # the tokenizer's EOS replaces the config class's default
    assert stop_token_ids([5, 7], 7, [3, 7]) == [5, 7, 3]  # a chat model's list holding the EOS is kept
    assert stop_token_ids([5, 7], 0, [0]) == 0
    assert stop_token_ids([5, 7], None, [3]) == [5, 7, 3]  # no tokenizer EOS: the list stays, the turn end joins
