"""Documents tokenized once per process: building the same dataset again reuses the token ids.

A process that builds one dataset several times (a launch that runs the recipe many times, as the tests do;
the train and validation splits of one corpus re-read for another run) tokenizes each corpus once. The
memo is exact: its key is the tokenizer's whole serialization (vocabulary, merges, normaliser,
pre-tokenizer, added tokens) and every document's text, so another tokenizer or one changed character
is a miss. Only fast tokenizers are memoised (a slow one has no serialization to key on), only corpora
of at most :data:`MAX_TOKENS` tokens, and only the last :data:`MAX_ENTRIES` corpora.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
from transformers import PreTrainedTokenizerBase

__all__ = ["MAX_ENTRIES", "MAX_TOKENS", "encode_documents"]

MAX_ENTRIES = 4
MAX_TOKENS = 4_000_000  # 32 MiB of int64 ids per corpus at most

_MEMO: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()


def _key(tokenizer: PreTrainedTokenizerBase, docs: Sequence[str]) -> bytes | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    h = hashlib.blake2b(digest_size=32)
    h.update(type(tokenizer).__qualname__.encode())
    h.update(backend.to_str().encode())
    h.update(len(docs).to_bytes(8, "little"))
    for doc in docs:
        data = doc.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def encode_documents(tokenizer: PreTrainedTokenizerBase, docs: Sequence[str]) -> list[np.ndarray]:
    """``tokenizer(docs, add_special_tokens=False)["input_ids"]``, one ``[L_i] int64`` array per document.

    The arrays are read-only views of one memoised buffer (copy before changing them); nothing else is
    mutated.
    """
    key = _key(tokenizer, docs)
    hit = _MEMO.get(key) if key is not None else None
    if hit is None:
        encoded = tokenizer(list(docs), add_special_tokens=False, verbose=False)["input_ids"] if docs else []
        lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for e in encoded for t in e), dtype=np.int64, count=int(offsets[-1]))
        flat.flags.writeable = False
        hit = (flat, offsets)
        if key is not None and len(flat) <= MAX_TOKENS:
            _MEMO[key] = hit
            while len(_MEMO) > MAX_ENTRIES:
                _MEMO.popitem(last=False)
    else:
        _MEMO.move_to_end(key)
    flat, offsets = hit
    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
