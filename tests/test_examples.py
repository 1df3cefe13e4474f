"""The own-loop examples the README and docs/own_loop.md show are the files under examples/ verbatim, and they
run: examples/own_loop_context_parallel.py (README), own_loop.py and own_loop_fsdp.py (docs/own_loop.md; the
FSDP one on 4 ranks against one process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.dist_harness import REPO_ROOT, free_port


def _run_example(name: str, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc examples/<name> args`` on 127.0.0.1, one thread per rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(REPO_ROOT / "examples" / name), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)


def test_own_loop_page_shows_the_example_files():
    page = (REPO_ROOT / "docs" / "own_loop.md").read_text()
    for marker, name in (("own_loop", "own_loop.py"), ("own_loop_fsdp", "own_loop_fsdp.py")):
        block = re.search(rf"<!-- {marker}:start -->\n```python\n(.*?)```\n<!-- {marker}:end -->", page, re.S)
        assert block, f"docs/own_loop.md has no {marker} block"
        assert block.group(1) == (REPO_ROOT / "examples" / name).read_text()


def test_readme_dp_fsdp_snippet_is_taken_from_the_example():
    """The README's "with data parallelism and FSDP2" lines are lines of examples/own_loop_fsdp.py, which CI runs."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("With data parallelism and FSDP2", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1).strip().splitlines()
    example = {line.strip() for line in (REPO_ROOT / "examples" / "own_loop_fsdp.py").read_text().splitlines()}
    assert len(snippet) >= 5
    assert [line for line in snippet if line.strip() not in example] == []


def test_own_loop_example_runs_on_two_ranks():
    proc = _run_example("own_loop.py", 2)
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
    proc = _run_example("own_loop_context_parallel.py", 2, "thd_docs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "context_parallel: method thd_docs" in proc.stdout and "cp_size 2" in proc.stdout
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+) over 36 tokens \(thd_docs\)", proc.stdout)]
    assert len(losses) == 2, proc.stdout
    assert all(abs(x - 5.55) < 0.1 for x in losses)  # ~ln(256) for an untrained model


def _one_process_reference(steps: int = 2) -> list[tuple[float, float]]:
    """examples/own_loop_fsdp.py's steps in one process: every document alone, the loss a token sum over the
    global label count, the same AdamW and clipping; ``[(loss, grad norm)]`` per step."""
    import importlib.util

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = importlib.util.spec_from_file_location("own_loop_fsdp", REPO_ROOT / "examples" / "own_loop_fsdp.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for step in range(steps):
        rows = [example.packed_row(step, dp_rank) for dp_rank in range(2)]
        n_tokens = sum(int((r["labels"] != -100).sum()) for r in rows)
        total = torch.zeros(())
        for row in rows:  # each document alone: its positions restart at 0
            starts = (row["position_ids"][0] == 0).nonzero().flatten().tolist() + [row["input_ids"].shape[1]]
            for a, b in zip(starts[:-1], starts[1:]):
                logits = model(input_ids=row["input_ids"][:, a:b], use_cache=False).logits
                total = total + F.cross_entropy(logits[0], row["labels"][0, a:b], reduction="sum")
        loss = total / n_tokens
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), norm.item()))
    return out


def test_fsdp_example_matches_one_process_on_four_ranks():
    """Data parallel x CP with FSDP2 through context_parallel (the README's "with DP and FSDP2"): the loss and
    gradient norm of both steps equal one process's, each document run alone (the second step also proves the
    first update was the same)."""
    proc = _run_example("own_loop_fsdp.py", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [(float(a), float(b)) for a, b in re.findall(r"loss (\d+\.\d+) grad norm (\d+\.\d+) over 45 tokens", proc.stdout)]
    assert len(got) == 2, proc.stdout
    for (loss, norm), (ref_loss, ref_norm) in zip(got, _one_process_reference()):
        assert abs(loss - ref_loss) <= 2e-6 * ref_loss, (loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (norm, ref_norm)
