"""Run as a fresh process: peak extra memory of one Ulysses attention forward+backward (world 1) on
packed rows, S tokens of 4 equal documents.

    python -m tests.workers.attn_memory_probe SEQ [SEQ ...]

Prints one line per SEQ: peak RSS above the pre-attention baseline in MiB.
"""

from __future__ import annotations

import gc
import sys

import torch

from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, ulysses_attention_forward
from automodel.training.cpu_memory import peak_rss_mib, reset_peak_rss, rss_mib


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2
    training = False

    def __init__(self) -> None:
        super().__init__()
        self.config = None


def main(seq: int, heads: int = 4, kv_heads: int = 2, dim: int = 16) -> float:
    torch.set_num_threads(1)
    docs = 4
    pos = torch.arange(seq // docs).repeat(docs).unsqueeze(0)  # 4 documents of S/4 tokens
    ctx_factory, _ = make_ulysses_batch_and_ctx(None, {"input_ids": torch.zeros(1, seq).long(), "position_ids": pos})
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, seq, dim, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, seq, dim, generator=g, requires_grad=True)
    gc.collect()
    base = rss_mib()
    reset_peak_rss()
    with ctx_factory():
        out, _ = ulysses_attention_forward(_Attn(), q, k, v, None, scaling=dim**-0.5)
        out.sum().backward()
    return peak_rss_mib() - base


if __name__ == "__main__":
    seqs = [int(a) for a in sys.argv[1:]]
    main(seqs[0])  # warm-up
    for s in seqs:
        print(f"{main(s):.3f}", flush=True)
