"""A config file that is not valid YAML (a key written twice, a bad indent; the user's file or a parent in
its ``defaults``) is a one-line ConfigError naming the file, the line and the column, not a traceback
(``automodel finetune`` prints it as ``error: ...`` and exits 2)."""

from __future__ import annotations

import pytest

from automodel.config import ConfigError, load_config


@pytest.mark.parametrize(
    "text, where, problem",
    [
        ("defaults: [cp, _self_]\nrecipe:\n  name: x\nrecipe:\n  seed: 1\n", "line 4, column 1", "found duplicate key recipe"),
        ("defaults: [cp, _self_]\nrecipe:\n  name: x\n   seed: 1\n", "line 4, column 8", "mapping values are not allowed here"),
        ("recipe:\n  name: x\n   seed: 1\n", "line 3, column 8", "mapping values are not allowed here"),
    ],
)  # fmt: skip
def test_a_config_that_is_not_yaml_is_one_line(tmp_path, text, where, problem):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(path)], world_size=2)
    msg = str(info.value)
    assert msg.startswith(f"{path}, {where}: not valid YAML ({problem}); fix the file there"), msg
    assert "\n" not in msg


def test_a_broken_parent_is_named(tmp_path):
    (tmp_path / "parent.yaml").write_text("defaults: [cp, _self_]\nrecipe:\n  name: x\nrecipe:\n  seed: 1\n")
    (tmp_path / "child.yaml").write_text("defaults: [parent, _self_]\nrecipe:\n  seed: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(tmp_path / "child.yaml")], world_size=2)
    assert str(info.value).startswith(f"{tmp_path / 'parent.yaml'}, line 4, column 1: not valid YAML"), info.value
