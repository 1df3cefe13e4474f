"""TextDataset: default corpus, splits, exact single shift, local files, packing, errors."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from automodel.data.splits import is_validation
from automodel.data.text_dataset import TextDataset, load_documents
from automodel.data.tokenizer import load_tokenizer

SEQ = 128


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def train(tok):
    return TextDataset(tokenizer=tok, seq_len=SEQ)


@pytest.fixture(scope="module")
def docs():
    return load_documents(None)


def _stream(tok, docs):
    out = []
    for ids in tok(docs, add_special_tokens=False)["input_ids"]:
        out += ids + [tok.eos_token_id]
    return torch.tensor(out)


def test_default_corpus_rows_are_the_eos_joined_stream_shifted_once(tok, train, docs):
    train_docs = [d for d in docs if not is_validation(d, 0.05)]
    stream = _stream(tok, train_docs)
    assert train.num_documents == len(train_docs)
    assert train.num_tokens == len(stream)
    assert len(train) == len(stream) // (SEQ + 1)
    for r in (0, 1, len(train) // 2, len(train) - 1):
        row = stream[r * (SEQ + 1) : (r + 1) * (SEQ + 1)]
        item = train[r]
        assert set(item) == {"input_ids", "labels"}
        assert item["input_ids"].dtype == item["labels"].dtype == torch.int64
        assert torch.equal(item["input_ids"], row[:-1])
        assert torch.equal(item["labels"], row[1:])
        # shifted exactly once: labels[t] is input_ids[t+1]
        assert torch.equal(item["labels"][:-1], item["input_ids"][1:])


def test_default_corpus_is_deterministic(tok, train):
    again = TextDataset(tokenizer=tok, seq_len=SEQ)
    assert len(again) == len(train)
    assert torch.equal(again._rows, train._rows)


def test_validation_split_is_a_disjoint_deterministic_fraction(tok, train, docs):
    val = TextDataset(tokenizer=None, seq_len=SEQ, split="validation")
    whole = TextDataset(tokenizer=tok, seq_len=SEQ, split="all")
    assert val.num_documents + train.num_documents == whole.num_documents == len(docs) == 4000
    assert 0.03 < val.num_documents / len(docs) < 0.07
    assert val.num_tokens + train.num_tokens == whole.num_tokens
    val_docs = [d for d in docs if is_validation(d, 0.05)]
    assert torch.equal(val[0]["input_ids"], _stream(tok, val_docs)[:SEQ])
    # the split depends on the content only: reordering the documents does not move any of them
    assert [d for d in reversed(docs) if is_validation(d, 0.05)] == val_docs[::-1]


def test_local_jsonl_text_and_gzip_files(tok, tmp_path):
    texts = ["first document here.", "second one, a bit longer than the first.", "third."]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": t, "x": 1}) + "\n" for t in texts) + "\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("\n\n".join(texts))
    (tmp_path / "c.txt").write_text("\n\n".join(texts))
    ds_j = TextDataset(
        path=str(tmp_path / "a.jsonl"), tokenizer=tok, seq_len=4, split="all", text_field="body"
    )
    ds_t = TextDataset(
        path=str(tmp_path / "b.txt.gz"), tokenizer=tok, seq_len=4, split="all", doc_separator="\n\n"
    )
    ds_c = TextDataset(path=str(tmp_path / "c.txt"), tokenizer=tok, seq_len=4, split="all")
    assert ds_j.num_documents == ds_t.num_documents == 3 and ds_c.num_documents == 1
    assert torch.equal(ds_j._rows, ds_t._rows)
    assert torch.equal(ds_j._rows.flatten(), _stream(tok, texts)[: ds_j._rows.numel()])
    # a directory: every data file in name order
    both = load_documents(str(tmp_path), text_field="body", doc_separator="\n\n")
    assert both == texts * 3


@pytest.mark.parametrize("m", [1, 8])
def test_packed_rows_keep_documents_apart(tok, m):
    ds = TextDataset(tokenizer=tok, seq_len=SEQ, pack=True, seq_pad_multiple=m, split="validation")
    val_docs = [d for d in load_documents(None) if is_validation(d, 0.05)]
    pieces = []  # every document's tokens rebuilt from the packed rows
    for r in range(len(ds)):
        row = ds[r]
        n = row["input_ids"].numel()
        assert n <= SEQ and int(row["seq_lens_padded"].sum()) == n
        assert bool((row["seq_lens_padded"] % m == 0).all())
        start = 0
        for length, padded in zip(row["seq_lens"].tolist(), row["seq_lens_padded"].tolist()):
            ids, lab = row["input_ids"][start : start + padded], row["labels"][start : start + padded]
            assert torch.equal(row["position_ids"][start : start + padded], torch.arange(padded))
            assert bool((lab[length:] == -100).all()) and bool((ids[length:] == tok.pad_token_id).all())
            assert bool((lab[:length] != -100).all())
            assert torch.equal(lab[: length - 1], ids[1:length])  # shifted once inside the document
            pieces.append(torch.cat([ids[:1], lab[:length]]))
            start += padded
    # consecutive pieces of a long document overlap by one token; rebuild and compare with the stream
    rebuilt, eos = [], tok.eos_token_id
    for p in pieces:
        rebuilt += p.tolist() if not rebuilt or rebuilt[-1] == eos else p.tolist()[1:]
    assert rebuilt == _stream(tok, val_docs).tolist()


def test_hydra_target_instantiation(tmp_path):
    from hydra.utils import instantiate

    (tmp_path / "d.jsonl").write_text('{"text": "one two three four five six seven"}\n')
    cfg = {
        "_target_": "automodel.data.text_dataset.TextDataset",
        "path": str(tmp_path / "d.jsonl"),
        "tokenizer": "default",
        "seq_len": 4,
        "split": "all",
    }
    ds = instantiate(cfg)
    assert isinstance(ds, TextDataset) and len(ds) >= 1 and ds[0]["input_ids"].shape == (4,)
    ins = instantiate(
        {
            "_target_": "automodel.data.instruction_dataset.InstructionDataset",
            "seq_len": 32,
            "format": "messages",
        }
    )
    assert len(ins) > 1000 and ins.format == "messages"


def test_errors_name_the_value_and_the_fix(tok, tmp_path):
    with pytest.raises(ValueError, match=r"seq_len=1 must be an integer >= 2.*data\.seq_len"):
        TextDataset(tokenizer=tok, seq_len=1)
    with pytest.raises(ValueError, match=r"seq_len='8' must be an integer"):
        TextDataset(tokenizer=tok, seq_len="8")
    with pytest.raises(ValueError, match=r"'/no/such/file\.jsonl' does not exist.*set data\.dataset\.path \(or data\.validation_dataset\.path\)"):
        TextDataset(path="/no/such/file.jsonl", tokenizer=tok, seq_len=8)
    with pytest.raises(ValueError, match=r"data path entry '' must be a non-empty path"):
        TextDataset(path="", tokenizer=tok, seq_len=8)
    with pytest.raises(ValueError, match=r"split='dev' is not one of"):
        TextDataset(tokenizer=tok, seq_len=8, split="dev")
    with pytest.raises(ValueError, match=r"val_fraction=0 must be a number strictly between 0 and 1"):
        TextDataset(tokenizer=tok, seq_len=8, val_fraction=0)
    with pytest.raises(ValueError, match=r"fewer than one row of seq_len\+1=100001.*lower data\.seq_len"):
        TextDataset(tokenizer=tok, seq_len=100_000, split="validation")
    with pytest.raises(ValueError, match=r"seq_len=100 is not divisible by seq_pad_multiple=8.*e\.g\. 104"):
        TextDataset(tokenizer=tok, seq_len=100, pack=True, seq_pad_multiple=8)
    with pytest.raises(ValueError, match=r"seq_pad_multiple=8 only applies to packed rows"):
        TextDataset(tokenizer=tok, seq_len=128, seq_pad_multiple=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "oops"}\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2 has no field 'text' \(fields: \['txt'\]\).*text_field"
    ):
        TextDataset(path=str(bad), tokenizer=tok, seq_len=8, split="all")
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not valid JSON"):
        TextDataset(path=str(bad), tokenizer=tok, seq_len=8, split="all")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"cannot tell the format of .*data\.csv.*file_format"):
        TextDataset(path=str(tmp_path / "data.csv"), tokenizer=tok, seq_len=8, split="all")


def test_tokenized_documents_are_memoised_exactly(tok, docs):
    """automodel.data.encode_cache: the second encoding of a corpus is the memoised one, equal to the tokenizer's
    own output; one changed character, or a tokenizer with another vocabulary, is encoded afresh."""
    from automodel.data import encode_cache

    sample = docs[:50]
    want = tok(sample, add_special_tokens=False, verbose=False)["input_ids"]
    first = encode_cache.encode_documents(tok, sample)
    again = encode_cache.encode_documents(tok, list(sample))
    assert [e.tolist() for e in first] == want and [e.tolist() for e in again] == want
    assert again[0].base is first[0].base and not again[0].flags.writeable  # the memo, read-only
    changed = [sample[0] + "!", *sample[1:]]
    got = encode_cache.encode_documents(tok, changed)
    assert got[0].base is not first[0].base
    assert got[0].tolist() == tok(changed[0], add_special_tokens=False)["input_ids"]
    other = load_tokenizer(None)
    other.add_tokens(["zzqq"])
    with_added = encode_cache.encode_documents(other, ["a zzqq b"])
    assert with_added[0].tolist() == other("a zzqq b", add_special_tokens=False)["input_ids"]
    plain = encode_cache.encode_documents(tok, ["a zzqq b"])[0].tolist()
    assert plain == tok("a zzqq b", add_special_tokens=False)["input_ids"] != with_added[0].tolist()
