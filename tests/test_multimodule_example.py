"""examples/multimodule_pipeline.py runs on 3 ranks (encoder on 0, Llama on 1-2 at pp=2 or ring cp=2) and
matches one process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dist_harness import REPO_ROOT, free_port

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("llm", ["pp", "cp"])
def test_multimodule_example_matches_one_process(llm):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO_ROOT / "examples" / "multimodule_pipeline.py"), "--steps", "2", "--llm", llm,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = re.findall(r"step (\d) loss (\d+\.\d+) one-process (\d+\.\d+)", proc.stdout)
    assert [s[0] for s in steps] == ["0", "1"], proc.stdout
    assert all(abs(float(a) - 4.85) < 0.1 for _, a, _ in steps)  # ~ln(128) for an untrained model
    match = re.search(r"max loss rel err (\S+) max grad rel err (\S+) \(float32, llm (\w+)=2\)", proc.stdout)
    assert match, proc.stdout
    assert float(match.group(1)) <= 1e-5 and float(match.group(2)) <= 1e-4 and match.group(3) == llm
