"""``distributed.cp_method: ulysses`` in the recipe: registry, validation, dry run, packed-row references.

The training runs themselves (Ulysses cp=2 vs the single-device run, on plain and on packed rows)
are in the launched group of ``tests/test_recipe_parity.py``. Here: what can be checked without a
process group (in-process ``load_config`` / ``dry_run_report``, the unit-level batch functions), plus
two runs of the real script for the exit code 2 contract, and the proof that the cp=1 reference for
packed rows (transformers' document masking from restarting ``position_ids``) is the per-document
computation that Ulysses reproduces.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import (
    check_model_config_for_cp,
    cp_methods,
    get_cp_method,
)
from tests.dist_harness import free_port

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "finetune.py"
ULYSSES = "configs/cp_ulysses.yaml"


def load(*overrides: str, world: int = 2, config: str = ULYSSES):
    return load_config(["--config", config, *overrides], world_size=world)


def problems(*overrides: str, world: int = 2, config: str = ULYSSES) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, world=world, config=config)
    return str(info.value)


def _recipe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


# ------------------------------------------------------------------ the registry


def test_registry_entries():
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx

    u = get_cp_method("ulysses")
    assert u.batch_function() is make_ulysses_batch_and_ctx
    assert u.attn_implementations == ("sdpa", "eager", "flex_attention") and u.supports_packed
    assert u.splits_heads and u.chunks_per_rank == 1 and u.layout == "contiguous"
    assert not get_cp_method("ring").splits_heads and get_cp_method("ring").chunks_per_rank == 2
    with pytest.raises(
        ValueError, match=r"distributed.cp_method='bogus' is not one of \['ring', 'thd', 'thd_docs', 'ulysses', 'usp'\]"
    ):
        get_cp_method("bogus")


def test_no_method_runs_at_cp1():
    class NotAModel:  # would fail if anything tried to switch it
        pass

    from automodel.distributed.cp.bind import bind_cp_method, no_cp_batch_and_ctx

    for name in cp_methods():
        fn, prepared = bind_cp_method(name, NotAModel(), None, cp_size=1)
        assert fn is no_cp_batch_and_ctx and not prepared.switched and prepared.previous_attn is None
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    factory, out = no_cp_batch_and_ctx(None, batch)
    assert out is batch
    with factory():
        pass


@pytest.mark.parametrize("seq, cp", [(256, 2), (15, 2), (100, 3), (8, 8)])
def test_token_ranges_contiguous_match_the_ulysses_shards(seq, cp):
    from automodel.distributed.sp.all_to_all import even_split_sizes

    ranges = [get_cp_method("ulysses").token_ranges(seq, cp, r) for r in range(cp)]
    assert [b - a for ((a, b),) in ranges] == even_split_sizes(seq, cp)
    assert ranges[0][0][0] == 0 and ranges[-1][0][1] == seq
    assert all(ranges[r][0][1] == ranges[r + 1][0][0] for r in range(cp - 1))
    assert get_cp_method("ring").token_ranges(16, 2, 0) == [(0, 4), (12, 16)]


# ------------------------------------------------------------------ config validation


def test_cp_ulysses_yaml_is_cp_yaml_with_the_method_changed():
    ulysses, ring = load().raw, load(config="configs/cp.yaml").raw
    assert ulysses["distributed"]["cp_method"] == "ulysses" and ring["distributed"]["cp_method"] == "ring"
    assert ulysses["recipe"]["name"] == "cp-ulysses-tiny-llama"
    for key in ("model", "data", "step_scheduler", "optimizer", "lr_scheduler", "fsdp", "checkpoint"):
        assert ulysses[key] == ring[key], key
    assert "defaults" not in ulysses


def test_unknown_method_names_the_key_and_the_allowed_values():
    msg = problems("distributed.cp_method=bogus")
    assert "distributed.cp_method='bogus' is not one of ['ring', 'thd', 'thd_docs', 'ulysses', 'usp']" in msg
    assert "set distributed.cp_method to one of ring | ulysses | thd | thd_docs | usp" in msg


def test_heads_not_divisible_by_cp_is_rejected_from_the_inline_config():
    msg = problems(
        "distributed.cp_size=4",
        "model.config.num_attention_heads=6",
        "model.config.num_key_value_heads=2",
        world=4,
    )
    assert (
        "distributed.cp_method=ulysses splits the attention heads over the CP ranks, but model.config has "
        "num_attention_heads=6, which is not divisible by distributed.cp_size=4" in msg
    )
    assert "set distributed.cp_size to a divisor of 6 ([2, 3, 6]); or set distributed.cp_method to one" in msg
    # the methods named pass the same rules: those that do not split heads, and usp with a ulysses_size that divides 6
    assert "with this config: ring | thd | thd_docs | usp (ulysses_size=2), or auto" in msg
    # config_overrides win over the inline value; ring does not split heads
    assert load("distributed.cp_size=4", "+model.config_overrides.num_attention_heads=8", world=4)
    assert load("distributed.cp_size=4", "model.config.num_attention_heads=6", "model.config.num_key_value_heads=2",
                "distributed.cp_method=ring", world=4)  # fmt: skip


def test_heads_check_on_a_loaded_config():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match=r"model has num_attention_heads=6, which is not divisible by "
                                         r"distributed.cp_size=4"):  # fmt: skip
        check_model_config_for_cp(
            "ulysses", LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2), 4
        )
    check_model_config_for_cp(
        "ulysses", LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2), 3
    )
    check_model_config_for_cp(
        "ulysses", LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2), 1
    )
    check_model_config_for_cp(
        "ring", LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=2), 4
    )


def test_ulysses_takes_eager_flex_and_packed_rows_ring_does_not():
    for attn in ("eager", "flex_attention"):
        assert load(f"model.attn_implementation={attn}", "+data.dataset.pack=true")
    with pytest.raises(
        ConfigError, match=r"flex_attention cannot train on CPU \(torch has no FlexAttention backward"
    ):
        load_config(
            ["--config", ULYSSES, "model.attn_implementation=flex_attention"],
            world_size=2,
            cuda_available=False,
        )
    msg = problems("model.attn_implementation=flash_attention_2")
    assert (
        "distributed.cp_method=ulysses with cp_size=2 needs model.attn_implementation in "
        "['sdpa', 'eager', 'flex_attention'], got 'flash_attention_2'" in msg
    )
    msg = problems("+data.dataset.pack=true", config="configs/cp.yaml")
    assert "data.dataset.pack=true (several documents per row) with distributed.cp_method=ring" in msg
    # usp is not named at cp_size 2 (it has no configuration there: ulysses_size must be a proper divisor)
    assert "takes packed rows with this config: ulysses | thd | thd_docs, or auto" in msg
    assert "data.dataset.pack=false" in msg
    msg = problems("model.attn_implementation=flex_attention", config="configs/cp.yaml")
    assert "set distributed.cp_method to one that takes attn_implementation='flex_attention' with this config: ulysses, or auto" in msg


def test_rows_are_padded_to_one_contiguous_slice_per_rank():
    from automodel.training.row_padding import pad_multiple

    # any data.seq_len validates: the collator pads every row (labels -100) to the method's multiple
    assert pad_multiple(load("data.seq_len=129").cfg) == 2  # Ulysses: cp_size
    assert pad_multiple(load("data.seq_len=130", config="configs/cp.yaml").cfg) == 4  # ring: 2*cp_size
    assert pad_multiple(load("data.seq_len=129", "data.pad_to_multiple_of=2").cfg) == 2
    assert "data.pad_to_multiple_of=3 is not a multiple of cp_size = 2" in problems(
        "data.pad_to_multiple_of=3"
    )


def test_dry_run_prints_the_method_and_the_contiguous_layout():
    from automodel.training.dry_run import dry_run_report

    report = dry_run_report(load_config(["--config", ULYSSES, "recipe.dry_run=true"]))
    assert "cp_method ulysses (all-to-all" in report and "split into 2 contiguous slices" in report
    assert "0       0        0  0  0 |       0        0 | [0, 128)\n" in report
    assert "1       0        0  1  0 |       0        1 | [128, 256)\n" in report
    assert (
        "q / k,v -> [4, 2, 256, 32] / [4, 1, 256, 32]: the inner kernel 'sdpa' sees the whole row" in report
    )
    report = dry_run_report(load_config(["--config", "configs/cp.yaml", "recipe.dry_run=true"]))
    assert "cp_method ring (torch ring attention" in report and "[0, 64), [192, 256)" in report


def test_subprocess_exit_2_for_a_bogus_method(tmp_path):
    out = tmp_path / "outputs"
    proc = _recipe(
        "--config", ULYSSES, "distributed.cp_method=bogus", f"recipe.output_root={out}", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "distributed.cp_method='bogus' is not one of ['ring', 'thd', 'thd_docs', 'ulysses', 'usp']" in proc.stderr
    assert not out.exists()


def _weightless_model_dir(path: Path) -> list[str]:
    """A pretrained directory with a config.json (3 heads) and NO weights; overrides that use it."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1024, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=3, num_key_value_heads=1).save_pretrained(path)  # fmt: skip
    return ["~model.config", f"model.pretrained_model_name_or_path={path}", "data.tokenizer=default"]  # no tokenizer there


def test_dry_run_checks_the_heads_of_a_pretrained_config(tmp_path):
    from automodel.training.dry_run import dry_run_report

    # the rules cannot see the heads of a pretrained config: the dry run reads its config.json
    loaded = load_config(["--config", ULYSSES, *_weightless_model_dir(tmp_path), "recipe.dry_run=true"])
    with pytest.raises(ValueError, match=r"model has num_attention_heads=3, which is not divisible by "
                                         r"distributed.cp_size=2; set distributed.cp_size to a divisor of 3"):  # fmt: skip
        dry_run_report(loaded)


def test_subprocess_heads_checked_before_any_weight_is_loaded(tmp_path):
    # the real run on 2 ranks stops at the config check (exit 2), not later at the missing weights
    args = [*_weightless_model_dir(tmp_path / "model"), f"recipe.output_dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(RECIPE), "--config", ULYSSES,
         *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert log.count("error: distributed.cp_method=ulysses splits the attention heads") == 1, (
        log
    )  # rank 0 prints it once (automodel.training.user_errors)
    assert "exitcode  : 2" in log, log  # torchrun's report of the ranks' exit code
    assert not (tmp_path / "run" / "hf_model").exists()


# ------------------------------------------------------------------ the packed-rows reference


@pytest.fixture(scope="module")
def packed_batch():
    from automodel.data.collator import collate
    from automodel.data.text_dataset import TextDataset

    ds = TextDataset(seq_len=256, pack=True, split="validation", val_fraction=0.05)
    rows = [ds[i] for i in range(len(ds)) if ds[i]["seq_lens"].numel() >= 3][:2]
    assert len(rows) == 2
    return collate(rows, pad_token_id=ds.pad_token_id, pad_to_multiple_of=1)


def _tiny_model(attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)  # fmt: skip
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_reference_is_per_document_attention_and_ulysses_agrees(packed_batch, attn):
    """The cp=1 recipe path (transformers' masks from restarting position_ids) equals running every
    document alone, and so does Ulysses' own mask from seq_lens_padded (here at world size 1)."""
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention
    from automodel.training.step import MODEL_INPUT_KEYS, prepare_batch

    model = _tiny_model(attn)
    batch = prepare_batch(packed_batch, torch.device("cpu"))
    with torch.no_grad():
        ref = model(**{k: batch[k] for k in MODEL_INPUT_KEYS if k in batch}).logits  # the recipe's cp=1 call
        across = model(input_ids=batch["input_ids"]).logits  # no position_ids: attends across documents
        alone = torch.zeros_like(ref)
        for b, lens in enumerate(batch["seq_lens_padded"].tolist()):
            start = 0
            for n in (n for n in lens if n > 0):
                alone[b, start : start + n] = model(
                    input_ids=batch["input_ids"][b : b + 1, start : start + n]
                ).logits[0]
                start += n
            assert start == batch["input_ids"].size(1)
        inner = set_ulysses_attention(model)
        factory, local = make_ulysses_batch_and_ctx(None, batch, inner_attn=inner)
        assert sorted(local) == ["input_ids", "labels", "position_ids"]
        with factory():
            ulysses = model(
                input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
            ).logits
    assert (ref - alone).abs().max().item() <= 1e-5
    assert (ulysses - ref).abs().max().item() <= 1e-5
    assert (across - ref).abs().max().item() > 1e-2  # document masking matters for these rows
