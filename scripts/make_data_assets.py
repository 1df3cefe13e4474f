#!/usr/bin/env python
"""Write (or check) the shipped data assets under ``automodel/data/assets/``.

    python scripts/make_data_assets.py            # regenerate every asset in place
    python scripts/make_data_assets.py --check    # exit 1 if the shipped files differ from a rebuild

Assets written:

- ``corpus/default_corpus.jsonl.gz``: synthetic documents (``{"text": ...}`` per line) from
  :func:`automodel.data.synthetic_corpus.generate_corpus`; no third-party text, Apache-2.0 like the
  rest of the project.
- ``corpus/default_instructions.jsonl.gz``: synthetic instruction examples with ``prompt``,
  ``response`` and chat ``messages`` fields (:func:`generate_instructions`).
- ``tokenizer/``: a byte-level BPE (``tokenizers`` library) trained on the corpus, saved with
  ``PreTrainedTokenizerFast.save_pretrained`` so that ``AutoTokenizer.from_pretrained(dir)`` loads it
  offline. Special tokens: ``<|endoftext|>`` (BOS and EOS), ``<|pad|>``, and ChatML's
  ``<|im_start|>`` / ``<|im_end|>`` used by the shipped chat template.

Gzip members are written with ``mtime=0`` so the bytes depend only on the content.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ASSETS = REPO_ROOT / "automodel" / "data" / "assets"

CORPUS_DOCS = 4000
CORPUS_SEED = 1234
INSTRUCTION_EXAMPLES = 2000
INSTRUCTION_SEED = 4321
VOCAB_SIZE = 1024

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]

# ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, and "<|im_start|>assistant\n"
# as the generation prompt. Every rendering of a prefix of a conversation is a prefix of the
# rendering of the whole conversation, which is what instruction_dataset's loss masking needs.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _jsonl_gz_bytes(rows: list[dict]) -> bytes:
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
    return gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)


def build_corpus_files() -> dict[str, bytes]:
    """Return ``{relative path: bytes}`` for the corpus files (deterministic)."""
    sys.path.insert(0, str(REPO_ROOT))
    from automodel.data.synthetic_corpus import generate_corpus, generate_instructions

    docs = generate_corpus(CORPUS_DOCS, CORPUS_SEED)
    ins = generate_instructions(INSTRUCTION_EXAMPLES, INSTRUCTION_SEED)
    return {
        "corpus/default_corpus.jsonl.gz": _jsonl_gz_bytes([{"text": d} for d in docs]),
        "corpus/default_instructions.jsonl.gz": _jsonl_gz_bytes(ins),
    }


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Train a byte-level BPE on ``texts`` and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_all(out_dir: Path) -> None:
    """Write every asset under ``out_dir`` (same layout as ``automodel/data/assets``)."""
    files = build_corpus_files()
    for rel, data in files.items():
        path = out_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    docs = [
        json.loads(line)["text"]
        for line in gzip.decompress(files["corpus/default_corpus.jsonl.gz"]).decode().splitlines()
    ]
    ins = [
        json.loads(line)
        for line in gzip.decompress(files["corpus/default_instructions.jsonl.gz"]).splitlines()
    ]
    # The tokenizer also sees the instruction texts so that chat markup and the prompt words merge well.
    texts = docs + [e["prompt"] + e["response"] for e in ins]
    tok = train_tokenizer(texts)
    tok_dir = out_dir / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(tok_dir))


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".md"
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare")
    parser.add_argument("--out", type=Path, default=ASSETS, help="output directory (default: the package)")
    args = parser.parse_args(argv)
    if not args.check:
        build_all(args.out)
        for rel, sha in _digest(args.out).items():
            print(f"{sha[:16]}  {(args.out / rel).stat().st_size:>8}  {rel}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build_all(Path(tmp))
        want, have = _digest(Path(tmp)), _digest(args.out)
    bad = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    for k in bad:
        print(f"differs: {k}", file=sys.stderr)
    print("assets match a fresh build" if not bad else f"{len(bad)} asset file(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
