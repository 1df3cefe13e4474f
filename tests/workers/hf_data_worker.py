"""Hugging Face datasets sources on 2 gloo ranks (see tests/test_data_hf_dist.py).

One group runs: the once-per-node tokenization (rank 0 tokenizes, rank 1 opens the cache), an error
on rank 0's data shared with rank 1 (no hang), and the recipe at cp=2 on a jsonl made here through
``HFDataset``, ``InstructionDataset`` and ``StreamingHFDataset`` (the same rows, so the same losses),
plus ``HFDataset`` at dp=2 and a streaming run stopped by SIGTERM at step 4 and resumed. Three of the
chat runs export (``InstructionDataset``, ``HFDataset`` from its cache, streaming).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from automodel.config import load_config
from automodel.data import load_tokenizer
from automodel.data.hf_dataset import HFDataset
from automodel.data.hf_tokenize import TOKENIZE_CALLS
from automodel.data.instruction_dataset import default_instructions_path
from automodel.errors import UserInputError
from automodel.training.trainer import FinetuneTrainer
from tests.workers.recipe_worker import TINY, _sigterm_at

N = 400


def _make_data(out: Path) -> tuple[str, str]:
    jsonl, bad = out / "chat.jsonl", out / "bad.jsonl"
    if not jsonl.exists():
        with gzip.open(default_instructions_path(), "rt") as f:
            recs = [json.loads(line) for line, _ in zip(f, range(N), strict=False)]
        tmp = out / "chat.jsonl.tmp"
        tmp.write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in recs))
        tmp.rename(jsonl)
        bad.write_text(
            json.dumps({"messages": recs[0]["messages"]})
            + "\n"
            + json.dumps({"messages": recs[1]["messages"][:1]})
            + "\n"
        )
    return str(jsonl), str(bad)


def _recipe(world: int, out: Path, name: str, overrides: list[str], hooks=None) -> dict:
    argv = [
        "--config",
        "configs/cp.yaml",
        *TINY,
        f"recipe.output_dir={out / name}",
        "data.shuffle=false",
        *overrides,
    ]
    trainer = FinetuneTrainer(load_config(argv, world_size=world), hooks)
    result = trainer.run()
    return {
        "losses": dict(result.losses),
        "val_losses": dict(result.val_losses),
        "final_step": result.final_step,
        "stopped_by_sigterm": result.stopped_by_sigterm,
        "dataset": type(trainer.train_dataset).__name__,
        "export_dir": str(result.export_dir) if result.export_dir else None,
    }


def pair(rank: int, world_size: int, out: str) -> dict:
    import torch.distributed as dist

    out_dir = Path(out)
    if rank == 0:
        _make_data(out_dir)
    dist.barrier()
    jsonl, bad = _make_data(out_dir)
    tok = load_tokenizer(None)
    res: dict = {}

    # 1. tokenized once per node: rank 0 first, rank 1 then opens the cache
    before = TOKENIZE_CALLS["rows"]
    ds = HFDataset(jsonl, tok, seq_len=128, split="all", cache_dir=str(out_dir / "cache_once"), num_proc=1)
    res["once"] = {
        "from_cache": ds.tokenized_from_cache,
        "rows_tokenized": TOKENIZE_CALLS["rows"] - before,
        "len": len(ds),
    }

    # 2. a bad row seen by rank 0 is an error on every rank, not a hang
    try:
        HFDataset(bad, tok, seq_len=128, split="all", cache_dir=str(out_dir / "cache_bad"))
        res["bad"] = None
    except UserInputError as e:
        res["bad"] = str(e)

    # 3. the recipe at cp=2 through each data source on the same rows
    hf = [
        "data.dataset._target_=automodel.data.hf_dataset.HFDataset",
        f"data.dataset.path={jsonl}",
        "+data.dataset.format=messages",
        f"+data.dataset.cache_dir={out_dir / 'cache_recipe'}",
    ]
    stream = [
        "data.dataset._target_=automodel.data.streaming.StreamingHFDataset",
        f"data.dataset.path={jsonl}",
        "+data.dataset.format=messages",
        f"+data.dataset.cache_dir={out_dir / 'cache_recipe'}",
    ]
    inst = [
        "data.dataset._target_=automodel.data.instruction_dataset.InstructionDataset",
        f"data.dataset.path={jsonl}",
        "+data.dataset.format=messages",
    ]
    cp2 = ["distributed.cp_size=2"]
    export = ["export.enabled=true"]  # chat exports list <|im_end|> as EOS (HFDataset's from its cache)
    res["hf_cp2"] = _recipe(world_size, out_dir, "hf_cp2", [*hf, *cp2])
    res["inst_cp2"] = _recipe(world_size, out_dir, "inst_cp2", [*inst, *cp2, *export])
    res["hf_dp2"] = _recipe(world_size, out_dir, "hf_dp2", [*hf, "distributed.cp_size=1", *export])
    res["stream_cp2"] = _recipe(world_size, out_dir, "stream_cp2", [*stream, *cp2, *export])
    res["stream_stopped"] = _recipe(world_size, out_dir, "stream_resume", [*stream, *cp2], _sigterm_at(4))
    res["stream_resumed"] = _recipe(
        world_size, out_dir, "stream_resume", [*stream, *cp2, "checkpoint.resume=true"]
    )
    return res
