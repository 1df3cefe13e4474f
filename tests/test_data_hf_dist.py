"""Hugging Face datasets sources on 2 gloo ranks, and through the recipe at cp=2.

One launch (module-scoped fixture, ``tests/workers/hf_data_worker.py``):

- tokenization runs once per node: local rank 0 tokenizes, rank 1 waits and then opens the cache
  (it tokenizes 0 rows);
- a bad row found by rank 0 (a conversation without an assistant turn) raises the same
  ``UserInputError`` on both ranks instead of leaving rank 1 waiting;
- the recipe (``configs/cp.yaml``, tiny fp32 model, 8 steps, data.shuffle=false) at cp=2 on a jsonl of
  chat rows made in the test: ``HFDataset`` and ``StreamingHFDataset`` give exactly the losses of
  ``InstructionDataset`` on the same file (the same batches), ``HFDataset`` at dp=2 (no CP) matches
  cp=2 within the parity bar, and a streaming run stopped by SIGTERM after step 4 resumes to the same
  losses;
- the chat runs' exports stop where the data taught the model to stop: ``generation_config.json``
  lists ``<|im_end|>`` (the shipped ChatML template's end of turn) beside EOS, and plain transformers'
  ``generate()`` stops there (forced: the model made to emit it).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_distributed

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_dist")
    return run_distributed("tests.workers.hf_data_worker:pair", world_size=2, timeout=900, out=str(out))


def test_tokenized_once_per_node(res):
    r0, r1 = res[0]["once"], res[1]["once"]
    assert r0["from_cache"] is False and r0["rows_tokenized"] == 400
    assert r1["from_cache"] is True and r1["rows_tokenized"] == 0
    assert r0["len"] == r1["len"] == 400


def test_bad_row_on_rank0_is_an_error_on_every_rank(res):
    for r in res:
        assert r["bad"] is not None and "row 2: no message has role 'assistant'" in r["bad"]


def _rel(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and len(b) == 8
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in b)


def test_recipe_cp2_on_datasets_sources(res):
    r = res[0]
    assert r["hf_cp2"]["dataset"] == "HFDataset" and r["stream_cp2"]["dataset"] == "StreamingHFDataset"
    ref = r["inst_cp2"]["losses"]
    assert r["hf_cp2"]["losses"] == ref  # the same rows, batches and arithmetic: bit-identical
    assert r["stream_cp2"]["losses"] == ref
    assert r["hf_cp2"]["val_losses"] == r["inst_cp2"]["val_losses"]
    assert r["stream_cp2"]["val_losses"] and all(v > 0 for v in r["stream_cp2"]["val_losses"].values())
    assert _rel(r["hf_dp2"]["losses"], ref) <= LOSS_RTOL
    assert res[1]["hf_cp2"]["losses"] == ref  # both cp ranks report the same loss


def test_recipe_streaming_resume_is_exact(res):
    r = res[0]
    first, second = r["stream_stopped"], r["stream_resumed"]
    assert first["stopped_by_sigterm"] and first["final_step"] == 4
    assert sorted(first["losses"]) == [1, 2, 3, 4] and second["final_step"] == 8
    resumed = {**first["losses"], **second["losses"]}
    assert resumed == r["stream_cp2"]["losses"]


@pytest.mark.parametrize("run", ["inst_cp2", "hf_dp2", "stream_cp2"])
def test_chat_sft_export_stops_at_the_end_of_turn(res, run):
    import json
    from pathlib import Path

    from automodel.data import load_tokenizer
    from tests.test_export_generation import check_generation_stops_at

    out = Path(res[0][run]["export_dir"])
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [0, 3]
    check_generation_stops_at(out, load_tokenizer(None), 3)
