"""The recipe with ``loss.chunk_tokens`` on 2 gloo ranks (see tests/test_recipe_chunked_loss.py)."""

from __future__ import annotations

from pathlib import Path

from tests.workers.recipe_worker import CP, ULYSSES, _run, _summary

CHUNK = ["loss.chunk_tokens=64"]
# a tiny Gemma 2: its logits soft-capped (a cap of 0.1, which its tiny logits reach: the tanh bends them), its eager
# attention's scores soft-capped too
GEMMA2 = ["model.config._target_=transformers.Gemma2Config", "+model.config.head_dim=16",
          "+model.config.final_logit_softcapping=0.1", "model.attn_implementation=eager"]  # fmt: skip


def pair(rank: int, world_size: int, out: str) -> dict:
    """World 2: the plain loss at cp=1 (dp=2, the reference), and loss.chunk_tokens=64 with ring cp=2,
    Ulysses cp=2 with activation checkpointing, and cp=1 (dp=2); a soft-capped Gemma 2's plain loss at cp=1 and its
    chunked loss with ring cp=2."""
    out_dir = Path(out)
    runs = {
        "plain_cp1": (["distributed.cp_size=1", "loss.chunk_tokens=null"], CP),
        "chunked_cp1": (["distributed.cp_size=1", *CHUNK], CP),
        "chunked_ring_cp2": (["distributed.cp_size=2", *CHUNK], CP),
        "chunked_ulysses_ac_cp2": (
            ["distributed.cp_size=2", *CHUNK, "model.activation_checkpointing=true"],
            ULYSSES,
        ),
        "gemma2_plain_cp1": ([*GEMMA2, "distributed.cp_size=1", "loss.chunk_tokens=null"], CP),
        "gemma2_chunked_ring_cp2": ([*GEMMA2, "distributed.cp_size=2", *CHUNK], CP),
    }
    results = {}
    for name, (overrides, config) in runs.items():
        summary = _summary(*_run(world_size, out_dir, name, overrides, config=config))
        summary.pop("state")
        results[name] = summary
    return results
