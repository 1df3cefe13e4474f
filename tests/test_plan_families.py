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


def family_config(fam, directory) -> str:
    """A recipe config (a YAML file in ``directory``) whose ``model.config`` is ``fam``'s tiny config: the keys
    that differ from the class's defaults and that the class's ``__init__`` takes (the typecheck refuses others),
    with the vocabulary of the shipped tokenizer (1024 ids)."""
    config = fam.build_config()
    accepted = _accepted_keys(type(config))[0]
    node = {k: v for k, v in config.to_diff_dict().items()
            if k not in ("model_type", "transformers_version") and (accepted is None or k in accepted)}  # fmt: skip
    doc = yaml.safe_load(Path("configs/cp.yaml").read_text())  # whole (no defaults list: one compose is cheaper)
    doc["model"]["config"] = {"_target_": f"transformers.{type(config).__name__}", **node, "vocab_size": 1024}
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
