"""Every family of the support matrix plans (issue 41, item 5): ``automodel plan`` and the dry run on the meta device.

Each family's tiny config (tests/family_matrix.py) is written as a recipe config (``configs/cp.yaml`` with the
family's ``model.config``) and planned for 2 GPUs with ``automodel plan`` (every layout, CP method and memory
technique), then dry-run for its config's own layout with ``loss.chunk_tokens: auto`` (what training resolves
first). Attention-free models (Mamba, RWKV, xLSTM) crashed both on ``hidden_size // num_attention_heads``.
No process group, no weights: a fraction of a second per family.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from automodel.cli import main
from automodel.config import load_config
from automodel.config.typecheck import _accepted_keys
from automodel.training.dry_run import dry_run_report
from tests.family_matrix import FAMILIES, family_by_name


def family_config(fam, directory, config=None) -> str:
    """A recipe config (a YAML file in ``directory``) whose ``model.config`` is ``fam``'s tiny config (or ``config``,
    one built from it with other sizes: scripts/bench_plan_families_cp.py): the keys that differ from the class's
    defaults and that the class's ``__init__`` takes (the typecheck refuses others), with the vocabulary of the
    shipped tokenizer (1024 ids; the per-layer embedding of Gemma 3n / 4 too)."""
    config = fam.build_config() if config is None else config
    accepted = _accepted_keys(type(config))[0]
    node = {k: v for k, v in config.to_diff_dict().items()
            if k not in ("model_type", "transformers_version") and (accepted is None or k in accepted)}  # fmt: skip
    doc = yaml.safe_load(Path("configs/cp.yaml").read_text())  # whole (no defaults list: one compose is cheaper)
    vocab = {"vocab_size": 1024}
    if getattr(config, "vocab_size_per_layer_input", None) == config.vocab_size:  # Gemma 3n / 4's per-layer table
        vocab["vocab_size_per_layer_input"] = 1024  # (Gemma 4 looks every id up in it: an id past it is an IndexError)
    if getattr(config, "unpadded_vocab_size", None) == config.vocab_size:  # Inkling 2: logits cut to it
        vocab["unpadded_vocab_size"] = 1024
    doc["model"]["config"] = {"_target_": f"transformers.{type(config).__name__}", **node, **vocab}
    doc["model"]["attn_implementation"] = fam.attn_implementation()
    doc["loss"] = {"chunk_tokens": "auto"}
    path = directory / f"{fam.name.replace('@', '_')}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_every_family_plans_and_dry_runs(fam, tmp_path, capsys):
    config = family_config(fam, tmp_path)
    assert main(["plan", "--config", config, "--gpus", "2", "--gpu-type", "h100"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert re.search(r"^longest: [1-9]\d* tokens per row", out.splitlines()[-1], re.M), out
    report = dry_run_report(load_config(["--config", config, "recipe.dry_run=true", "distributed.cp_size=1",
                                         "recipe.dry_run_world_size=2"]))  # FSDP2 over 2, as a first run  # fmt: skip
    assert re.search(r"loss\.chunk_tokens auto: (on|off)", report) and "dry run: nothing was trained" in report


def test_attention_free_models_plan_without_attention_terms(tmp_path):
    report = dry_run_report(load_config(["--config", family_config(family_by_name("mamba"), tmp_path),
                                         "recipe.dry_run=true", "distributed.cp_size=1"]))  # fmt: skip
    assert "layers 2, hidden 64, no attention, vocab 1024" in report and "attention q / k,v" not in report


def test_decoder_layers_are_outermost_blocks_and_mamba_shards_with_fsdp2(tmp_path):
    """FSDP2 wraps each decoder block once: a model that names a block and a part of it (Mamba's MambaBlock and its
    MambaMixer, Zamba's hybrid layer and its Mamba layer) gets the block only. Wrapping the part after its block
    crashed ``fully_shard`` ("Cannot concatenate overlapping meshes"), at any world size; one gloo rank shows it.
    (Two ranks, FSDP2 on and off, 2 steps of a 14-layer Zamba: the same losses and gradient norms.)"""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from automodel.distributed.mesh import ParallelDims
    from automodel.models.parallelize import apply_fsdp2, decoder_layers, fsdp_units

    for fam in FAMILIES:
        with torch.device("meta"):
            model = fam.build_model()
        layers = decoder_layers(model)
        ids = {id(layer) for layer in layers}
        nested = [type(layer).__name__ for layer in layers if any(id(m) in ids for m in layer.modules() if m is not layer)]
        assert not nested, (fam.name, nested)
    assert [type(layer).__name__ for layer in decoder_layers(family_by_name("mamba").build_model())] == ["MambaBlock"] * 2
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = family_by_name("mamba").build_model()
        apply_fsdp2(model, ParallelDims(world_size=1).build_mesh("cpu"), param_dtype=None, reduce_dtype=torch.float32)
        ids = torch.randint(3, 128, (1, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        # Zamba's hybrid layers share one attention block: they are one FSDP2 unit (fully_shard refused a parameter
        # a second group would manage; transformers ties them with the embeddings); 14 layers hold 3 hybrid ones
        zamba = AutoModelForCausalLM.from_config(family_by_name("zamba").build_config().__class__(
            **{**family_by_name("zamba").config_kwargs, "num_hidden_layers": 14, "attn_layer_period": 6,
               "attn_layer_offset": 4, "tie_word_embeddings": True}), attn_implementation="eager")  # fmt: skip
        units = fsdp_units(decoder_layers(zamba))
        assert [len(u) for u in units if isinstance(u, list)] == [3] and len(units) == 12
        apply_fsdp2(zamba, ParallelDims(world_size=1).build_mesh("cpu"), param_dtype=None, reduce_dtype=torch.float32)
        zamba(input_ids=ids, labels=ids).loss.backward()
    finally:
        dist.destroy_process_group()


# the families whose recipe run the default CI launch carries (the whole sweep: scripts/family_sweep.py, or -m slow):
# attention-free (Mamba crashed in fully_shard), a shared block (Zamba), softcapping on eager (Gemma 2), MoE
# (Mixtral), a linear mixer (Qwen3-Next)
TRAINED_IN_CI = ("gemma2", "mixtral", "qwen3_next", "zamba", "mamba")


def _train(names, tmp_path, timeout: float) -> dict:
    from tests.dist_harness import run_distributed

    configs = [(name, family_config(family_by_name(name), tmp_path)) for name in names]
    ranks = run_distributed("tests.workers.family_train_worker:main", world_size=2, timeout=timeout, configs=configs,
                            out=str(tmp_path / "runs"))  # fmt: skip
    assert ranks[0].keys() == ranks[1].keys() == set(names)
    return {name: (ranks[0][name], ranks[1][name]) for name in names}


def _assert_trained(results: dict) -> None:
    bad = {name: got[0].get("reason") or got[0].get("error") for name, got in results.items()
           if got[0]["status"] != "trained"}  # fmt: skip
    assert not bad, bad
    for name, (first, second) in results.items():
        assert first["fsdp2"] and first["losses"] == second["losses"], name  # FSDP2 over 2 ranks: one loss
        assert first["chunk_tokens"] in (None, 1024), (name, first["chunk_tokens"])  # auto: resolved, on or off


@pytest.mark.dist
def test_families_train_two_steps_under_fsdp2_with_the_default_chunked_loss(tmp_path):
    """Issue 41: the recipe trains each family 2 steps at 2 ranks with FSDP2 and ``loss.chunk_tokens: auto``."""
    _assert_trained(_train(TRAINED_IN_CI, tmp_path, timeout=300))


@pytest.mark.slow
@pytest.mark.dist
def test_every_family_trains_two_steps_under_fsdp2(tmp_path):
    """Every row of the support matrix, the same way (scripts/family_sweep.py prints the same per family)."""
    _assert_trained(_train([f.name for f in FAMILIES], tmp_path, timeout=2400))
