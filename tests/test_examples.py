"""The README's "use CP in your own loop" example is examples/own_loop.py verbatim, and it runs."""

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
