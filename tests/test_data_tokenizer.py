"""The shipped tokenizer loads offline, round-trips text, and load_tokenizer explains its errors."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from automodel.data.tokenizer import default_tokenizer_dir, ensure_pad_token, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_default_tokenizer_loads_offline_with_plain_transformers(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for t in (
        load_tokenizer(None),
        load_tokenizer("default"),
        AutoTokenizer.from_pretrained(str(default_tokenizer_dir())),
        PreTrainedTokenizerFast.from_pretrained(str(default_tokenizer_dir())),
    ):
        assert len(t) == 1024
        assert t.convert_ids_to_tokens([0, 1, 2, 3]) == [
            "<|endoftext|>",
            "<|pad|>",
            "<|im_start|>",
            "<|im_end|>",
        ]
        assert (t.eos_token_id, t.bos_token_id, t.pad_token_id) == (0, 0, 1)
        assert "<|im_start|>" in t.chat_template


@pytest.mark.parametrize(
    "text",
    [
        "Ana has 7 apples.\nNow Ben has 3 and Cleo has 12.",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "ünïcødé — 日本語 😀 ∑x²",
        "<|im_start|>user\nhi<|im_end|>\n",
        "",
    ],
)
def test_round_trip_is_exact(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < 1024 for i in ids)


def test_corpus_text_compresses(tok):
    # A BPE trained on the corpus should merge its common words: far fewer tokens than bytes.
    text = "Ana gives 2 apples to Ben.\nNow Ana has 5 and Ben has 9."
    assert len(tok(text)["input_ids"]) < len(text.encode()) / 2.5
    assert tok(text)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]  # adds no BOS/EOS


def test_chat_template_renders_chatml(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    assert tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )
    ids = tok("<|im_start|>user", add_special_tokens=False)["input_ids"]
    assert ids[0] == 2  # special tokens in text are recognised as single tokens


def test_local_directory_round_trip(tok, tmp_path):
    tok.save_pretrained(str(tmp_path / "tok"))
    again = load_tokenizer(str(tmp_path / "tok"))
    text = "Who keeps the red lamp? The otter."
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == tok.chat_template


def test_ensure_pad_token_reuses_eos(tok, tmp_path):
    tok.save_pretrained(str(tmp_path / "t"))
    t = AutoTokenizer.from_pretrained(str(tmp_path / "t"))
    t.pad_token = None
    assert t.pad_token_id is None
    assert ensure_pad_token(t).pad_token_id == t.eos_token_id


def test_errors_name_the_value_and_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'\./no/such/dir'.*not a directory.*'default'"):
        load_tokenizer("./no/such/dir")
    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(f))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no tokenizer\.json.*save_pretrained"):
        load_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(TypeError, match="must be a str"):
        load_tokenizer(123)  # type: ignore[arg-type]


def test_hub_id_offline_not_cached_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    assert not os.path.exists("automodel-test-org")
    with pytest.raises(
        ValueError, match=r"(?s)'automodel-test-org/no-such-tokenizer'.*HF_HUB_OFFLINE is set"
    ):
        load_tokenizer("automodel-test-org/no-such-tokenizer")


def test_a_pretrained_model_brings_its_own_tokenizer(tmp_path):
    """data.tokenizer null + model.pretrained_model_name_or_path: the model's tokenizer, not the shipped one (a
    model fed another tokenizer's ids trains without an error, on wrong tokens); 'default' keeps the shipped one
    on purpose; a model directory without tokenizer files is an error naming both keys."""

    from automodel.data.tokenizer import load_run_tokenizer, tokenizer_source
    from automodel.errors import UserInputError

    assert tokenizer_source(None, None) is None  # a model built from a config: the shipped tokenizer
    assert tokenizer_source(None, "org/model") == "org/model"
    assert tokenizer_source("default", "org/model") == "default"
    assert tokenizer_source("other/tok", "org/model") == "other/tok"

    shipped = load_tokenizer(None)
    own = PreTrainedTokenizerFast(tokenizer_object=shipped.backend_tokenizer, eos_token="<|endoftext|>")
    own.add_tokens(["<extra_a>", "<extra_b>"])  # the model's tokenizer differs from the shipped one
    model_dir = tmp_path / "model"
    own.save_pretrained(model_dir)
    assert len(load_run_tokenizer(None, str(model_dir))) == len(shipped) + 2
    assert len(load_run_tokenizer("default", str(model_dir))) == len(shipped)

    bare = tmp_path / "weights_only"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(UserInputError) as err:
        load_run_tokenizer(None, str(bare))
    msg = str(err.value)
    assert "model.pretrained_model_name_or_path=" in msg and "has no tokenizer files" in msg
    assert "set data.tokenizer to the tokenizer the model was trained with" in msg and "data.tokenizer=default" in msg
