"""configs/cp_packed.yaml (cp_method=thd) in the recipe on gloo ranks (see tests/test_thd_recipe.py).

``pair`` (2 ranks): thd cp=2 on packed rows (documents padded to 2*cp=4 automatically) and on
unpacked rows. ``single`` (1 rank): the same runs at cp=1 (the packed one with seq_pad_multiple=4
set by hand, so the rows are the same). Every run: the tiny fp32 overrides of recipe_worker, 8 steps; the sliding
cp=2 run with activation checkpointing and offload (exact: its reference runs without them).
"""

from __future__ import annotations

from pathlib import Path

from tests.workers.recipe_worker import _run, _summary

PACKED_CFG = "configs/cp_packed.yaml"
THD = "distributed.cp_method=thd"  # the config ships thd_docs
PACKED = ["data.seq_len=256", THD]
UNPACKED = ["data.dataset.pack=false", "data.seq_len=128", THD]
# a sliding-window model (Mistral, window 16 < the documents): windowed layers run the halo kernel
SLIDING = ["model.config._target_=transformers.MistralConfig", "+model.config.sliding_window=16"]
# checkpointing with activation offload under FSDP2 on the sliding run (issue 41: each observably on under thd too)
OFFLOAD = ["model.activation_checkpointing=true", "model.activation_offload=true"]


def _with_padding(trainer, result) -> dict:
    out = _summary(trainer, result)
    out["seq_pad_multiple"] = getattr(trainer.train_dataset, "seq_pad_multiple", None)
    log = (Path(result.run_dir) / "logs" / f"rank_{trainer.rank}.log").read_text().splitlines()
    out["padding_log"] = [line.split(": ", 1)[1] for line in log if "pads every packed document" in line]
    return out


def pair(rank: int, world_size: int, out: str) -> dict:
    out_dir = Path(out)
    return {
        "thd_packed_cp2": _with_padding(
            *_run(
                world_size, out_dir, "thd_packed_cp2", ["distributed.cp_size=2", *PACKED], config=PACKED_CFG
            )
        ),
        "thd_plain_cp2": _with_padding(
            *_run(
                world_size, out_dir, "thd_plain_cp2", ["distributed.cp_size=2", *UNPACKED], config=PACKED_CFG
            )
        ),
        "thd_sliding_packed_cp2": _with_padding(
            *_run(
                world_size, out_dir, "thd_sliding_packed_cp2", ["distributed.cp_size=2", *PACKED, *SLIDING, *OFFLOAD],
                config=PACKED_CFG,
            )
        ),
    }


def single(rank: int, world_size: int, out: str) -> dict:
    out_dir = Path(out)
    ref = ["distributed.cp_size=1", *PACKED, "+data.dataset.seq_pad_multiple=4", "data.pad_to_multiple_of=4"]
    return {
        "packed_ref": _with_padding(*_run(world_size, out_dir, "packed_ref", ref, config=PACKED_CFG)),
        "plain_ref": _with_padding(
            *_run(world_size, out_dir, "plain_ref", ["distributed.cp_size=1", *UNPACKED], config=PACKED_CFG)
        ),
        "sliding_packed_ref": _with_padding(
            *_run(world_size, out_dir, "sliding_packed_ref", [*ref, *SLIDING], config=PACKED_CFG)
        ),
    }


def packed_cp(rank: int, world_size: int, out: str) -> dict:
    """Manual runs (not in CI): thd at cp=world_size on packed rows (automatic padding to 2*cp)."""
    name = f"thd_packed_cp{world_size}"
    return {
        name: _with_padding(
            *_run(
                world_size, Path(out), name, [f"distributed.cp_size={world_size}", *PACKED], config=PACKED_CFG
            )
        )
    }


def packed_ref(rank: int, world_size: int, out: str, multiple: int) -> dict:
    """Manual runs (not in CI): the cp=1 reference with documents padded to ``multiple`` by hand."""
    pad = [f"+data.dataset.seq_pad_multiple={multiple}", f"data.pad_to_multiple_of={multiple}"]
    name = f"packed_ref{multiple}"
    return {
        name: _with_padding(
            *_run(world_size, Path(out), name, ["distributed.cp_size=1", *PACKED, *pad], config=PACKED_CFG)
        )
    }
