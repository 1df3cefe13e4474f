"""The pin file: scripts/setup.sh installs exactly constraints.txt, and the pins agree with pyproject.toml."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "constraints.txt"


def _pins_module():
    spec = importlib.util.spec_from_file_location("automodel_pins_script", ROOT / "scripts" / "pins.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pins_py = _pins_module()


def _requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in ("dev", "tensorboard", "wandb"):  # what setup.sh installs
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def test_every_requirement_is_pinned_inside_its_range():
    pins = pins_py.read(str(PINS))
    for req in _requirements():
        name = pins_py.canonical(req.name)
        assert name in pins, f"{req.name} ({req}) has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}")
    assert "automodel" not in pins and "pip" not in pins


def test_pins_are_exact_and_sorted():
    pins = pins_py.read(str(PINS))
    names = [line.split("==")[0] for line in PINS.read_text().splitlines() if line and not line.startswith("#")]
    assert names == sorted(names) and len(names) == len(pins) == len(set(names))
    assert all("+" not in v for v in pins.values()), "local version labels (+cpu) are dropped from pins"


def test_environment_holds_the_pins():
    """The suite runs on what setup.sh pinned (scripts/test.sh says which file; compat.sh runs set none)."""
    pin_file = os.environ.get("AUTOMODEL_PINS_FILE")
    if not pin_file:
        pytest.skip("AUTOMODEL_PINS_FILE is not set: not run through scripts/test.sh with pins")
    pins, have = pins_py.read(pin_file), pins_py.installed()
    kept_torch = pins.get("torch") != have.get("torch")  # setup.sh keeps a host's torch (a CUDA build)
    wrong = {n: (have[n], v) for n, v in pins.items()
             if n in have and have[n] != v and not (kept_torch and (n in ("torch", "triton") or n.startswith("nvidia-")))}
    assert not wrong, f"installed != pinned (name: (installed, pinned)): {wrong}; run bash scripts/setup.sh"
    missing = [n for n in pins if n not in have]
    # a pin that nothing installs on this platform may be absent; the packages we import may not
    assert not {"transformers", "peft", "datasets", "hydra-core", "omegaconf", "safetensors"} & set(missing), missing


def test_read_rejects_ranges(tmp_path):
    bad = tmp_path / "pins.txt"
    bad.write_text("# header\ntorch==2.13.0\ntransformers>=5.17\n")
    with pytest.raises(ValueError, match=r"pins.txt:3: 'transformers>=5.17' is not `name==version`"):
        pins_py.read(str(bad))


def test_diff_reports_moves(tmp_path, capsys):
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("transformers==5.24.0\nTyping_Extensions==4.15.0\nhf-xet==1.7.0\n")
    new.write_text("transformers==5.25.0\ntyping-extensions==4.15.0\nkernels==0.19.1\n")
    assert pins_py.diff(str(old), str(new)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["  transformers 5.24.0 -> 5.25.0", "  kernels 0.19.1 (new)", "  hf-xet 1.7.0 (no longer installed)"]


def test_check_names_each_drifted_pin(tmp_path, capsys):
    pins = tmp_path / "pins.txt"
    have = pins_py.installed()
    pins.write_text(f"transformers==0.0.1\ntorch=={have['torch']}\n")
    assert pins_py.check(str(pins), set()) == 1
    err = capsys.readouterr().err
    assert f"transformers {have['transformers']} installed, pinned 0.0.1" in err
    assert pins_py.check(str(pins), {"transformers"}) == 0


def test_update_pins_refuses_write_with_a_subset():
    for args, message in ((["--write", "--", "-k", "thd"], "--write moves the pins only after the whole suite"),
                          (["--bogus"], "unknown argument --bogus")):
        run = subprocess.run(["bash", str(ROOT / "scripts" / "update_pins.sh"), *args], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "AUTOMODEL_PINS_CACHE": "/nonexistent"})
        assert run.returncode == 2 and message in run.stderr, (run.returncode, run.stderr)



def test_installed_reads_the_distribution_the_interpreter_imports(tmp_path, monkeypatch):
    """A venv made with ``--system-site-packages`` (setup.sh on a host whose Python has torch) sees the system's older
    copies of packages it pinned after its own: the first on ``sys.path`` is the one imported, and the one reported."""
    for where, version in (("venv", "2.0"), ("system", "1.0")):
        info = tmp_path / where / f"pin_probe_pkg-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pin-probe-pkg\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "system"))
    monkeypatch.syspath_prepend(str(tmp_path / "venv"))  # first on sys.path
    assert pins_py.installed()[pins_py.canonical("pin-probe-pkg")] == "2.0"


def test_the_suite_runs_under_the_hash_seed_it_printed():
    """scripts/test.sh draws ``PYTHONHASHSEED`` unless it is given, exports it and prints it: the order of every set, and
    any choice made by iterating one, repeats under the printed seed. This worker (an interpreter of its own) and a
    child process hash a string alike, so both run under it (a process without the variable draws its own)."""
    import sys

    if not os.environ.get("AUTOMODEL_REQUIRE_EXTRAS"):
        pytest.skip("scripts/test.sh sets the seed; a bare pytest run keeps Python's own draw")
    seed = os.environ.get("PYTHONHASHSEED", "")
    assert seed.isdigit() and 0 < int(seed) <= 4294967295, seed
    child = subprocess.run([sys.executable, "-c", "print(hash('automodel'))"], capture_output=True, text=True,
                           env=dict(os.environ), check=True, timeout=60)  # fmt: skip
    assert int(child.stdout) == hash("automodel")
