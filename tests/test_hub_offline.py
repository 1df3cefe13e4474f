"""Models and tokenizers are offline by default (automodel/data/hub_offline.py): an uncached hub id fails
at once with the download command, a missing local path says so and suggests no download."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from automodel.config import load_config
from automodel.data.tokenizer import load_tokenizer
from automodel.errors import UserInputError
from automodel.models.loader import resolve_model_config

REPO = Path(__file__).resolve().parents[1]
UNCACHED = "automodel-test-org/never-cached-model-22a"


def _model_cfg(name: str, *extra: str):
    argv = ["--config", str(REPO / "configs/cp.yaml"), f"model.pretrained_model_name_or_path={name}", "~model.config"]
    return load_config([*argv, *extra], world_size=2).cfg.model


@pytest.fixture
def no_offline_env(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_uncached_hub_ids_fail_at_once_with_the_download_command(no_offline_env):
    model = _model_cfg(UNCACHED)
    assert model.allow_download is False
    t0 = time.perf_counter()
    with pytest.raises(UserInputError) as info:
        resolve_model_config(model)
    with pytest.raises(UserInputError) as tok_info:
        load_tokenizer(UNCACHED)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"{elapsed:.1f}s: the hub was contacted"
    for msg in (str(info.value), str(tok_info.value)):
        assert f"`hf download {UNCACHED}`" in msg and "model.allow_download=true" in msg, msg
        assert "HF_HUB_OFFLINE" not in msg and "couldn't connect" not in msg, msg


def test_offline_env_is_named_only_when_set(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserInputError, match=r"HF_HUB_OFFLINE is set in the environment.*hf download"):
        resolve_model_config(_model_cfg(UNCACHED, "model.allow_download=true"))


def test_missing_local_paths_say_so_without_a_download(no_offline_env, tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(UserInputError) as info:
        resolve_model_config(_model_cfg(str(missing)))
    with pytest.raises(UserInputError) as tok_info:
        load_tokenizer(str(missing))
    for msg in (str(info.value), str(tok_info.value)):
        assert "the local path does not exist" in msg and "download" not in msg, msg
