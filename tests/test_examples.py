"""The README's "use CP in your own loop" examples are examples/own_loop_context_parallel.py and
examples/own_loop.py verbatim, and they run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.dist_harness import REPO_ROOT, free_port


def test_readme_example_is_the_example_file():
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"<!-- own_loop:start -->\n```python\n(.*?)```\n<!-- own_loop:end -->", readme, re.S)
    assert block, "README has no own_loop block"
    assert block.group(1) == (REPO_ROOT / "examples" / "own_loop.py").read_text()


def test_own_loop_example_runs_on_two_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO_ROOT / "examples" / "own_loop.py"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(r"loss (\d+\.\d+) over 1024 tokens", proc.stdout)
    assert match, proc.stdout
    assert abs(float(match.group(1)) - 5.55) < 0.1  # ~ln(256) for an untrained model


def test_readme_context_parallel_example_is_the_example_file():
    readme = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"<!-- own_loop_cp:start -->\n```python\n(.*?)```\n<!-- own_loop_cp:end -->", readme, re.S)
    assert block, "README has no own_loop_cp block"
    assert block.group(1) == (REPO_ROOT / "examples" / "own_loop_context_parallel.py").read_text()


def test_context_parallel_example_runs_on_two_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO_ROOT / "examples" / "own_loop_context_parallel.py"), "thd_docs",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "context_parallel: method thd_docs" in proc.stdout and "cp_size 2" in proc.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) over 36 tokens \(thd_docs\)", proc.stdout)]
    assert len(losses) == 2, proc.stdout
    assert all(abs(x - 5.55) < 0.1 for x in losses)  # ~ln(256) for an untrained model
