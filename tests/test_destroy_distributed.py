"""``destroy_distributed`` frees the process groups while the interpreter is alive: no gloo thread is left to
release a collective's tensors during shutdown, which aborts a finished process (pytorch/pytorch#190489)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.dist_harness import REPO_ROOT, free_port

SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig
    from automodel.distributed.cp import context_parallel
    from automodel.distributed.mesh import ParallelDims, destroy_distributed, init_distributed

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
        return sum(n.startswith(("pt_gloo", "gloo")) for n in names)

    def main():  # a training loop's objects: a mesh, a CP handle, a collective on the CP group
        mesh = ParallelDims(cp=2).build_mesh()
        model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))
        cp = context_parallel(model, mesh, method="thd_docs")
        t = torch.ones(3)
        dist.all_reduce(t, group=mesh["cp"].get_group())
        cp.restore()

    init_distributed()
    main()
    dist.destroy_process_group()
    after_destroy = gloo_threads()
    destroy_distributed()  # no group left to destroy: it frees the ones garbage still holds
    print(f"rank {dist.get_rank() if dist.is_initialized() else os.environ['RANK']}: gloo threads "
          f"{after_destroy} after destroy_process_group, {gloo_threads()} after destroy_distributed")
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_destroy_distributed_leaves_no_gloo_thread(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = re.findall(r"gloo threads (\d+) after destroy_process_group, (\d+) after destroy_distributed", proc.stdout)
    assert len(counts) == 2, proc.stdout
    for after_destroy, after_ours in counts:
        assert int(after_destroy) > 0  # dist.destroy_process_group alone: the groups (and their threads) live on
        assert int(after_ours) == 0
