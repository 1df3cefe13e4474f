"""A config anywhere may inherit the shipped ones: ``defaults`` resolve in its own directory, then configs/."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def test_config_outside_configs_inherits_cp(tmp_path):
    own = tmp_path / "my_sft.yaml"
    own.write_text("defaults:\n  - cp\n  - _self_\n\nstep_scheduler:\n  max_steps: 70\n")
    shipped = load_config(["--config", str(REPO / "configs/cp.yaml")], world_size=2)
    loaded = load_config(["--config", str(own), "optimizer.lr=1e-4"], world_size=2)
    assert loaded.cfg.step_scheduler.max_steps == 70 and loaded.cfg.optimizer["lr"] == 1e-4
    assert loaded.raw["model"] == shipped.raw["model"] and loaded.raw["data"] == shipped.raw["data"]

    # the config's own directory comes first: a local cp.yaml shadows the shipped one
    (tmp_path / "cp.yaml").write_text((REPO / "configs/cp.yaml").read_text().replace("cp-tiny-llama", "local-cp"))
    assert load_config(["--config", str(own)], world_size=2).cfg.recipe.name == "local-cp"


def test_missing_default_names_where_it_looked(tmp_path):
    own = tmp_path / "bad.yaml"
    own.write_text("defaults:\n  - no_such_base\n  - _self_\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(own)], world_size=2)
    msg = str(info.value)
    assert "defaults entry 'no_such_base' not found" in msg and str(tmp_path) in msg
    assert str(REPO / "configs") in msg, msg
