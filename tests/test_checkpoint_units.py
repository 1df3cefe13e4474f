"""Checkpoint pieces without a process group: completion marker, per-step reseed, dropout detection,
and the resume checks' messages."""

from __future__ import annotations

import json

import pytest
import torch

from automodel.errors import UserInputError
from automodel.training.checkpoint import latest_checkpoint, list_checkpoints, read_meta
from automodel.training.elastic import (
    check_resume_compatible,
    dropout_settings,
    reseed_for_step,
    step_seed,
)


def _ckpt(root, name, complete=True):
    d = root / name
    d.mkdir(parents=True)
    (d / "rank_0.pt").write_bytes(b"x")
    if complete:
        (d / "meta.json").write_text(json.dumps({"step": int(name.split("_")[1].split(".")[0])}))
    return d


def test_only_complete_checkpoints_count(tmp_path):
    _ckpt(tmp_path, "step_2")
    _ckpt(tmp_path, "step_10")
    _ckpt(tmp_path, "step_12.tmp")  # an interrupted save, even with its marker written
    _ckpt(tmp_path, "step_14", complete=False)  # no completion marker
    (tmp_path / "step_16").write_text("not a directory")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 10]  # numeric order, not lexical
    assert latest_checkpoint(tmp_path).name == "step_10"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_incomplete_checkpoint_is_a_user_error_naming_the_complete_one(tmp_path):
    _ckpt(tmp_path, "step_2")
    bad = _ckpt(tmp_path, "step_4", complete=False)
    with pytest.raises(UserInputError, match=r"step_4 is not a complete checkpoint .*newest complete one "
                                             r"there is .*step_2.*checkpoint.resume=auto"):  # fmt: skip
        read_meta(bad)
    assert read_meta(tmp_path / "step_2")["step"] == 2


def _dropout_mask(n=64):
    return torch.nn.functional.dropout(torch.ones(n), p=0.5, training=True) > 0


def test_reseed_makes_step_randomness_independent_of_history():
    reseed_for_step(1234, 5, 1)
    a = _dropout_mask()
    torch.rand(1000)  # a different history: another layout, another number of earlier draws
    _dropout_mask()
    reseed_for_step(1234, 5, 1)
    assert torch.equal(_dropout_mask(), a)
    for other in ((1234, 6, 1), (1234, 5, 0), (99, 5, 1)):
        reseed_for_step(*other)
        assert not torch.equal(_dropout_mask(), a), other
    assert len({step_seed(1, s, r) for s in range(50) for r in range(8)}) == 400
    assert 0 <= step_seed(2**31, 10**6, 1023) < 2**63


def test_dropout_settings_finds_config_fields_and_modules():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    assert dropout_settings(LlamaForCausalLM(LlamaConfig(**cfg))) == {}
    assert dropout_settings(LlamaForCausalLM(LlamaConfig(**cfg, attention_dropout=0.1))) == {
        "config.attention_dropout": 0.1
    }
    assert dropout_settings(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2))) == {"1": 0.2}


def test_changed_global_batch_size_is_refused_with_the_fix():
    meta = {"global_batch_size": 8}
    check_resume_compatible("ck", meta, "world_size=2 (...)", "world_size=1 (...)", 8)
    check_resume_compatible("ck", {}, "A", "B", 8)  # checkpoints from before the field: not checked
    expected = (
        r"global_batch_size=8 \(world_size=2 .*global_batch_size=16 \(world_size=1.*"
        r"resume with step_scheduler.global_batch_size=8"
    )
    with pytest.raises(UserInputError, match=expected):
        check_resume_compatible("ck", meta, "world_size=2 (...)", "world_size=1 (...)", 16)


def test_prune_keeps_the_checkpoint_just_written_and_cleanup_takes_only_tmp_dirs(tmp_path, caplog):
    from automodel.training.checkpoint import Checkpointer, CheckpointLayout

    layout = CheckpointLayout(world_size=1, dp_replicate=1, dp_shard=1, cp=1, tp=1)
    ck = Checkpointer(tmp_path, layout, keep_last=1)
    for name in ("step_4", "step_8", "step_6"):  # resumed from step_4 after step_8 was written
        _ckpt(tmp_path, name)
    _ckpt(tmp_path, "step_7.tmp", complete=False)
    _ckpt(tmp_path, "step_9.replaced.tmp")
    (tmp_path / "notes.tmp").mkdir()  # not ours
    ck._clean_incomplete()
    with caplog.at_level("WARNING"):
        ck._prune(keep=tmp_path / "step_6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "step_6", "step_8"]
    assert "later steps than step_6 (step_8" in caplog.text
