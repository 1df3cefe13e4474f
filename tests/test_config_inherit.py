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


# ---- a model of another class replaces the inherited model.config whole (issue 27, item 6)

# the three models of the user's report, each a child of cp.yaml (whose model is a LlamaConfig)
OTHER_CLASS = {
    "qwen3_next": {
        "_target_": "transformers.Qwen3NextConfig",
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "gemma3": {
        "_target_": "transformers.Gemma3TextConfig",
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "sliding_window": 64,
    },
    "nemotron_h": {
        "_target_": "transformers.NemotronHConfig",
        "vocab_size": 1024,
        "hidden_size": 64,
        "layers_block_type": ["mamba", "attention", "mlp"],
    },
}


def _child(tmp_path: Path, name: str, model_config: dict, parent: str = "cp") -> Path:
    import yaml

    own = tmp_path / f"{name}.yaml"
    own.write_text(yaml.safe_dump({"defaults": [parent, "_self_"], "model": {"config": model_config}}))
    return own


@pytest.mark.parametrize("name", sorted(OTHER_CLASS))
def test_a_model_of_another_class_gets_exactly_its_own_keys(tmp_path, name):
    loaded = load_config(["--config", str(_child(tmp_path, name, OTHER_CLASS[name]))], world_size=2)
    assert loaded.raw["model"]["config"] == OTHER_CLASS[name]  # no rope_theta, tie_word_embeddings, ... of cp.yaml
    shipped = load_config(["--config", str(REPO / "configs/cp.yaml")], world_size=2).raw
    # the rest of the model section, and every other section, is inherited as before
    assert {k: v for k, v in loaded.raw["model"].items() if k != "config"} == {
        k: v for k, v in shipped["model"].items() if k != "config"
    }
    assert loaded.raw["data"] == shipped["data"] and loaded.raw["optimizer"] == shipped["optimizer"]


def test_a_model_of_the_same_class_merges(tmp_path):
    own = _child(tmp_path, "same", {"_target_": "transformers.LlamaConfig", "num_hidden_layers": 2})
    partial = _child(tmp_path, "partial", {"hidden_size": 64})  # no class: a few keys changed
    shipped = load_config(["--config", str(REPO / "configs/cp.yaml")], world_size=2).raw["model"]["config"]
    assert load_config(["--config", str(own)], world_size=2).raw["model"]["config"] == {**shipped, "num_hidden_layers": 2}
    assert load_config(["--config", str(partial)], world_size=2).raw["model"]["config"] == {**shipped, "hidden_size": 64}


def test_grandchild_and_command_line(tmp_path):
    """A chain: cp (Llama) <- qwen3_next child <- grandchild of the same class (merges with the child only);
    command-line overrides apply on top, including a key cp.yaml had and the child did not."""
    _child(tmp_path, "qwen3_next", OTHER_CLASS["qwen3_next"])
    grand = _child(tmp_path, "grand", {"num_hidden_layers": 2}, parent="qwen3_next")
    loaded = load_config(["--config", str(grand), "model.config.rope_theta=5e5", "model.config.hidden_size=32"], world_size=2)
    assert loaded.raw["model"]["config"] == {**OTHER_CLASS["qwen3_next"], "num_hidden_layers": 2, "hidden_size": 32,
                                             "rope_theta": 5e5}  # fmt: skip


def test_command_line_class_change_keeps_the_configs_keys():
    """The command line edits the config, it is not a parent: a class swapped there keeps the sizes."""
    argv = ["--config", str(REPO / "configs/cp.yaml"), "model.config._target_=transformers.Qwen3Config",
            "model.config.hidden_size=32", "~model.config.rope_theta"]  # fmt: skip
    shipped = load_config(["--config", str(REPO / "configs/cp.yaml")], world_size=2).raw["model"]["config"]
    expected = {**shipped, "_target_": "transformers.Qwen3Config", "hidden_size": 32}
    del expected["rope_theta"]
    assert load_config(argv, world_size=2).raw["model"]["config"] == expected


def test_command_line_class_change_replaces_the_old_class_nested_configs(tmp_path):
    """Qwen2-VL -> Qwen2.5-VL on the command line: vision_config (embed_dim and mlp_ratio are Qwen2-VL's; its
    hidden_size is the merger's output, Qwen2.5-VL's is the tower's width) is replaced with Qwen2.5-VL's
    defaults plus the command line's own vision keys; text_config (every key Qwen2.5-VL's) is kept, as the
    top-level keys are; a deletion inside the replaced node has nothing left to delete. Config level only."""
    import transformers

    vlm = ["--config", str(REPO / "configs/vlm_cp.yaml")]
    shipped = load_config(vlm, world_size=2).raw["model"]["config"]
    assert {"embed_dim", "mlp_ratio"} <= set(shipped["vision_config"])
    swap = [*vlm, "model.config._target_=transformers.Qwen2_5_VLConfig", "model.config.vision_config.depth=2",
            "model.config.vision_config.out_hidden_size=64", "~model.config.vision_config.mlp_ratio"]  # fmt: skip
    node = load_config(swap, world_size=2).raw["model"]["config"]
    assert node["_target_"] == "transformers.Qwen2_5_VLConfig"
    assert node["vision_config"] == {"depth": 2, "out_hidden_size": 64}
    assert node["text_config"] == shipped["text_config"]
    assert {k: v for k, v in node.items() if k != "vision_config"} == {
        **{k: v for k, v in shipped.items() if k != "vision_config"}, "_target_": "transformers.Qwen2_5_VLConfig"}
    vision = transformers.Qwen2_5_VLConfig(**{k: v for k, v in node.items() if k != "_target_"}).vision_config
    default = transformers.Qwen2_5_VLConfig().vision_config
    assert not hasattr(vision, "embed_dim") and not hasattr(vision, "mlp_ratio")
    assert (vision.depth, vision.out_hidden_size, vision.hidden_size) == (2, 64, default.hidden_size)
    # the same class on the command line changes nothing; a nested config of the new class's keys is kept
    same = load_config([*vlm, "model.config._target_=transformers.Qwen2VLConfig"], world_size=2)
    assert same.raw["model"]["config"] == shipped


def test_fold_replaces_on_class_change_only():
    from automodel.config.model_inherit import compose_model_config, model_class

    llama = {"_target_": "transformers.LlamaConfig", "a": 1, "rope_scaling": {"type": "yarn", "f": 2}}
    auto = {"_target_": "transformers.AutoConfig.for_model"}
    assert model_class({**auto, "model_type": "qwen3"})[1] == "qwen3"
    same = [model_class({"_target_": t}) for t in ("transformers.LlamaConfig", "transformers.models.llama.LlamaConfig")]
    assert same[0] == same[1] == ("transformers.models.llama.configuration_llama.LlamaConfig", None)
    node, replaced = compose_model_config([("cp.yaml", llama), ("a.yaml", {"rope_scaling": {"f": 4}})])
    assert node == {**llama, "rope_scaling": {"type": "yarn", "f": 4}}  # no class: merges, nested too
    node, replaced = compose_model_config(
        [("cp.yaml", llama), ("a.yaml", {"rope_scaling": {"f": 4}}), ("b.yaml", {**auto, "model_type": "qwen3", "b": 2}),
         ("c.yaml", {**auto, "model_type": "gemma3_text", "c": 3})]
    )  # fmt: skip
    assert node == {**auto, "model_type": "gemma3_text", "c": 3}
    assert replaced == [
        "b.yaml: transformers.AutoConfig.for_model(qwen3) replaces transformers.LlamaConfig",
        "c.yaml: transformers.AutoConfig.for_model(gemma3_text) replaces transformers.AutoConfig.for_model(qwen3)",
    ]


def test_a_model_config_group_replaces_too(tmp_path):
    """A model from a config group of the user's (``model/qwen3.yaml``, package ``model``) after cp."""
    import yaml

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "qwen3.yaml").write_text(yaml.safe_dump({"config": OTHER_CLASS["qwen3_next"]}))
    own = tmp_path / "grouped.yaml"
    own.write_text(yaml.safe_dump({"defaults": ["cp", {"model": "qwen3"}, "_self_"]}))
    loaded = load_config(["--config", str(own)], world_size=2)
    assert loaded.raw["model"]["config"] == OTHER_CLASS["qwen3_next"] and loaded.raw["model"]["dtype"] == "float32"


def test_a_config_without_parents_skips_the_defaults_list_with_the_same_answer(tmp_path):
    """model_replacement_overrides answers a config without parents (and a command line that keeps the class) from
    the file alone: the same deletions as reading the defaults list through Hydra, for every shipped config."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from automodel.config.model_inherit import _without_parents, model_replacement_overrides

    configs = sorted(Path("configs").resolve().glob("*.yaml"))
    assert any(_without_parents(c) for c in configs) and not all(_without_parents(c) for c in configs)
    for overrides in ([], ["model.config.hidden_size=32"], ["model.config._target_=transformers.Qwen3Config"]):
        for config in configs:
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(config.parent), version_base="1.3"):
                fast = model_replacement_overrides(config.stem, [], overrides, config)
                full = model_replacement_overrides(config.stem, [], overrides)
            assert fast == full, (config.name, overrides, fast, full)
    GlobalHydra.instance().clear()
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [cp, _self_]\n")
    assert not _without_parents(bad) and not _without_parents(tmp_path / "missing.yaml") and not _without_parents(None)
    bad.write_text("model: {config: [unclosed\n")
    assert not _without_parents(bad)
