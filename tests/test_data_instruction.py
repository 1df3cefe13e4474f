"""InstructionDataset: prompt tokens masked to -100 in both formats, single shift, truncation, errors."""

from __future__ import annotations

import json

import pytest
import torch

from automodel.data.instruction_dataset import InstructionDataset
from automodel.data.tokenizer import load_tokenizer

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "Sort these numbers: 9 4 7"},
    {"role": "assistant", "content": "4 7 9"},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _trained_runs(labels):
    """Maximal runs of consecutive non-ignored labels, as lists."""
    runs, cur = [], []
    for v in labels.tolist():
        if v == -100:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(v)
    return runs + ([cur] if cur else [])


def test_prompt_response_masks_the_prompt_exactly(tok, tmp_path):
    recs = [
        {"prompt": "Question: What is 7 * 8?\nAnswer:", "response": " 56."},
        {"prompt": "Reverse: a b c\n", "response": "c b a"},
    ]
    ds = InstructionDataset(path=_write(tmp_path / "d.jsonl", recs), tokenizer=tok, seq_len=64, split="all")
    assert len(ds) == 2 and ds.num_truncated == 0
    for rec, i in zip(recs, range(2)):
        item = ds[i]
        prompt = [tok.bos_token_id] + _ids(tok, rec["prompt"])
        full = prompt + _ids(tok, rec["response"]) + [tok.eos_token_id]
        assert item["input_ids"].tolist() == full[:-1]
        want = [-100] * (len(prompt) - 1) + full[len(prompt) :]
        assert item["labels"].tolist() == want
        assert (
            tok.decode([t for t in item["labels"].tolist() if t != -100]) == rec["response"] + "<|endoftext|>"
        )


def test_messages_mask_everything_but_assistant_turns(tok, tmp_path):
    ds = InstructionDataset(
        path=_write(tmp_path / "c.jsonl", [{"messages": CONVO}]),
        tokenizer=tok,
        seq_len=256,
        format="messages",
        split="all",
    )
    item = ds[0]
    rendered = tok.apply_chat_template(CONVO, tokenize=False)
    full = _ids(tok, rendered)
    assert item["input_ids"].tolist() + [item["labels"][-1].item()] == full  # shifted once, nothing lost
    runs = [tok.decode(r) for r in _trained_runs(item["labels"])]
    assert runs == ["2 + 3 = 5.<|im_end|>\n", "4 7 9<|im_end|>\n"]
    # every trained label is the next input token
    lab, inp = item["labels"][:-1], item["input_ids"][1:]
    assert torch.equal(lab[lab != -100], inp[lab != -100])


def test_truncation_keeps_the_first_seq_len_plus_one_tokens(tok, tmp_path, caplog):
    rec = {"prompt": "Q:", "response": " " + " ".join(str(i) for i in range(60))}
    path = _write(tmp_path / "t.jsonl", [rec])
    full = [tok.bos_token_id] + _ids(tok, rec["prompt"]) + _ids(tok, rec["response"]) + [tok.eos_token_id]
    with caplog.at_level("INFO", logger="automodel.data.instruction_dataset"):
        ds = InstructionDataset(path=path, tokenizer=tok, seq_len=16, split="all")
    assert ds.num_truncated == 1
    assert "1 of 1 examples of" in caplog.text and "truncated to seq_len+1=17 tokens" in caplog.text
    assert ds[0]["input_ids"].tolist() == full[:16]
    assert ds[0]["labels"][-1].item() == full[16]
    # a prompt longer than seq_len leaves no trainable token: counted (and logged), not hidden
    long_prompt = {"prompt": "word " * 40, "response": " ok"}
    ds2 = InstructionDataset(
        path=_write(tmp_path / "l.jsonl", [long_prompt]), tokenizer=tok, seq_len=8, split="all"
    )
    assert ds2.num_without_labels == 1 and bool((ds2[0]["labels"] == -100).all())


def test_default_instruction_set_both_formats_and_splits(tok):
    pr = InstructionDataset(tokenizer=tok, seq_len=256)
    ms = InstructionDataset(tokenizer=tok, seq_len=256, format="messages")
    for train in (pr, ms):
        val = InstructionDataset(tokenizer=tok, seq_len=256, split="validation", format=train.format)
        assert len(train) + len(val) == 2000 and 40 < len(val) < 160
        # the split key is the trained content: no validation example is also a training example
        train_rows = {tuple(train[i]["input_ids"].tolist()) for i in range(len(train))}
        assert not any(tuple(val[i]["input_ids"].tolist()) in train_rows for i in range(len(val)))
    assert pr.num_truncated == ms.num_truncated == pr.num_without_labels == 0
    for i in range(0, len(pr), 97):
        assert (pr[i]["labels"] != -100).sum() >= 2 and (ms[i]["labels"] != -100).sum() >= 2
        assert pr[i]["labels"][0] == -100 and ms[i]["labels"][0] == -100


def test_packed_instructions_keep_every_label(tok):
    plain = InstructionDataset(tokenizer=tok, seq_len=128, split="validation")
    packed = InstructionDataset(tokenizer=tok, seq_len=128, split="validation", pack=True, seq_pad_multiple=4)
    assert len(packed) < len(plain)
    labels_plain = torch.cat([plain[i]["labels"] for i in range(len(plain))])
    labels_packed = torch.cat([packed[i]["labels"] for i in range(len(packed))])
    assert torch.equal(labels_plain[labels_plain != -100], labels_packed[labels_packed != -100])
    assert sum(packed[i]["seq_lens"].numel() for i in range(len(packed))) == len(plain)


def test_errors_name_the_value_and_the_fix(tok, tmp_path):
    good = _write(tmp_path / "g.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"format='chat' is not one of.*'messages'"):
        InstructionDataset(path=good, tokenizer=tok, seq_len=8, format="chat")
    with pytest.raises(ValueError, match=r"seq_len=0 must be an integer >= 2"):
        InstructionDataset(path=good, tokenizer=tok, seq_len=0)
    with pytest.raises(ValueError, match=r"g\.jsonl:1: no field 'messages'.*messages_field"):
        InstructionDataset(path=good, tokenizer=tok, seq_len=8, format="messages", split="all")
    bad = _write(tmp_path / "b.jsonl", [{"question": "a", "response": "b"}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: field 'prompt' is missing.*data\.prompt_field"):
        InstructionDataset(path=bad, tokenizer=tok, seq_len=8, split="all")
    no_asst = _write(tmp_path / "n.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"n\.jsonl:1: no message has role 'assistant'"):
        InstructionDataset(path=no_asst, tokenizer=tok, seq_len=8, format="messages", split="all")
    bad_msg = _write(tmp_path / "m.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"m\.jsonl:1: message 0 is .*string 'role' and 'content'"):
        InstructionDataset(path=bad_msg, tokenizer=tok, seq_len=8, format="messages", split="all")
    (tmp_path / "x.txt").write_text("plain text")
    with pytest.raises(ValueError, match=r"instruction data must be \.jsonl"):
        InstructionDataset(path=str(tmp_path / "x.txt"), tokenizer=tok, seq_len=8, split="all")


def test_template_without_prefix_property_is_refused(tok, tmp_path):
    tok.save_pretrained(str(tmp_path / "tok"))
    odd = load_tokenizer(str(tmp_path / "tok"))
    # renders only the LAST assistant message with an end marker: prefixes are not prefixes
    odd.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
        "{% if loop.last %}{{ ' <END>' }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    path = _write(tmp_path / "c.jsonl", [{"messages": CONVO}])
    with pytest.raises(
        ValueError, match=r"c\.jsonl:1: the chat template .* is not prefix-stable.*prompt_response"
    ):
        InstructionDataset(path=path, tokenizer=odd, seq_len=256, format="messages", split="all")
    odd.chat_template = None
    with pytest.raises(ValueError, match=r"format='messages' needs a chat template"):
        InstructionDataset(path=path, tokenizer=odd, seq_len=256, format="messages", split="all")
