"""The ``automodel`` console command (automodel/cli.py): one error line and exit 2 for every input
mistake, exit 143 / 130 after a checkpoint on SIGTERM / SIGINT, nothing of the launcher's own.

The command is not installed into the test venv: it runs as ``python -m automodel.cli`` (the console
script calls the same ``main``, which ``test_pyproject_declares_the_console_script`` checks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from automodel import cli
from tests.workers.recipe_worker import TINY

REPO = Path(__file__).resolve().parents[1]
CP = str(REPO / "configs" / "cp.yaml")


def _env() -> dict[str, str]:
    # the setup's output is held until it worked (30 s by default): longer here, for a loaded CI machine
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", AUTOMODEL_SETUP_HOLD_S="600")
    env.pop("AUTOMODEL_LAUNCHER_LOG", None)
    return env


def _cli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "automodel.cli", "finetune", *args],
        capture_output=True, text=True, env=_env(), cwd=cwd, timeout=timeout,
    )  # fmt: skip


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_pyproject_declares_the_console_script():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["automodel"] == "automodel.cli:main"
    assert callable(cli.main)


def test_split_argv_separates_launcher_and_recipe_arguments():
    _, takes = cli._launcher_parser()
    launcher, recipe = cli.split_argv(
        ["--config", "cp.yaml", "--nproc-per-node", "2", "a.b=1", "--nnodes=2", "--standalone",
         "--rdzv_endpoint", "h:1", "+x=2", "-c", "other.yaml"],
        takes,
    )  # fmt: skip
    assert launcher == ["--nproc-per-node", "2", "--nnodes=2", "--standalone", "--rdzv_endpoint", "h:1"]
    assert recipe == ["--config", "cp.yaml", "a.b=1", "+x=2", "-c", "other.yaml"]
    with pytest.raises(cli._UsageError, match=r"unknown option '--no-python'"):
        cli.split_argv(["--no-python"], takes)


MISTAKES = {  # overrides -> a fragment of the one error line
    ("step_scheduler.max_step=10",): "did you mean 'step_scheduler.max_steps'?",
    ("optimizer.lrr=1e-3",): "did you mean 'optimizer.lr'?",
    ("data.pad_to_multiple_of=6",): "set it to a multiple of 4 (e.g. 4 or 8), or to null (then 4)",
    ("lr_scheduler.warmup_steps=10", "step_scheduler.max_steps=3"):
        "lr_scheduler.warmup_steps=10 is more than step_scheduler.max_steps=3",
    ("distributed.cp_size=3",): "is not divisible by",
}


def test_config_mistakes_are_one_line_and_exit_2(capfd, tmp_path):
    """Each mistake is caught by the command before any rank starts (cheap: one Hydra compose each)."""
    for override, fragment in MISTAKES.items():
        code = cli.main(["finetune", "--config", CP, "--nproc-per-node", "2", *override, f"recipe.output_root={tmp_path}"])
        out, err = capfd.readouterr()
        lines = _lines(out + err)
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (override, out, err)
        assert fragment in lines[0], (override, lines[0])
        assert "+step_scheduler" not in lines[0] and "To append" not in lines[0], lines[0]
    assert cli.main(["finetune", "--nproc-per-node"]) == 2
    assert _lines(capfd.readouterr().err) == ["error: --nproc-per-node needs a value (see automodel finetune --help)"]


@pytest.mark.dist
def test_real_launches_one_line_exit_2(tmp_path):
    """Through the real command: a typo (a process of its own), and a broken jsonl line that the ranks
    find (launched by torch's elastic launcher; HFDataset, which counts the line from 1)."""
    typo = _cli("--config", CP, "--nproc-per-node", "2", "step_scheduler.max_step=10", cwd=tmp_path)
    assert typo.returncode == 2 and _lines(typo.stdout + typo.stderr) == [
        "error: step_scheduler.max_step: unknown key; did you mean 'step_scheduler.max_steps'? check the "
        "spelling (every key: docs/recipe.md)"
    ], typo

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a good line"}) + "\n" + '{"text": broken\n')
    run = _cli(
        "--config", CP, "--nproc-per-node", "2", "data.dataset._target_=automodel.data.hf_dataset.HFDataset",
        f"+data.dataset.path={bad}", "~data.dataset.val_fraction", f"recipe.output_root={tmp_path / 'out'}",
        cwd=tmp_path,
    )  # fmt: skip
    lines = _lines(run.stdout + run.stderr)
    assert run.returncode == 2 and len(lines) == 1, run
    assert lines[0].startswith(f"error: {bad}:2 is not valid JSON"), lines


@pytest.mark.dist
def test_sigterm_and_sigint_checkpoint_and_exit_143_130(tmp_path):
    """A signal to the command stops the ranks with SIGTERM: they checkpoint, it exits 143 (130 for SIGINT)."""
    for sig, want in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        out = tmp_path / sig.name
        p = subprocess.Popen(
            [sys.executable, "-m", "automodel.cli", "finetune", "--config", CP, "--nproc-per-node", "2",
             *TINY, "step_scheduler.max_steps=100000", "step_scheduler.val_every_steps=null", "data.seq_len=64",
             f"recipe.output_dir={out}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().strip()):
            assert p.poll() is None, p.communicate()
            time.sleep(0.2)
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == want, (sig, p.returncode, stdout, stderr)
        assert "Traceback" not in stdout + stderr and "SignalException" not in stderr, stderr
        assert "stopped by SIGTERM" in stdout, stdout
        assert list((out / "checkpoints").glob("step_*")), list(out.iterdir())


def test_quick_start_uses_the_console_command():
    """README's quick start runs scripts/run.sh, which runs the console command that setup installs."""
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "bash scripts/run.sh" in quick and "bash scripts/test.sh" in quick
    assert "automodel finetune --config configs/cp.yaml --nproc-per-node 2" in quick
    run_sh = (REPO / "scripts" / "run.sh").read_text()
    assert 'bash "$root/scripts/setup.sh"' in run_sh and '"$automodel" finetune' in run_sh
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "pip install --quiet \"${pin_args[@]}\" -e" in setup and "$venv/bin/automodel" in setup


def test_target_keys_are_added_without_plus_and_typos_get_no_plus_advice():
    from automodel.config.compose import compose_config

    raw = compose_config(REPO / "configs/cp.yaml", ["optimizer.foreach=false"])  # an AdamW argument the YAML lacks
    assert raw["optimizer"]["foreach"] is False


def test_each_command_prints_its_own_usage(capsys):
    assert cli.main(["finetune", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: automodel finetune") and "automodel plan" not in out
    assert cli.main(["plan", "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: automodel plan") and "automodel finetune" not in out
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: automodel finetune" in out and "usage: automodel plan" in out


def test_dry_run_plans_the_launchs_gpus_per_node(capfd):
    """``--nproc-per-node 4`` reaches the dry run as its GPUs per node (automodel plan's --gpus-per-node)."""
    assert cli.main(["finetune", "--config", CP, "--nproc-per-node", "4", "recipe.dry_run=true",
                     "recipe.gpu_type=h100"]) == 0  # fmt: skip
    out = capfd.readouterr().out
    assert "(planned for world size 4)" in out and "4 GPUs per node assumed" in out
    assert "= 4 rank(s) x" in out and "limit 1024 GiB per node of 4 GPUs" in out
