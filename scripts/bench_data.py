#!/usr/bin/env python
"""Data start-up cost at world 2: today's in-memory readers vs the Hugging Face ``datasets`` path.

    nice -n 19 python scripts/bench_data.py --mb 200 --out /tmp/bench_data

Generates a ``--mb`` MB jsonl of text documents (the shipped synthetic corpus, repeated with a
numbered prefix so every document is distinct), then for each mode starts a fresh 2-rank gloo group
(``automodel.distributed.launch``) in which every rank builds the training dataset and its dp loader
and takes the first batch. Per rank it prints the wall time from the start of the dataset build to
the first batch ("time to first step", without the model) and the peak RSS of the rank process
(``ru_maxrss``; the ``datasets`` tokenizer worker processes are reported separately as ``children``).

Modes:
- ``readers``: ``TextDataset`` (every rank reads and tokenizes the whole file in memory);
- ``hf-cold``: ``HFDataset`` with an empty cache (local rank 0 converts the json to arrow and
  tokenizes with ``num_proc`` processes while rank 1 waits, then rank 1 opens the cache);
- ``hf-warm``: ``HFDataset`` again on the cache that ``hf-cold`` left (nothing is tokenized);
- ``stream``: ``StreamingHFDataset`` (nothing ahead of time; tokenizes what the first batch needs).

Both ranks are dp ranks (dp_size=2), seq_len 1024, 4 rows per rank.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

MODES = ("hf-cold", "hf-warm", "readers", "stream")


def make_jsonl(path: Path, mb: int) -> int:
    """Write ``mb`` MB of ``{"text": ...}`` lines to ``path`` (kept if it already has that size)."""
    from automodel.data.text_dataset import default_corpus_path

    target = mb * 1_000_000
    if path.exists() and abs(path.stat().st_size - target) < 2_000_000:
        return path.stat().st_size
    with gzip.open(default_corpus_path(), "rt") as f:
        docs = [json.loads(line)["text"] for line in f]
    size, k = 0, 0
    with open(path, "w") as out:
        while size < target:
            line = json.dumps({"text": f"Document {k}. " + docs[k % len(docs)]}) + "\n"
            out.write(line)
            size += len(line.encode())
            k += 1
    return size


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its finished children (tokenizer workers)."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def rank_main(rank: int, world_size: int, mode: str, path: str, cache: str, seq_len: int) -> dict:
    import resource

    from automodel.data import TextDataset, build_dataloader, load_tokenizer
    from automodel.data.hf_dataset import HFDataset
    from automodel.data.streaming import StreamingHFDataset

    tok = load_tokenizer(None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0, c0 = time.perf_counter(), _cpu_s()
    if mode == "readers":
        ds = TextDataset(path, tok, seq_len=seq_len)
    elif mode in ("hf-cold", "hf-warm"):
        ds = HFDataset(path, tok, seq_len=seq_len, format="text", cache_dir=cache)
    else:
        ds = StreamingHFDataset(path, tok, seq_len=seq_len, format="text", cache_dir=cache)
    t1 = time.perf_counter()
    loader = build_dataloader(
        ds, local_batch_size=4, dp_rank=rank, dp_size=world_size, seed=0, shuffle=mode != "stream"
    )
    batch = next(iter(loader))
    t2 = time.perf_counter()
    return {
        "build_s": t1 - t0,
        "first_step_s": t2 - t0,
        "cpu_s": _cpu_s() - c0,
        "rss_before_mb": rss0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "children_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "rows": len(ds) if hasattr(ds, "__len__") else None,
        "from_cache": getattr(ds, "tokenized_from_cache", None),
        "batch": tuple(batch["input_ids"].shape),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=200, help="size of the generated jsonl in MB")
    ap.add_argument("--out", default="/tmp/bench_data", help="work directory (data and caches)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--timeout", type=int, default=3600)
    args = ap.parse_args()

    from automodel.distributed.launch import run_on_ranks

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"docs_{args.mb}mb.jsonl"
    size = make_jsonl(path, args.mb)
    cache = out / "hf_cache"
    print(f"data: {path} ({size / 1e6:.1f} MB), world 2, seq_len {args.seq_len}, cpus {os.cpu_count()}")
    print(
        f"{'mode':8s} {'rank':>4s} {'build s':>8s} {'1st step s':>10s} {'CPU s':>7s} {'RSS MB':>8s} "
        f"{'(start)':>8s} {'children MB':>11s}"
    )
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {MODES}")
        if mode == "hf-cold" and cache.exists():
            shutil.rmtree(cache)
        res = run_on_ranks(
            "scripts.bench_data:rank_main",
            world_size=2,
            timeout=args.timeout,
            mode=mode,
            path=str(path),
            cache=str(cache),
            seq_len=args.seq_len,
        )
        for r, x in enumerate(res):
            print(
                f"{mode:8s} {r:4d} {x['build_s']:8.1f} {x['first_step_s']:10.1f} {x['cpu_s']:7.1f} "
                f"{x['peak_rss_mb']:8.0f} "
                f"{x['rss_before_mb']:8.0f} {x['children_peak_rss_mb']:11.0f}"
                + (f"  rows={x['rows']}" if x["rows"] else "")
                + (f" from_cache={x['from_cache']}" if x["from_cache"] is not None else ""),
                flush=True,
            )


if __name__ == "__main__":
    main()
