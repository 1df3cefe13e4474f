"""Unit tests of the training pieces that need no process group."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from automodel.config.schema import CheckpointSection, RecipeSection
from automodel.data.collator import label_token_count
from automodel.distributed.cp import get_cp_method
from automodel.training.checkpoint import latest_checkpoint, list_checkpoints
from automodel.training.dry_run import head_tail_positions, rank_layout
from automodel.training.loss import token_cross_entropy_sum
from automodel.training.lr_schedule import warmup_cosine, warmup_cosine_factor
from automodel.training.metrics import MetricsWriter, read_metrics
from automodel.training.plot import plot_loss_curve
from automodel.training.run_dir import choose_run_dir
from automodel.training.step import prepare_batch

# ------------------------------------------------------------------ loss


def test_token_cross_entropy_sum_matches_torch_and_ignores_minus_100():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum")
    assert torch.allclose(token_cross_entropy_sum(logits, labels), want)
    assert label_token_count(labels).item() == 8
    assert token_cross_entropy_sum(logits, torch.full((2, 5), -100)).item() == 0.0
    assert token_cross_entropy_sum(logits.bfloat16(), labels).dtype == torch.float32


def test_sum_over_shards_divided_by_global_count_is_the_mean():
    # the identity the recipe's loss normalisation rests on: shards of the tokens, one global divisor
    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(4, 8, 7, generator=g), torch.randint(0, 7, (4, 8), generator=g)
    labels[labels == 3] = -100
    n = label_token_count(labels)
    parts = [
        token_cross_entropy_sum(logits[:, s], labels[:, s]) for s in (slice(0, 2), slice(2, 6), slice(6, 8))
    ]
    mean = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(sum(parts) / n, mean, rtol=1e-6)


# ------------------------------------------------------------------ lr schedule


def test_warmup_cosine_values():
    assert warmup_cosine_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert warmup_cosine_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert warmup_cosine_factor(99, 100, 10, 0.1) == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    assert warmup_cosine_factor(int(mid), 100, 10, 0.0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 44 / 89))
    )
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = warmup_cosine(opt, total_steps=4, warmup_steps=2, min_lr_ratio=0.25)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 0.5])


def test_warmup_cosine_rejects_bad_arguments():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="min_lr_ratio=2"):
        warmup_cosine(opt, total_steps=4, min_lr_ratio=2)
    with pytest.raises(ValueError, match="total_steps=0"):
        warmup_cosine(opt, total_steps=0)


# ------------------------------------------------------------------ batch preparation


def _batch(mask=None, labels=None):
    ids = torch.arange(12).view(2, 6)
    out = {"input_ids": ids, "labels": labels if labels is not None else ids + 1}
    if mask is not None:
        out["attention_mask"] = mask
    return out


def test_prepare_batch_drops_right_padding_mask():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    labels = torch.arange(12).view(2, 6).masked_fill(mask == 0, -100)
    b = _batch(mask, labels)
    out = prepare_batch(b, torch.device("cpu"))
    assert "attention_mask" not in out and "attention_mask" in b  # input untouched
    assert torch.equal(out["labels"], labels)


def test_prepare_batch_rejects_left_padding_and_labelled_padding():
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding or holes"):
        prepare_batch(_batch(left), torch.device("cpu"))
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="labels != -100"):
        prepare_batch(_batch(right), torch.device("cpu"))


def test_prepare_batch_folds_loss_mask_into_labels():
    b = _batch()
    b["loss_mask"] = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    out = prepare_batch(b, torch.device("cpu"))
    assert "loss_mask" not in out
    assert out["labels"][0, :2].tolist() == [-100, -100] and out["labels"][1].tolist() == list(range(7, 13))


# ------------------------------------------------------------------ CP method registry


def test_cp_dispatch():
    from automodel.distributed.cp_utils import make_cp_batch_and_ctx

    assert get_cp_method("ring").batch_function() is make_cp_batch_and_ctx
    ring = get_cp_method("ring")
    assert ring.attn_implementations == ("sdpa", "eager") and not ring.supports_packed  # eager: routed in its context
    with pytest.raises(ValueError, match="distributed.cp_method='nope' is not one of"):
        get_cp_method("nope")


# ------------------------------------------------------------------ dry-run arithmetic


def test_rank_layout_is_row_major_like_init_device_mesh():
    layout = rank_layout({"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1})
    assert [(r["dp_replicate"], r["dp_shard"], r["cp"]) for r in layout[:4]] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
    ]
    assert [r["dp_rank"] for r in layout] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r["fsdp_index"] for r in layout] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_tail_positions_cover_the_row_once(cp):
    seq = 64
    covered = sorted(i for r in range(cp) for a, b in head_tail_positions(seq, cp, r) for i in range(a, b))
    assert covered == list(range(seq))
    if cp > 1:
        assert head_tail_positions(seq, cp, 0) == [(0, seq // (2 * cp)), (seq - seq // (2 * cp), seq)]


# ------------------------------------------------------------------ checkpoints, run dir, metrics, plot


def test_list_and_latest_checkpoint_skip_incomplete(tmp_path):
    for name, complete in (("step_2", True), ("step_10", True), ("step_12", False), ("step_14.tmp", True)):
        (tmp_path / name).mkdir()
        if complete:
            (tmp_path / name / "meta.json").write_text("{}")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 10]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_choose_run_dir(tmp_path):
    rec = RecipeSection(name="exp", output_root=str(tmp_path))
    first = choose_run_dir(rec, CheckpointSection())
    assert first.parent == tmp_path / "exp" and not first.exists()
    first.mkdir(parents=True)
    assert choose_run_dir(rec, CheckpointSection()) != first  # a taken name gets a suffix
    # resume picks the newest run that has a complete checkpoint
    (first / "checkpoints" / "step_3").mkdir(parents=True)
    (first / "checkpoints" / "step_3" / "meta.json").write_text("{}")
    time.sleep(0.01)
    (tmp_path / "exp" / "99999999-999999").mkdir()  # newer, but without a checkpoint
    assert choose_run_dir(rec, CheckpointSection(resume=True)) == first
    assert (
        choose_run_dir(RecipeSection(output_dir=str(tmp_path / "x")), CheckpointSection()) == tmp_path / "x"
    )


def test_metrics_and_plot(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl", enabled=True)
    for step, loss in enumerate([3.0, 2.5, 2.0], start=1):
        w.write({"type": "train", "step": step, "loss": loss, "grad_norm": float("inf")})
    w.write({"type": "val", "step": 3, "val_loss": 2.2})
    w.close()
    records = read_metrics(tmp_path / "m.jsonl")
    assert records[0] == {"type": "train", "step": 1, "loss": 3.0, "grad_norm": "inf"}
    png = plot_loss_curve(tmp_path / "m.jsonl", tmp_path / "loss.png", title="t")
    assert png.read_bytes()[:4] == b"\x89PNG"
    MetricsWriter(tmp_path / "off.jsonl", enabled=False).write({"a": 1})
    assert not (tmp_path / "off.jsonl").exists()
    json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
