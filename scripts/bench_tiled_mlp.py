#!/usr/bin/env python
"""Step peak of a wide-MLP model on CPU with and without ``model.tiled_mlp`` (issue 35, item 1).

A Llama-shaped model whose MLP is much wider than its hidden size (default hidden 128, MLP 16384, 2 layers,
vocabulary 32000, fp32) trains one step on one row of 4096 tokens with activation checkpointing and the
chunked loss (``loss.chunk_tokens=256``), in a fresh process (one thread, glibc's mmap threshold fixed so freed
tensors leave the RSS, as in scripts/bench_memory.py). For each setting the **step peak** is the kernel's peak
RSS during forward + loss + backward + AdamW step minus the RSS just before it (weights, AdamW states and the
batch are not counted). AdamW runs with lr=0, so both settings train the same step on the same weights and their
losses must be equal.

Without tiling the recompute of each layer holds the ``[4096, 16384]`` gate / up / activation tensors and their
gradients (256 MiB each); with ``model.tiled_mlp=true`` (tiles of ``ceil(4096 x 128 / 16384)`` = 32 -> 64
tokens) one tile's are 4 MiB each.

    nice python scripts/bench_tiled_mlp.py                  # the figures in docs/recipe.md
    nice python scripts/bench_tiled_mlp.py --seq-len 8192 --tiled-mlp 512
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from automodel.training.cpu_memory import MMAP_ENV, peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402


def measure_worker(rank: int, world: int, settings: list, model_kw: dict, seq: int, chunk: int) -> list[dict]:
    """One measured step per ``model.tiled_mlp`` setting (in order, on the same weights); per setting
    ``{"peak_mib", "loss", "time"}``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from automodel.models.tiled_mlp import apply_tiled_mlp, remove_tiled_mlp
    from automodel.training.step import forward_loss_sum

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False, **model_kw)
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=False)  # lr 0: the weights stay
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (1, seq), generator=g)

    def step(n: int) -> tuple[float, float]:
        start = time.perf_counter()
        loss = forward_loss_sum(model, {"input_ids": ids[:, :n]}, labels[:, :n], chunk) / n
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - start

    out = []
    for setting in settings:
        remove_tiled_mlp(model)
        apply_tiled_mlp(model, setting)
        step(256)  # warm-up: AdamW states, lazy imports, the tiled MLP's first-call probe
        gc.collect()
        base = rss_mib()
        reset_peak_rss()
        loss, t = step(seq)
        out.append({"peak_mib": peak_rss_mib() - base, "loss": loss, "time": t})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument(
        "--tiled-mlp", default="true", help="the setting compared with false: true or tokens per tile"
    )
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    for key, value in MMAP_ENV.items():  # read by the spawned interpreter's glibc at start-up
        os.environ.setdefault(key, value)
    tiled: bool | int = True if args.tiled_mlp.lower() == "true" else int(args.tiled_mlp)
    h = args.hidden_size
    model_kw = dict(
        hidden_size=h,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=max(h // 32, 1),
        num_key_value_heads=max(h // 64, 1),
        vocab_size=args.vocab,
    )
    settings: list = [False, tiled]
    (rows,) = run_on_ranks(
        "scripts.bench_tiled_mlp:measure_worker",
        1,
        args.timeout,
        settings=settings,
        model_kw=model_kw,
        seq=args.seq_len,
        chunk=args.chunk_tokens,
    )
    from automodel.models.tiled_mlp import resolve_tile_tokens

    print(
        f"Llama-shaped: hidden {h}, MLP {args.intermediate_size}, {args.layers} layers, vocab {args.vocab}, fp32, "
        f"{args.seq_len} tokens, activation checkpointing, loss.chunk_tokens={args.chunk_tokens}, AdamW, CPU, "
        f"1 thread, torch {torch.__version__}"
    )
    print("| model.tiled_mlp | tokens per tile | step peak MiB | loss | step s |")
    print("|---|---|---|---|---|")
    for setting, r in zip(settings, rows, strict=True):
        tile = resolve_tile_tokens(setting, h, args.intermediate_size, args.seq_len)
        print(
            f"| {str(setting).lower()} | {tile or '-'} | {r['peak_mib']:.0f} | {r['loss']:.6f} | {r['time']:.1f} |"
        )
    ratio = rows[1]["peak_mib"] / rows[0]["peak_mib"]
    same = rows[0]["loss"] == rows[1]["loss"]
    print(f"\nstep peak ratio tiled / untiled: {ratio:.3f} (target <= 0.6); losses equal: {same}")
    if ratio > 0.6 or abs(rows[0]["loss"] - rows[1]["loss"]) > 1e-6 * abs(rows[0]["loss"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
