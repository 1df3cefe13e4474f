"""What a run leaves for its user, through the recipe (one world-1 launch: tests/workers/run_outputs_worker.py).

- step lines every ``logging.log_every_steps`` on stdout and in ``logs/rank_0.log``; no tqdm frames
  without a terminal;
- TensorBoard event files and an offline Weights & Biases run, read back: the per-step losses equal
  ``metrics.jsonl``;
- ``recipe.sample_prompts`` -> ``samples.jsonl``;
- ``checkpoint.resume=auto`` passes over a run of another config (naming the key), finds the run of the
  same config, refuses a changed ``max_steps`` and continues with it once
  ``checkpoint.allow_schedule_change=true``.

The trackers are extras (``pip install -e '.[tensorboard,wandb]'``, which scripts/setup.sh installs):
outside CI (``CI`` or ``AUTOMODEL_REQUIRE_EXTRAS`` unset) the module is skipped without them; in CI a
missing one fails.
"""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import struct
from pathlib import Path

import pytest

from automodel.training.lr_schedule import warmup_cosine_factor
from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist
PROMPT = "the model of a small"


def _require(module: str):
    if os.environ.get("CI") or os.environ.get("AUTOMODEL_REQUIRE_EXTRAS"):
        return importlib.import_module(module)  # CI installs the extras: a missing one is a failure
    return pytest.importorskip(module, reason=f"the {module} extra is not installed")


_require("tensorboard")
_require("wandb")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_outputs")
    (res,) = run_distributed(
        "tests.workers.run_outputs_worker:main", world_size=1, timeout=500, out=str(out), prompt=PROMPT
    )
    return res


def _train_losses(runs: dict) -> dict[int, float]:
    """Run A's steps 1-4 from its metrics.jsonl, as A left it (runs D and G continue the same file)."""
    return {r["step"]: r["loss"] for r in runs["a"]["metrics"] if r["type"] == "train"}


def test_step_lines_on_stdout_and_in_the_rank0_log(runs):
    a = runs["a"]
    for text in (a["stdout"], a["rank0_log"]):
        lines = [ln for ln in text.splitlines() if " step " in ln and " | loss " in ln]
        assert [ln.split(" step ")[1].split(" |")[0] for ln in lines] == ["1/4", "2/4", "4/4"]
        for key in ("| lr ", "| grad norm ", " tokens/s (", "/device)", " s/step", "| peak mem "):
            assert all(key in ln for ln in lines), key
        assert f"loss {a['losses'][2]:.4f}" in lines[1]
    assert "\r" not in a["stdout"] and "train:" not in a["stdout"]  # no tqdm frame without a terminal


def test_tensorboard_events_hold_the_per_step_losses(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = Path(runs["a"]["run_dir"])
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("train/loss")}
    want = _train_losses(runs)
    assert sorted(got) == [1, 2, 3, 4] and all(math.isclose(got[s], want[s], rel_tol=1e-6) for s in want)
    assert sorted(e.step for e in acc.Scalars("val/loss")) == [2, 4]


def _wandb_records(path: str) -> list[bytes]:
    """The records of a ``.wandb`` file (a LevelDB-style log: 7-byte file header, 32 KiB blocks of
    ``crc32 | length u16 | type u8`` chunks; type 1 full, 2 first, 3 middle, 4 last)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    return out


def test_wandb_offline_run_holds_the_per_step_losses(runs):
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(runs["a"]["run_dir"])
    path = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))[0]  # A's (D's is later)
    got = {}
    for raw in _wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if "train/loss" in items:
                got[items["_step"]] = items["train/loss"]
    want = _train_losses(runs)
    assert sorted(got) == [1, 2, 3, 4] and all(math.isclose(got[s], want[s], rel_tol=1e-9) for s in want)


def test_samples_written_from_the_exported_model(runs):
    (line,) = [json.loads(x) for x in Path(runs["a"]["samples_path"]).read_text().splitlines()]
    assert line["prompt"] == PROMPT and 1 <= line["new_tokens"] <= 5 and isinstance(line["completion"], str)
    assert line["stopped_at_eos"] == (line["new_tokens"] < 5)


def test_resume_auto_passes_over_another_config_and_says_why(runs):
    a, b = runs["a"], runs["b"]
    assert b["run_dir"] != a["run_dir"] and b["start_step"] == 0
    assert Path(a["run_dir"]).name in b["stdout"] and "data.seq_len: 128 -> 64" in b["stdout"]


def test_schedule_change_on_resume_is_refused_then_explicit(runs):
    err = runs["c_error"]
    assert err is not None and "step_scheduler.max_steps: 4 -> 6" in err and "step 4" in err
    assert "checkpoint.allow_schedule_change=true" in err and "step 5 would train at lr" in err
    d = runs["d"]
    assert d["run_dir"] == runs["a"]["run_dir"] and d["start_step"] == 4 and sorted(d["losses"]) == [5, 6]
    assert "allow_schedule_change=true: resuming" in d["stdout"] and "step_scheduler.max_steps: 4 -> 6" in d["stdout"]
    # the last step (6, 0-based 5) ran at the new schedule's lr; lr_last is the lr after it (0-based 6)
    assert d["lr_last"] == pytest.approx(3e-3 * warmup_cosine_factor(6, 6, 2, 0.1))


def test_d_continued_the_metrics_of_a(runs):
    assert runs["d"]["metrics_steps"] == [1, 2, 3, 4, 5, 6]


def test_a_run_into_another_runs_directory_is_refused_before_any_work(runs):
    err, run_dir = runs["e_error"], runs["a"]["run_dir"]
    assert err is not None and err.startswith(f"the run directory {run_dir} holds another run's outputs (")
    for held in ("config.yaml", "metrics.jsonl", "summary.json", "samples.jsonl", "hf_model/",
                 "checkpoints step_2, step_4"):  # fmt: skip
        assert held in err, held
    assert "checkpoint.resume=false" in err and "set recipe.output_dir to a new directory" in err
    assert "checkpoint.resume=auto" in err
    assert runs["e_untouched"]  # nothing of A was rewritten, not even config.yaml


def test_a_resume_from_an_earlier_checkpoint_continues_one_run(runs):
    a, g = runs["a"], runs["g"]
    assert g["start_step"] == 2 and sorted(g["losses"]) == [3, 4]
    for step in (3, 4):  # an exact resume: the same losses as A's first pass
        assert g["losses"][step] == pytest.approx(a["losses"][step], rel=1e-6)
    assert g["metrics_steps"] == [1, 2, 3, 4]  # each step once: A's 3, 4 and D's 5, 6 moved aside
    assert [r["step"] for r in g["superseded_metrics"] if r["type"] == "train"] == [3, 4, 5, 6]
    assert g["checkpoints"] == ["step_2", "step_4", "superseded"]  # G's own step_4
    assert [n.split("-")[0] for n in g["superseded_checkpoints"]] == ["step_4"]  # A's
    assert "moved step_4, a checkpoint of a later step that this run abandons" in g["stdout"]
    assert "later steps than" not in g["stdout"]  # no claim that it resumed an older checkpoint


def test_on_nonfinite_skip_counts_goes_on_and_stops_after_n_in_a_row(runs):
    h = runs["h"]
    assert runs["h_exit"] == 3
    train = [r for r in h["metrics"] if r["type"] == "train"]
    skipped = [r["step"] for r in train if r.get("skipped")]
    assert len(skipped) == 2 and skipped[1] == skipped[0] + 1 == train[-1]["step"]  # stopped at the 2nd in a row
    assert [r["nonfinite_skipped"] for r in train if r.get("skipped")] == [1, 2]
    assert all(r["nonfinite"].startswith(("the loss is ", "the gradient norm is ")) for r in train[-2:])
    stop = skipped[1]
    (line,) = h["stderr"].splitlines()
    assert line.startswith(f"error: step {stop}: the ") and "2 steps in a row" in line
    assert "recipe.max_nonfinite_in_row=2" in line and "Traceback" not in h["stderr"]
    s = h["summary"]
    assert s["nonfinite_skipped"] == 2 and s["nonfinite_steps"] == skipped and s["final_step"] == stop
    assert s["stopped_by_nonfinite"] == line.removeprefix("error: ")
    assert h["checkpoints"] == list(range(1, stop))  # the skipped step before it saved unchanged, finite weights
