"""Run as a fresh process: peak extra memory of one loss forward+backward over N local tokens.

    python -m tests.workers.loss_memory_probe VOCAB HIDDEN TOKENS:CHUNK [TOKENS:CHUNK ...]

Prints, per TOKENS:CHUNK pair, the peak RSS above the pre-loss baseline in MiB (chunk 0 = the plain
loss). Started with MALLOC_MMAP_THRESHOLD_ fixed (cpu_memory.MMAP_ENV), so every tensor of the
previous measurement has left the RSS before the next one starts.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.nn.functional as F

from automodel.training.chunked_loss import chunked_linear_cross_entropy_sum
from automodel.training.cpu_memory import peak_rss_mib, reset_peak_rss, rss_mib
from automodel.training.loss import token_cross_entropy_sum


def main(tokens: int, chunk: int, vocab: int, hidden: int) -> float:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,), generator=g)
    gc.collect()
    base = rss_mib()
    reset_peak_rss()
    loss = chunked_linear_cross_entropy_sum(h, w, y, chunk) if chunk else token_cross_entropy_sum(F.linear(h, w), y)
    loss.backward()
    return peak_rss_mib() - base


if __name__ == "__main__":
    vocab, hidden = int(sys.argv[1]), int(sys.argv[2])
    pairs = [tuple(int(v) for v in pair.split(":")) for pair in sys.argv[3:]]
    main(*pairs[0], vocab, hidden)  # warm-up: one-time allocations (thread pools, lazy init) stay out
    for tokens, chunk in pairs:
        print(f"{main(tokens, chunk, vocab, hidden):.3f}", flush=True)
