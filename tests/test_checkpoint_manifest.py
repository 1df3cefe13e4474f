"""Verified checkpoints without a process group: the manifest, each kind of damage, and which
checkpoint a resume picks (skip with one warning, or one error naming the file and the good one)."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from automodel.errors import UserInputError
from automodel.training.checkpoint_manifest import MANIFEST_FILE, verify_checkpoint, write_manifest
from automodel.training.resume_policy import select_resume_checkpoint

FILES = {".metadata": b"m" * 50, "__0_0.distcp": b"a" * 3000, "__1_0.distcp": b"b" * 3000, "rank_0.pt": b"r" * 400}


def _ckpt(root, step, manifest=True):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    for name, data in FILES.items():
        (d / name).write_bytes(data + bytes([step]))
    meta = {"step": step, "layout": {}}
    if manifest:
        meta["manifest"] = MANIFEST_FILE
    (d / "meta.json").write_text(json.dumps(meta))
    if manifest:
        write_manifest(d)
    return d


def test_manifest_records_every_file_with_size_and_sha256(tmp_path):
    d = _ckpt(tmp_path, 2)
    files = json.loads((d / MANIFEST_FILE).read_text())["files"]
    assert sorted(files) == sorted([*FILES, "meta.json"])
    data = (d / "__1_0.distcp").read_bytes()
    assert files["__1_0.distcp"] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not (d / f"{MANIFEST_FILE}.tmp").exists()
    assert verify_checkpoint(d) == (True, None)


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("__1_0.distcp", _truncate, "has 1500 bytes where the manifest records 3001"),
        ("__1_0.distcp", _flip, "has another sha256"),
        ("rank_0.pt", _truncate, "has 200 bytes"),
        (".metadata", lambda p: p.unlink(), "is missing"),
        ("meta.json", _flip, "has another sha256"),
        (MANIFEST_FILE, _truncate, "cannot be read"),
        (MANIFEST_FILE, lambda p: p.unlink(), "is missing (meta.json says"),
    ],
)
def test_each_damage_is_found_and_named(tmp_path, name, damage, reason):
    d = _ckpt(tmp_path, 2)
    damage(d / name)
    has_manifest, found = verify_checkpoint(d)
    assert found is not None and found.file == name and reason in found.reason, found


def test_checkpoint_before_manifests_is_unverifiable_not_damaged(tmp_path):
    d = _ckpt(tmp_path, 2, manifest=False)
    assert verify_checkpoint(d) == (False, None)
    (d / "meta.json").write_text("{trunc")
    assert verify_checkpoint(d)[1].file == "meta.json"


def test_resume_auto_skips_the_damaged_newest_with_one_warning(tmp_path, caplog):
    _ckpt(tmp_path, 2)
    good = _ckpt(tmp_path, 4)
    bad = _ckpt(tmp_path, 6)
    _truncate(bad / "__1_0.distcp")
    with caplog.at_level(logging.WARNING):
        assert select_resume_checkpoint(tmp_path, None) == good
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert str(bad) in warnings[0] and "__1_0.distcp" in warnings[0]


def test_resume_auto_all_damaged_is_an_error_and_none_without_checkpoints(tmp_path):
    assert select_resume_checkpoint(tmp_path / "none", None) is None
    for step in (2, 4):
        _flip(_ckpt(tmp_path, step) / "rank_0.pt")
    with pytest.raises(UserInputError, match=r"every checkpoint under .* is damaged \(step_4: rank_0.pt .*step_2"):
        select_resume_checkpoint(tmp_path, None)


def test_explicit_damaged_checkpoint_names_the_file_and_the_newest_good_one(tmp_path):
    _ckpt(tmp_path, 2)
    good = _ckpt(tmp_path, 4)
    bad = _ckpt(tmp_path, 6)
    _truncate(bad / "rank_0.pt")
    with pytest.raises(UserInputError) as e:
        select_resume_checkpoint(tmp_path, bad)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"checkpoint {bad} is damaged: rank_0.pt has" in msg
    assert f"the newest good checkpoint is {good}: resume with checkpoint.resume_from={good}" in msg
    assert select_resume_checkpoint(tmp_path, good) == good


def test_legacy_checkpoint_loads_with_a_warning(tmp_path, caplog):
    old = _ckpt(tmp_path, 2, manifest=False)
    with caplog.at_level(logging.WARNING):
        assert select_resume_checkpoint(tmp_path, None) == old
        assert select_resume_checkpoint(tmp_path, old) == old
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all("cannot be verified" in w for w in warnings), warnings
