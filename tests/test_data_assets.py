"""The shipped assets are small, licensed, and exactly what scripts/make_data_assets.py produces."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from automodel.data.synthetic_corpus import generate_corpus, generate_instructions
from automodel.data.tokenizer import assets_dir


def _load_script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "make_data_assets.py"
    spec = importlib.util.spec_from_file_location("make_data_assets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_assets_are_small_and_documented():
    files = [p for p in assets_dir().rglob("*") if p.is_file()]
    names = {str(p.relative_to(assets_dir())) for p in files}
    assert {
        "README.md",
        "corpus/default_corpus.jsonl.gz",
        "corpus/default_instructions.jsonl.gz",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
        "tokenizer/chat_template.jinja",
    } <= names
    assert sum(p.stat().st_size for p in files) < 1_000_000
    readme = (assets_dir() / "README.md").read_text()
    assert "Apache-2.0" in readme and "No third-party text" in readme


def test_corpus_files_match_the_generator():
    docs = [
        json.loads(line)["text"] for line in gzip.open(assets_dir() / "corpus/default_corpus.jsonl.gz", "rt")
    ]
    mod = _load_script()
    assert docs == generate_corpus(mod.CORPUS_DOCS, mod.CORPUS_SEED)
    ins = [
        json.loads(line) for line in gzip.open(assets_dir() / "corpus/default_instructions.jsonl.gz", "rt")
    ]
    assert ins == generate_instructions(mod.INSTRUCTION_EXAMPLES, mod.INSTRUCTION_SEED)
    assert generate_corpus(3, seed=1) == generate_corpus(3, seed=1) != generate_corpus(3, seed=2)


def test_a_fresh_build_reproduces_every_asset_byte_for_byte(tmp_path):
    mod = _load_script()
    mod.build_all(tmp_path)
    assert mod._digest(tmp_path) == mod._digest(assets_dir())
