"""HFDataset / StreamingHFDataset on Hugging Face ``datasets``: every source kind, the column mapping,
chat masks, the tokenization cache, packing + collator on top, exact streaming resume, bad input.

All data is made in the test (from the shipped synthetic instruction set) and every ``datasets``
cache lives under the test's tmp dir; nothing touches the network.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time

import pytest
import torch

from automodel.data import InstructionDataset, TextDataset, build_dataloader, load_tokenizer
from automodel.data.hf_dataset import HFDataset
from automodel.data.hf_source import load_hf_source
from automodel.data.hf_tokenize import TOKENIZE_CALLS
from automodel.data.instruction_dataset import default_instructions_path
from automodel.data.streaming import StreamingHFDataset
from automodel.errors import UserInputError

N = 120  # records


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A jsonl with text / prompt / completion / messages columns, and the same rows in every format."""
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("hfdata")
    with gzip.open(default_instructions_path(), "rt") as f:
        recs = [json.loads(line) for line, _ in zip(f, range(N), strict=False)]
    rows = [
        {
            "text": r["prompt"] + r["response"],
            "prompt": r["prompt"],
            "completion": r["response"],
            "messages": r["messages"],
        }
        for r in recs
    ]
    jsonl = root / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = str(root / "cache")
    ds = load_hf_source(str(jsonl), cache_dir=cache)
    ds.to_parquet(str(root / "data.parquet"))
    ds.to_json(str(root / "data.json"), lines=False)
    ds.save_to_disk(str(root / "disk"))
    datasets.DatasetDict({"train": ds, "eval": ds.select(range(10))}).save_to_disk(str(root / "diskdict"))
    shutil.copy(ds.cache_files[0]["filename"], root / "data.arrow")
    # A hub id "someone/tiny" as datasets leaves it in HF_DATASETS_CACHE after an online load_dataset.
    hub = root / "hubcache" / "someone___tiny" / "default" / "0.0.0" / "0123abcd"
    hub.mkdir(parents=True)
    shutil.copy(os.path.join(os.path.dirname(ds.cache_files[0]["filename"]), "dataset_info.json"), hub)
    shutil.copy(ds.cache_files[0]["filename"], hub / "tiny-train.arrow")
    return {"root": root, "jsonl": str(jsonl), "cache": cache, "rows": rows}


def _same(a, b, n=None):
    assert len(a) == len(b), (len(a), len(b))
    for i in range(len(a) if n is None else min(n, len(a))):
        x, y = a[i], b[i]
        assert sorted(x) == sorted(y), (sorted(x), sorted(y))
        for k in x:
            assert torch.equal(x[k], y[k]), (i, k)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "disk", "diskdict", "hub"])
def test_each_source_kind_loads_the_same_rows(data, tok, kind):
    root, cache = data["root"], data["cache"]
    path, extra = {
        "jsonl": (data["jsonl"], {}),
        "json": (str(root / "data.json"), {}),
        "parquet": (str(root / "data.parquet"), {}),
        "arrow": (str(root / "data.arrow"), {}),
        "disk": (str(root / "disk"), {}),
        "diskdict": (str(root / "diskdict"), {"hf_split": "train"}),
        "hub": ("someone/tiny", {"cache_dir": str(root / "hubcache")}),
    }[kind]
    kw = dict(seq_len=64, split="all", format="messages", pack=True, seq_pad_multiple=4)
    ref = HFDataset(data["jsonl"], tok, cache_dir=cache, **kw)
    got = HFDataset(path, tok, **{"cache_dir": str(root / f"cache_{kind}"), **extra, **kw})
    assert got.num_examples == N
    _same(got, ref)


def test_text_rows_equal_text_dataset(data, tok):
    jsonl = data["jsonl"]
    for pack, m in ((False, 1), (True, 4)):
        ref = TextDataset(jsonl, tok, seq_len=32, pack=pack, seq_pad_multiple=m)  # split=train by hash
        got = HFDataset(
            jsonl, tok, seq_len=32, format="text", pack=pack, seq_pad_multiple=m, cache_dir=data["cache"]
        )
        _same(got, ref)
    # map_batch_size=1: most map batches hold only rows of the other split and come out empty
    kw = dict(seq_len=32, format="text", split="validation", val_fraction=0.2, cache_dir=data["cache"])
    val = HFDataset(jsonl, tok, map_batch_size=1, **kw)
    _same(val, TextDataset(jsonl, tok, seq_len=32, split="validation", val_fraction=0.2))
    _same(list(StreamingHFDataset(jsonl, tok, **kw)), val)


def test_prompt_completion_and_messages_equal_instruction_dataset(data, tok, tmp_path):
    # InstructionDataset reads 'response'; HFDataset maps completion_column='completion'.
    rows = data["rows"]
    pr = tmp_path / "pr.jsonl"
    pr.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "response": r["completion"]}) + "\n" for r in rows)
    )
    ref = InstructionDataset(str(pr), tok, seq_len=48, format="prompt_response", split="all")
    got = HFDataset(
        str(pr), tok, seq_len=48, split="all", completion_column="response", cache_dir=data["cache"]
    )
    assert got.format == "prompt_completion"
    _same(got, ref)
    for split in ("train", "validation"):
        ref = InstructionDataset(
            data["jsonl"], tok, seq_len=48, format="messages", split=split, val_fraction=0.2
        )
        got = HFDataset(
            data["jsonl"], tok, seq_len=48, split=split, val_fraction=0.2, cache_dir=data["cache"]
        )
        assert got.format == "messages"  # auto: the messages column wins
        _same(got, ref)
        assert got.num_truncated == ref.num_truncated


def test_chat_loss_only_on_assistant_turns(tok, tmp_path):
    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "2 + 3 = 5."},
        {"role": "user", "content": "Sort: 9 4 7"},
        {"role": "assistant", "content": "4 7 9"},
    ]
    # arrow gives every message every key any message has: 'name' is None where absent, and is dropped
    convo_with_name = [dict(convo[0], name="sys"), *convo[1:]]
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": convo_with_name}) + "\n")
    ds = HFDataset(str(p), tok, seq_len=256, split="all", cache_dir=str(tmp_path / "c"))
    ex = ds[0]
    ids, labels = ex["input_ids"], ex["labels"]
    full = tok.apply_chat_template(convo_with_name, tokenize=False)
    assert tok.decode(torch.cat([ids, ex["labels"][-1:]])) == full
    runs, cur = [], []
    for t, v in enumerate(labels.tolist()):
        if v == -100:
            if cur:
                runs.append(cur)
            cur = []
        else:
            assert v == (ids[t + 1].item() if t + 1 < len(ids) else v)
            cur.append(v)
    runs.append(cur) if cur else None
    assert [tok.decode(r) for r in runs] == ["2 + 3 = 5.<|im_end|>\n", "4 7 9<|im_end|>\n"]


def test_cache_built_once_and_reused(data, tok, tmp_path):
    cache = str(tmp_path / "c")
    kw = dict(seq_len=64, split="all", format="messages", cache_dir=cache, num_proc=1)
    before = TOKENIZE_CALLS["rows"]
    first = HFDataset(data["jsonl"], tok, **kw)
    assert not first.tokenized_from_cache and TOKENIZE_CALLS["rows"] - before == N
    mid = TOKENIZE_CALLS["rows"]
    second = HFDataset(data["jsonl"], tok, **kw)
    assert second.tokenized_from_cache and second.cache_file == first.cache_file
    assert TOKENIZE_CALLS["rows"] == mid  # the warm run tokenized nothing
    _same(second, first)
    # anything that changes the examples changes the fingerprint
    other = HFDataset(data["jsonl"], tok, **{**kw, "seq_len": 32})
    assert not other.tokenized_from_cache and other.cache_file != first.cache_file
    # two tokenizer processes give the same rows (and their own cache shards)
    kw2 = {**kw, "num_proc": 2, "cache_dir": str(tmp_path / "c2")}
    multi = HFDataset(data["jsonl"], tok, **kw2)
    assert not multi.tokenized_from_cache
    _same(multi, first)
    before = TOKENIZE_CALLS["rows"]
    again = HFDataset(data["jsonl"], tok, **{**kw2, "num_proc": 1})  # datasets reuses the 2 shards
    assert again.tokenized_from_cache and TOKENIZE_CALLS["rows"] == before
    _same(again, first)


def test_no_progress_bars_out_of_order_with_the_log(data, tok, tmp_path, capfd):
    """datasets' tqdm bars (on stderr, out of order with the log) are off while a source loads and tokenizes,
    and the user's setting is restored afterwards."""
    import datasets

    datasets.enable_progress_bars()
    try:
        capfd.readouterr()
        load_hf_source(data["jsonl"], cache_dir=str(tmp_path / "src"))  # a fresh cache: "Generating train split"
        HFDataset(data["jsonl"], tok, seq_len=64, split="all", format="text", cache_dir=str(tmp_path / "c"),
                  num_proc=1)  # fmt: skip
        err = capfd.readouterr().err
        assert "it/s" not in err and "examples/s" not in err and "%|" not in err, err
        assert not datasets.are_progress_bars_disabled()
    finally:
        datasets.disable_progress_bars()


def test_train_and_validation_share_one_tokenization(data, tok, tmp_path):
    kw = dict(seq_len=32, format="text", cache_dir=str(tmp_path / "c"), num_proc=1)
    before = TOKENIZE_CALLS["rows"]
    train = HFDataset(data["jsonl"], tok, split="train", val_fraction=0.2, **kw)
    assert not train.tokenized_from_cache and TOKENIZE_CALLS["rows"] - before == N
    mid = TOKENIZE_CALLS["rows"]
    for split, frac in (("validation", 0.2), ("train", 0.5), ("all", 0.05)):  # any split or fraction: no work
        other = HFDataset(data["jsonl"], tok, split=split, val_fraction=frac, **kw)
        assert other.tokenized_from_cache and other.cache_file == train.cache_file
        _same(other, TextDataset(data["jsonl"], tok, seq_len=32, split=split, val_fraction=frac))
    assert TOKENIZE_CALLS["rows"] == mid


def test_packing_and_collator_unchanged_on_top(data, tok):
    kw = dict(seq_len=64, pack=True, seq_pad_multiple=4)
    ref = InstructionDataset(data["jsonl"], tok, format="messages", **kw)
    got = HFDataset(data["jsonl"], tok, cache_dir=data["cache"], **kw)
    loaders = [
        build_dataloader(d, local_batch_size=2, dp_rank=1, dp_size=2, seed=3, pad_to_multiple_of=8)
        for d in (ref, got)
    ]
    for a, b in zip(*loaders, strict=True):
        assert sorted(a) == ["input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded"]
        for k in a:
            assert torch.equal(a[k], b[k])


def _collect(loader, epochs):
    out, states = [], []
    for _ in range(epochs):
        for b in loader:
            out.append(b)
            states.append(loader.state_dict())
    return out, states


@pytest.mark.parametrize("fmt,pack", [("text", False), ("messages", True)])
def test_streaming_rows_and_exact_resume(data, tok, fmt, pack):
    kw = dict(seq_len=64, split="all", format=fmt, pack=pack, seq_pad_multiple=4 if pack else 1)
    stream = StreamingHFDataset(data["jsonl"], tok, cache_dir=data["cache"], **kw)
    _same(list(stream), HFDataset(data["jsonl"], tok, cache_dir=data["cache"], **kw))  # same rows, same order

    def loader():
        return build_dataloader(
            stream, local_batch_size=3, dp_rank=0, dp_size=1, seed=0, shuffle=False, pad_to_multiple_of=4
        )

    full, states = _collect(loader(), 2)  # two epochs
    per_epoch = len(full) // 2
    assert per_epoch >= 5
    for j in (per_epoch // 2, per_epoch - 1, per_epoch + 1):  # mid-epoch, at and after the epoch end
        resumed = loader()
        resumed.load_state_dict(json.loads(json.dumps(states[j])))  # plain values: survive JSON
        got = []
        while len(got) < len(full) - j - 1:
            got += list(resumed)
        for a, b in zip(got, full[j + 1 :], strict=False):
            for k in a:
                assert torch.equal(a[k], b[k]), (j, k)


def test_streaming_shards_by_dp_rank(data, tok, tmp_path):
    # two files, two dp ranks: each rank reads one file; together they read every example once
    rows = data["rows"]
    files = []
    for i in range(2):
        p = tmp_path / f"part{i}.jsonl"
        recs = [
            {"messages": [{"role": "system", "content": f"record {k}"}, *rows[k]["messages"]]}
            for k in range(i, N, 2)
        ]
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
        files.append(str(p))
    stream = StreamingHFDataset(files, tok, seq_len=512, split="all", cache_dir=str(tmp_path / "c"))
    seen = []
    for r in range(2):
        loader = build_dataloader(
            stream, local_batch_size=1, dp_rank=r, dp_size=2, seed=0, shuffle=False, drop_last=False
        )
        seen.append(
            [tuple(b["input_ids"][0][b["input_ids"][0] != tok.pad_token_id].tolist()) for b in loader]
        )
    assert len(seen[0]) == len(seen[1]) == N // 2 and not set(seen[0]) & set(seen[1])
    whole = [
        tuple(x["input_ids"].tolist())
        for x in StreamingHFDataset(files, tok, seq_len=512, split="all", cache_dir=str(tmp_path / "c"))
    ]
    assert sorted(seen[0] + seen[1]) == sorted(whole) and len(whole) == N


# ---------------------------------------------------------------- bad input


def test_missing_column_is_a_clear_error(data, tok):
    with pytest.raises(UserInputError, match=r"no column 'answer'.*completion_column"):
        HFDataset(
            data["jsonl"],
            tok,
            format="prompt_completion",
            completion_column="answer",
            cache_dir=data["cache"],
        )
    with pytest.raises(UserInputError, match=r"no column 'body'.*text_column"):
        StreamingHFDataset(data["jsonl"], tok, format="text", text_column="body", cache_dir=data["cache"])


def test_messages_row_without_assistant_turn(tok, tmp_path):
    p = tmp_path / "bad.jsonl"
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    p.write_text(json.dumps({"messages": good}) + "\n" + json.dumps({"messages": good[:1]}) + "\n")
    with pytest.raises(UserInputError, match=r"row 2: no message has role 'assistant'"):
        HFDataset(str(p), tok, split="all", cache_dir=str(tmp_path / "c"))
    with pytest.raises(UserInputError, match=r"row 2: no message has role 'assistant'"):
        list(StreamingHFDataset(str(p), tok, split="all", cache_dir=str(tmp_path / "c")))


def test_uncached_hub_id_fails_fast_with_how_to_download(tok, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(
        UserInputError, match=r"hub dataset 'someone/absent'.*offline.*load_dataset\('someone/absent'\)"
    ):
        HFDataset("someone/absent", tok, cache_dir=str(tmp_path))
    assert time.monotonic() - t0 < 30  # no network wait


def test_other_bad_input(data, tok, tmp_path):
    with pytest.raises(UserInputError, match="format='chat' is not one of"):
        HFDataset(data["jsonl"], tok, format="chat", cache_dir=data["cache"])
    with pytest.raises(UserInputError, match="does not exist"):
        HFDataset(str(tmp_path / "nope.jsonl"), tok)
    with pytest.raises(UserInputError, match="not one written by save_to_disk"):
        HFDataset(str(tmp_path), tok)
    stream = StreamingHFDataset(data["jsonl"], tok, cache_dir=data["cache"])
    with pytest.raises(UserInputError, match="set data.shuffle=false"):
        build_dataloader(stream, local_batch_size=1, dp_rank=0, dp_size=1, seed=0, shuffle=True)
    loader = build_dataloader(stream, local_batch_size=1, dp_rank=0, dp_size=1, seed=0, shuffle=False)
    other = build_dataloader(stream, local_batch_size=2, dp_rank=0, dp_size=1, seed=0, shuffle=False)
    with pytest.raises(UserInputError, match="local_batch_size: checkpoint 2 != now 1"):
        loader.load_state_dict(other.state_dict())


def test_hf_and_streaming_sources_take_the_same_row_arguments():
    """Both are config targets, so each lists its arguments; the shared ones may not drift apart."""
    import inspect

    from automodel.data.hf_dataset import HFDataset
    from automodel.data.streaming import StreamingHFDataset

    a, b = inspect.signature(HFDataset).parameters, inspect.signature(StreamingHFDataset).parameters
    assert set(a) - set(b) == {"num_proc", "map_batch_size"} and set(b) <= set(a)
    assert [(p.name, p.default, p.annotation) for p in b.values()] == [
        (a[n].name, a[n].default, a[n].annotation) for n in b
    ]
